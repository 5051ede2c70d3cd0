"""The Pixtral vision transformer (transformers 5.24's `PixtralVisionModel`), as Mistral 3 reads
features off it (raycluster.model.mistral3_vision); other Pixtral users could take it as it is.

`PixtralVisionSpec.from_config(vision_config, field="vision_config")` reads a checkpoint's
`vision_config` dict with transformers' PixtralVisionConfig defaults for the fields it leaves out
(errors: ValueError naming the field). The head width is always hidden_size / num_attention_heads,
as PixtralVisionConfig recomputes it over a stored `head_dim`; the 2-D rotary's base is
`rope_parameters.rope_theta` (or the older top-level `rope_theta`; 10000 by default) and its type
must be the axial one ("axial", or "default" / none, which PixtralVisionConfig turns into axial).
`PixtralVisionModel(spec)` holds the tower under transformers' names below the wrapper's
`vision_tower.`: `patch_conv.weight` (no bias), `ln_pre.weight`, `transformer.layers.{i}.`
{`attention_norm`, `attention.{q,k,v,o}_proj` (no biases), `ffn_norm`,
`feed_forward.{gate,up,down}_proj`}, so a loader copies tensors in by name.

Pixels enter `PixtralVisionModel(images, depth=None)` as a list of [C, H, W] tensors, each image
at its own size (H and W multiples of patch_size: the processor made them so); each is cut into
patches by the Conv2d, the patches of all images are concatenated in image order (row-major within
an image), RMS-normed (`ln_pre`) and run through the first `depth` layers (all by default; k
layers give transformers' `hidden_states[k]`). Each patch is turned by the 2-D rotary of its
(row, column) inside its own image, and attends only to the patches of its own image (transformers'
block-diagonal mask: here one attention call per image). They leave as [total patches, hidden].
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

from raycluster.model.clip_vision import activation, positive_int
# PixtralRMSNorm and Mistral3RMSNorm are Llama's (normed in float32, cast back, then scaled).
from raycluster.model.llama import RMSNorm

# transformers' PixtralVisionConfig defaults, for the fields a config leaves out.
PIXTRAL_DEFAULTS = {"hidden_size": 1024, "intermediate_size": 4096, "num_hidden_layers": 24, "num_attention_heads": 16,
                    "num_channels": 3, "image_size": 1024, "patch_size": 16, "hidden_act": "gelu"}
DEFAULT_ROPE_THETA = 10_000.0
# PixtralRMSNorm's epsilon is fixed in transformers (ln_pre and every layer's norms), not a config field.
NORM_EPS = 1e-5


@dataclasses.dataclass(frozen=True)
class PixtralVisionSpec:
    """A Pixtral tower's shape (module docstring)."""
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_channels: int
    image_size: int
    patch_size: int
    hidden_act: str
    rope_theta: float

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @classmethod
    def from_config(cls, vision_config, field: str = "vision_config") -> "PixtralVisionSpec":
        if not isinstance(vision_config, dict):
            raise ValueError(f"config field {field!r} must be an object, got {vision_config!r}")
        kind = vision_config.get("model_type", "pixtral")
        if kind != "pixtral":
            raise ValueError(f"config field '{field}.model_type' = {kind!r}: expected 'pixtral'")
        c = {**PIXTRAL_DEFAULTS, **{k: v for k, v in vision_config.items() if v is not None}}
        ints = {name: positive_int(c[name], f"{field}.{name}")
                for name in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                             "num_channels", "patch_size", "image_size")}
        hidden, heads = ints["hidden_size"], ints["num_attention_heads"]
        if hidden % heads or (hidden // heads) % 2:
            raise ValueError(f"config field '{field}.hidden_size' = {hidden} must be {field}.num_attention_heads "
                             f"({heads}) heads of an even width (the rotary turns pairs of dimensions)")
        activation(c["hidden_act"], f"{field}.hidden_act")      # refused here, naming the field
        return cls(**ints, hidden_act=c["hidden_act"], rope_theta=_rope_theta(vision_config, field))


def _rope_theta(vision_config: dict, field: str) -> float:
    """The axial rotary's base (module docstring); ValueError naming the field otherwise."""
    rope = vision_config.get("rope_parameters")
    if rope is not None and not isinstance(rope, dict):
        raise ValueError(f"config field '{field}.rope_parameters' = {rope!r}: expected an object")
    rope = rope or {}
    kind = rope.get("rope_type", rope.get("type"))
    if kind not in (None, "default", "axial"):
        raise ValueError(f"config field '{field}.rope_parameters.rope_type' = {kind!r}: Pixtral's tower takes only "
                         "its axial 2-D rotary")
    name = "rope_parameters.rope_theta" if rope.get("rope_theta") is not None else "rope_theta"
    theta = rope.get("rope_theta", vision_config.get("rope_theta"))
    theta = DEFAULT_ROPE_THETA if theta is None else theta
    if not isinstance(theta, (int, float)) or isinstance(theta, bool) or theta <= 0:
        raise ValueError(f"config field '{field}.{name}' = {theta!r}: expected a positive number")
    return float(theta)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class _Attention(nn.Module):
    def __init__(self, hidden: int, heads: int):
        super().__init__()
        self.heads, self.head_dim = heads, hidden // heads
        self.q_proj = nn.Linear(hidden, hidden, bias=False)
        self.k_proj = nn.Linear(hidden, hidden, bias=False)
        self.v_proj = nn.Linear(hidden, hidden, bias=False)
        self.o_proj = nn.Linear(hidden, hidden, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, lengths: list[int]) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = (proj(x).view(n, self.heads, self.head_dim).transpose(0, 1)
                   for proj in (self.q_proj, self.k_proj, self.v_proj))      # [heads, patches, head_dim]
        q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
        # One unmasked call per image is transformers' block-diagonal mask without its
        # [patches, patches] matrix over every image of the batch.
        out = torch.cat([F.scaled_dot_product_attention(qi, ki, vi) for qi, ki, vi in
                         zip(q.split(lengths, 1), k.split(lengths, 1), v.split(lengths, 1))], dim=1)
        return self.o_proj(out.transpose(0, 1).reshape(n, -1))


class _FeedForward(nn.Module):
    def __init__(self, hidden: int, intermediate: int, act):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)
        self.act = act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class _Layer(nn.Module):
    def __init__(self, spec: PixtralVisionSpec):
        super().__init__()
        self.attention_norm = RMSNorm(spec.hidden_size, NORM_EPS)
        self.attention = _Attention(spec.hidden_size, spec.num_attention_heads)
        self.ffn_norm = RMSNorm(spec.hidden_size, NORM_EPS)
        self.feed_forward = _FeedForward(spec.hidden_size, spec.intermediate_size,
                                         activation(spec.hidden_act, "vision_config.hidden_act"))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, lengths: list[int]) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), cos, sin, lengths)
        return x + self.feed_forward(self.ffn_norm(x))


