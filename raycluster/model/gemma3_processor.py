"""Gemma 3's image processor (transformers' `Gemma3ImageProcessorPil`, as Gemma3Processor calls it),
from a PIL image to the pixels the SigLIP tower takes.

`Gemma3ImageProcessor.from_model_dir(path)` reads the checkpoint's preprocessor_config.json (None
without one) with Gemma3ImageProcessor's defaults for the fields it leaves out or sets null (the
released files set do_convert_rgb and the pan-and-scan fields null): RGB conversion (transparency
composited onto white; always, as Gemma3Processor passes do_convert_rgb true over the file's
value), a resize to size["height"] x size["width"] with `resample` (bilinear), rescale (through
float64, then float32), normalize (mean and std 0.5). Pan-and-scan (extra crops of long images,
each its own image in the prompt) is not done: a file's `do_pan_and_scan` is ignored, as transformers
5.24's Gemma3Processor ignores it (its own default false wins; only its bare image processor
crops). A `size` that is not one fixed height and width is refused, naming the field.

Called as `processor(image) -> (pixels float32 [3, height, width], (image height, image width))`,
the common form of raycluster.model.llava's processors; the steps are
raycluster.model.image_processor's (transformers' PIL backend, shared with CLIP's processor).
"""

from __future__ import annotations

import json
import os

import torch
from PIL import Image

from raycluster.model.image_processor import ImageProcessor

# transformers' IMAGENET_STANDARD_MEAN / _STD, Gemma3ImageProcessor's defaults.
GEMMA3_MEAN = (0.5, 0.5, 0.5)
GEMMA3_STD = (0.5, 0.5, 0.5)
_DEFAULTS = {"do_convert_rgb": True, "do_resize": True, "size": {"height": 224, "width": 224},
             "resample": Image.Resampling.BILINEAR, "do_rescale": True, "rescale_factor": 1 / 255,
             "do_normalize": True, "image_mean": GEMMA3_MEAN, "image_std": GEMMA3_STD}


def _square_size(value) -> dict:
    """`size` as Gemma3ImageProcessor reads it (default_to_square: an int is a square)."""
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return {"height": value, "width": value}
    if isinstance(value, dict) and set(value) == {"height", "width"} and all(
            isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in value.values()):
        return dict(value)
    raise ValueError(f"preprocessor_config.json field 'size' = {value!r}: expected {{\"height\": H, \"width\": W}} "
                     "(Gemma 3 resizes every image to one fixed size)")


def _channels(value, name: str) -> tuple[float, ...]:
    values = tuple(value) if isinstance(value, (list, tuple)) else (value,) * 3
    if len(values) != 3 or not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
        raise ValueError(f"preprocessor_config.json field {name!r} = {value!r}: expected 3 numbers (or one)")
    return tuple(float(v) for v in values)


class Gemma3ImageProcessor:
    """One checkpoint's Gemma 3 image preprocessing (module docstring)."""

    def __init__(self, fields: dict | None = None):
        d = {**_DEFAULTS, **{k: v for k, v in (fields or {}).items() if v is not None}}
        # `do_pan_and_scan` is not read: Gemma3Processor passes its own default (false) over the file's.
        self.size = _square_size(d["size"])
        self.steps = ImageProcessor(do_convert_rgb=bool(d["do_convert_rgb"]), do_resize=bool(d["do_resize"]),
                                    size=self.size, resample=int(d["resample"]), do_center_crop=False,
                                    do_rescale=bool(d["do_rescale"]), rescale_factor=float(d["rescale_factor"]),
                                    do_normalize=bool(d["do_normalize"]),
                                    image_mean=_channels(d["image_mean"], "image_mean"),
                                    image_std=_channels(d["image_std"], "image_std"))

    @classmethod
    def from_model_dir(cls, model_dir: str | os.PathLike) -> "Gemma3ImageProcessor | None":
        path = os.path.join(os.fspath(model_dir), "preprocessor_config.json")
        if not os.path.exists(path):
            return None
        with open(path) as f:
            fields = json.load(f)
        if not isinstance(fields, dict):
            raise ValueError(f"{path}: expected a JSON object, got {type(fields).__name__}")
        return cls(fields)

    def __call__(self, image: Image.Image) -> tuple[torch.Tensor, tuple[int, int]]:
        """(float32 [3, height, width] pixels, the image's own (height, width))."""
        return self.steps(image), (image.height, image.width)
