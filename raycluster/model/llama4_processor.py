"""Llama 4's image processor (transformers 5.24's `Llama4ImageProcessor`, as Llama4Processor calls
it for Llama4ForConditionalGeneration: Llama 4 Scout / Maverick), from a PIL image to the tiles the
vision tower takes, and `Llama4Grid`: how many tiles an image makes and the span of prompt tokens
Llama4Processor expands its "<|image|>" placeholder to.

transformers 5.24 has one Llama 4 image processor, on its torchvision backend (there is no PIL
one); this module gives its output bit for bit in plain torch and PIL. `from_model_dir(path)` reads
preprocessor_config.json (None without one; Llama4ImageProcessor's defaults for fields left out or
null) and processor_config.json's `patch_size` and `pixel_shuffle_ratio` (Llama4Processor's 14 and
0.5), which set the tokens a tile takes. The steps, `size` = S pixels a tile:
1. RGB (transparency composited onto white; always: the tower takes 3 channels), uint8 [3, H, W];
2. the canvas: of the resolutions of 1..`max_patches` tiles (find_supported_resolutions' list and
   order), get_best_fit's: the smallest upscale (largest with `resize_to_max_canvas`), else the
   least downscale, ties to the smallest area. Without `resize_to_max_canvas` the image is not
   upscaled past max(its side, S); the aspect ratio is kept (get_max_res_without_distortion);
3. torchvision's tensor resize (antialiased for bilinear and bicubic; uint8 in, uint8 out, natively
   where torchvision does it natively, else through float32 and rounding), zero padding right and
   bottom to the canvas, then Llama4ImageProcessor's rescale and normalize in bfloat16 ((x * factor
   - mean) / std, each step rounded to bfloat16), cut into rows x columns tiles, row-major;
4. with more than one tile, a global tile after them: the whole image resized (not kept to its
   aspect) to one S x S tile, normalized alike.
Fields it cannot do are refused naming them (`do_resize` false, as transformers does; `do_rescale`
false, whose pixels transformers cannot normalize or the tower take; a `resample` other than
nearest / bilinear / bicubic; a non-square `size`).

Called as `processor(image) -> (pixels float32 [tiles, 3, S, S], (image height, image width))`, the
common form of raycluster.model.llava's processors (the bfloat16 values, exactly, in float32).
`processor.grid` (`Llama4Grid`) answers for an image's (height, width): `canvas` (rows, columns of
tiles), `tiles_for`, `tokens_for` (its span's length), `feature_runs` (the [start, end) runs of the
span the features fill) and `span_ids(size, tokens)` (the span's ids, `SpanTokens` giving the ids
of Llama4Processor's six literal tokens; `span_tokens_of(path)` finds them in tokenizer.json).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import platform
from typing import NamedTuple

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image

from raycluster.model.image_processor import to_rgb
from raycluster.model.pixtral_processor import read_json

# Llama4ImageProcessor's defaults for the fields preprocessor_config.json leaves out.
_DEFAULTS = {"do_resize": True, "size": {"height": 336, "width": 336}, "resample": Image.Resampling.BILINEAR,
             "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True, "image_mean": [0.5] * 3,
             "image_std": [0.5] * 3, "max_patches": 16, "resize_to_max_canvas": False}
# Llama4Processor's defaults for the fields processor_config.json leaves out; "image_token" is the
# placeholder the chat template writes and the processor expands.
PROCESSOR_DEFAULTS = {"patch_size": 14, "pixel_shuffle_ratio": 0.5, "image_token": "<|image|>"}
# PIL resample -> torch interpolate's mode, as transformers maps it to torchvision's (NEAREST is
# torchvision's NEAREST_EXACT); the others (box, hamming, lanczos) are refused.
_MODES = {Image.Resampling.NEAREST: "nearest-exact", Image.Resampling.BILINEAR: "bilinear",
          Image.Resampling.BICUBIC: "bicubic"}


class SpanTokens(NamedTuple):
    """The ids of the tokens Llama4Processor's `_prompt_split_image` writes (literals in its code)."""
    image_start: int
    image_end: int
    image: int
    patch: int
    tile_x_separator: int
    tile_y_separator: int


SPAN_TOKEN_TEXT = {"image_start": "<|image_start|>", "image_end": "<|image_end|>", "image": "<|image|>",
                   "patch": "<|patch|>", "tile_x_separator": "<|tile_x_separator|>",
                   "tile_y_separator": "<|tile_y_separator|>"}


