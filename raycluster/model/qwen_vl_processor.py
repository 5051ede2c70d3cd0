"""Qwen2-VL's and Qwen2.5-VL's images to pixels and tokens: transformers 5.24's
`Qwen2VLImageProcessorPil` (both models share it) and the arithmetic `Qwen2VLProcessor` and the
model's `get_rope_index` count with.

`QwenVLGrid` is the arithmetic alone (no pixels): `smart_resize` takes an image of (height,
width) to the nearest size whose sides are multiples of factor = patch_size * merge_size and whose
area lies in [min_pixels, max_pixels] (aspect ratio kept as well as rounding allows); the resized
image is a grid_h x grid_w grid of patch_size patches (grid_t = 1: an image is one frame), and
every merge_size x merge_size block of patches becomes one token. `grid_thw(size)` is transformers'
`image_grid_thw` row, `grid_for(size)` the text model's (t, h // merge, w // merge) and
`tokens_for(size)` its product. The model reads patch / merge / temporal sizes from config.json;
the pixel limits come from preprocessor_config.json (`pixel_limits`, transformers' defaults
without one), so the model's side and the processor's agree.

`QwenVLImageProcessor(image)` takes a PIL image (RGB, transparency on white), resizes it to the
smart size (PIL, bicubic by default), rescales and normalizes it (OpenAI CLIP's mean / std by
default) as raycluster.model.image_processor does, and patchifies it as transformers does: the
frame repeated temporal_patch_size times, one row per patch of [C, T, P, P] values, rows ordered by
merge block (block row, block column, then the patches inside the block row-major). Out: float32
[grid_h * grid_w, C * T * P * P] and the image's (height, width).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os

import torch
from PIL import Image

from raycluster.model.anyres import check_image_size
from raycluster.model.image_processor import ImageProcessor, to_rgb

# Qwen2VLImageProcessor's defaults: size {"shortest_edge": 56 * 56, "longest_edge": 28 * 28 * 1280}.
DEFAULT_MIN_PIXELS = 56 * 56
DEFAULT_MAX_PIXELS = 28 * 28 * 1280
MAX_ASPECT_RATIO = 200      # smart_resize refuses longer / shorter side ratios above this


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """transformers' smart_resize: (height, width) in multiples of `factor`, area within
    [min_pixels, max_pixels]; ValueError for an aspect ratio above 200."""
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise ValueError(f"absolute aspect ratio must be smaller than {MAX_ASPECT_RATIO}, got "
                         f"{max(height, width) / min(height, width)}")
    h_bar, w_bar = round(height / factor) * factor, round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


@dataclasses.dataclass(frozen=True)
class QwenVLGrid:
    """An image size's patches and tokens (module docstring)."""
    patch_size: int = 14
    merge_size: int = 2
    temporal_patch_size: int = 2
    min_pixels: int = DEFAULT_MIN_PIXELS
    max_pixels: int = DEFAULT_MAX_PIXELS

    def check(self, image_size) -> str | None:
        """None for an image (height, width) this grid takes, else why not."""
        reason = check_image_size(image_size)
        if reason is None and max(image_size) / min(image_size) > MAX_ASPECT_RATIO:
            reason = f"image of {image_size[0]}x{image_size[1]} has an aspect ratio above {MAX_ASPECT_RATIO}"
        return reason

    def resized(self, image_size: tuple[int, int]) -> tuple[int, int]:
        """(height, width) the processor resizes an image of `image_size` to."""
        return smart_resize(*image_size, self.patch_size * self.merge_size, self.min_pixels, self.max_pixels)

    def grid_thw(self, image_size: tuple[int, int]) -> tuple[int, int, int]:
        """transformers' image_grid_thw row: (1, patch rows, patch columns)."""
        height, width = self.resized(image_size)
        return 1, height // self.patch_size, width // self.patch_size

    def grid_for(self, image_size: tuple[int, int]) -> tuple[int, int, int]:
        """The text model's grid of the image's tokens: (t, rows, columns) after merging."""
        t, h, w = self.grid_thw(image_size)
        return t, h // self.merge_size, w // self.merge_size

    def tokens_for(self, image_size: tuple[int, int]) -> int:
        t, h, w = self.grid_for(image_size)
        return t * h * w

    def patch_dim(self, channels: int = 3) -> int:
        """Values in one pixel row: [C, T, P, P]."""
        return channels * self.temporal_patch_size * self.patch_size ** 2


