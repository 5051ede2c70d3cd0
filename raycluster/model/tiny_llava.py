"""The image side of the tiny LLaVA and LLaVA-NeXT checkpoints (raycluster.model.tiny_multimodal's
`write_tiny_multimodal(path, "LlavaForConditionalGeneration" or "LlavaNextForConditionalGeneration",
vision_weights=True)`): a seeded CLIP tower (hidden 32, 2 layers, 2 heads, 28-pixel images in
14-pixel patches: 4 features a square) and projector to the text hidden size,
`preprocessor_config.json` (CLIPImageProcessor; LLaVA-NeXT's LlavaNextImageProcessor with its
pinpoints, a seeded `image_newline` and LlavaNextProcessor's processor_config.json), and a
tokenizer whose special added token "<image>" is the config's `image_token_index`: the id after
the tiny text vocabulary, which grows by one to cover it. Its chat template renders a message's
content list as the text parts with "<image>" for each image part (string content as before).

`llava_fields(...)` gives the config pieces before the text checkpoint is written;
`vision_tensors(config, seed, style)` the tensors under the layout's names; `write_llava_files(path,
config)` the processor, tokenizer and template files over the text checkpoint's.
"""

from __future__ import annotations

import json
import os
from typing import Callable

import torch

from raycluster.model.clip_vision import ClipVisionTower
from raycluster.model.image_processor import CLIP_MEAN, CLIP_STD
from raycluster.model.tiny import TOKENIZER_VOCAB, _tokenizer_json

IMAGE_TOKEN = "<image>"
IMAGE_TOKEN_ID = TOKENIZER_VOCAB        # the first id after the tiny tokenizer's vocabulary

def parts_template(image_text: str, video_text: str | None = None) -> str:
    """The tiny image-text checkpoints' chat template: it iterates a message's content parts (as
    llava-hf's and Qwen's do), rendering each image part as `image_text` and each video part as
    `video_text` (Qwen-VL's; string content as the tiny text model's template)."""
    video = "" if video_text is None else "{% elif part['type'] in ['video', 'video_url'] %}{{ '" + video_text + "' }}"
    return ("{{ bos_token }}"
            "{% for message in messages %}"
            "{{ '<|' + message['role'] + '|>\\n' }}"
            "{% if message['content'] is string %}{{ message['content'] }}"
            "{% else %}{% for part in message['content'] %}"
            "{% if part['type'] == 'text' %}{{ part['text'] }}"
            "{% elif part['type'] in ['image', 'image_url'] %}{{ '" + image_text + "' }}" + video + "{% endif %}"
            "{% endfor %}{% endif %}"
            "{{ eos_token + '\\n' }}"
            "{% endfor %}"
            "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}")


CHAT_TEMPLATE = parts_template(IMAGE_TOKEN)


