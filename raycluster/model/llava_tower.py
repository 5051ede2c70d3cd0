"""The CLIP tower and projector both LLaVA image encoders are built on (LLaVA-1.5's
raycluster.model.llava, LLaVA-NeXT's raycluster.model.llava_next), and reading them from a checkpoint.

`ClipProjectorEncoder(config, text_hidden)` validates config.json's LLaVA fields (transformers'
LlavaConfig / LlavaNextConfig defaults) and builds the CLIP tower (raycluster.model.clip_vision)
up to the deepest `vision_feature_layer` and `multi_modal_projector` (linear_1 ->
`projector_hidden_act` -> linear_2). Square tower inputs enter `tile_features(pixels [N, C, S, S])`
and leave as [N, tokens_per_tile, text hidden]: the selected hidden state(s) concatenated along the
features, the CLS token dropped ("default" strategy) or kept ("full"), projected.

`from_checkpoint(model_dir, dtype, device)` (a subclass's too) reads config.json and the tensors
from model.safetensors or its shards (raycluster.model.checkpoint_files): the tower under the
released files' `vision_tower.vision_model.`, transformers 5's `model.` before it, or the bare
`vision_tower.` transformers 5.24 saves; the projector under `multi_modal_projector.` (or
`model.multi_modal_projector.`); a subclass's own parameters (`EXTRA_TENSORS`: LLaVA-NeXT's
`image_newline`) under the names it lists. Only the tower layers the feature layers need are read.
"""

from __future__ import annotations

import json
import os

import torch
from torch import nn

from raycluster.model.checkpoint_files import (CheckpointError, copy_whole, read_named, read_prefixed,
                                               stored_prefixes, tower_and_projector)
from raycluster.model.clip_vision import ClipVisionTower, activation, hidden_state_index

# Where checkpoints keep the tower and the projector (the first whose patch embedding / linear_1
# is stored wins: `vision_tower.vision_model.` must be tried before the bare `vision_tower.`).
_TOWER_PREFIXES = ("vision_tower.vision_model.", "model.vision_tower.vision_model.", "vision_tower.",
                   "model.vision_tower.")
_PROJECTOR_PREFIXES = ("multi_modal_projector.", "model.multi_modal_projector.")
# Stored tower tensors LLaVA never uses (old saves kept the position ids buffer).
_UNUSED = ("post_layernorm.", "embeddings.position_ids")


class _Projector(nn.Module):
    def __init__(self, in_features: int, hidden: int, act, bias: bool):
        super().__init__()
        self.linear_1, self.act = nn.Linear(in_features, hidden, bias), act
        self.linear_2 = nn.Linear(hidden, hidden, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(x)))


def check_items(encoder, items: list[tuple[torch.Tensor, tuple[int, int]]]) -> None:
    """ValueError naming the first image whose pixels do not fit its size (`encoder.check_pixels`,
    any image encoder's)."""
    for k, (pixels, size) in enumerate(items):
        reason = encoder.check_pixels(pixels, size)
        if reason is not None:
            raise ValueError(f"image {k}: {reason}")


def pack_each(features: torch.Tensor, items: list[tuple[torch.Tensor, tuple[int, int]]], pack) -> list[torch.Tensor]:
    """Per image, `pack(its squares' features, its size)`: `features` holds every image's squares
    (its pixels' first dimension) in the items' order (LLaVA-NeXT's and LLaVA-OneVision's tiles)."""
    out, at = [], 0
    for pixels, size in items:
        out.append(pack(features[at:at + pixels.shape[0]], tuple(size)))
        at += pixels.shape[0]
    return out


def shape_reason(pixel_values, want: tuple[int, ...], image_size) -> str | None:
    """None if `pixel_values` have the shape `want`, else why not (for an image of `image_size`)."""
    shape = tuple(getattr(pixel_values, "shape", ()))
    if shape == want:
        return None
    return f"pixels are {shape}; an image of {image_size[0]}x{image_size[1]} takes {want}"