@functools.lru_cache(maxsize=8)
def supported_tiles(max_patches: int) -> tuple[tuple[int, int], ...]:
    """find_supported_resolutions' (rows, columns) of 1..max_patches tiles, in its order (grouped
    by aspect ratio in first-seen order, from the most tiles down): the order breaks area ties."""
    by_ratio: dict[float, list[tuple[int, int]]] = {}
    for tiles in range(max_patches, 0, -1):
        for rows in sorted(d for d in range(1, tiles + 1) if tiles % d == 0):
            by_ratio.setdefault(rows / (tiles // rows), []).append((rows, tiles // rows))
    return tuple(shape for shapes in by_ratio.values() for shape in shapes)


def _max_res_without_distortion(image_size, target_size):
    """transformers' get_max_res_without_distortion, verbatim: a target side may be a 0-d tensor
    (then its scale is float32, else a Python float), and which it is decides some floors."""
    height, width = image_size
    target_height, target_width = target_size
    scale_w, scale_h = target_width / width, target_height / height
    if scale_w < scale_h:
        return min(math.floor(height * scale_w), target_height), target_width
    return target_height, min(math.floor(width * scale_h), target_width)


@dataclasses.dataclass(frozen=True)
class Llama4Grid:
    """An image's tiles and prompt span (module docstring): `tile_size` pixels a tile,
    `tokens_per_tile` patch tokens a tile (after the pixel shuffle)."""
    tile_size: int
    max_patches: int
    resize_to_max_canvas: bool
    tokens_per_tile: int

    def fit(self, image_size: tuple[int, int]) -> tuple[tuple[int, int], tuple[int, int]]:
        """((rows, columns) of tiles, (height, width) the image is resized to before padding)."""
        height, width = image_size
        if height < 1 or width < 1:
            raise ValueError(f"an image of {height}x{width} pixels has no pixel to process")
        return _fit(self, (int(height), int(width)))

    def canvas(self, image_size: tuple[int, int]) -> tuple[int, int]:
        """(rows, columns) of tiles (Llama4ImageProcessor's aspect_ratios)."""
        return self.fit(image_size)[0]

    def tiles_for(self, image_size: tuple[int, int]) -> int:
        """The tiles the tower takes: rows x columns, and the global tile when that is more than 1."""
        rows, columns = self.canvas(image_size)
        return rows * columns + (rows * columns > 1)

    def tokens_for(self, image_size: tuple[int, int]) -> int:
        """The span's length: <|image_start|>, each row's tiles with an x separator between them and
        a y separator after the row (none of those for one tile), <|image|>, the global tile's
        patches, <|image_end|>."""
        rows, columns = self.canvas(image_size)
        n, t = rows * columns, self.tokens_per_tile
        return t + 3 if n == 1 else n * (t + 1) + t + 3

    def feature_runs(self, image_size: tuple[int, int]) -> list[tuple[int, int]]:
        """[start, end) of each tile's <|patch|> run within the span, in the order the tiles' features
        come (row-major, then the global tile)."""
        rows, columns = self.canvas(image_size)
        t = self.tokens_per_tile
        if rows * columns == 1:
            return [(2, 2 + t)]
        runs, at = [], 1
        for _ in range(rows):
            for _ in range(columns):
                runs.append((at, at + t))
                at += t + 1         # the tile's run, then an x separator (the row's last: a y separator)
        return runs + [(at + 1, at + 1 + t)]      # after <|image|>

    def span_ids(self, image_size: tuple[int, int], tokens: SpanTokens) -> list[int]:
        """The span's ids, as Llama4Processor._prompt_split_image writes them."""
        rows, columns = self.canvas(image_size)
        patches = [tokens.patch] * self.tokens_per_tile
        ids = [tokens.image_start]
        if rows * columns > 1:
            for _ in range(rows):
                for x in range(columns):
                    ids += patches + ([tokens.tile_x_separator] if x < columns - 1 else [])
                ids.append(tokens.tile_y_separator)
        return ids + [tokens.image] + patches + [tokens.image_end]


@functools.lru_cache(maxsize=4096)
def _fit(grid: Llama4Grid, image_size: tuple[int, int]) -> tuple[tuple[int, int], tuple[int, int]]:
    """Llama4Grid.fit, cached: the prompt side asks it of an image's size several times."""
    height, width = image_size
    s = grid.tile_size
    # get_best_fit as transformers computes it, in torch: the int64 canvases over the image's
    # int sides give float32 scales, whose comparisons and ties choose the canvas. On the CPU
    # whatever the default device (the gateway asks under torch.device("meta")).
    canvases = torch.tensor([(r * s, c * s) for r, c in supported_tiles(grid.max_patches)], device="cpu")
    scale_w, scale_h = canvases[:, 1] / width, canvases[:, 0] / height
    scales = torch.where(scale_h > scale_w, scale_w, scale_h)
    up = scales[scales >= 1]
    if len(up):
        selected = up.max() if grid.resize_to_max_canvas else up.min()
    else:
        selected = scales[scales < 1].max()
    chosen = canvases[scales == selected]
    canvas = chosen[torch.argmin(chosen[:, 0] * chosen[:, 1])]
    if grid.resize_to_max_canvas:
        target = (canvas[0], canvas[1])
    else:       # min() of an int and a 0-d tensor returns either, as in transformers (see above)
        target = (min(max(height, s), canvas[0]), min(max(width, s), canvas[1]))
    new_height, new_width = _max_res_without_distortion((height, width), target)
    return (int(canvas[0]) // s, int(canvas[1]) // s), (max(int(new_height), 1), max(int(new_width), 1))


def processor_fields(model_dir: str | os.PathLike) -> dict:
    """processor_config.json's Llama4Processor fields over its defaults (validated)."""
    fields = read_json(os.path.join(os.fspath(model_dir), "processor_config.json"))
    out = {**PROCESSOR_DEFAULTS, **{k: v for k, v in fields.items() if k in PROCESSOR_DEFAULTS and v is not None}}
    patch, ratio = out["patch_size"], out["pixel_shuffle_ratio"]
    if not isinstance(patch, int) or isinstance(patch, bool) or patch <= 0:
        raise ValueError(f"processor_config.json field 'patch_size' = {patch!r}: expected a positive int")
    if not isinstance(ratio, (int, float)) or isinstance(ratio, bool) or not 0 < ratio <= 1:
        raise ValueError(f"processor_config.json field 'pixel_shuffle_ratio' = {ratio!r}: expected a number in (0, 1]")
    if not isinstance(out["image_token"], str) or not out["image_token"]:
        raise ValueError(f"processor_config.json field 'image_token' = {out['image_token']!r}: expected a token")
    return out


def span_tokens_of(model_dir: str | os.PathLike) -> tuple[SpanTokens, int]:
    """(the span tokens' ids, the placeholder's id: processor_config.json's `image_token`) from the
    checkpoint's tokenizer.json; ValueError naming the file or the token it lacks."""
    path = os.fspath(model_dir)
    file = os.path.join(path, "tokenizer.json")
    if not os.path.exists(file):
        raise ValueError(f"{path}: no tokenizer.json to find Llama 4's image tokens in")
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(file)
    ids = {}
    for name, text in {**SPAN_TOKEN_TEXT, "placeholder": processor_fields(path)["image_token"]}.items():
        ids[name] = tokenizer.token_to_id(text)
        if ids[name] is None:
            raise ValueError(f"{file}: the tokenizer has no {text!r} token, which Llama4Processor writes for an image")
    placeholder = ids.pop("placeholder")
    return SpanTokens(**ids), placeholder


def _square_size(size) -> int:
    """S of a `size` field: {"height": S, "width": S}, or an int S (a square, as transformers reads it)."""
    if isinstance(size, int) and not isinstance(size, bool) and size > 0:
        return size
    if isinstance(size, dict) and isinstance(size.get("height"), int) and size.get("height") == size.get("width") \
            and size["height"] > 0 and not isinstance(size["height"], bool):
        return size["height"]
    raise ValueError(f"preprocessor_config.json field 'size' = {size!r}: expected a square "
                     "{\"height\": S, \"width\": S} (Llama 4's tiles)")


def _channels(value, name: str) -> tuple[float, ...]:
    values = tuple(value) if isinstance(value, (list, tuple)) else (value,) * 3
    if len(values) != 3 or not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
        raise ValueError(f"preprocessor_config.json field {name!r} = {value!r}: expected 3 numbers (or one)")
    if name == "image_std" and not all(values):
        raise ValueError(f"preprocessor_config.json field 'image_std' = {value!r}: a zero divides by zero")
    return tuple(float(v) for v in values)


def _native_uint8(mode: str) -> bool:
    """Whether torchvision 0.28's resize_image interpolates uint8 pixels as they are on this CPU
    (bilinear: on AVX2 / AVX512 and ARM; bicubic and nearest always), not through float32."""
    if mode == "bilinear":
        return torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512") or platform.machine() in ("aarch64",
                                                                                                       "arm64")
    return True


def resize_uint8(pixels: torch.Tensor, size: tuple[int, int], mode: str) -> torch.Tensor:
    """torchvision's resize of uint8 [N, C, H, W] (module docstring); the same size: untouched."""
    if tuple(pixels.shape[-2:]) == tuple(size):
        return pixels
    native = _native_uint8(mode)
    x = pixels if native else pixels.to(torch.float32)
    smooth = mode in ("bilinear", "bicubic")
    x = F.interpolate(x, size=list(size), mode=mode, align_corners=False if smooth else None, antialias=smooth)
    return x if native else x.round_().to(torch.uint8)


class Llama4ImageProcessor:
    """One checkpoint's Llama 4 image preprocessing (module docstring)."""

    def __init__(self, fields: dict | None = None, patch_size: int = 14, pixel_shuffle_ratio: float = 0.5):
        d = {**_DEFAULTS, **{k: v for k, v in (fields or {}).items() if v is not None}}
        if not d["do_resize"]:
            raise ValueError("preprocessor_config.json field 'do_resize' = false: Llama 4 always resizes its images "
                             "to a canvas of tiles (transformers refuses it too)")
        if not d["do_rescale"]:
            raise ValueError("preprocessor_config.json field 'do_rescale' = false: transformers' Llama 4 pixels would "
                             "stay uint8, which it can neither normalize nor give the tower")
        for name in ("do_normalize", "resize_to_max_canvas"):
            if not isinstance(d[name], bool):
                raise ValueError(f"preprocessor_config.json field {name!r} = {d[name]!r}: expected true or false")
        patches = d["max_patches"]
        if not isinstance(patches, int) or isinstance(patches, bool) or patches <= 0:
            raise ValueError(f"preprocessor_config.json field 'max_patches' = {patches!r}: expected a positive int")
        try:
            self.mode = _MODES[Image.Resampling(int(d["resample"]))]
        except (KeyError, ValueError, TypeError):
            raise ValueError(f"preprocessor_config.json field 'resample' = {d['resample']!r}: expected 0 (nearest), "
                             "2 (bilinear) or 3 (bicubic)") from None
        factor = d["rescale_factor"]
        if not isinstance(factor, (int, float)) or isinstance(factor, bool):
            raise ValueError(f"preprocessor_config.json field 'rescale_factor' = {factor!r}: expected a number")
        self.rescale_factor, self.do_normalize = float(factor), d["do_normalize"]
        self.image_mean = _channels(d["image_mean"], "image_mean")
        self.image_std = _channels(d["image_std"], "image_std")
        tile = _square_size(d["size"])
        # Llama4Processor's count: whole patches of the tile, fewer by the shuffle's 1 / ratio^2.
        tokens = (tile // patch_size) ** 2 // int(round(1.0 / pixel_shuffle_ratio ** 2))
        self.grid = Llama4Grid(tile, patches, d["resize_to_max_canvas"], tokens)

    @classmethod
    def from_model_dir(cls, model_dir: str | os.PathLike) -> "Llama4ImageProcessor | None":
        path = os.fspath(model_dir)
        if not os.path.exists(os.path.join(path, "preprocessor_config.json")):
            return None
        processor = processor_fields(path)
        return cls(read_json(os.path.join(path, "preprocessor_config.json")), processor["patch_size"],
                   processor["pixel_shuffle_ratio"])

    def normalized(self, pixels: torch.Tensor) -> torch.Tensor:
        """Llama4ImageProcessor.rescale_and_normalize of uint8 pixels, as float32: with normalize, each
        step in bfloat16 as transformers does it (the same torch ops); without, x * factor in float32."""
        if not self.do_normalize:
            return pixels * self.rescale_factor
        x = pixels.to(torch.bfloat16) * self.rescale_factor
        mean = torch.as_tensor(self.image_mean, dtype=torch.bfloat16).view(-1, 1, 1)
        std = torch.as_tensor(self.image_std, dtype=torch.bfloat16).view(-1, 1, 1)
        return x.sub(mean).div_(std).to(torch.float32)

    def __call__(self, image: Image.Image) -> tuple[torch.Tensor, tuple[int, int]]:
        """(float32 [tiles, 3, S, S] pixels, the image's own (height, width))."""
        size = (image.height, image.width)
        (rows, columns), resized = self.grid.fit(size)
        s = self.grid.tile_size
        pixels = torch.from_numpy(np.array(to_rgb(image))).permute(2, 0, 1).contiguous()[None]    # uint8 [1, 3, H, W]
        canvas = resize_uint8(pixels, resized, self.mode)
        canvas = F.pad(canvas, (0, columns * s - resized[1], 0, rows * s - resized[0]))     # zeros right / bottom
        tiles = self.normalized(canvas).view(3, rows, s, columns, s).permute(1, 3, 0, 2, 4).reshape(-1, 3, s, s)
        if rows * columns > 1:
            whole = self.normalized(resize_uint8(pixels, (s, s), self.mode))
            tiles = torch.cat([tiles, whole])
        return tiles.contiguous(), size
