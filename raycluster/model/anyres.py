"""LLaVA-NeXT's "anyres" image layout: transformers 5.24's `LlavaNextImageProcessorPil` (pixels)
and the arithmetic `LlavaNextModel.pack_image_features` / `LlavaNextProcessor` share (tokens).

Pixels: `AnyresImageProcessor(image)` takes a PIL image (RGB, transparency on white) of
(height, width); `select_best_resolution` picks the checkpoint's `image_grid_pinpoints` entry that
keeps most of the image with least waste; the image is resized into it keeping its aspect ratio
(`fit_size`: the long side fills the target, the other rounded up) and centered on a canvas of
zero pixels (black before normalization; the odd pixel of padding goes after); the canvas is cut
into `tile_size` squares in row-major order. The whole image resized to one square (not keeping
its aspect ratio) comes first. Each square then goes through the CLIP steps of
raycluster.model.image_processor (`preprocess_rgb`). Out: float32 [1 + tiles, 3, S, S] and the
image's (height, width), which the model needs to undo the padding.

Tokens: `AnyresGrid` (from config.json) is the model's side. An image's tiles form a grid of
rows x cols tiles, each side x side features (side = tile_size // patch_size); their features laid
on one (rows * side) x (cols * side) grid are cropped back to the image's aspect ratio
(`kept`: transformers' `unpad_image`), and each kept row ends with the `image_newline` feature.
An image becomes base_tokens + kept_rows * (kept_cols + 1) features, placeholders in the prompt.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os

import numpy as np
import torch
from PIL import Image

from raycluster.model.image_processor import ImageProcessor, to_rgb

# LlavaNextConfig's and LlavaNextImageProcessor's default pinpoints, (height, width).
DEFAULT_PINPOINTS = ((336, 672), (672, 336), (672, 672), (1008, 336), (336, 1008))


def select_best_resolution(image_size: tuple[int, int], pinpoints) -> tuple[int, int]:
    """transformers' select_best_resolution: the (height, width) pinpoint whose aspect-preserving
    downscale keeps the most of the image's pixels, ties to the least wasted area; first wins."""
    height, width = image_size
    best, most, least_waste = None, 0, float("inf")
    for h, w in pinpoints:
        scale = min(w / width, h / height)
        effective = min(int(width * scale) * int(height * scale), width * height)
        waste = w * h - effective
        if effective > most or (effective == most and waste < least_waste):
            best, most, least_waste = (h, w), effective, waste
    return best


def fit_size(image_size: tuple[int, int], target: tuple[int, int]) -> tuple[int, int]:
    """transformers' get_patch_output_size: (height, width) of the image resized into `target`
    keeping its aspect ratio, the side that does not fill the target rounded up."""
    height, width = image_size
    target_height, target_width = target
    scale_w, scale_h = target_width / width, target_height / height
    if scale_w < scale_h:
        return min(math.ceil(height * scale_w), target_height), target_width
    return target_height, min(math.ceil(width * scale_h), target_width)


def check_image_size(image_size) -> str | None:
    """None for an image (height, width) of positive ints, else the reason."""
    if not isinstance(image_size, (tuple, list)) or len(image_size) != 2 or \
            not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in image_size):
        return f"image size {image_size!r} is not a (height, width) of positive ints"
    return None


def pinpoints_of(value, field: str, tile_size: int) -> tuple[tuple[int, int], ...]:
    """A config's `image_grid_pinpoints` as (height, width) pairs; ValueError naming `field` unless
    each is a pair of positive multiples of `tile_size` (the model reshapes whole tiles)."""
    try:
        pairs = tuple((int(h), int(w)) for h, w in value)
    except (TypeError, ValueError):
        pairs = ()
    if not pairs or any(h <= 0 or w <= 0 or h % tile_size or w % tile_size for h, w in pairs):
        raise ValueError(f"config field {field!r} = {value!r}: expected [[height, width], ...] in multiples of "
                         f"the {tile_size}-pixel tile")
    return pairs


