"""The tiny LLaVA-OneVision image-text checkpoint with its whole image side, for tests:
`write_tiny_llava_onevision(path, seed=0, layout="released", text_layers=2, vision=None, **fields)`.

raycluster.model.tiny_multimodal writes the text model (the tiny Qwen2 checkpoint wrapped as
LlavaOnevisionForConditionalGeneration, `text_config.model_type` "qwen2", its vocabulary grown by
two for "<image>" and "<video>"); this module then rewrites config.json and model.safetensors
with a seeded SigLIP tower (hidden 32, 2 layers, 2 heads, 28-pixel tiles in 7-pixel patches: 4 x 4
= 16 features a square; every layer and the post_layernorm, as released files hold them), the
projector to the text hidden size and `image_newline`, under the released names
(`vision_tower.vision_model.`, `multi_modal_projector.`, `image_newline` beside `language_model.`)
or transformers 5's (`layout="transformers5"`: the same under `model.`, the head as `lm_head.`).
config.json takes LlavaOnevisionConfig's fields: pinpoints of 1 to 4 tiles a side (up to 16 tiles:
an image on the 4 x 4 grid holds more than "anyres_max_9" allows and is shrunk), the "full"
strategy, the last layer's features. It adds preprocessor_config.json (LlavaOnevisionImageProcessor
as released: the tile-sized square, bicubic, mean / std 0.5, the pinpoints),
video_preprocessor_config.json (LlavaOnevisionVideoProcessor: frames resized to the tile-sized
square, the same mean / std), processor_config.json (LlavaOnevisionProcessor's num_image_tokens,
strategy and vision_aspect_ratio), and the tokenizer with the special added tokens "<image>" and
"<video>" at the ids after the tiny vocabulary (IMAGE_TOKEN_ID and VIDEO_TOKEN_ID, the config's
`image_token_index` and `video_token_index`) and raycluster.model.tiny_llava's content-list
template (an image part rendered as "<image>", a video part as "<video>").

`vision`: vision_config fields over the tiny tower's; `fields`: top-level LLaVA-OneVision fields
(vision_feature_layer, vision_feature_select_strategy, vision_aspect_ratio, image_grid_pinpoints,
projector_hidden_act, multimodal_projector_bias).
"""

from __future__ import annotations

import json
import os

import torch
from safetensors.torch import load_file, save_file

from raycluster.model.llava_onevision import ARCHITECTURE
from raycluster.model.siglip_vision import SiglipVisionModel, SiglipVisionSpec
from raycluster.model.tiny import TOKENIZER_VOCAB
from raycluster.model.tiny_llava import (IMAGE_TOKEN, IMAGE_TOKEN_ID, parts_template, seeded_tensors,
                                         write_tokenizer_with)
from raycluster.model.tiny_multimodal import write_tiny_multimodal

VISION = {"model_type": "siglip_vision_model", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
          "num_attention_heads": 2, "num_channels": 3, "image_size": 28, "patch_size": 7,
          "hidden_act": "gelu_pytorch_tanh", "layer_norm_eps": 1e-6, "attention_dropout": 0.0,
          "vision_use_head": False}
MEAN = STD = (0.5, 0.5, 0.5)        # the released processor's
# LLaVA-OneVision's video placeholder, the id after "<image>"'s (which stays where tiny_llava puts it).
VIDEO_TOKEN = "<video>"
VIDEO_TOKEN_ID = IMAGE_TOKEN_ID + 1
CHAT_TEMPLATE = parts_template(IMAGE_TOKEN, VIDEO_TOKEN)


def tiny_pinpoints(tile: int, most: int = 4) -> list[list[int]]:
    """Every (height, width) of 1 to `most` tiles a side, as the released list is of 1 to 6."""
    return [[tile * i, tile * j] for i in range(1, most + 1) for j in range(1, most + 1)]


