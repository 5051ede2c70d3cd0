"""Qwen2-VL's and Qwen2.5-VL's videos to pixels and tokens: transformers 5.24's
`Qwen2VLVideoProcessor` (both models share it; frames given, none sampled: its `do_sample_frames`
default) and the arithmetic `Qwen2VLProcessor` and `get_rope_index` count a video's tokens and
positions with.

A video's size is (frames, height, width): its frames as given, all of one size. `QwenVLVideoGrid`
is the arithmetic: every frame resized to one smart size (raycluster.model.qwen_vl_processor's
`smart_resize` under the video's pixel limits), the frames padded to a multiple of
temporal_patch_size by repeating the last, each temporal_patch_size frames one temporal patch, and
each merge_size x merge_size block of patches of one temporal patch one token: grid_thw =
(ceil(frames / T), h / P, w / P), tokens = t * (h / P / M) * (w / P / M).

`QwenVLVideoProcessor(frames)` takes PIL frames, resizes and normalizes each as the image processor
does (PIL bicubic: transformers' video processor resizes with torchvision, which can round a pixel
a level differently), and patchifies them as transformers does: rows [t, block row, block column,
row in block, column in block], each [C, T, P, P]. Out: float32 [t * h * w, C * T * P * P] and
(frames, height, width).

`video_fields(model_dir)` reads video_preprocessor_config.json, else preprocessor_config.json
(transformers' order: a released Qwen2-VL's image limits then bound its videos too), with
Qwen2VLVideoProcessor's defaults: 128 * 28 * 28 to 28 * 28 * 768 pixels a frame, at most 768
frames. `time_step` is the spacing of a video's temporal patches in the text model's rotary
positions: Qwen2.5-VL's tokens_per_second * T / fps (frames given are taken as sampled at 2 per
second, Qwen's default), 1 for Qwen2-VL.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os

import torch
from PIL import Image

from raycluster.model.image_processor import ImageProcessor, frames_size, to_rgb
from raycluster.model.qwen_vl_processor import (MAX_ASPECT_RATIO, QwenVLGrid, patch_grid, processing_steps,
                                                read_preprocessor)

# Qwen2VLVideoProcessor's defaults.
DEFAULT_MIN_PIXELS = 128 * 28 * 28
DEFAULT_MAX_PIXELS = 28 * 28 * 768
DEFAULT_MAX_FRAMES = 768
# Frames given are taken as sampled at this rate (Qwen's default sampling rate; qwen-vl-utils' FPS).
DEFAULT_FPS = 2.0


@dataclasses.dataclass(frozen=True)
class VideoFields:
    min_pixels: int = DEFAULT_MIN_PIXELS
    max_pixels: int = DEFAULT_MAX_PIXELS
    max_frames: int = DEFAULT_MAX_FRAMES


def read_video_preprocessor(model_dir: str | os.PathLike) -> dict | None:
    """video_preprocessor_config.json's fields, else preprocessor_config.json's, else None."""
    path = os.path.join(model_dir, "video_preprocessor_config.json")
    if os.path.exists(path):
        with open(path) as f:
            return json.load(f)
    return read_preprocessor(model_dir)


def video_fields(fields: dict | None) -> VideoFields:
    """The pixel limits and frame cap of a video processor's fields (None: the defaults), as
    Qwen2VLVideoProcessor reads them: `size`'s shortest_edge / longest_edge, each overridden by a
    `min_pixels` / `max_pixels` field. ValueError for values it cannot work with."""
    fields = fields or {}
    size = fields.get("size")
    size = dict(size) if isinstance(size, dict) else {"shortest_edge": DEFAULT_MIN_PIXELS,
                                                       "longest_edge": DEFAULT_MAX_PIXELS}
    if fields.get("min_pixels") is not None:
        size["shortest_edge"] = fields["min_pixels"]
    if fields.get("max_pixels") is not None:
        size["longest_edge"] = fields["max_pixels"]
    low, high = size.get("shortest_edge"), size.get("longest_edge")
    frames = fields.get("max_frames", DEFAULT_MAX_FRAMES)
    for name, v in (("min_pixels", low), ("max_pixels", high), ("max_frames", frames)):
        if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
            raise ValueError(f"video processor config: {name} must be a positive int, got {v!r}")
    return VideoFields(low, high, frames)


@dataclasses.dataclass(frozen=True)
class QwenVLVideoGrid:
    """A video size's patches and tokens (module docstring); `image` holds the patch sizes."""
    image: QwenVLGrid
    limits: VideoFields = VideoFields()

    def check(self, size) -> str | None:
        """None for a video (frames, height, width) this grid takes, else why not."""
        if len(size) != 3 or not all(isinstance(v, int) and not isinstance(v, bool) for v in size):
            return f"a video's size is (frames, height, width), got {tuple(size)!r}"
        frames, height, width = size
        if not 1 <= frames <= self.limits.max_frames:
            return f"a video holds 1 to {self.limits.max_frames} frames, got {frames}"
        if height <= 0 or width <= 0:
            return f"video frames of {height}x{width} pixels"
        if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
            return f"video frames of {height}x{width} have an aspect ratio above {MAX_ASPECT_RATIO}"
        return None

    def resized(self, size) -> tuple[int, int]:
        """(height, width) every frame of a video of `size` is resized to."""
        g = self.image
        return dataclasses.replace(g, min_pixels=self.limits.min_pixels, max_pixels=self.limits.max_pixels
                                   ).resized(tuple(size[1:]))

    def grid_thw(self, size) -> tuple[int, int, int]:
        """transformers' video_grid_thw row: (temporal patches, patch rows, patch columns)."""
        height, width = self.resized(size)
        g = self.image
        return math.ceil(size[0] / g.temporal_patch_size), height // g.patch_size, width // g.patch_size

    def grid_for(self, size) -> tuple[int, int, int]:
        t, h, w = self.grid_thw(size)
        return t, h // self.image.merge_size, w // self.image.merge_size

    def tokens_for(self, size) -> int:
        t, h, w = self.grid_for(size)
        return t * h * w


