"""LLaVA-OneVision's anyres layout: transformers 5.24's `LlavaOnevisionImageProcessorPil` (pixels)
and the arithmetic `LlavaOnevisionModel.pack_image_features` / `LlavaOnevisionProcessor` share
(tokens). Both are LLaVA-NeXT's (raycluster.model.anyres) with OneVision's defaults and one step
more: an image whose unpadded feature grid holds too many tiles' worth of features is shrunk.

Pixels: `OnevisionImageProcessor(image)` takes a PIL image of (height, width) and returns float32
[1 + tiles, 3, S, S] and (height, width), as AnyresImageProcessor does; only the fields' defaults
differ (`size` a 384 x 384 square, no center crop, OneVision's 36 pinpoints up to 2304 pixels) and
the tile's side is the crop's height when there is a crop, else the size's. This is the processor's
path for an image alone in its prompt (transformers' `batch_num_images` of 1, also what it does
for a flat list of images); a prompt given as a nested list with several images is processed
differently by transformers (each image padded to one square) and is not served here.

Tokens: `OnevisionGrid` (from config.json) is the model's side: LLaVA-NeXT's grid of tiles, cropped
back to the image's aspect ratio (`kept`), and then, when the kept grid's features outnumber
`max_tiles` (config.json's `vision_aspect_ratio` "anyres_max_N") whole tiles' by a ratio over 1.1,
bilinearly resized to (rows // ratio, cols // ratio) (`packed_shape`). An image becomes the base
square's features plus each packed row and its newline, as placeholders in the prompt.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re

from raycluster.model.anyres import AnyresGrid, AnyresImageProcessor, pinpoints_of
from raycluster.model.image_processor import CLIP_MEAN, CLIP_STD, ImageProcessor, _size
from raycluster.model.siglip_vision import SiglipVisionSpec

# LlavaOnevisionConfig's and LlavaOnevisionImageProcessor's default pinpoints: every (height,
# width) of 1 to 6 tiles of 384 pixels a side.
DEFAULT_PINPOINTS = tuple((384 * i, 384 * j) for i in range(1, 7) for j in range(1, 7))
DEFAULT_ASPECT_RATIO = "anyres_max_9"
# LlavaOnevisionConfig's vision_config when config.json has none.
DEFAULT_VISION = {"model_type": "siglip_vision_model", "hidden_size": 1152, "intermediate_size": 4304,
                  "patch_size": 14, "image_size": 384, "num_hidden_layers": 26, "num_attention_heads": 16,
                  "vision_use_head": False}
# LlavaOnevisionImageProcessorPil's defaults for the fields a preprocessor_config.json leaves out.
_PROCESSOR_DEFAULTS = {"size": {"height": 384, "width": 384}, "do_center_crop": False, "crop_size": None,
                       "resample": 3, "image_mean": CLIP_MEAN, "image_std": CLIP_STD}


def max_tiles_of(value) -> int:
    """The N of a `vision_aspect_ratio` "anyres_max_N" (transformers reads nothing else); ValueError
    naming the field otherwise."""
    match = re.fullmatch(r"anyres_max_(\d+)", value) if isinstance(value, str) else None
    if match is None or int(match.group(1)) <= 0:
        raise ValueError(f"config field 'vision_aspect_ratio' = {value!r}: expected 'anyres_max_N' (N > 0 tiles)")
    return int(match.group(1))


@dataclasses.dataclass(frozen=True)
class OnevisionGrid(AnyresGrid):
    """The model's anyres arithmetic (module docstring): AnyresGrid's, then the shrink."""
    max_tiles: int = 9          # vision_aspect_ratio's N

    @classmethod
    def from_config(cls, config: dict) -> "OnevisionGrid":
        """From a LLaVA-OneVision config.json dict (LlavaOnevisionConfig's defaults)."""
        vision = config.get("vision_config")
        spec = SiglipVisionSpec.from_config(DEFAULT_VISION if vision is None else vision)
        pinpoints = config.get("image_grid_pinpoints")
        pinpoints = pinpoints_of(DEFAULT_PINPOINTS if pinpoints is None else pinpoints, "image_grid_pinpoints",
                                 spec.image_size)
        return cls(pinpoints, spec.image_size, spec.patch_size,
                   max_tiles_of(config.get("vision_aspect_ratio", DEFAULT_ASPECT_RATIO)))

    def packed_shape(self, image_size: tuple[int, int]) -> tuple[int, int]:
        """(rows, columns) of an image's tile features after the unpadding and the shrink (before
        the newlines), with transformers' float arithmetic: ratio = sqrt(rows * cols / (N * side^2)),
        shrunk to (int(rows // ratio), int(cols // ratio)) when ratio > 1.1."""
        row_slice, col_slice = self.kept(image_size)
        rows, cols = row_slice.stop - row_slice.start, col_slice.stop - col_slice.start
        ratio = math.sqrt(rows * cols / (self.max_tiles * self.side ** 2))
        if ratio > 1.1:
            return int(rows // ratio), int(cols // ratio)
        return rows, cols

    def tokens_for(self, image_size: tuple[int, int]) -> int:
        """The features (prompt placeholders) of an image of (height, width): the base square's,
        then each packed row and its newline."""
        rows, cols = self.packed_shape(image_size)
        return self.base_tokens + rows * (cols + 1)


@dataclasses.dataclass
class OnevisionImageProcessor(AnyresImageProcessor):
    """LlavaOnevisionImageProcessorPil's single-image path (module docstring)."""
    pinpoints: tuple[tuple[int, int], ...] = DEFAULT_PINPOINTS

    @classmethod
    def from_model_dir(cls, model_dir: str | os.PathLike) -> "OnevisionImageProcessor | None":
        """From preprocessor_config.json (None without one); ValueError naming a field it cannot use."""
        path = os.path.join(model_dir, "preprocessor_config.json")
        if not os.path.exists(path):
            return None
        with open(path) as f:
            d = json.load(f)
        # ImageProcessor's own reading would fill left-out fields with CLIP's defaults; OneVision's differ.
        fields = {f.name for f in dataclasses.fields(ImageProcessor)} - {"pad_to_square"}
        kwargs = {**_PROCESSOR_DEFAULTS, **{k: v for k, v in d.items() if k in fields and v is not None}}
        kwargs["size"] = _size(kwargs["size"], "size")
        if kwargs["crop_size"] is not None:
            kwargs["crop_size"] = _size(kwargs["crop_size"], "crop_size")
        elif kwargs["do_center_crop"]:
            raise ValueError("preprocessor_config.json field 'crop_size' is missing, and 'do_center_crop' is set")
        for name in ("image_mean", "image_std"):
            value = kwargs[name]
            kwargs[name] = tuple(value) if isinstance(value, (list, tuple)) else (float(value),) * 3
        crop = kwargs["crop_size"]
        # transformers' tile side: the crop's height, else the size's (height or shortest edge).
        size = kwargs["size"]
        tile = crop["height"] if crop is not None else size.get("height", size.get("shortest_edge"))
        if crop is None:        # ImageProcessor wants a crop size; without do_center_crop it is never used
            kwargs["crop_size"] = {"height": tile, "width": tile}
        steps = ImageProcessor(**kwargs, pad_to_square=False)
        value = d.get("image_grid_pinpoints")
        return cls(steps, pinpoints_of(DEFAULT_PINPOINTS if value is None else value, "image_grid_pinpoints", tile))