class _Transformer(nn.Module):
    def __init__(self, spec: PixtralVisionSpec):
        super().__init__()
        self.layers = nn.ModuleList(_Layer(spec) for _ in range(spec.num_hidden_layers))


class PixtralVisionModel(nn.Module):
    """A list of [C, H, W] images -> [total patches, hidden] (module docstring)."""

    def __init__(self, spec: PixtralVisionSpec):
        super().__init__()
        self.spec = spec
        self.patch_conv = nn.Conv2d(spec.num_channels, spec.hidden_size, kernel_size=spec.patch_size,
                                    stride=spec.patch_size, bias=False)
        self.ln_pre = RMSNorm(spec.hidden_size, NORM_EPS)
        self.transformer = _Transformer(spec)

    @property
    def dtype(self) -> torch.dtype:
        return self.patch_conv.weight.dtype

    def grid_of(self, pixels: torch.Tensor) -> tuple[int, int]:
        """The (rows, columns) of patches of one [C, H, W] image."""
        return pixels.shape[-2] // self.spec.patch_size, pixels.shape[-1] // self.spec.patch_size

    def rotary(self, grids: list[tuple[int, int]], dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) [patches, head_dim] of every image's patches in order, as
        PixtralVisionRotaryEmbedding computes them (in float32, then cast)."""
        device, dim = self.patch_conv.weight.device, self.spec.head_dim
        # transformers' axial frequencies: the even-indexed ones of a 1-D rotary over the head
        # turn by the patch's row, the odd-indexed ones by its column. Computed here, in float32,
        # rather than kept as a buffer a meta-device build and a dtype cast would spoil.
        inv_freq = 1.0 / (self.spec.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float, device=device) / dim))
        inv_freq = torch.cat([inv_freq[0::2], inv_freq[1::2]])
        positions = torch.cat([torch.stack(torch.meshgrid(torch.arange(h, device=device),
                                                          torch.arange(w, device=device), indexing="ij"),
                                           dim=-1).reshape(-1, 2) for h, w in grids])
        freqs = positions[..., None].float() * inv_freq       # [patches, 2, head_dim / 2]
        angles = []
        for f in (freqs.cos(), freqs.sin()):
            rows, cols = f.chunk(2, dim=-1)
            half = torch.cat([rows[:, 0], cols[:, 1]], dim=-1)        # row angles, then column angles
            angles.append(torch.cat([half, half], dim=-1).to(dtype))
        return angles[0], angles[1]

    def forward(self, images: list[torch.Tensor], depth: int | None = None) -> torch.Tensor:
        s = self.spec
        for k, pixels in enumerate(images):
            if pixels.dim() != 3 or pixels.shape[0] != s.num_channels or min(self.grid_of(pixels)) < 1:
                raise ValueError(f"image {k}: pixels must be [{s.num_channels}, H, W] of at least one "
                                 f"{s.patch_size}-pixel patch, got {list(pixels.shape)}")
        grids = [self.grid_of(p) for p in images]
        patches = [self.patch_conv(p.to(self.dtype)[None]).flatten(2)[0].T for p in images]
        x = self.ln_pre(torch.cat(patches))
        cos, sin = self.rotary(grids, x.dtype)
        lengths = [h * w for h, w in grids]
        layers = self.transformer.layers if depth is None else self.transformer.layers[:depth]
        for layer in layers:
            x = layer(x, cos, sin, lengths)
        return x