class ClipProjectorEncoder(nn.Module):
    """The tower's selected features of square inputs, projected (module docstring)."""

    # A subclass's parameters outside the tower and projector: name -> the stored names to try.
    EXTRA_TENSORS: dict[str, tuple[str, ...]] = {}
    takes_embeds = True         # a client's embeddings [tokens, text hidden] may stand for an image's output
    bidirectional = False       # the text model attends an image's tokens causally

    def __init__(self, config: dict, text_hidden: int):
        super().__init__()
        vision = config.get("vision_config")
        if not isinstance(vision, dict):
            raise ValueError(f"config field 'vision_config' must be an object, got {vision!r}")
        kind = vision.get("model_type", "clip_vision_model")
        if kind != "clip_vision_model":
            raise ValueError(f"config field 'vision_config.model_type' = {kind!r}: only LLaVA over a CLIP tower "
                             "('clip_vision_model') takes images here")
        layers = config.get("vision_feature_layer", -2)
        self.feature_layers = [layers] if isinstance(layers, int) else list(layers)
        if not self.feature_layers or not all(isinstance(i, int) for i in self.feature_layers):
            raise ValueError(f"config field 'vision_feature_layer' = {layers!r}: expected an int or a list of ints")
        self.select_strategy = config.get("vision_feature_select_strategy", "default")
        if self.select_strategy not in ("default", "full"):
            raise ValueError(f"config field 'vision_feature_select_strategy' = {self.select_strategy!r}: "
                             "expected 'default' or 'full'")
        depth = vision.get("num_hidden_layers")
        if not isinstance(depth, int):
            raise ValueError(f"config field 'vision_config.num_hidden_layers' = {depth!r}: expected an int")
        deepest = max(hidden_state_index(i, depth) for i in self.feature_layers)
        self.vision_tower = ClipVisionTower(vision, num_layers=deepest)
        act = activation(config.get("projector_hidden_act", "gelu"), "projector_hidden_act")
        self.multi_modal_projector = _Projector(self.vision_tower.hidden_size * len(self.feature_layers), text_hidden,
                                                act, bool(config.get("multimodal_projector_bias", True)))
        token = config.get("image_token_index", config.get("image_token_id", 32000))
        self.image_token_id: int = int(token)
        self.image_size: int = self.vision_tower.image_size
        self.tokens_per_tile: int = self.vision_tower.num_patches + (self.select_strategy == "full")
        self.text_hidden_size = text_hidden

    @property
    def dtype(self) -> torch.dtype:
        return self.multi_modal_projector.linear_1.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.multi_modal_projector.linear_1.weight.device

    def tile_features(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """[N, C, image_size, image_size] pixels -> [N, tokens_per_tile, text hidden] features."""
        t = self.vision_tower
        if pixel_values.dim() != 4 or tuple(pixel_values.shape[1:]) != (t.num_channels, t.image_size, t.image_size):
            raise ValueError(f"pixel_values must be [N, {t.num_channels}, {t.image_size}, {t.image_size}], "
                             f"got {list(pixel_values.shape)}")
        states = t.hidden_states(pixel_values.to(self.device, self.dtype), self.feature_layers)
        if self.select_strategy == "default":
            states = [s[:, 1:] for s in states]
        return self.multi_modal_projector(torch.cat(states, dim=-1))

    @classmethod
    def stores_tower(cls, path: str) -> bool:
        """Whether the checkpoint's files hold the CLIP tower (else it is served on its text)."""
        return tensor_prefixes(path)[0] is not None

    @classmethod
    def from_checkpoint(cls, model_dir: str | os.PathLike, dtype: torch.dtype = torch.float32,
                        device: str | torch.device = "cpu"):
        path = os.fspath(model_dir)
        config = read_config(path)
        tower_prefix, projector_prefix = tower_and_projector(tensor_prefixes(path), path, "vision tower")
        projector = read_prefixed(path, projector_prefix)
        with torch.device("meta"):
            encoder = cls(config, _text_hidden(config, projector))
        encoder.to_empty(device=device).to(dtype)
        built = len(encoder.vision_tower.encoder.layers)
        tower = {k: v for k, v in read_prefixed(path, tower_prefix).items()
                 if not k.startswith(_UNUSED) and _layer_of(k) < built}
        params = dict(encoder.named_parameters())
        loaded = {"vision_tower." + k: v for k, v in tower.items()}
        loaded.update({"multi_modal_projector." + k: v for k, v in projector.items()})
        for name, candidates in cls.EXTRA_TENSORS.items():
            for stored in candidates:
                tensor = read_named(path, stored)
                if tensor is not None:
                    loaded[name] = tensor
                    break
        copy_whole(params, loaded, path, "LLaVA vision tower / projector", dtype)
        return encoder.eval()


def read_config(path: str) -> dict:
    with open(os.path.join(path, "config.json")) as f:
        return json.load(f)


def tensor_prefixes(path: str) -> tuple[str | None, str | None]:
    """(tower prefix, projector prefix) of the stored names (None: not stored)."""
    return stored_prefixes(path, (_TOWER_PREFIXES, "embeddings.patch_embedding.weight"),
                           (_PROJECTOR_PREFIXES, "linear_1.weight"))


def _text_hidden(config: dict, projector: dict[str, torch.Tensor]) -> int:
    """The text model's hidden size: text_config's, else the projector's output rows (released
    configs such as llava-1.5-7b's leave LlamaConfig's default 4096 out)."""
    text = config.get("text_config") or {}
    if text.get("hidden_size") is not None:
        return int(text["hidden_size"])
    if "linear_2.weight" in projector:
        return int(projector["linear_2.weight"].shape[0])
    raise CheckpointError("config field 'text_config.hidden_size' is missing and no multi_modal_projector.linear_2 "
                          "tensor gives it")


def _layer_of(name: str) -> int:
    """The encoder layer a tower tensor belongs to (-1 for the others)."""
    if not name.startswith("encoder.layers."):
        return -1
    return int(name.split(".")[2])
