"""transformers' Llama 4 as the reference for raycluster's Llama 4 image input (test-time only).

`hf_llama4(model_dir)` is the checkpoint's Llama4ForConditionalGeneration (float32, cached), its
forward mended where transformers 5.24 breaks it (`_with_image_outputs`). For
the tiny checkpoint's `model.`-prefixed layout, which transformers 5.24 does not load for Llama 4,
the model is built from config.json and given the same tensors under its own names.

`hf_llama4_processor(model_dir)` is Llama4Processor over transformers' Llama4ImageProcessor and the
checkpoint's tokenizer, with processor_config.json's fields. transformers 5.24 has only a
torchvision Llama4ImageProcessor, and this environment has no torchvision: its module is then
imported with a stand-in for torchvision.transforms.v2.functional (for the import only), and
while it runs, the torchvision backend's module is handed the same stand-in (`tvF` and its
PIL-to-torchvision resample map; restored afterwards). The stand-in transcribes the three torchvision
0.28 kernels the Llama 4 path calls: `resize_image` (F.interpolate, antialiased for bilinear /
bicubic, uint8 natively where torchvision does it natively), `pad_image` (constant) and
`normalize_image`. Everything else — the canvas choice, the resize targets, padding, the bfloat16
rescale / normalize, the tiles' split and order, the global tile, the prompt's expansion — is
transformers' own code. (raycluster's processor was also checked once against this path with the
real torchvision 0.28: equal bit for bit, on both its uint8 and float32 resize paths.) With
torchvision installed, the real one is used.

`hf_processor_outputs(model_dir, text, images)` is that processor's output as it gives it;
`hf_processed(model_dir, text, images)` is its output for one text with "<|image|>"
per image: the expanded prompt ids (no BOS added), each image's [tiles, 3, S, S] pixels (float32
of transformers' bfloat16) and its (rows, columns) of tiles. `hf_llama4_greedy(model_dir,
input_ids, pixel_values, max_new_tokens)` is the model's greedy continuation of one expanded prompt
(pure argmax: EOS neither stops nor is suppressed), the new token ids only; `pixel_values` a list of
each image's tiles or their concatenation. `hf_llama4_logits(model_dir, input_ids,
inputs_embeds=..., pixel_values=...)` is one forward's [L, vocab] logits; `hf_token_embeddings`
the prompt's token embeddings.
"""

from __future__ import annotations

import contextlib
import enum
import functools
import importlib
import json
import os
import platform
import sys
import types

import torch
import torch.nn.functional as F

_MODULE = "transformers.models.llama4.image_processing_llama4"
_ABSENT = object()


class InterpolationMode(enum.Enum):
    NEAREST = "nearest"
    NEAREST_EXACT = "nearest-exact"
    BILINEAR = "bilinear"
    BICUBIC = "bicubic"
    BOX = "box"
    HAMMING = "hamming"
    LANCZOS = "lanczos"


def _resize(image, size, interpolation=InterpolationMode.BILINEAR, max_size=None, antialias=True):
    """torchvision 0.28's resize_image, for a [..., C, H, W] tensor and an [h, w] size."""
    smooth = interpolation in (InterpolationMode.BILINEAR, InterpolationMode.BICUBIC, InterpolationMode.LANCZOS)
    antialias, align_corners = bool(antialias) and smooth, (False if smooth else None)
    shape = image.shape
    channels, height, width = shape[-3:]
    new_height, new_width = (int(s) for s in size)
    if (new_height, new_width) == (height, width):
        return image
    acceptable = [torch.float32, torch.float64]
    if interpolation in (InterpolationMode.NEAREST, InterpolationMode.NEAREST_EXACT):
        acceptable.append(torch.uint8)
    elif image.device.type == "cpu":
        native = (torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")
                  or platform.machine() in ("aarch64", "arm64")) if interpolation == InterpolationMode.BILINEAR \
            else interpolation in (InterpolationMode.BICUBIC, InterpolationMode.LANCZOS)
        if native:
            acceptable.append(torch.uint8)
    dtype = image.dtype
    image = image.reshape(-1, channels, height, width)
    cast = dtype not in acceptable
    if cast:
        image = image.to(torch.float32)
    image = F.interpolate(image, size=[new_height, new_width], mode=interpolation.value, align_corners=align_corners,
                          antialias=antialias)
    if cast:
        if interpolation in (InterpolationMode.BICUBIC, InterpolationMode.LANCZOS) and dtype == torch.uint8:
            image = image.clamp_(min=0, max=255)
        if dtype in (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64):
            image = image.round_()
        image = image.to(dtype=dtype)
    return image.reshape(shape[:-3] + (channels, new_height, new_width))