@dataclasses.dataclass(frozen=True)
class AnyresGrid:
    """The model's anyres arithmetic (module docstring)."""
    pinpoints: tuple[tuple[int, int], ...]
    tile_size: int       # vision_config.image_size: the tower's square input
    patch_size: int      # vision_config.patch_size

    @classmethod
    def from_config(cls, config: dict) -> "AnyresGrid":
        """From a LLaVA-NeXT config.json dict (LlavaNextConfig's default pinpoints)."""
        vision = config.get("vision_config") or {}
        try:
            tile, patch = int(vision["image_size"]), int(vision["patch_size"])
        except KeyError as e:
            raise ValueError(f"config field 'vision_config.{e.args[0]}' is missing") from e
        pinpoints = config.get("image_grid_pinpoints")
        return cls(pinpoints_of(DEFAULT_PINPOINTS if pinpoints is None else pinpoints, "image_grid_pinpoints", tile),
                   tile, patch)

    @property
    def side(self) -> int:
        """Feature rows (and columns) of one tile."""
        return self.tile_size // self.patch_size

    @property
    def base_tokens(self) -> int:
        """Features of the base square (the "default" strategy: no CLS)."""
        return self.side * self.side

    def grid_shape(self, image_size: tuple[int, int]) -> tuple[int, int]:
        """(rows, cols) of tiles an image of (height, width) is cut into."""
        height, width = select_best_resolution(image_size, self.pinpoints)
        return height // self.tile_size, width // self.tile_size

    def num_tiles(self, image_size: tuple[int, int]) -> int:
        rows, cols = self.grid_shape(image_size)
        return rows * cols

    def kept(self, image_size: tuple[int, int]) -> tuple[slice, slice]:
        """(row slice, column slice) of the tiles' feature grid that transformers' unpad_image keeps
        for an image of (height, width): the padding's share of rows (or columns) cut from both ends."""
        height, width = image_size
        rows, cols = self.grid_shape(image_size)
        current_height, current_width = rows * self.side, cols * self.side
        if width / height > current_width / current_height:
            new_height = int(round(height * (current_width / width), 7))
            pad = (current_height - new_height) // 2
            return slice(pad, current_height - pad), slice(0, current_width)
        new_width = int(round(width * (current_height / height), 7))
        pad = (current_width - new_width) // 2
        return slice(0, current_height), slice(pad, current_width - pad)

    def tokens_for(self, image_size: tuple[int, int]) -> int:
        """The features (prompt placeholders) of an image of (height, width): the base square's,
        then each kept row of the tiles' grid and its newline."""
        rows, cols = self.kept(image_size)
        kept_rows, kept_cols = rows.stop - rows.start, cols.stop - cols.start
        return self.base_tokens + kept_rows * (kept_cols + 1)


@dataclasses.dataclass
class AnyresImageProcessor:
    """LlavaNextImageProcessor's PIL path (module docstring); `steps` the CLIP steps of each square."""
    steps: ImageProcessor
    pinpoints: tuple[tuple[int, int], ...] = DEFAULT_PINPOINTS

    @classmethod
    def from_model_dir(cls, model_dir: str | os.PathLike) -> "AnyresImageProcessor | None":
        """From preprocessor_config.json (None without one)."""
        steps = ImageProcessor.from_model_dir(model_dir)
        if steps is None:
            return None
        with open(os.path.join(model_dir, "preprocessor_config.json")) as f:
            value = json.load(f).get("image_grid_pinpoints")
        tile = steps.crop_size["height"]
        return cls(steps, pinpoints_of(DEFAULT_PINPOINTS if value is None else value, "image_grid_pinpoints", tile))

    @property
    def tile_size(self) -> int:
        """The squares' side: the crop's height, as transformers takes it."""
        return self.steps.crop_size["height"]

    def __call__(self, image: Image.Image) -> tuple[torch.Tensor, tuple[int, int]]:
        """(float32 [1 + tiles, 3, S, S], (height, width)) for `image`."""
        image = to_rgb(image)
        size = (image.height, image.width)
        resample = Image.Resampling(self.steps.resample)
        best_height, best_width = select_best_resolution(size, self.pinpoints)
        fit_height, fit_width = fit_size(size, (best_height, best_width))
        canvas = np.zeros((best_height, best_width, 3), dtype=np.uint8)
        top, left = (best_height - fit_height) // 2, (best_width - fit_width) // 2
        canvas[top:top + fit_height, left:left + fit_width] = np.asarray(image.resize((fit_width, fit_height),
                                                                                      resample=resample))
        tile = self.tile_size
        squares = [image.resize(self._base_size()[::-1], resample=resample)]
        squares += [Image.fromarray(canvas[i:i + tile, j:j + tile])
                    for i in range(0, best_height, tile) for j in range(0, best_width, tile)]
        return torch.stack([self.steps.preprocess_rgb(s) for s in squares]), size

    def _base_size(self) -> tuple[int, int]:
        """(height, width) the whole image is resized to: `size` as a square of its shortest edge."""
        size = self.steps.size
        if "height" in size and "width" in size:
            return size["height"], size["width"]
        return size["shortest_edge"], size["shortest_edge"]
