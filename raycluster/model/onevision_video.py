"""LLaVA-OneVision's videos to pixels and tokens: transformers 5.24's `LlavaOnevisionVideoProcessor`
(frames given, none sampled: its `do_sample_frames` default) and the arithmetic
`LlavaOnevisionProcessor.replace_video_token` and `LlavaOnevisionModel.get_video_features` count a
video's tokens with.

A video's size is (frames, height, width): its frames as given, all of one size. `OnevisionVideoGrid`
is the arithmetic: every frame is one tower square of side x side features, bilinearly pooled to
ceil(side / 2) x ceil(side / 2) (`apply_pooling`), the frames' pooled features one after another,
then one `image_newline` for the whole video: tokens = frames * ceil(side / 2)^2 + 1. `check(size)`
refuses sizes the engine must not take (no frames, more than `max_frames`, empty frames).

`OnevisionVideoProcessor(frames)` takes PIL frames and returns float32 [frames, 3, H, W] and
(frames, height, width): each frame through the image processor's steps
(raycluster.model.image_processor: RGB, an exact PIL resize to `size`, rescale through float64,
normalize in float32). transformers' video processor resizes with torchvision and fuses rescale
and normalize into one float32 step, so a resized pixel can land a level apart and a normalized
value an ulp apart from its output. `from_model_dir(path)` reads video_preprocessor_config.json,
else preprocessor_config.json (transformers' order), with LlavaOnevisionVideoProcessor's defaults:
a 384 x 384 square, bicubic, rescale 1/255, OpenAI CLIP's mean / std; None without either file.
"""

from __future__ import annotations

import dataclasses
import os

import torch
from PIL import Image

from raycluster.model.image_processor import CLIP_MEAN, CLIP_STD, ImageProcessor, _size, frames_size
from raycluster.model.qwen_vl_video import read_video_preprocessor

# A request's video may hold at most this many frames (transformers sets no cap; this bounds the
# work on a request before any is done: 768 frames of llava-onevision's 384-pixel squares are
# 768 * 196 + 1 tokens, far past any context). The engine's encoder budget bounds it further.
DEFAULT_MAX_FRAMES = 768
# LlavaOnevisionVideoProcessor's defaults for the fields a file leaves out.
_DEFAULTS = {"do_resize": True, "size": {"height": 384, "width": 384}, "resample": 3, "do_center_crop": False,
             "crop_size": None, "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True,
             "image_mean": CLIP_MEAN, "image_std": CLIP_STD, "do_convert_rgb": True}


def video_size_reason(size, max_frames: int = DEFAULT_MAX_FRAMES) -> str | None:
    """None for a video size (frames, height, width) of ints, 1 to `max_frames` frames of a
    positive height and width; else why not."""
    if not isinstance(size, (tuple, list)) or len(size) != 3 or \
            not all(isinstance(v, int) and not isinstance(v, bool) for v in size):
        return f"a video's size is (frames, height, width) of ints, got {size!r}"
    frames, height, width = size
    if not 1 <= frames <= max_frames:
        return f"a video holds 1 to {max_frames} frames, got {frames}"
    if height <= 0 or width <= 0:
        return f"video frames of {height}x{width} pixels"
    return None


@dataclasses.dataclass(frozen=True)
class OnevisionVideoGrid:
    """A video size's tokens (module docstring); `side` is a tower square's features a side
    (vision_config.image_size // patch_size)."""
    side: int
    max_frames: int = DEFAULT_MAX_FRAMES

    @property
    def pooled_side(self) -> int:
        """A frame's features a side after apply_pooling: ceil(side / 2)."""
        return -(-self.side // 2)

    def check(self, size) -> str | None:
        """None for a video (frames, height, width) this grid takes, else why not."""
        return video_size_reason(size, self.max_frames)

    def tokens_for(self, size) -> int:
        """The features (prompt placeholders) of a video of (frames, height, width): each frame's
        pooled square, then one newline."""
        return size[0] * self.pooled_side ** 2 + 1


@dataclasses.dataclass(frozen=True)
class OnevisionVideoProcessor:
    """LlavaOnevisionVideoProcessor over frames given (module docstring)."""
    steps: ImageProcessor
    max_frames: int = DEFAULT_MAX_FRAMES

    @classmethod
    def from_model_dir(cls, model_dir: str | os.PathLike) -> "OnevisionVideoProcessor | None":
        """From video_preprocessor_config.json or preprocessor_config.json (None without either);
        ValueError naming a field it cannot use."""
        fields = read_video_preprocessor(model_dir)
        return None if fields is None else cls.from_fields(fields)

    @classmethod
    def from_fields(cls, d: dict) -> "OnevisionVideoProcessor":
        """From a video processor file's fields (LlavaOnevisionVideoProcessor's defaults for the rest)."""
        # The image processor's own reading would fill left-out fields with CLIP's defaults; the video's differ.
        names = {f.name for f in dataclasses.fields(ImageProcessor)} - {"pad_to_square"}
        kwargs = {**_DEFAULTS, **{k: v for k, v in d.items() if k in names and v is not None}}
        kwargs["size"] = _size(kwargs["size"], "size")
        if kwargs["crop_size"] is not None:
            kwargs["crop_size"] = _size(kwargs["crop_size"], "crop_size")
        elif kwargs["do_center_crop"]:
            raise ValueError("video processor field 'crop_size' is missing, and 'do_center_crop' is set")
        if "shortest_edge" in kwargs["size"] and kwargs["do_resize"] and not kwargs["do_center_crop"]:
            # The video processor's shortest-edge resize keeps the frames' aspect ratio; the tower takes squares.
            raise ValueError(f"video processor field 'size' = {kwargs['size']!r}: LLaVA-OneVision's frames are "
                             "resized to the tower's square, {\"height\": S, \"width\": S}")
        for name in ("image_mean", "image_std"):
            value = kwargs[name]
            kwargs[name] = tuple(value) if isinstance(value, (list, tuple)) else (float(value),) * 3
        if kwargs["crop_size"] is None:     # ImageProcessor wants a crop size; without do_center_crop it is unused
            kwargs["crop_size"] = {"height": 1, "width": 1}
        return cls(ImageProcessor(**kwargs, pad_to_square=False))

    @property
    def frame_size(self) -> tuple[int, int] | None:
        """(height, width) every frame leaves at; None when frames keep their own (no resize, no crop)."""
        s = self.steps
        if s.do_center_crop:
            return s.crop_size["height"], s.crop_size["width"]
        return (s.size["height"], s.size["width"]) if s.do_resize else None

    def __call__(self, frames: list[Image.Image]) -> tuple[torch.Tensor, tuple[int, int, int]]:
        """(float32 [frames, 3, H, W], (frames, height, width)); ValueError for no frames, frames
        of different sizes, or too many."""
        size = frames_size(frames)
        reason = video_size_reason(size, self.max_frames)
        if reason is not None:
            raise ValueError(reason)
        return torch.stack([self.steps(f) for f in frames]), size