def _pad(image, padding, fill=None, padding_mode="constant"):
    """torchvision 0.28's pad_image, constant mode: `padding` [left, top, right, bottom]."""
    if padding_mode != "constant":
        raise NotImplementedError("the stand-in pads with constants only (all Llama 4's path uses)")
    left, top, right, bottom = padding
    shape = image.shape
    flat = image.reshape(-1, *shape[-3:])
    fills = [0 if fill is None else fill] if not isinstance(fill, (list, tuple)) else list(fill)
    out = F.pad(flat, [left, right, top, bottom], mode="constant", value=float(fills[0] if len(fills) == 1 else 0))
    if len(fills) > 1:
        value = torch.tensor(fills).to(dtype=image.dtype).reshape(-1, 1, 1)
        for region in ((..., slice(0, top), slice(None)), (..., slice(None), slice(0, left)),
                       (..., slice(out.shape[-2] - bottom, None), slice(None)),
                       (..., slice(None), slice(out.shape[-1] - right, None))):
            out[region] = value
    return out.reshape(*shape[:-2], *out.shape[-2:])


def _normalize(image, mean, std, inplace=False):
    """torchvision 0.28's normalize_image: in the image's dtype."""
    if not image.is_floating_point():
        raise TypeError(f"Input tensor should be a float tensor. Got {image.dtype}.")
    mean = torch.as_tensor(mean, dtype=image.dtype, device=image.device)
    std = torch.as_tensor(std, dtype=image.dtype, device=image.device)
    mean = mean.view(-1, 1, 1) if mean.ndim == 1 else mean
    std = std.view(-1, 1, 1) if std.ndim == 1 else std
    return (image.sub_(mean) if inplace else image.sub(mean)).div_(std)


@functools.lru_cache(maxsize=1)
def _stand_in_modules() -> dict[str, types.ModuleType]:
    functional = types.ModuleType("torchvision.transforms.v2.functional")
    functional.InterpolationMode, functional.resize = InterpolationMode, _resize
    functional.pad, functional.normalize = _pad, _normalize
    v2 = types.ModuleType("torchvision.transforms.v2")
    v2.functional = functional
    transforms = types.ModuleType("torchvision.transforms")
    transforms.v2 = v2
    root = types.ModuleType("torchvision")
    root.transforms = transforms
    return {"torchvision": root, "torchvision.transforms": transforms, "torchvision.transforms.v2": v2,
            "torchvision.transforms.v2.functional": functional}


@functools.lru_cache(maxsize=1)
def llama4_image_processor_class() -> tuple[type, bool]:
    """(transformers' Llama4ImageProcessor, whether it runs on the stand-in)."""
    try:
        return importlib.import_module(_MODULE).Llama4ImageProcessor, False
    except ImportError:
        pass
    from transformers.utils import import_utils
    import_utils.is_torchvision_available()     # its cached answer taken before the stand-in is in place
    modules = _stand_in_modules()
    saved = {name: sys.modules.get(name) for name in modules}
    sys.modules.update(modules)
    try:
        return importlib.import_module(_MODULE).Llama4ImageProcessor, True
    finally:
        for name, module in saved.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module


@contextlib.contextmanager
def _backend():
    """The torchvision backend's module given the stand-in while transformers' processor runs."""
    _, stand_in = llama4_image_processor_class()
    if not stand_in:
        yield
        return
    from PIL import Image
    from transformers import image_processing_backends as backends
    modes = {Image.Resampling.NEAREST: InterpolationMode.NEAREST_EXACT, Image.Resampling.BOX: InterpolationMode.BOX,
             Image.Resampling.BILINEAR: InterpolationMode.BILINEAR, Image.Resampling.HAMMING: InterpolationMode.HAMMING,
             Image.Resampling.BICUBIC: InterpolationMode.BICUBIC, Image.Resampling.LANCZOS: InterpolationMode.LANCZOS}
    names = {"tvF": _stand_in_modules()["torchvision.transforms.v2.functional"],
             "pil_torch_interpolation_mapping": modes}
    saved = {name: backends.__dict__.get(name, _ABSENT) for name in names}
    backends.__dict__.update(names)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is _ABSENT:        # the name was not there before
                del backends.__dict__[name]
            else:
                backends.__dict__[name] = value


def hf_llama4_image_processor(model_dir):
    cls, _ = llama4_image_processor_class()
    return cls.from_pretrained(str(model_dir))


