"""The tiny Mistral 3 image-text checkpoint with its whole image side, for tests:
`write_tiny_mistral3_vl(path, seed=0, layout="released", **vision_options)`.

raycluster.model.tiny_multimodal writes the text model (the tiny Mistral text checkpoint wrapped as
Mistral3ForConditionalGeneration, its vocabulary grown by the three image tokens, its head untied);
this module then rewrites config.json and model.safetensors with a seeded Pixtral tower (hidden 32,
2 layers, 2 heads, 4-pixel patches, images resized to fit 40 pixels: up to 5 x 5 merged patches)
and Mistral 3's projector (RMSNorm, the 2 x 2 patch merger, linear_1 -> gelu -> linear_2 to the
text hidden size, no biases), under the released names (`vision_tower.`, `multi_modal_projector.`
beside `language_model.`) or transformers 5's (`layout="transformers5"`: the same under `model.`).
It adds preprocessor_config.json (PixtralImageProcessor as released: bicubic, CLIP's mean / std,
`size.longest_edge`), processor_config.json (PixtralProcessor's patch_size, spatial_merge_size and
image tokens), and a tokenizer whose special added tokens "[IMG]", "[IMG_BREAK]" and "[IMG_END]"
take the ids after the tiny vocabulary (config.json's image_token_index is the first: Mistral3Config
has no field for the other two, which PixtralProcessor looks up in the tokenizer). Its chat
template renders a content list's image parts as "[IMG]" (string content as before); the processor
expands that to the image's span.

`vision_options`: vision_config fields (hidden_size, num_hidden_layers, patch_size, hidden_act,
image_size, ...), Mistral 3's own fields (spatial_merge_size, vision_feature_layer,
projector_hidden_act, multimodal_projector_bias) and `longest_edge` (the processor's bound;
vision_config.image_size by default).
"""

from __future__ import annotations

import json
import os

import torch
from safetensors.torch import load_file, save_file

from raycluster.model.image_processor import CLIP_MEAN, CLIP_STD
from raycluster.model.mistral3_vision import ARCHITECTURE, Mistral3ImageEncoder
from raycluster.model.tiny import TOKENIZER_VOCAB
from raycluster.model.tiny_llava import parts_template, seeded_tensors, write_tokenizer_with
from raycluster.model.tiny_multimodal import write_tiny_multimodal

IMAGE_TOKEN, IMAGE_BREAK_TOKEN, IMAGE_END_TOKEN = "[IMG]", "[IMG_BREAK]", "[IMG_END]"
IMAGE_TOKEN_ID, IMAGE_BREAK_TOKEN_ID, IMAGE_END_TOKEN_ID = range(TOKENIZER_VOCAB, TOKENIZER_VOCAB + 3)
VISION = {"model_type": "pixtral", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
          "num_attention_heads": 2, "num_channels": 3, "image_size": 40, "patch_size": 4, "head_dim": 16,
          "hidden_act": "silu", "attention_dropout": 0.0, "initializer_range": 0.02}
ROPE_THETA = 10_000.0
WRAPPER = {"spatial_merge_size": 2, "vision_feature_layer": -1, "projector_hidden_act": "gelu",
           "multimodal_projector_bias": False}

CHAT_TEMPLATE = parts_template(IMAGE_TOKEN)


def write_tiny_mistral3_vl(path: str | os.PathLike, seed: int = 0, layout: str = "released", **vision_options) -> str:
    """The tiny Mistral 3 with its image side (module docstring); returns the path."""
    wrapper = {**WRAPPER, **{k: vision_options.pop(k) for k in list(vision_options) if k in WRAPPER}}
    vision = {**VISION, **vision_options}
    longest_edge = vision.pop("longest_edge", vision["image_size"])
    # The released configs give the rotary's base as a top-level rope_theta; transformers 5 saves
    # rope_parameters (both are read here, and by transformers).
    vision.update({"rope_theta": ROPE_THETA} if layout == "released" else
                  {"rope_parameters": {"rope_theta": ROPE_THETA, "rope_type": "axial"}})
    vision["head_dim"] = vision["hidden_size"] // vision["num_attention_heads"]
    # An untied head (Mistral3Config ties by default): the images then move what greedy says more.
    path = write_tiny_multimodal(path, ARCHITECTURE, seed=seed, layout=layout, vocab_size=TOKENIZER_VOCAB + 3,
                                 tie_word_embeddings=False)
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    config.update(vision_config=vision, image_token_index=IMAGE_TOKEN_ID, tie_word_embeddings=False, **wrapper)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)
    prefix = "model." if layout == "transformers5" else ""
    # The text model's tensors; the one placeholder tower tensor tiny_multimodal wrote goes.
    tensors = {k: v for k, v in load_file(os.path.join(path, "model.safetensors")).items()
               if not k.startswith(prefix + "vision_tower.")}
    tensors.update({prefix + k: v for k, v in vision_tensors(config, seed).items()})
    save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    _write_processor_files(path, vision["patch_size"], wrapper["spatial_merge_size"], longest_edge)
    return path


def vision_tensors(config: dict, seed: int) -> dict[str, torch.Tensor]:
    """The seeded tower and projector under the released names."""
    ids = {"image_break_token_id": IMAGE_BREAK_TOKEN_ID, "image_end_token_id": IMAGE_END_TOKEN_ID}
    with torch.device("meta"):
        encoder = Mistral3ImageEncoder({**config, **ids})
    shapes = {n: tuple(p.shape) for n, p in encoder.named_parameters()}
    return seeded_tensors(shapes, seed, lambda name: name.endswith(("norm.weight", "ln_pre.weight")))


def _write_processor_files(path: str, patch_size: int, merge: int, longest_edge: int) -> None:
    """preprocessor_config.json and processor_config.json as released, and the tokenizer."""
    processor = {"image_processor_type": "PixtralImageProcessor", "processor_class": "PixtralProcessor",
                 "crop_size": None, "default_to_square": True, "do_center_crop": None, "do_convert_rgb": True,
                 "do_normalize": True, "do_rescale": True, "do_resize": True, "image_mean": list(CLIP_MEAN),
                 "image_std": list(CLIP_STD), "patch_size": {"height": patch_size, "width": patch_size},
                 "resample": 3, "rescale_factor": 1 / 255, "size": {"longest_edge": longest_edge}}
    with open(os.path.join(path, "preprocessor_config.json"), "w") as f:
        json.dump(processor, f, indent=2, sort_keys=True)
    with open(os.path.join(path, "processor_config.json"), "w") as f:
        json.dump({"image_break_token": IMAGE_BREAK_TOKEN, "image_end_token": IMAGE_END_TOKEN,
                   "image_token": IMAGE_TOKEN, "patch_size": patch_size, "processor_class": "PixtralProcessor",
                   "spatial_merge_size": merge}, f, indent=2, sort_keys=True)
    write_tokenizer_with(path, [IMAGE_TOKEN, IMAGE_BREAK_TOKEN, IMAGE_END_TOKEN], CHAT_TEMPLATE)
