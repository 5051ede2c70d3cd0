"""The SigLIP vision transformer (transformers' `SiglipVisionModel` without its pooling head), as
Gemma 3 reads features off it; built so other SigLIP users (PaliGemma, LLaVA-OneVision) can take it.

`SiglipVisionSpec.from_config(vision_config, field="vision_config")` reads a checkpoint's
`vision_config` dict with transformers' SiglipVisionConfig defaults (the released Gemma 3 configs
leave hidden_act, layer_norm_eps and num_channels out); errors are ValueError naming the field.
`SiglipVisionModel(spec)` holds the tower as transformers' released files name it below the
wrapper's prefix: `vision_model.embeddings.{patch_embedding,position_embedding}`,
`vision_model.encoder.layers.{i}.*`, `vision_model.post_layernorm.*`, so a loader copies tensors
in by name. The pooling head (`vision_model.head.*`, `vision_use_head`) is not built: Gemma 3 takes
the last hidden state.

Pixels enter `SiglipVisionModel(pixel_values [N, C, S, S])` at the tower's fixed image_size (no
position interpolation) and leave as the last hidden state after post_layernorm, [N, patches,
hidden] with the patches in row-major order: transformers' `last_hidden_state`.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

# SigLIP's encoder layer is CLIP's: the same pre-norm block, parameter names, biased
# projections and unmasked attention over every patch; only the embeddings and the norms
# around the encoder differ (no class token, no pre-layernorm, a post-layernorm on every patch).
from raycluster.model.clip_vision import _Encoder, _EncoderLayer, activation, positive_int

# transformers' SiglipVisionConfig defaults, for the fields a release leaves out.
SIGLIP_DEFAULTS = {"hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 12, "num_attention_heads": 12,
                   "num_channels": 3, "image_size": 224, "patch_size": 16, "hidden_act": "gelu_pytorch_tanh",
                   "layer_norm_eps": 1e-6}


@dataclasses.dataclass(frozen=True)
class SiglipVisionSpec:
    """A SigLIP tower's shape (module docstring)."""
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_channels: int
    image_size: int
    patch_size: int
    hidden_act: str
    layer_norm_eps: float

    @property
    def patches_per_side(self) -> int:
        # The patch Conv2d has no padding: a remainder of pixels past the last patch is dropped.
        return self.image_size // self.patch_size

    @property
    def num_patches(self) -> int:
        return self.patches_per_side ** 2

    @classmethod
    def from_config(cls, vision_config, field: str = "vision_config") -> "SiglipVisionSpec":
        if not isinstance(vision_config, dict):
            raise ValueError(f"config field {field!r} must be an object, got {vision_config!r}")
        kind = vision_config.get("model_type", "siglip_vision_model")
        if kind != "siglip_vision_model":
            raise ValueError(f"config field '{field}.model_type' = {kind!r}: expected 'siglip_vision_model'")
        c = {**SIGLIP_DEFAULTS, **{k: v for k, v in vision_config.items() if v is not None}}
        size = c["image_size"]
        if isinstance(size, (list, tuple)):     # SiglipVisionConfig allows [h, w]; the positions are a square grid
            if len(size) != 2 or size[0] != size[1]:
                raise ValueError(f"config field '{field}.image_size' = {size!r}: only square images are supported")
            size = size[0]
        ints = {}
        for name in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_channels",
                     "patch_size"):
            ints[name] = positive_int(c[name], f"{field}.{name}")
        ints["image_size"] = positive_int(size, f"{field}.image_size")
        if ints["image_size"] < ints["patch_size"]:
            raise ValueError(f"config field '{field}.image_size' = {ints['image_size']} is smaller than one "
                             f"{ints['patch_size']}-pixel patch")
        if ints["hidden_size"] % ints["num_attention_heads"]:
            raise ValueError(f"config field '{field}.hidden_size' = {ints['hidden_size']} is not a multiple of "
                             f"'{field}.num_attention_heads' = {ints['num_attention_heads']}")
        activation(c["hidden_act"], f"{field}.hidden_act")      # refused here, naming the field
        eps = c["layer_norm_eps"]
        if not isinstance(eps, (int, float)) or isinstance(eps, bool) or eps <= 0:
            raise ValueError(f"config field '{field}.layer_norm_eps' = {eps!r}: expected a positive number")
        return cls(**ints, hidden_act=c["hidden_act"], layer_norm_eps=float(eps))


class _Embeddings(nn.Module):
    def __init__(self, spec: SiglipVisionSpec):
        super().__init__()
        self.patch_embedding = nn.Conv2d(spec.num_channels, spec.hidden_size, kernel_size=spec.patch_size,
                                         stride=spec.patch_size)
        self.position_embedding = nn.Embedding(spec.num_patches, spec.hidden_size)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        patches = self.patch_embedding(pixel_values).flatten(2).transpose(1, 2)     # [N, P, H], row-major
        return patches + self.position_embedding.weight


class SiglipVisionTransformer(nn.Module):
    """The tower's layers (names as below `vision_model.`)."""

    def __init__(self, spec: SiglipVisionSpec):
        super().__init__()
        act = activation(spec.hidden_act, "vision_config.hidden_act")
        self.embeddings = _Embeddings(spec)
        self.encoder = _Encoder([_EncoderLayer(spec.hidden_size, spec.intermediate_size, spec.num_attention_heads,
                                               spec.layer_norm_eps, act) for _ in range(spec.num_hidden_layers)])
        self.post_layernorm = nn.LayerNorm(spec.hidden_size, eps=spec.layer_norm_eps)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        x = self.embeddings(pixel_values)
        for layer in self.encoder.layers:
            x = layer(x)
        return self.post_layernorm(x)


class SiglipVisionModel(nn.Module):
    """pixels [N, C, S, S] -> last hidden state [N, patches, hidden] (module docstring)."""

    def __init__(self, spec: SiglipVisionSpec):
        super().__init__()
        self.spec = spec
        self.vision_model = SiglipVisionTransformer(spec)

    @property
    def dtype(self) -> torch.dtype:
        return self.vision_model.embeddings.patch_embedding.weight.dtype

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        s = self.spec
        want = (s.num_channels, s.image_size, s.image_size)
        if pixel_values.dim() != 4 or tuple(pixel_values.shape[1:]) != want:
            raise ValueError(f"pixel_values must be [N, {', '.join(map(str, want))}], got {list(pixel_values.shape)}")
        return self.vision_model(pixel_values.to(self.dtype))