def hf_image_processed(model_dir, images) -> tuple[list[torch.Tensor], list[tuple[int, int]]]:
    """Each image's [tiles, 3, S, S] pixels (float32 of transformers' bfloat16) and (rows, columns)."""
    with _backend():
        out = hf_llama4_image_processor(model_dir)(list(images), return_tensors="pt")
    canvases = [tuple(int(x) for x in r) for r in out["aspect_ratios"]]
    counts = [r * c + (r * c > 1) for r, c in canvases]
    return [p.float() for p in out["pixel_values"].split(counts)], canvases


def hf_llama4_processor(model_dir):
    from transformers import AutoTokenizer
    from transformers.models.llama4.processing_llama4 import Llama4Processor

    path = str(model_dir)
    fields = {}
    if os.path.exists(os.path.join(path, "processor_config.json")):
        with open(os.path.join(path, "processor_config.json")) as f:
            fields = {k: v for k, v in json.load(f).items() if k != "processor_class"}
    return Llama4Processor(image_processor=hf_llama4_image_processor(path),
                           tokenizer=AutoTokenizer.from_pretrained(path), **fields)


def hf_processor_outputs(model_dir, text: str, images):
    """Llama4Processor's own outputs for one text (input_ids, attention_mask, bfloat16 pixel_values)."""
    with _backend():
        return hf_llama4_processor(model_dir)(text=[text], images=list(images), return_tensors="pt",
                                              add_special_tokens=False)


def hf_processed(model_dir, text: str, images) -> tuple[list[int], list[torch.Tensor], list[tuple[int, int]]]:
    """(expanded prompt ids, each image's [tiles, 3, S, S] pixels, each image's (rows, columns))."""
    out = hf_processor_outputs(model_dir, text, images)
    pixels, canvases = hf_image_processed(model_dir, images)
    assert torch.equal(torch.cat(pixels), out["pixel_values"].float())
    return out["input_ids"][0].tolist(), pixels, canvases


def _released_name(name: str) -> str:
    """A `model.`-layout tensor's name in Llama4ForConditionalGeneration's own layout."""
    for old, new in (("model.language_model.", "language_model.model."), ("lm_head.", "language_model.lm_head."),
                     ("model.", "")):
        if name.startswith(old):
            return new + name[len(old):]
    return name


@functools.lru_cache(maxsize=4)
def hf_llama4(model_dir: str):
    from safetensors.torch import load_file
    from transformers import Llama4Config, Llama4ForConditionalGeneration

    tensors = load_file(os.path.join(model_dir, "model.safetensors"))
    if not any(n.startswith("model.") for n in tensors):
        model = Llama4ForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32)
    else:
        model = Llama4ForConditionalGeneration(Llama4Config.from_pretrained(model_dir)).float()
        model.load_state_dict({_released_name(n): t for n, t in tensors.items()}, strict=True)
    model.language_model.register_forward_hook(_with_image_outputs)
    return model.eval()


def _with_image_outputs(module, args, output):
    """transformers 5.24's Llama4ForConditionalGeneration.forward reads `image_outputs` off its text
    model's output, which has no such field (AttributeError on every call, images or not): the text
    model's output gets that attribute, None (ModelOutput keeps a None attribute out of its fields,
    so nothing else the forward returns changes)."""
    if not hasattr(output, "image_outputs"):
        output.image_outputs = None
    return output


def _batch(pixel_values) -> torch.Tensor:
    return pixel_values if isinstance(pixel_values, torch.Tensor) else torch.cat(list(pixel_values))


def hf_llama4_greedy(model_dir, input_ids: list[int], pixel_values, max_new_tokens: int) -> list[int]:
    from llava_reference import _greedy

    return _greedy(hf_llama4(str(model_dir)), input_ids, _batch(pixel_values), max_new_tokens, False)


def hf_llama4_logits(model_dir, input_ids: list[int], inputs_embeds: torch.Tensor | None = None,
                     pixel_values=None) -> torch.Tensor:
    """[L, vocab] logits of one forward, from embeddings when given, else from the ids and the images."""
    model = hf_llama4(str(model_dir))
    if inputs_embeds is not None:
        inputs = {"inputs_embeds": inputs_embeds[None]}
    else:
        inputs = {"input_ids": torch.tensor([input_ids]), "pixel_values": _batch(pixel_values)}
    with torch.no_grad():
        return model(**inputs).logits[0]


def hf_token_embeddings(model_dir, input_ids: list[int]) -> torch.Tensor:
    """[L, hidden] token embeddings of the prompt (Llama 4 does not scale them)."""
    with torch.no_grad():
        return hf_llama4(str(model_dir)).get_input_embeddings()(torch.tensor(input_ids))