def llava_fields(vision: dict, extra: dict, overrides: dict, image_size: int = 28, num_hidden_layers: int = 2,
                 **fields) -> tuple[dict, dict, dict]:
    """(vision_config, top-level fields, text overrides) of the tiny LLaVA with a tower: `image_size`
    (a multiple of the 14-pixel patch), the tower's depth, and LLaVA's own fields in `fields`
    (vision_feature_layer, vision_feature_select_strategy, projector_hidden_act,
    multimodal_projector_bias; LLaVA-NeXT's image_grid_pinpoints)."""
    vision = {**vision, "num_hidden_layers": num_hidden_layers, "image_size": image_size, "hidden_act": "quick_gelu",
              "layer_norm_eps": 1e-5, "num_channels": 3}
    if "image_grid_pinpoints" in extra:     # LLaVA-NeXT: the table's pinpoints of 28-pixel tiles, in this tile's
        extra = {**extra, "image_grid_pinpoints": [[h // 28 * image_size, w // 28 * image_size]
                                                   for h, w in extra["image_grid_pinpoints"]]}
    extra = {**extra, "image_token_index": IMAGE_TOKEN_ID, "vision_feature_layer": -2,
             "vision_feature_select_strategy": "default", "projector_hidden_act": "gelu",
             "multimodal_projector_bias": True, **fields}
    return vision, extra, {**overrides, "vocab_size": TOKENIZER_VOCAB + 1}


def seeded_tensors(shapes: dict[str, tuple[int, ...]], seed: int, is_norm: Callable[[str], bool],
                   unit: tuple[str, ...] = ()) -> dict[str, torch.Tensor]:
    """A tiny vision tower's tensors by name, drawn in name order from `seed + 1` (apart from the
    text weights' stream): norm weights (`is_norm(name)`) near 1, biases small, the names ending
    in `unit` at unit scale, the rest scaled by their fan-in."""
    g = torch.Generator().manual_seed(seed + 1)
    out = {}
    for name in sorted(shapes):
        shape = shapes[name]
        if is_norm(name) and name.endswith(".weight"):
            t = 1.0 + 0.1 * torch.randn(shape, generator=g)
        elif name.endswith(".bias"):
            t = 0.02 * torch.randn(shape, generator=g)
        elif unit and name.endswith(unit):
            t = torch.randn(shape, generator=g)
        else:
            # Fan-in scaling keeps activations near unit size, so the projected features weigh as
            # much as the unit-scale token embeddings beside them and change what the text model says.
            fan_in = 1
            for d in shape[1:]:
                fan_in *= d
            t = torch.randn(shape, generator=g) / fan_in ** 0.5
        out[name] = t.contiguous()
    return out


def vision_tensors(config: dict, seed: int, style: str) -> dict[str, torch.Tensor]:
    """The seeded tower (every layer and post_layernorm, as released files hold them), projector
    and LLaVA-NeXT's image_newline under the released names (`style` "language_model") or
    transformers 5's ("transformers5")."""
    vision, text_hidden = config["vision_config"], config["text_config"]["hidden_size"]
    layers = config["vision_feature_layer"]
    width = vision["hidden_size"] * (1 if isinstance(layers, int) else len(layers))
    with torch.device("meta"):
        shapes = {"vision_tower.vision_model." + n: tuple(p.shape)
                  for n, p in ClipVisionTower(vision, post_layernorm=True).named_parameters()}
    bias = config["multimodal_projector_bias"]
    shapes.update({"multi_modal_projector.linear_1.weight": (text_hidden, width),
                   "multi_modal_projector.linear_2.weight": (text_hidden, text_hidden)})
    if bias:
        shapes.update({"multi_modal_projector.linear_1.bias": (text_hidden,),
                       "multi_modal_projector.linear_2.bias": (text_hidden,)})
    if config["model_type"] == "llava_next":
        shapes["image_newline"] = (text_hidden,)
    # image_newline at unit scale too: it sits among the features like a token embedding.
    out = seeded_tensors(shapes, seed, lambda name: "norm" in name.rpartition(".")[0],
                         ("class_embedding", "position_embedding.weight", "image_newline"))
    prefix = "model." if style == "transformers5" else ""
    return {prefix + k: v for k, v in out.items()}


def write_llava_files(path: str, config: dict) -> None:
    """preprocessor_config.json (and LLaVA-NeXT's processor_config.json), and the tokenizer with
    "<image>" and the content-list template."""
    size = config["vision_config"]["image_size"]
    processor = {"image_processor_type": "CLIPImageProcessor", "processor_class": "LlavaProcessor",
                 "do_convert_rgb": True, "do_resize": True, "size": {"shortest_edge": size}, "resample": 3,
                 "do_center_crop": True, "crop_size": {"height": size, "width": size}, "do_rescale": True,
                 "rescale_factor": 1 / 255, "do_normalize": True, "image_mean": list(CLIP_MEAN),
                 "image_std": list(CLIP_STD)}
    if config["model_type"] == "llava_next":
        processor.update(image_processor_type="LlavaNextImageProcessor", processor_class="LlavaNextProcessor",
                         image_grid_pinpoints=config["image_grid_pinpoints"], do_pad=True,
                         aspect_ratio_setting="anyres")
        # As llava-v1.6's: the CLS the processor counts and then drops for the "default" strategy.
        with open(os.path.join(path, "processor_config.json"), "w") as f:
            json.dump({"image_token": IMAGE_TOKEN, "num_additional_image_tokens": 1,
                       "patch_size": config["vision_config"]["patch_size"], "processor_class": "LlavaNextProcessor",
                       "vision_feature_select_strategy": config["vision_feature_select_strategy"]},
                      f, indent=2, sort_keys=True)
    with open(os.path.join(path, "preprocessor_config.json"), "w") as f:
        json.dump(processor, f, indent=2, sort_keys=True)
    write_tokenizer_with(path, [IMAGE_TOKEN], CHAT_TEMPLATE)


def write_tokenizer_with(path: str, tokens: list[str], template: str) -> None:
    """The tiny tokenizer with `tokens` as special added tokens after its vocabulary (ids
    TOKENIZER_VOCAB, ...), and `template` as the chat template, over the text checkpoint's files."""
    from tokenizers import AddedToken, Tokenizer

    tok = Tokenizer.from_str(_tokenizer_json())
    if tok.get_vocab_size(with_added_tokens=True) != TOKENIZER_VOCAB:
        raise AssertionError("the tiny tokenizer's vocabulary is not the size the added token ids assume")
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in tokens])
    with open(os.path.join(path, "tokenizer.json"), "w", encoding="utf-8") as f:
        f.write(tok.to_str(pretty=True))
    with open(os.path.join(path, "tokenizer_config.json"), encoding="utf-8") as f:
        tok_cfg = json.load(f)
    tok_cfg["chat_template"] = template
    with open(os.path.join(path, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump(tok_cfg, f, indent=2, sort_keys=True)
        f.write("\n")
