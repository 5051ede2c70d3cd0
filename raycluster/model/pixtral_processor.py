"""Mistral 3's image processor (transformers 5.24's `PixtralImageProcessorPil`, as PixtralProcessor
calls it for Mistral3ForConditionalGeneration), from a PIL image to the pixels the Pixtral tower
takes, and `PixtralGrid`: how big an image's pixels and prompt span are for its size.

`PixtralImageProcessor.from_model_dir(path)` reads the checkpoint's preprocessor_config.json (None
without one) with PixtralImageProcessor's defaults for the fields it leaves out or sets null, and
processor_config.json's `patch_size` and `spatial_merge_size` (PixtralProcessor's defaults 16 and
1 without them): PixtralProcessor passes their product to the image processor as its patch size,
so every resized side is a whole number of merged patches. The steps: RGB conversion
(transparency composited onto white; always, the tower takes 3 channels), a resize with
`resample` (bicubic) to `PixtralGrid.resized` of the image's size, rescale (through float64, then
float32), normalize (CLIP's mean and std by default); raycluster.model.image_processor's steps,
transformers' PIL backend. A file asking for what PixtralProcessor's images never get here is
refused naming the field (`do_resize` false, `do_center_crop` true, a `size` that is neither
{"longest_edge": N} nor {"height": H, "width": W}). Batch padding (`do_pad`) is not done: each image
keeps its own size, which is what the model crops a padded batch back to.

Called as `processor(image) -> (pixels float32 [3, H', W'], (image height, image width))`, the
common form of raycluster.model.llava's processors; `processor.grid.grid_for((height, width))` is
the (rows, columns) of merged patches (one image token each) and `tokens_for` the span it takes in
the prompt, [IMG_BREAK] after every row and [IMG_END] for the last one included: rows x (columns + 1).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os

import torch
from PIL import Image

from raycluster.model.image_processor import CLIP_MEAN, CLIP_STD, ImageProcessor, to_rgb

# PixtralImageProcessor's defaults (CLIP's mean and std, a 1024-pixel longest edge, bicubic).
_DEFAULTS = {"do_resize": True, "size": {"longest_edge": 1024}, "resample": Image.Resampling.BICUBIC,
             "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True, "image_mean": CLIP_MEAN,
             "image_std": CLIP_STD, "do_center_crop": False}
# PixtralProcessor's defaults for the fields processor_config.json leaves out.
PROCESSOR_DEFAULTS = {"patch_size": 16, "spatial_merge_size": 1, "image_token": "[IMG]",
                      "image_break_token": "[IMG_BREAK]", "image_end_token": "[IMG_END]"}


@dataclasses.dataclass(frozen=True)
class PixtralGrid:
    """An image's resized size and merged-patch grid: transformers' get_resize_output_image_size
    with the bound (max_height, max_width) and `unit` = patch_size x spatial_merge_size pixels."""
    max_height: int
    max_width: int
    unit: int

    def resized(self, image_size: tuple[int, int]) -> tuple[int, int]:
        """(H', W') of the processor's pixels for an image of (height, width); ValueError for an
        image so thin that shrinking it leaves a side of no pixel (transformers fails on it too)."""
        height, width = image_size
        ratio = max(height / self.max_height, width / self.max_width)
        if ratio > 1:       # shrunk to fit, each side floored (transformers' choice over round())
            height, width = int(math.floor(height / ratio)), int(math.floor(width / ratio))
        if height < 1 or width < 1:     # transformers' resize fails on a side of 0 pixels
            raise ValueError(f"an image of {image_size[0]}x{image_size[1]} pixels is too thin: shrunk to fit "
                             f"{self.max_height}x{self.max_width}, a side would have no pixel left")
        # Then each side up to a whole number of merged patches (small images grow a little).
        return ((height - 1) // self.unit + 1) * self.unit, ((width - 1) // self.unit + 1) * self.unit

    def grid_for(self, image_size: tuple[int, int]) -> tuple[int, int]:
        """(rows, columns) of merged patches: one image token each."""
        height, width = self.resized(image_size)
        return height // self.unit, width // self.unit

    def tokens_for(self, image_size: tuple[int, int]) -> int:
        """The image's span in the prompt: each row's image tokens and its break (the last: end)."""
        rows, columns = self.grid_for(image_size)
        return rows * (columns + 1)


def bound_of(size, field: str = "preprocessor_config.json field 'size'") -> tuple[int, int]:
    """(max_height, max_width) of a Pixtral `size` field: {"longest_edge": N} (or an int N, which
    transformers reads as a square) bounds both sides by N; {"height": H, "width": W} each its own."""
    if isinstance(size, int) and not isinstance(size, bool) and size > 0:
        return size, size
    if isinstance(size, dict):
        edge = size.get("longest_edge")
        if edge is not None:
            if isinstance(edge, int) and not isinstance(edge, bool) and edge > 0:
                return edge, edge
        elif all(isinstance(size.get(k), int) and not isinstance(size.get(k), bool) and size[k] > 0
                 for k in ("height", "width")):
            return size["height"], size["width"]
    raise ValueError(f"{field} = {size!r}: expected {{\"longest_edge\": N}} or {{\"height\": H, \"width\": W}}")


def _channels(value, name: str) -> tuple[float, ...]:
    values = tuple(value) if isinstance(value, (list, tuple)) else (value,) * 3
    if len(values) != 3 or not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
        raise ValueError(f"preprocessor_config.json field {name!r} = {value!r}: expected 3 numbers (or one)")
    return tuple(float(v) for v in values)


def read_json(path: str) -> dict:
    """A JSON object file's fields ({} when the file does not exist)."""
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        fields = json.load(f)
    if not isinstance(fields, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(fields).__name__}")
    return fields