def time_step(version: str, vision_config: dict, temporal_patch_size: int, fps: float = DEFAULT_FPS) -> float:
    """The rotary-position spacing of a video's temporal patches (module docstring)."""
    if version != "qwen2_5_vl":
        return 1.0
    return float(vision_config.get("tokens_per_second", 4)) * temporal_patch_size / fps


@dataclasses.dataclass(frozen=True)
class QwenVLVideoProcessor:
    """Qwen2VLVideoProcessor over frames given (module docstring)."""
    grid: QwenVLVideoGrid
    steps: ImageProcessor
    do_resize: bool = True

    @classmethod
    def from_model_dir(cls, model_dir: str | os.PathLike) -> "QwenVLVideoProcessor | None":
        """From video_preprocessor_config.json or preprocessor_config.json (None without either)."""
        fields = read_video_preprocessor(model_dir)
        if fields is None:
            return None
        return cls(QwenVLVideoGrid(patch_grid(fields), video_fields(fields)), processing_steps(fields),
                   bool(fields.get("do_resize", True)))

    def __call__(self, frames: list[Image.Image]) -> tuple[torch.Tensor, tuple[int, int, int]]:
        """(float32 [t * h * w, C * T * P * P], (frames, height, width)); ValueError for frames of
        different sizes, too many, or a size smart_resize refuses."""
        size = frames_size(frames)
        reason = self.grid.check(size)
        if reason is not None:
            raise ValueError(reason)
        height, width = self.grid.resized(size) if self.do_resize else size[1:]
        g = self.grid.image
        factor = g.patch_size * g.merge_size
        if height % factor or width % factor:
            raise ValueError(f"video frames of {height}x{width} pixels are not in whole {factor}-pixel blocks "
                             "(do_resize is off)")
        steps = dataclasses.replace(self.steps, do_resize=self.do_resize, size={"height": height, "width": width})
        return self.patchify(torch.stack([steps.preprocess_rgb(to_rgb(f)) for f in frames])), size

    def patchify(self, frames: torch.Tensor) -> torch.Tensor:
        """[F, C, H, W] -> [ceil(F / T) * H / P * W / P, C * T * P * P] (module docstring)."""
        g = self.grid.image
        p, m, tp = g.patch_size, g.merge_size, g.temporal_patch_size
        if pad := -frames.shape[0] % tp:      # the last frame repeated up to a whole temporal patch
            frames = torch.cat([frames, frames[-1:].expand(pad, *frames.shape[1:])])
        n, channels, height, width = frames.shape
        x = frames.reshape(n // tp, tp, channels, height // p // m, m, p, width // p // m, m, p)
        x = x.permute(0, 3, 6, 4, 7, 2, 1, 5, 8)       # (t, block row, block col, row, col, C, T, P, P)
        return x.reshape(n // tp * (height // p) * (width // p), channels * tp * p * p).contiguous()
