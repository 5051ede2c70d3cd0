"""The tiny Gemma 3 image-text checkpoint with its whole image side, for tests:
`write_tiny_gemma3_vl(path, seed=0, layout="released", **vision_options)`.

raycluster.model.tiny_multimodal writes the text model (the tiny Gemma 3 text checkpoint wrapped
as Gemma3ForConditionalGeneration, its vocabulary grown by the three vision tokens, its head
untied); this module
then rewrites config.json and model.safetensors with a seeded SigLIP tower (hidden 32, 2 layers, 2
heads, 32-pixel images in 4-pixel patches: an 8x8 grid) and Gemma 3's projector (the grid pooled
to `mm_tokens_per_image` = 16 tokens, Gemma RMSNorm, the projection to the text hidden size),
under the released names (`vision_tower.vision_model.`, `multi_modal_projector.` beside
`language_model.`) or transformers 5's (`layout="transformers5"`: the same under `model.`). It
adds preprocessor_config.json (Gemma3ImageProcessor as released: bilinear resize to the square,
mean / std 0.5, pan-and-scan fields null), processor_config.json (Gemma3Processor's
image_seq_length), and a tokenizer whose special added tokens "<start_of_image>",
"<end_of_image>" and "<image_soft_token>" take the ids after the tiny vocabulary (the config's
boi_token_index, eoi_token_index and image_token_index), named in tokenizer_config.json as the
released file names them (boi_token, eoi_token, image_token) so Gemma3Processor finds them. Its
chat template renders a content list's image parts as "<start_of_image>", as Gemma 3's does
(string content as before); the processor expands that to the image's whole token run.

`vision_options`: vision_config fields (hidden_size, num_hidden_layers, image_size, patch_size,
...) and `mm_tokens_per_image`.
"""

from __future__ import annotations

import json
import os

import torch
from safetensors.torch import load_file, save_file

from raycluster.model.gemma3_processor import GEMMA3_MEAN, GEMMA3_STD
from raycluster.model.gemma3_vision import ARCHITECTURE
from raycluster.model.siglip_vision import SiglipVisionModel, SiglipVisionSpec
from raycluster.model.tiny import TOKENIZER_VOCAB
from raycluster.model.tiny_llava import parts_template, seeded_tensors, write_tokenizer_with
from raycluster.model.tiny_multimodal import write_tiny_multimodal

BOI_TOKEN, EOI_TOKEN, IMAGE_TOKEN = "<start_of_image>", "<end_of_image>", "<image_soft_token>"
BOI_TOKEN_ID, EOI_TOKEN_ID, IMAGE_TOKEN_ID = range(TOKENIZER_VOCAB, TOKENIZER_VOCAB + 3)
VISION = {"model_type": "siglip_vision_model", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
          "num_attention_heads": 2, "num_channels": 3, "image_size": 32, "patch_size": 4,
          "hidden_act": "gelu_pytorch_tanh", "layer_norm_eps": 1e-6, "attention_dropout": 0.0,
          "vision_use_head": False}
MM_TOKENS_PER_IMAGE = 16

CHAT_TEMPLATE = parts_template(BOI_TOKEN)


def write_tiny_gemma3_vl(path: str | os.PathLike, seed: int = 0, layout: str = "released", **vision_options) -> str:
    """The tiny Gemma 3 with its image side (module docstring); returns the path."""
    tokens = vision_options.pop("mm_tokens_per_image", MM_TOKENS_PER_IMAGE)
    vision = {**VISION, **vision_options}
    # An untied head: tied, the tiny Gemma's scaled embeddings (x sqrt(hidden)) dominate its
    # residual stream and the head scores the last input token itself far above all others, so it
    # repeats that token whatever an image says.
    path = write_tiny_multimodal(path, ARCHITECTURE, seed=seed, layout=layout, vocab_size=TOKENIZER_VOCAB + 3,
                                 tie_word_embeddings=False)
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    config.update(vision_config=vision, mm_tokens_per_image=tokens, image_token_index=IMAGE_TOKEN_ID,
                  boi_token_index=BOI_TOKEN_ID, eoi_token_index=EOI_TOKEN_ID, tie_word_embeddings=False)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)
    prefix = "model." if layout == "transformers5" else ""
    # The text model's tensors; the one placeholder tower tensor tiny_multimodal wrote goes.
    tensors = {k: v for k, v in load_file(os.path.join(path, "model.safetensors")).items()
               if not k.startswith(prefix + "vision_tower.")}
    tensors.update({prefix + k: v for k, v in vision_tensors(config, seed).items()})
    save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    _write_processor_files(path, vision["image_size"], tokens)
    return path


def vision_tensors(config: dict, seed: int) -> dict[str, torch.Tensor]:
    """The seeded tower and projector under the released names."""
    spec = SiglipVisionSpec.from_config(config["vision_config"])
    with torch.device("meta"):
        shapes = {"vision_tower." + n: tuple(p.shape) for n, p in SiglipVisionModel(spec).named_parameters()}
    norm = "multi_modal_projector.mm_soft_emb_norm.weight"
    shapes[norm] = (spec.hidden_size,)
    text_hidden = config["text_config"]["hidden_size"]
    shapes["multi_modal_projector.mm_input_projection_weight"] = (spec.hidden_size, text_hidden)
    # The projection at unit scale: its rows are the (normed, unit-size) pooled features, and its
    # outputs stand beside Gemma's embeddings, scaled by sqrt(hidden); weaker features would
    # barely change what the text model says.
    out = seeded_tensors(shapes, seed, lambda name: "norm" in name.rpartition(".")[0],
                         ("position_embedding.weight", "mm_input_projection_weight"))
    out[norm] = out[norm] - 1.0     # Gemma's RMSNorm scales by (1 + weight): near-one scales too
    return out


def _write_processor_files(path: str, image_size: int, tokens: int) -> None:
    """preprocessor_config.json and processor_config.json as released, and the tokenizer."""
    processor = {"image_processor_type": "Gemma3ImageProcessor", "processor_class": "Gemma3Processor",
                 "do_convert_rgb": None, "do_normalize": True, "do_pan_and_scan": None, "do_rescale": True,
                 "do_resize": True, "image_mean": list(GEMMA3_MEAN), "image_std": list(GEMMA3_STD),
                 "image_seq_length": tokens, "pan_and_scan_max_num_crops": None, "pan_and_scan_min_crop_size": None,
                 "pan_and_scan_min_ratio_to_activate": None, "resample": 2, "rescale_factor": 1 / 255,
                 "size": {"height": image_size, "width": image_size}}
    with open(os.path.join(path, "preprocessor_config.json"), "w") as f:
        json.dump(processor, f, indent=2, sort_keys=True)
    with open(os.path.join(path, "processor_config.json"), "w") as f:
        json.dump({"image_seq_length": tokens, "processor_class": "Gemma3Processor"}, f, indent=2, sort_keys=True)
    write_tokenizer_with(path, [BOI_TOKEN, EOI_TOKEN, IMAGE_TOKEN], CHAT_TEMPLATE)
    with open(os.path.join(path, "tokenizer_config.json"), encoding="utf-8") as f:
        tok_cfg = json.load(f)
    tok_cfg.update(boi_token=BOI_TOKEN, eoi_token=EOI_TOKEN, image_token=IMAGE_TOKEN)
    with open(os.path.join(path, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump(tok_cfg, f, indent=2, sort_keys=True)
        f.write("\n")
