"""The tiny Qwen3-VL checkpoint with a whole image side, for tests: raycluster.model.tiny_multimodal's
text-only `write_tiny_multimodal(path, "Qwen3VLForConditionalGeneration")` (a Qwen3 text model
under `model.language_model.`, interleaved multimodal RoPE) with, over its files:

- a seeded tower (raycluster.model.qwen3_vision: width 32, 3 blocks, 2 heads, 16-pixel patches,
  2 x 2 merge, 2 frames a patch, an 8 x 8 learned position grid, DeepStack after blocks 0 and 1,
  mergers out to the text hidden size) under `model.visual.`, in place of the lone tower tensor the
  text-only checkpoint holds (Qwen3-VL's released files are transformers 5's layout, the only one
  transformers loads it from: `layout` "released" or "transformers5", the same files);
- config.json's `vision_config` and its vision token ids;
- preprocessor_config.json as the released Qwen3-VL's (Qwen2VLImageProcessor fields: patch 16,
  merge 2, temporal 2, mean / std 0.5, the pixel limits as `size: {shortest_edge, longest_edge}`),
  with limits 64 * 64 and 32 * 32 * 16: a 30x40 image makes 6 tokens, none of an aspect ratio up
  to 8 more than 16;
- the tokenizer of raycluster.model.tiny_qwen_vl: "<|vision_start|>", "<|vision_end|>",
  "<|image_pad|>", "<|video_pad|>" as special added tokens after the tiny vocabulary (ids 4096 to
  4099; the text vocabulary grows to 4100), its chat template rendering an image part as
  "<|vision_start|><|image_pad|><|vision_end|>".

`write_tiny_qwen3_vl(path, seed, layout, text_overrides, **vision_options)`: vision_options are
vision_config fields (depth, deepstack_visual_indexes, num_position_embeddings, ...) and the
processor's min_pixels / max_pixels (written into `size`); text_overrides go to the text model
(num_hidden_layers, ...). Same arguments -> the same files.
"""

from __future__ import annotations

import json
import os

import torch
from safetensors.torch import load_file, save_file

from raycluster.model.qwen3_vision import Qwen3VisionSpec, Qwen3VisionTower
from raycluster.model.tiny import TOKENIZER_VOCAB, tiny_config
from raycluster.model.tiny_llava import seeded_tensors, write_tokenizer_with
from raycluster.model.tiny_multimodal import write_tiny_multimodal
from raycluster.model.tiny_qwen_vl import (CHAT_TEMPLATE, IMAGE_TOKEN_ID, VIDEO_TOKEN_ID, VISION_END_ID,
                                           VISION_START_ID, VISION_TOKENS)

ARCHITECTURE = "Qwen3VLForConditionalGeneration"
MIN_PIXELS, MAX_PIXELS = 64 * 64, 32 * 32 * 16
_PROCESSOR_OPTIONS = ("min_pixels", "max_pixels")


def qwen3_vl_vision_config(text_hidden: int, **options) -> dict:
    """The tiny tower's vision_config (`options`: its fields to change)."""
    return {"model_type": "qwen3_vl", "depth": 3, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2,
            "in_channels": 3, "patch_size": 16, "spatial_merge_size": 2, "temporal_patch_size": 2,
            "hidden_act": "gelu_pytorch_tanh", "out_hidden_size": text_hidden, "num_position_embeddings": 64,
            "deepstack_visual_indexes": [0, 1], "initializer_range": 0.02, **options}


def vision_tensors(vision: dict, seed: int, prefix: str) -> dict[str, torch.Tensor]:
    """The seeded tower under `prefix` ("model.visual." or "visual.")."""
    with torch.device("meta"):
        tower = Qwen3VisionTower(Qwen3VisionSpec.from_config(vision))
        shapes = {n: tuple(p.shape) for n, p in tower.named_parameters()}
    # The position table at unit scale: like a token embedding, it is added, not multiplied in.
    out = seeded_tensors(shapes, seed, lambda name: "norm" in name, ("pos_embed.weight",))
    return {prefix + k: v for k, v in out.items()}


def write_tiny_qwen3_vl(path: str | os.PathLike, seed: int = 0, layout: str = "released",
                        text_overrides: dict | None = None, **vision_options) -> str:
    """The tiny Qwen3-VL with its tower, processor and vision tokens (module docstring)."""
    if layout not in ("released", "transformers5"):
        raise ValueError(f"layout {layout!r}: the tiny Qwen3-VL is written as released ('released' or "
                         "'transformers5', the same files)")
    text_overrides = {**(text_overrides or {}), "vocab_size": TOKENIZER_VOCAB + len(VISION_TOKENS)}
    path = write_tiny_multimodal(path, ARCHITECTURE, seed=seed, layout=layout, **text_overrides)
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    text_hidden = text_overrides.get("hidden_size", tiny_config()["hidden_size"])
    config["vision_config"] = qwen3_vl_vision_config(
        text_hidden, **{k: v for k, v in vision_options.items() if k not in _PROCESSOR_OPTIONS})
    config.update(vision_start_token_id=VISION_START_ID, vision_end_token_id=VISION_END_ID,
                  image_token_id=IMAGE_TOKEN_ID, video_token_id=VIDEO_TOKEN_ID)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)

    weights = os.path.join(path, "model.safetensors")
    # Drop the text-only checkpoint's lone tower tensor; the whole tower takes its place.
    tensors = {k: v for k, v in load_file(weights).items() if not k.startswith("model.visual.")}
    tensors.update(vision_tensors(config["vision_config"], seed, "model.visual."))
    save_file(tensors, weights, metadata={"format": "pt"})

    vision = config["vision_config"]
    processor = {"image_processor_type": "Qwen2VLImageProcessorFast", "processor_class": "Qwen3VLProcessor",
                 "patch_size": vision["patch_size"], "merge_size": vision["spatial_merge_size"],
                 "temporal_patch_size": vision["temporal_patch_size"], "image_mean": [0.5, 0.5, 0.5],
                 "image_std": [0.5, 0.5, 0.5],
                 "size": {"shortest_edge": vision_options.get("min_pixels", MIN_PIXELS),
                          "longest_edge": vision_options.get("max_pixels", MAX_PIXELS)}}
    with open(os.path.join(path, "preprocessor_config.json"), "w") as f:
        json.dump(processor, f, indent=2, sort_keys=True)
    write_tokenizer_with(path, list(VISION_TOKENS), CHAT_TEMPLATE)
    return path
