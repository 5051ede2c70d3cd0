"""Images from request bytes to the pixel tensor a CLIP-style vision tower takes.

`decode_image(data)` turns the bytes of a request's image into a PIL image, or raises ValueError
(not an image, truncated, or more pixels than allowed: the server answers 400). `ImageProcessor`
holds a checkpoint's `preprocessor_config.json` (`ImageProcessor.from_model_dir`; None without
one) and maps a PIL image to float32 [3, H, W] exactly as transformers' PIL image processors do
(`CLIPImageProcessorPil`, and `LlavaImageProcessorPil`'s pad-to-square): RGB with transparency
composited onto white, a shortest-edge (or fixed height/width) PIL resize, a center crop that
pads with zeros when the image is smaller, rescale through float64 then float32, normalize in
float32. Fields the file leaves out take CLIPImageProcessor's defaults. `preprocess_rgb` is the
part after the RGB conversion, which LLaVA-NeXT's processor (raycluster.model.anyres) runs on
each of its squares.
"""

from __future__ import annotations

import dataclasses
import io
import json
import math
import os
import warnings

import numpy as np
import torch
from PIL import Image

# OPENAI_CLIP_MEAN / OPENAI_CLIP_STD, transformers' defaults for CLIP's processor.
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
# A request's image may hold at most this many pixels: decoding is bounded before any work on it.
MAX_IMAGE_PIXELS = 64 * 1024 * 1024


def decode_image(data: bytes, max_pixels: int = MAX_IMAGE_PIXELS) -> Image.Image:
    """The image `data` encodes (its first frame), fully decoded; ValueError for anything else."""
    try:
        # PIL warns (DecompressionBombWarning) above its own MAX_IMAGE_PIXELS and raises above twice
        # it; the warning is made an error so such an image is refused before decoding. (The
        # filter is process-wide while open() runs: only this warning class is affected.)
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data))        # reads the header only
    except (Image.DecompressionBombWarning, Image.DecompressionBombError) as e:
        raise ValueError(f"image is larger than the limit of pixels decoded here: {e}") from e
    except Exception as e:      # PIL raises OSError, SyntaxError, struct.error... for non-images
        raise ValueError(f"cannot decode image data ({len(data)} bytes): {e}") from e
    width, height = image.size
    if width * height > max_pixels:
        raise ValueError(f"image of {width}x{height} pixels is larger than the limit of {max_pixels} pixels")
    try:
        image.load()        # decode now: truncated or corrupt data fails here, not in the engine
    except Exception as e:
        raise ValueError(f"cannot decode image data ({len(data)} bytes): {e}") from e
    return image


def _size(value, name: str) -> dict:
    """A size field as transformers reads it: an int is a shortest edge ("size") or a square (crops)."""
    if isinstance(value, int):
        return {"shortest_edge": value} if name == "size" else {"height": value, "width": value}
    if isinstance(value, dict) and ("shortest_edge" in value or {"height", "width"} <= value.keys()):
        return value
    raise ValueError(f"preprocessor_config.json field {name!r} = {value!r}: expected "
                     "{\"shortest_edge\": N} or {\"height\": H, \"width\": W}")