def read_preprocessor(model_dir: str | os.PathLike) -> dict | None:
    path = os.path.join(model_dir, "preprocessor_config.json")
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def pixel_limits(fields: dict | None) -> tuple[int, int]:
    """(min_pixels, max_pixels) as Qwen2VLImageProcessor 5.24 reads preprocessor_config.json:
    `size`'s shortest_edge / longest_edge, each overridden by a `min_pixels` / `max_pixels` field;
    transformers' defaults without the file or `size`. ValueError for limits it cannot resize with."""
    fields = fields or {}
    size = fields.get("size")
    if size is None:
        size = {"shortest_edge": DEFAULT_MIN_PIXELS, "longest_edge": DEFAULT_MAX_PIXELS}
    elif isinstance(size, int):
        size = {"shortest_edge": size}
    size = dict(size) if isinstance(size, dict) else {}
    if fields.get("min_pixels") is not None:
        size["shortest_edge"] = fields["min_pixels"]
    if fields.get("max_pixels") is not None:
        size["longest_edge"] = fields["max_pixels"]
    low, high = size.get("shortest_edge"), size.get("longest_edge")
    if not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in (low, high)):
        raise ValueError(f"preprocessor_config.json: the pixel limits (min_pixels / max_pixels, or size's "
                         f"shortest_edge / longest_edge) must be positive ints, got {low!r} / {high!r}")
    return low, high


@dataclasses.dataclass(frozen=True)
class QwenVLImageProcessor:
    """Qwen2VLImageProcessorPil (module docstring); `steps` holds the resample, rescale and
    normalize fields."""
    grid: QwenVLGrid
    steps: ImageProcessor
    do_resize: bool = True

    @classmethod
    def from_model_dir(cls, model_dir: str | os.PathLike) -> "QwenVLImageProcessor | None":
        """From preprocessor_config.json (None without one)."""
        fields = read_preprocessor(model_dir)
        if fields is None:
            return None
        grid = patch_grid(fields, *pixel_limits(fields))
        return cls(grid, processing_steps(fields), bool(fields.get("do_resize", True)))

    def __call__(self, image: Image.Image) -> tuple[torch.Tensor, tuple[int, int]]:
        """(float32 [grid_h * grid_w, C * T * P * P], (height, width)) for `image`; ValueError
        for one smart_resize refuses."""
        image = to_rgb(image)
        size = (image.height, image.width)
        reason = self.grid.check(size)
        if reason is not None:
            raise ValueError(reason)
        height, width = self.grid.resized(size) if self.do_resize else size
        factor = self.grid.patch_size * self.grid.merge_size
        if height % factor or width % factor:
            raise ValueError(f"image of {height}x{width} pixels is not in whole {factor}-pixel blocks "
                             "(do_resize is off)")
        steps = dataclasses.replace(self.steps, do_resize=self.do_resize, size={"height": height, "width": width})
        return self.patchify(steps.preprocess_rgb(image)), size

    def patchify(self, pixels: torch.Tensor) -> torch.Tensor:
        """[C, H, W] -> [H / P * W / P, C * T * P * P], rows in merge-block order (module docstring)."""
        g = self.grid
        p, m, t = g.patch_size, g.merge_size, g.temporal_patch_size
        channels, height, width = pixels.shape
        rows, cols = height // p, width // p
        x = pixels.reshape(channels, rows // m, m, p, cols // m, m, p)
        x = x.permute(1, 4, 2, 5, 0, 3, 6)      # (block row, block col, row in block, col in block, C, P, P)
        x = x.unsqueeze(5).expand(*x.shape[:5], t, p, p)        # the frame repeated along time
        return x.reshape(rows * cols, channels * t * p * p).contiguous()


def patch_grid(fields: dict, min_pixels: int = DEFAULT_MIN_PIXELS, max_pixels: int = DEFAULT_MAX_PIXELS) -> QwenVLGrid:
    """The patch, merge and temporal patch sizes a processor config's fields name, under these limits."""
    return QwenVLGrid(int(fields.get("patch_size", 14)), int(fields.get("merge_size", 2)),
                      int(fields.get("temporal_patch_size", 2)), min_pixels, max_pixels)


def processing_steps(fields: dict) -> ImageProcessor:
    """The resample, rescale and normalize steps a Qwen-VL processor config's fields name (no crop;
    the resize size is each image's own)."""
    defaults = ImageProcessor()
    return ImageProcessor(
        resample=fields.get("resample", defaults.resample), do_center_crop=False,
        do_rescale=fields.get("do_rescale", True), rescale_factor=fields.get("rescale_factor", 1 / 255),
        do_normalize=fields.get("do_normalize", True),
        image_mean=_per_channel(fields.get("image_mean", defaults.image_mean)),
        image_std=_per_channel(fields.get("image_std", defaults.image_std)))


def _per_channel(value) -> tuple[float, ...]:
    return tuple(float(v) for v in value) if isinstance(value, (list, tuple)) else (float(value),) * 3
