"""Qwen3-VL's and Qwen3-VL-MoE's image encoder (transformers 5.24's `get_image_features` of
`Qwen3VLForConditionalGeneration` / `Qwen3VLMoeForConditionalGeneration`: the same tower), in the
common form the engine calls (raycluster.model.llava, raycluster.model.qwen_vl): `image_token_id`,
`grid` (raycluster.model.qwen_vl_processor's `QwenVLGrid`), `tokens_for((height, width))`,
`grid_for((height, width))`, `check_pixels(pixels, (height, width))`, `encode_images([(pixels,
(height, width)), ...])`, plus `deepstack_levels`.

`Qwen3VLImageEncoder(config, pixel_limits)` reads config.json (the tower from `vision_config`:
raycluster.model.qwen3_vision; the text hidden size from `text_config`) and the processor's pixel
limits (an image's token count depends on the size it is resized to). Pixels enter as the
processor's rows, [t * h * w patches, C * T * P * P] per image; every image of a call goes through
the tower at once (attention stays within each image). Each image leaves as ONE tensor
[tokens_for(size), (1 + deepstack_levels) * text hidden] in the encoder's dtype: columns
[0, H) the merger's features (what replaces the image's placeholders in the input embeddings),
then [H (1 + k), H (2 + k)) DeepStack level k, which transformers' `_deepstack_process` adds to
the hidden states after decoder layer k at the image's placeholder positions. One row per token
keeps the levels with their token through the engine's bookkeeping.

`from_checkpoint(model_dir, dtype, device)` reads config.json, preprocessor_config.json and the
tower's tensors from model.safetensors or its shards (raycluster.model.checkpoint_files): under
`model.visual.` (the released files, transformers 5's layout) or `visual.`.
"""

from __future__ import annotations

import os

import torch
from torch import nn

from raycluster.model.checkpoint_files import CheckpointError, copy_whole, read_prefixed, stored_names
from raycluster.model.llava_tower import check_items, read_config, shape_reason
from raycluster.model.qwen3_vision import Qwen3VisionSpec, Qwen3VisionTower
from raycluster.model.qwen_vl_processor import (DEFAULT_MAX_PIXELS, DEFAULT_MIN_PIXELS, QwenVLGrid, pixel_limits,
                                                read_preprocessor)

# Architectures whose tower this is (Qwen3-VL-MoE's vision model is Qwen3-VL's, module for module).
ARCHITECTURES = ("Qwen3VLForConditionalGeneration", "Qwen3VLMoeForConditionalGeneration")
_PREFIXES = ("model.visual.", "visual.")
# Stored tower tensors the encoder never uses (the rotary frequencies, should a save keep them).
_UNUSED = ("rotary_pos_emb.",)


def tower_prefix(path: str) -> str | None:
    """Where the checkpoint keeps the tower (None: not stored, or no readable weights). A text-only
    tiny checkpoint stores a lone tower tensor: the patch embedding tells a whole tower."""
    try:
        names = stored_names(path)
    except CheckpointError:
        return None
    return next((p for p in _PREFIXES if p + "patch_embed.proj.weight" in names), None)


def _text_hidden(config: dict) -> int | None:
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    return text.get("hidden_size")


class Qwen3VLImageEncoder(nn.Module):
    """The tower and the image-size arithmetic (module docstring)."""

    bidirectional = False       # the text model attends an image's tokens causally

    ARCHITECTURES = ARCHITECTURES

    def __init__(self, config: dict, pixel_limits: tuple[int, int] = (DEFAULT_MIN_PIXELS, DEFAULT_MAX_PIXELS)):
        super().__init__()
        archs = config.get("architectures") or []
        if not any(a in ARCHITECTURES for a in archs):
            raise ValueError(f"config field 'architectures' = {archs!r} names no Qwen3-VL model "
                             f"({', '.join(ARCHITECTURES)})")
        spec = Qwen3VisionSpec.from_config(config.get("vision_config"))
        text_hidden = _text_hidden(config)
        if text_hidden is not None and text_hidden != spec.out_hidden:
            raise ValueError(f"config field 'vision_config.out_hidden_size' = {spec.out_hidden}: the tower's tokens "
                             f"must be the text model's hidden size, {text_hidden}")
        self.visual = Qwen3VisionTower(spec)
        self.image_token_id: int = int(config.get("image_token_id", 151655))
        self.grid = QwenVLGrid(spec.patch_size, spec.merge_size, spec.temporal_patch_size, *pixel_limits)
        self.text_hidden_size = spec.out_hidden
        self.deepstack_levels: int = len(spec.deepstack)

    @property
    def dtype(self) -> torch.dtype:
        return self.visual.patch_embed.proj.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.visual.patch_embed.proj.weight.device

    def tokens_for(self, image_size: tuple[int, int]) -> int:
        """The tokens (prompt placeholders) of an image of (height, width)."""
        return self.grid.tokens_for(tuple(image_size))

    def grid_for(self, image_size: tuple[int, int]) -> tuple[int, int, int]:
        """(t, rows, columns) of the image's tokens for the text model's rotary positions."""
        return self.grid.grid_for(tuple(image_size))

    def check_pixels(self, pixel_values, image_size) -> str | None:
        """None if `pixel_values` are what the processor makes of an image of `image_size`, else why not."""
        reason = self.grid.check(image_size)
        if reason is not None:
            return reason
        t, h, w = self.grid.grid_thw(tuple(image_size))
        return shape_reason(pixel_values, (t * h * w, self.visual.spec.patch_dim), image_size)

    @torch.inference_mode()
    def encode_images(self, items: list[tuple[torch.Tensor, tuple[int, int]]]) -> list[torch.Tensor]:
        """Each image's [tokens_for(size), (1 + deepstack_levels) * text hidden] rows (module
        docstring); ValueError for pixels that do not fit their size."""
        check_items(self, items)
        if not items:
            return []
        pixels = torch.cat([torch.as_tensor(p) for p, _ in items]).to(self.device, self.dtype)
        merged, levels = self.visual(pixels, [self.grid.grid_thw(tuple(size)) for _, size in items])
        rows = torch.cat([merged, *levels], dim=-1)
        return list(rows.split([self.tokens_for(size) for _, size in items]))

    @classmethod
    def stores_tower(cls, path: str) -> bool:
        return tower_prefix(path) is not None

    @classmethod
    def from_checkpoint(cls, model_dir: str | os.PathLike, dtype: torch.dtype = torch.float32,
                        device: str | torch.device = "cpu") -> "Qwen3VLImageEncoder":
        path = os.fspath(model_dir)
        prefix = tower_prefix(path)
        if prefix is None:
            raise CheckpointError(f"{path!r}: the checkpoint stores no Qwen3-VL vision tower tensors")
        with torch.device("meta"):
            encoder = cls(read_config(path), pixel_limits(read_preprocessor(path)))
        encoder.to_empty(device=device).to(dtype)
        loaded = {"visual." + k: v for k, v in read_prefixed(path, prefix).items() if not k.startswith(_UNUSED)}
        copy_whole(dict(encoder.named_parameters()), loaded, path, "Qwen3-VL vision tower", dtype)
        return encoder.eval()
