"""Qwen2-VL's and Qwen2.5-VL's image encoder (transformers 5.24's `get_image_features` of
`Qwen2VLForConditionalGeneration` / `Qwen2_5_VLForConditionalGeneration`), in the common form the
engine calls (raycluster.model.llava): `image_token_id`, `tokens_for((height, width))`,
`check_pixels(pixels, (height, width))`, `encode_images([(pixels, (height, width)), ...])`; and
`grid_for((height, width))`, the (t, rows, columns) grid of the image's tokens the text model's
multimodal rotary positions are laid out on (transformers' `get_rope_index`).

Videos (Qwen2-VL, Qwen2.5-VL; `takes_video`) go through the same calls with a size of (frames,
height, width) (raycluster.model.qwen_vl_video): their placeholders are `video_token_id`
(`span_ids(size)`), their grids have one temporal patch per temporal_patch_size frames, and
`time_step_for(size)` spaces their temporal patches in the rotary positions.

`QwenVLImageEncoder(config, pixel_limits)` reads config.json (the version from `architectures`,
the tower from `vision_config`: raycluster.model.qwen_vision) and the processor's pixel limits
(raycluster.model.qwen_vl_processor: an image's token count depends on the size it is resized
to). Pixels enter as the processor's rows, [t * h * w patches, C * T * P * P] per image; every
image of a call goes through the tower at once (attention stays within each image), and each
leaves as [tokens_for(size), text hidden] in the encoder's dtype, the text model putting them,
in order, at its `image_token_id` placeholders.

`from_checkpoint(model_dir, dtype, device)` reads config.json, preprocessor_config.json and the
tower's tensors from model.safetensors or its shards (raycluster.model.checkpoint_files): under
`visual.` in the released files (their flat config), `model.visual.` in transformers 5's layout.
"""

from __future__ import annotations

import os

import torch
from torch import nn

from raycluster.model.checkpoint_files import CheckpointError, copy_whole, read_prefixed, stored_prefixes
from raycluster.model.llava_tower import check_items, read_config, shape_reason
from raycluster.model.qwen_vision import QwenVisionSpec, QwenVisionTower
from raycluster.model.qwen_vl_processor import (DEFAULT_MAX_PIXELS, DEFAULT_MIN_PIXELS, QwenVLGrid, pixel_limits,
                                                read_preprocessor)
from raycluster.model.qwen_vl_video import QwenVLVideoGrid, VideoFields, read_video_preprocessor, time_step, video_fields

# Architecture -> the tower's version (raycluster.model.qwen_vision).
ARCHITECTURES = {"Qwen2VLForConditionalGeneration": "qwen2_vl", "Qwen2_5_VLForConditionalGeneration": "qwen2_5_vl"}
_PREFIXES = ("visual.", "model.visual.")
# Stored tower tensors the encoder never uses (old saves kept the rotary frequencies).
_UNUSED = ("rotary_pos_emb.",)


def tower_prefix(path: str) -> str | None:
    """Where the checkpoint keeps the tower (None: not stored, or no readable weights)."""
    return stored_prefixes(path, (_PREFIXES, "patch_embed.proj.weight"))[0]


def _text_hidden(config: dict) -> int | None:
    """The text model's hidden size: a flat config's own (the released files), else text_config's."""
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    return text.get("hidden_size")