def write_tiny_llava_onevision(path: str | os.PathLike, seed: int = 0, layout: str = "released", text_layers: int = 2,
                               vision: dict | None = None, **fields) -> str:
    """The tiny LLaVA-OneVision with its image side (module docstring); returns the path."""
    vision = {**VISION, **(vision or {})}
    path = write_tiny_multimodal(path, ARCHITECTURE, seed=seed, layout=layout, num_hidden_layers=text_layers,
                                 vocab_size=TOKENIZER_VOCAB + 2)
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    config.update(vision_config=vision, image_token_index=IMAGE_TOKEN_ID, video_token_index=VIDEO_TOKEN_ID,
                  vision_feature_layer=-1,
                  vision_feature_select_strategy="full", vision_aspect_ratio="anyres_max_9",
                  image_grid_pinpoints=tiny_pinpoints(vision["image_size"]), projector_hidden_act="gelu",
                  multimodal_projector_bias=True, tie_word_embeddings=False)
    config.update(fields)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)
    prefix = "model." if layout == "transformers5" else ""
    # The text model's tensors; the one placeholder tower tensor tiny_multimodal wrote goes.
    tensors = {k: v for k, v in load_file(os.path.join(path, "model.safetensors")).items()
               if not k.startswith(prefix + "vision_tower.")}
    tensors.update({prefix + k: v for k, v in vision_tensors(config, seed).items()})
    save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    _write_processor_files(path, config)
    return path


def vision_tensors(config: dict, seed: int) -> dict[str, torch.Tensor]:
    """The seeded tower, projector and image_newline under the released names."""
    spec = SiglipVisionSpec.from_config(config["vision_config"])
    with torch.device("meta"):
        shapes = {"vision_tower." + n: tuple(p.shape) for n, p in SiglipVisionModel(spec).named_parameters()}
    layers = config["vision_feature_layer"]
    width = spec.hidden_size * (1 if isinstance(layers, int) else len(layers))
    text_hidden = config["text_config"]["hidden_size"]
    shapes.update({"multi_modal_projector.linear_1.weight": (text_hidden, width),
                   "multi_modal_projector.linear_2.weight": (text_hidden, text_hidden), "image_newline": (text_hidden,)})
    if config["multimodal_projector_bias"]:
        shapes.update({"multi_modal_projector.linear_1.bias": (text_hidden,),
                       "multi_modal_projector.linear_2.bias": (text_hidden,)})
    # image_newline at unit scale: it sits among the features like a token embedding.
    return seeded_tensors(shapes, seed, lambda name: "norm" in name.rpartition(".")[0],
                          ("position_embedding.weight", "image_newline"))


def _write_processor_files(path: str, config: dict) -> None:
    """preprocessor_config.json, video_preprocessor_config.json and processor_config.json as
    released, and the tokenizer."""
    vision = config["vision_config"]
    tile = vision["image_size"]
    processor = {"image_processor_type": "LlavaOnevisionImageProcessor", "processor_class": "LlavaOnevisionProcessor",
                 "do_convert_rgb": True, "do_normalize": True, "do_pad": True, "do_rescale": True, "do_resize": True,
                 "image_grid_pinpoints": config["image_grid_pinpoints"], "image_mean": list(MEAN),
                 "image_std": list(STD), "resample": 3, "rescale_factor": 1 / 255,
                 "size": {"height": tile, "width": tile}}
    with open(os.path.join(path, "preprocessor_config.json"), "w") as f:
        json.dump(processor, f, indent=2, sort_keys=True)
    video = {"video_processor_type": "LlavaOnevisionVideoProcessor", "processor_class": "LlavaOnevisionProcessor",
             "do_convert_rgb": True, "do_normalize": True, "do_rescale": True, "do_resize": True,
             "do_sample_frames": False, "image_mean": list(MEAN), "image_std": list(STD), "resample": 3,
             "rescale_factor": 1 / 255, "size": {"height": tile, "width": tile}}
    with open(os.path.join(path, "video_preprocessor_config.json"), "w") as f:
        json.dump(video, f, indent=2, sort_keys=True)
    with open(os.path.join(path, "processor_config.json"), "w") as f:
        json.dump({"image_token": IMAGE_TOKEN, "num_image_tokens": (tile // vision["patch_size"]) ** 2,
                   "processor_class": "LlavaOnevisionProcessor", "video_token": VIDEO_TOKEN,
                   "vision_aspect_ratio": config["vision_aspect_ratio"],
                   "vision_feature_select_strategy": config["vision_feature_select_strategy"]},
                  f, indent=2, sort_keys=True)
    write_tokenizer_with(path, [IMAGE_TOKEN, VIDEO_TOKEN], CHAT_TEMPLATE)
