"""The tiny Llama 4 image-text checkpoint with its whole image side, for tests:
`write_tiny_llama4_vl(path, seed=0, layout="released", **vision_options)`.

raycluster.model.tiny_multimodal writes the text model (the tiny Llama 4 MoE text checkpoint
wrapped as Llama4ForConditionalGeneration, its vocabulary grown by the six image tokens, its head
untied); this module then rewrites config.json and model.safetensors with a seeded vision tower
(hidden 32, 2 layers, 2 heads, 16-pixel tiles of 4-pixel patches: a 4 x 4 grid the pixel shuffle
makes 4 tokens a tile; the adapter 128 -> 64 -> 64) and the projector (64 -> the text hidden size),
under the released names (`vision_model.`, `multi_modal_projector.` beside `language_model.`, as
transformers 5.24 also saves Llama 4) or, `layout="transformers5"`, under `model.` (beside the text
as tiny_multimodal lays it out there: `model.language_model.`, `lm_head.`; raycluster reads that
layout, transformers 5.24's Llama4ForConditionalGeneration does not load it). It adds
preprocessor_config.json (Llama4ImageProcessor as released: bilinear, mean / std 0.5, `max_patches`
4 here so images make 1 to 4 tiles), processor_config.json (Llama4Processor's patch_size,
pixel_shuffle_ratio and placeholder) and a tokenizer whose special added tokens "<|image_start|>",
"<|image_end|>", "<|image|>", "<|patch|>", "<|tile_x_separator|>" and "<|tile_y_separator|>" take
the ids after the tiny vocabulary (config.json's boi_token_index, eoi_token_index and
image_token_index are the first, second and fourth, as in the releases). Its chat template renders
a content list's image parts as "<|image|>" (string content as before), which the processor expands.

`vision_options`: vision_config fields (hidden_size, num_hidden_layers, num_attention_heads,
image_size, patch_size, pixel_shuffle_ratio, projector_output_dim, ...; intermediate_size follows
hidden_size and the shuffle unless given, the projector dims follow projector_output_dim) and the
processor's `max_patches`, `resize_to_max_canvas` and `resample`.
"""

from __future__ import annotations

import json
import os

import torch
from safetensors.torch import load_file, save_file

from raycluster.model.llama4_image import ARCHITECTURE, Llama4ImageEncoder
from raycluster.model.llama4_processor import SPAN_TOKEN_TEXT, SpanTokens
from raycluster.model.tiny import TOKENIZER_VOCAB
from raycluster.model.tiny_llava import parts_template, seeded_tensors, write_tokenizer_with
from raycluster.model.tiny_multimodal import write_tiny_multimodal

# The six tokens in SpanTokens' order take the ids after the tiny vocabulary.
TOKENS = SpanTokens(*SPAN_TOKEN_TEXT.values())
TOKEN_IDS = SpanTokens(*range(TOKENIZER_VOCAB, TOKENIZER_VOCAB + len(TOKENS)))
IMAGE_TOKEN = TOKENS.image                      # what the chat template writes for an image
PATCH_TOKEN_ID = TOKEN_IDS.patch                # config.json's image_token_index
VISION = {"model_type": "llama4_vision_model", "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2,
          "num_channels": 3, "image_size": 16, "patch_size": 4, "pixel_shuffle_ratio": 0.5,
          "projector_output_dim": 64, "norm_eps": 1e-5, "hidden_act": "gelu", "multi_modal_projector_bias": False,
          "projector_dropout": 0.0, "attention_dropout": 0.0, "initializer_range": 0.02, "vision_feature_layer": -1,
          "vision_feature_select_strategy": "default"}
ROPE_THETA = 10_000.0
PROCESSOR = {"max_patches": 4, "resize_to_max_canvas": False, "resample": 2}

CHAT_TEMPLATE = parts_template(IMAGE_TOKEN)


def write_tiny_llama4_vl(path: str | os.PathLike, seed: int = 0, layout: str = "released", **vision_options) -> str:
    """The tiny Llama 4 with its image side (module docstring); returns the path."""
    processor = {**PROCESSOR, **{k: vision_options.pop(k) for k in list(vision_options) if k in PROCESSOR}}
    vision = {**VISION, **vision_options}
    k = round(1 / vision["pixel_shuffle_ratio"])
    vision.setdefault("intermediate_size", vision["hidden_size"] * k * k)
    for name in ("projector_input_dim", "vision_output_dim"):
        vision.setdefault(name, vision["projector_output_dim"])
    # The releases give the rotary's base as a top-level rope_theta; transformers 5 saves
    # rope_parameters (both are read here, and by transformers).
    vision.update({"rope_theta": ROPE_THETA} if layout == "released" else
                  {"rope_parameters": {"rope_theta": ROPE_THETA, "rope_type": "default"}})
    # An untied head (the tiny Llama 4's already is; Llama4Config's default too), so the images
    # move what greedy says.
    path = write_tiny_multimodal(path, ARCHITECTURE, seed=seed, layout=layout,
                                 vocab_size=TOKENIZER_VOCAB + len(TOKENS), tie_word_embeddings=False)
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    config.update(vision_config=vision, image_token_index=TOKEN_IDS.patch, boi_token_index=TOKEN_IDS.image_start,
                  eoi_token_index=TOKEN_IDS.image_end, tie_word_embeddings=False)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)
    prefix = "model." if layout == "transformers5" else ""
    # The text model's tensors; the one placeholder tower tensor tiny_multimodal wrote goes.
    tensors = {n: t for n, t in load_file(os.path.join(path, "model.safetensors")).items()
               if not n.startswith(prefix + "vision_tower.")}
    tensors.update({prefix + n: t for n, t in vision_tensors(config, seed).items()})
    save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    _write_processor_files(path, vision, processor)
    return path


def vision_tensors(config: dict, seed: int) -> dict[str, torch.Tensor]:
    """The seeded tower and projector under the released names."""
    with torch.device("meta"):
        encoder = Llama4ImageEncoder(config, span_tokens=TOKEN_IDS)
    shapes = {n: tuple(p.shape) for n, p in encoder.named_parameters()}
    return seeded_tensors(shapes, seed, lambda name: "layernorm" in name)


def _write_processor_files(path: str, vision: dict, processor: dict) -> None:
    """preprocessor_config.json and processor_config.json as released (a tiny tile), and the tokenizer."""
    tile = vision["image_size"]
    fields = {"image_processor_type": "Llama4ImageProcessorFast", "processor_class": "Llama4Processor",
              "crop_size": None, "data_format": "channels_first", "default_to_square": True, "device": None,
              "do_center_crop": None, "do_convert_rgb": True, "do_normalize": True, "do_rescale": True,
              "do_resize": True, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
              "input_data_format": None, "rescale_factor": 0.00392156862745098, "return_tensors": None,
              "size": {"height": tile, "width": tile}, **processor}
    with open(os.path.join(path, "preprocessor_config.json"), "w") as f:
        json.dump(fields, f, indent=2, sort_keys=True)
    with open(os.path.join(path, "processor_config.json"), "w") as f:
        json.dump({"fake_image_token": IMAGE_TOKEN, "image_token": IMAGE_TOKEN, "patch_size": vision["patch_size"],
                   "pixel_shuffle_ratio": vision["pixel_shuffle_ratio"], "processor_class": "Llama4Processor"},
                  f, indent=2, sort_keys=True)
    write_tokenizer_with(path, list(TOKENS), CHAT_TEMPLATE)