class QwenVLImageEncoder(nn.Module):
    """The tower and the image-size arithmetic (module docstring). Qwen3-VL's encoder
    (raycluster.model.qwen3_vl) is this one over another tower (`_tower`, `_features`)."""

    bidirectional = False       # the text model attends an image's tokens causally
    takes_video = True
    takes_embeds = True         # a client's embeddings with their grid may stand for an image's output
    NAME = "Qwen-VL"

    def __init__(self, config: dict, pixel_limits: tuple[int, int] = (DEFAULT_MIN_PIXELS, DEFAULT_MAX_PIXELS),
                 video: VideoFields = VideoFields()):
        super().__init__()
        self.visual, spec, field = self._tower(config)
        text_hidden = _text_hidden(config)
        if text_hidden is not None and text_hidden != spec.out_hidden:
            raise ValueError(f"config field 'vision_config.{field}' = {spec.out_hidden}: the tower's tokens must be "
                             f"the text model's hidden size, {text_hidden}")
        self.image_token_id: int = int(config.get("image_token_id", 151655))
        self.video_token_id: int = int(config.get("video_token_id", 151656))
        self.grid = QwenVLGrid(spec.patch_size, spec.merge_size, spec.temporal_patch_size, *pixel_limits)
        self.video_grid = QwenVLVideoGrid(self.grid, video)
        self.video_time_step = time_step(getattr(spec, "version", ""), config.get("vision_config") or {},
                                         spec.temporal_patch_size)
        self.text_hidden_size = spec.out_hidden

    @staticmethod
    def _tower(config: dict) -> tuple[nn.Module, QwenVisionSpec, str]:
        """(the tower, its spec, the vision_config field naming its output width) of config.json."""
        archs = config.get("architectures") or []
        version = next((ARCHITECTURES[a] for a in archs if a in ARCHITECTURES), None)
        if version is None:
            raise ValueError(f"config field 'architectures' = {archs!r} names no Qwen-VL model "
                             f"({', '.join(ARCHITECTURES)})")
        spec = QwenVisionSpec.from_config(config.get("vision_config"), version)
        return QwenVisionTower(spec), spec, "hidden_size" if version == "qwen2_vl" else "out_hidden_size"

    def _features(self, pixels: torch.Tensor, grids: list[tuple[int, int, int]]) -> torch.Tensor:
        """The tower's output rows for the images' patches, one per image token, in order."""
        return self.visual(pixels, grids)

    @property
    def dtype(self) -> torch.dtype:
        return self.visual.patch_embed.proj.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.visual.patch_embed.proj.weight.device

    def _grid(self, size) -> QwenVLGrid | QwenVLVideoGrid:
        return self.video_grid if len(size) == 3 else self.grid

    def tokens_for(self, size) -> int:
        """The tokens (prompt placeholders) of an image of (height, width) or a video of (frames,
        height, width)."""
        return self._grid(size).tokens_for(tuple(size))

    def grid_for(self, size) -> tuple[int, int, int]:
        """(t, rows, columns) of the image's or video's tokens for the text model's rotary positions."""
        return self._grid(size).grid_for(tuple(size))

    def span_ids(self, size) -> list[int]:
        """The prompt tokens of an image or video of `size`: its placeholder token, repeated."""
        return [self.video_token_id if len(size) == 3 else self.image_token_id] * self.tokens_for(size)

    def time_step_for(self, size) -> float:
        """The spacing of the item's temporal patches in the rotary positions (1 for an image)."""
        return self.video_time_step if len(size) == 3 else 1.0

    def check_pixels(self, pixel_values, size) -> str | None:
        """None if `pixel_values` are what the processor makes of an image or video of `size`, else why not."""
        if len(size) == 3 and not self.takes_video:
            return f"{self.NAME} videos are not served here (images only)"
        reason = self._grid(size).check(size)
        if reason is not None:
            return reason
        t, h, w = self._grid(size).grid_thw(tuple(size))
        want = (t * h * w, self.visual.spec.patch_dim)
        if len(size) == 3 and tuple(getattr(pixel_values, "shape", ())) != want:
            return f"pixels are {tuple(getattr(pixel_values, 'shape', ()))}; a video of {size[0]} frames of " \
                   f"{size[1]}x{size[2]} takes {want}"
        return shape_reason(pixel_values, want, size)

    @torch.inference_mode()
    def encode_images(self, items: list[tuple[torch.Tensor, tuple[int, int]]]) -> list[torch.Tensor]:
        """Each image's features [tokens_for(size), text hidden] (module docstring); ValueError for
        pixels that do not fit their size."""
        check_items(self, items)
        if not items:
            return []
        pixels = torch.cat([torch.as_tensor(p) for p, _ in items]).to(self.device, self.dtype)
        features = self._features(pixels, [self._grid(size).grid_thw(tuple(size)) for _, size in items])
        return list(features.split([self.tokens_for(size) for _, size in items]))

    @classmethod
    def stores_tower(cls, path: str) -> bool:
        return tower_prefix(path) is not None

    @classmethod
    def from_checkpoint(cls, model_dir: str | os.PathLike, dtype: torch.dtype = torch.float32,
                        device: str | torch.device = "cpu") -> "QwenVLImageEncoder":
        path = os.fspath(model_dir)
        prefix = tower_prefix(path)
        if prefix is None:
            raise CheckpointError(f"{path!r}: the checkpoint stores no {cls.NAME} vision tower tensors")
        with torch.device("meta"):
            encoder = cls(read_config(path), pixel_limits(read_preprocessor(path)),
                          video_fields(read_video_preprocessor(path)))
        encoder.to_empty(device=device).to(dtype)
        loaded = {"visual." + k: v for k, v in read_prefixed(path, prefix).items() if not k.startswith(_UNUSED)}
        params = dict(encoder.named_parameters())
        copy_whole(params, loaded, path, f"{cls.NAME} vision tower", dtype)
        return encoder.eval()