def processor_fields(model_dir: str | os.PathLike) -> dict:
    """processor_config.json's PixtralProcessor fields over PixtralProcessor's defaults."""
    fields = read_json(os.path.join(os.fspath(model_dir), "processor_config.json"))
    out = {**PROCESSOR_DEFAULTS, **{k: v for k, v in fields.items() if k in PROCESSOR_DEFAULTS and v is not None}}
    for name in ("patch_size", "spatial_merge_size"):
        value = out[name]
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ValueError(f"processor_config.json field {name!r} = {value!r}: expected a positive int")
    return out


class PixtralImageProcessor:
    """One checkpoint's Mistral 3 image preprocessing (module docstring)."""

    def __init__(self, fields: dict | None = None, patch_size: int = 16, spatial_merge_size: int = 1):
        d = {**_DEFAULTS, **{k: v for k, v in (fields or {}).items() if v is not None}}
        if not d["do_resize"]:
            raise ValueError("preprocessor_config.json field 'do_resize' = false: PixtralProcessor's images are "
                             "resized to whole merged patches here")
        if d["do_center_crop"]:
            raise ValueError("preprocessor_config.json field 'do_center_crop' = true is not supported for Pixtral")
        max_height, max_width = bound_of(d["size"])
        self.grid = PixtralGrid(max_height, max_width, patch_size * spatial_merge_size)
        # The resize is done here (to the grid's size); the shared steps do the rest.
        self.resample = Image.Resampling(int(d["resample"]))
        self.steps = ImageProcessor(do_convert_rgb=True, do_resize=False, do_center_crop=False,
                                    do_rescale=bool(d["do_rescale"]), rescale_factor=float(d["rescale_factor"]),
                                    do_normalize=bool(d["do_normalize"]),
                                    image_mean=_channels(d["image_mean"], "image_mean"),
                                    image_std=_channels(d["image_std"], "image_std"))

    @classmethod
    def from_model_dir(cls, model_dir: str | os.PathLike) -> "PixtralImageProcessor | None":
        path = os.fspath(model_dir)
        if not os.path.exists(os.path.join(path, "preprocessor_config.json")):
            return None
        fields = read_json(os.path.join(path, "preprocessor_config.json"))
        processor = processor_fields(path)
        return cls(fields, processor["patch_size"], processor["spatial_merge_size"])

    def __call__(self, image: Image.Image) -> tuple[torch.Tensor, tuple[int, int]]:
        """(float32 [3, H', W'] pixels, the image's own (height, width))."""
        size = (image.height, image.width)
        height, width = self.grid.resized(size)
        rgb = to_rgb(image).resize((width, height), resample=self.resample)
        return self.steps.preprocess_rgb(rgb), size
