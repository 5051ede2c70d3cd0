"""The image side of the tiny Qwen2-VL and Qwen2.5-VL checkpoints (raycluster.model.tiny_multimodal's
`write_tiny_multimodal(path, "Qwen2VLForConditionalGeneration" or "Qwen2_5_VLForConditionalGeneration",
vision_weights=True)`): a seeded tower (raycluster.model.qwen_vision: width 32, 2 blocks, 2 heads,
14-pixel patches, 2 x 2 merge, 2 frames a patch; Qwen2.5-VL's windows of 56 pixels, block 1
attending over the whole image) whose merger outputs the text hidden size; preprocessor_config.json
(Qwen2VLImageProcessor with min_pixels 56 * 56 and max_pixels 28 * 28 * 16: a 30x40 image makes 6
tokens, none more than 16); and a tokenizer whose special added tokens "<|vision_start|>",
"<|vision_end|>", "<|image_pad|>" and "<|video_pad|>" take the ids after the tiny text vocabulary
(the config's vision_start_token_id, vision_end_token_id, image_token_id and video_token_id; the
text vocabulary grows to cover them). Its chat template renders an image part as
"<|vision_start|><|image_pad|><|vision_end|>", a video part as "<|vision_start|><|video_pad|><|vision_end|>"
(string content as before).

`qwen_vl_fields(arch, vision, extra, overrides, **options)` gives the config pieces before the
text checkpoint is written (options: vision_config fields, and min_pixels / max_pixels for the
processor); `vision_tensors(config, seed, style)` the tower under the layout's names;
`write_qwen_vl_files(path, config, processor)` the processor, tokenizer and template files over
the text checkpoint's.
"""

from __future__ import annotations

import json
import os

import torch

from raycluster.model.image_processor import CLIP_MEAN, CLIP_STD
from raycluster.model.qwen_vision import QwenVisionSpec, QwenVisionTower
from raycluster.model.qwen_vl import ARCHITECTURES
from raycluster.model.tiny import TOKENIZER_VOCAB, tiny_config
from raycluster.model.tiny_llava import parts_template, seeded_tensors, write_tokenizer_with

# Qwen's order of its vision tokens, from the first id after the tiny vocabulary.
VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
VISION_START_ID, VISION_END_ID, IMAGE_TOKEN_ID, VIDEO_TOKEN_ID = range(TOKENIZER_VOCAB, TOKENIZER_VOCAB + 4)
IMAGE_TOKEN = "<|image_pad|>"

CHAT_TEMPLATE = parts_template("<|vision_start|><|image_pad|><|vision_end|>", "<|vision_start|><|video_pad|><|vision_end|>")
_PROCESSOR_OPTIONS = ("min_pixels", "max_pixels")


def qwen_vl_fields(arch: str, vision: dict, extra: dict, overrides: dict, **options
                   ) -> tuple[dict, dict, dict, dict]:
    """(vision_config, top-level fields, text overrides, processor fields) of the tiny Qwen-VL with
    a tower; `options`: vision_config fields (depth, window_size, fullatt_block_indexes, ...) and
    the processor's min_pixels / max_pixels."""
    text_hidden = overrides.get("hidden_size", tiny_config()["hidden_size"])
    common = {"depth": 2, "num_heads": 2, "in_channels": 3, "patch_size": 14, "spatial_merge_size": 2,
              "temporal_patch_size": 2}
    if ARCHITECTURES[arch] == "qwen2_vl":
        vision = {**vision, **common, "embed_dim": 32, "mlp_ratio": 2, "hidden_act": "quick_gelu",
                  "hidden_size": text_hidden}
    else:
        vision = {**vision, **common, "hidden_size": 32, "intermediate_size": 64, "hidden_act": "silu",
                  "out_hidden_size": text_hidden, "window_size": 56, "fullatt_block_indexes": [1],
                  "tokens_per_second": 2}
    vision.update({k: v for k, v in options.items() if k not in _PROCESSOR_OPTIONS})
    processor = {"min_pixels": 56 * 56, "max_pixels": 28 * 28 * 16,
                 **{k: v for k, v in options.items() if k in _PROCESSOR_OPTIONS}}
    extra = {**extra, "vision_start_token_id": VISION_START_ID, "vision_end_token_id": VISION_END_ID,
             "image_token_id": IMAGE_TOKEN_ID, "video_token_id": VIDEO_TOKEN_ID}
    return vision, extra, {**overrides, "vocab_size": TOKENIZER_VOCAB + len(VISION_TOKENS)}, processor


def vision_tensors(config: dict, seed: int, style: str) -> dict[str, torch.Tensor]:
    """The seeded tower under the released names (`visual.`, `style` "flat") or transformers 5's
    (`model.visual.`, "transformers5")."""
    spec = QwenVisionSpec.from_config(config["vision_config"], ARCHITECTURES[config["architectures"][0]])
    with torch.device("meta"):
        shapes = {n: tuple(p.shape) for n, p in QwenVisionTower(spec).named_parameters()}
    out = seeded_tensors(shapes, seed, lambda name: "norm" in name or "ln_q" in name)
    prefix = "model.visual." if style == "transformers5" else "visual."
    return {prefix + k: v for k, v in out.items()}


def write_qwen_vl_files(path: str, config: dict, processor: dict) -> None:
    """preprocessor_config.json, and the tokenizer with the vision tokens and the content-list template."""
    vision = config["vision_config"]
    fields = {"image_processor_type": "Qwen2VLImageProcessor", "processor_class": "Qwen2VLProcessor",
              "do_convert_rgb": True, "do_resize": True, "resample": 3, "do_rescale": True, "rescale_factor": 1 / 255,
              "do_normalize": True, "image_mean": list(CLIP_MEAN), "image_std": list(CLIP_STD),
              "patch_size": vision["patch_size"], "merge_size": vision["spatial_merge_size"],
              "temporal_patch_size": vision["temporal_patch_size"], **processor}
    with open(os.path.join(path, "preprocessor_config.json"), "w") as f:
        json.dump(fields, f, indent=2, sort_keys=True)
    write_tokenizer_with(path, list(VISION_TOKENS), CHAT_TEMPLATE)