@dataclasses.dataclass
class ImageProcessor:
    """One checkpoint's image preprocessing (CLIPImageProcessor's fields and defaults)."""
    do_convert_rgb: bool = True
    do_resize: bool = True
    size: dict = dataclasses.field(default_factory=lambda: {"shortest_edge": 224})
    resample: int = Image.Resampling.BICUBIC
    do_center_crop: bool = True
    crop_size: dict = dataclasses.field(default_factory=lambda: {"height": 224, "width": 224})
    do_rescale: bool = True
    rescale_factor: float = 1 / 255
    do_normalize: bool = True
    image_mean: tuple[float, ...] = CLIP_MEAN
    image_std: tuple[float, ...] = CLIP_STD
    pad_to_square: bool = False      # LlavaImageProcessor's do_pad: a square of the mean color first

    @classmethod
    def from_model_dir(cls, model_dir: str | os.PathLike) -> "ImageProcessor | None":
        path = os.path.join(model_dir, "preprocessor_config.json")
        if not os.path.exists(path):
            return None
        with open(path) as f:
            d = json.load(f)
        fields = {f.name for f in dataclasses.fields(cls)} - {"pad_to_square"}
        kwargs = {k: v for k, v in d.items() if k in fields and v is not None}
        for name in ("size", "crop_size"):
            if name in kwargs:
                kwargs[name] = _size(kwargs[name], name)
        for name in ("image_mean", "image_std"):
            if name in kwargs:
                value = kwargs[name]
                kwargs[name] = tuple(value) if isinstance(value, (list, tuple)) else (float(value),) * 3
        # Only LLaVA's own processor pads to a square; CLIP's ignores a stray do_pad.
        kwargs["pad_to_square"] = bool(d.get("do_pad")) and \
            str(d.get("image_processor_type", "")).startswith("LlavaImageProcessor")
        return cls(**kwargs)

    def __call__(self, image: Image.Image) -> torch.Tensor:
        """float32 [3, H, W] for `image`."""
        image = to_rgb(image)      # also without do_convert_rgb: the tower takes 3 channels
        if self.pad_to_square:
            image = _pad_to_square(image, tuple(int(m * 255) for m in self.image_mean))
        return self.preprocess_rgb(image)

    def preprocess_rgb(self, image: Image.Image) -> torch.Tensor:
        """float32 [3, H, W] for an RGB image: the resize, crop, rescale and normalize (what
        LLaVA-NeXT's processor, raycluster.model.anyres, applies to each of its tiles)."""
        if self.do_resize:
            height, width = self._resized(image.height, image.width)
            image = image.resize((width, height), resample=Image.Resampling(self.resample))
        pixels = torch.from_numpy(np.array(image)).permute(2, 0, 1)      # uint8 [3, H, W]
        if self.do_center_crop:
            pixels = _center_crop(pixels, self.crop_size["height"], self.crop_size["width"])
        x = pixels.to(torch.float64) * self.rescale_factor if self.do_rescale else pixels.to(torch.float64)
        x = x.to(torch.float32)     # transformers rescales in float64, then keeps float32
        if self.do_normalize:
            mean = torch.tensor(self.image_mean, dtype=torch.float32).view(-1, 1, 1)
            std = torch.tensor(self.image_std, dtype=torch.float32).view(-1, 1, 1)
            x = (x - mean) / std
        return x.contiguous()

    def _resized(self, height: int, width: int) -> tuple[int, int]:
        """(height, width) after the resize, with transformers' rounding (the long edge truncated)."""
        if "shortest_edge" in self.size:
            target = self.size["shortest_edge"]
            short, long = (width, height) if width <= height else (height, width)
            new_long = int(target * long / short)
            return (new_long, target) if width <= height else (target, new_long)
        return self.size["height"], self.size["width"]


def frames_size(frames: list[Image.Image]) -> tuple[int, int, int]:
    """(frames, height, width) of a video's frames; ValueError for none, or frames of two sizes."""
    if not frames:
        raise ValueError("a video needs at least one frame")
    sizes = {(f.height, f.width) for f in frames}
    if len(sizes) > 1:
        raise ValueError(f"a video's frames must share one size, got {sorted(sizes)}")
    return len(frames), frames[0].height, frames[0].width


def to_rgb(image: Image.Image) -> Image.Image:
    """transformers 5's convert_to_rgb: any transparency composited onto white."""
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, rgba).convert("RGB")
    return image.convert("RGB")


def _pad_to_square(image: Image.Image, color: tuple[int, ...]) -> Image.Image:
    """The image centered on a square of `color` as wide as its long edge (the short side's offset
    rounded down)."""
    width, height = image.size
    if width == height:
        return image
    side = max(width, height)
    square = Image.new("RGB", (side, side), color)
    square.paste(image, ((side - width) // 2, (side - height) // 2))
    return square


def _center_crop(pixels: torch.Tensor, crop_height: int, crop_width: int) -> torch.Tensor:
    """transformers' center_crop of [C, H, W]: the window's offset rounded down; an image smaller
    than the window is first zero-padded to cover it, its own offset rounded up."""
    _, height, width = pixels.shape
    top, left = (height - crop_height) // 2, (width - crop_width) // 2
    if top >= 0 and left >= 0:
        return pixels[:, top:top + crop_height, left:left + crop_width]
    new_height, new_width = max(crop_height, height), max(crop_width, width)
    top_pad, left_pad = math.ceil((new_height - height) / 2), math.ceil((new_width - width) / 2)
    padded = pixels.new_zeros((pixels.shape[0], new_height, new_width))
    padded[:, top_pad:top_pad + height, left_pad:left_pad + width] = pixels
    top, left = top + top_pad, left + left_pad
    return padded[:, max(0, top):min(new_height, top + crop_height), max(0, left):min(new_width, left + crop_width)]
