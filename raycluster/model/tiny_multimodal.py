"""Tiny image-text checkpoints (Gemma 3, Mistral 3 / Ministral 3, LLaVA, LLaVA-NeXT, LLaVA-OneVision, Llama 4,
Qwen2-VL, Qwen2.5-VL, Qwen3-VL, Qwen3-VL-MoE) for tests: `write_tiny_multimodal(path, arch)` wraps the tiny text
checkpoint of the wrapper's text model (raycluster.model.tiny) as its released files and
transformers lay them out, with a vision config and one vision tensor (a text-only server never
reads the tower); LLaVA's and LLaVA-NeXT's with `vision_weights=True`: the whole tower, projector
(and NeXT's image_newline), image processor and "<image>" token (raycluster.model.tiny_llava;
LLaVA-OneVision's whole image side: raycluster.model.tiny_llava_onevision);
Qwen2-VL's and Qwen2.5-VL's: the whole tower, image processor and vision tokens
(raycluster.model.tiny_qwen_vl)."""

from __future__ import annotations

import json
import os

import torch
from safetensors.torch import save_file

from raycluster.model.tiny import write_tiny_model


# Image-text wrappers of a tiny text checkpoint: (model_type, text model_type, the text
# architecture, a tiny vision tower's config, extra top-level fields).
_MULTIMODAL = {
    "Gemma3ForConditionalGeneration": ("gemma3", "gemma3_text", "Gemma3ForCausalLM", {
        "model_type": "siglip_vision_model", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
        "num_attention_heads": 2, "image_size": 28, "patch_size": 14},
        {"mm_tokens_per_image": 4, "image_token_index": 5, "boi_token_index": 3, "eoi_token_index": 4}),
    "Mistral3ForConditionalGeneration": ("mistral3", "mistral", "MistralForCausalLM", {
        "model_type": "pixtral", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
        "num_attention_heads": 2, "image_size": 28, "patch_size": 14, "head_dim": 16},
        {"image_token_index": 5, "spatial_merge_size": 2}),
    "LlavaForConditionalGeneration": ("llava", "llama", "LlamaForCausalLM", {
        "model_type": "clip_vision_model", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
        "num_attention_heads": 2, "image_size": 28, "patch_size": 14, "projection_dim": 32},
        {"image_token_index": 5}),
    # LLaVA-NeXT over Mistral (llava-v1.6-mistral's layout); pinpoints of 28-pixel tiles, (height, width).
    "LlavaNextForConditionalGeneration": ("llava_next", "mistral", "MistralForCausalLM", {
        "model_type": "clip_vision_model", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
        "num_attention_heads": 2, "image_size": 28, "patch_size": 14, "projection_dim": 32},
        {"image_token_index": 5, "image_grid_pinpoints": [[28, 56], [56, 28], [56, 56]]}),
    # LLaVA-OneVision over Qwen2 (llava-onevision-qwen2's layout), a SigLIP tower; the whole image side:
    # raycluster.model.tiny_llava_onevision.
    "LlavaOnevisionForConditionalGeneration": ("llava_onevision", "qwen2", "Qwen2ForCausalLM", {
        "model_type": "siglip_vision_model", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
        "num_attention_heads": 2, "image_size": 28, "patch_size": 7, "vision_use_head": False},
        {"image_token_index": 5, "image_grid_pinpoints": [[28, 28], [28, 56], [56, 28], [56, 56]]}),
    "Llama4ForConditionalGeneration": ("llama4", "llama4_text", "Llama4ForCausalLM", {
        "model_type": "llama4_vision_model", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
        "num_attention_heads": 2, "image_size": 28, "patch_size": 14, "vision_output_dim": 32,
        "projector_input_dim": 32, "projector_output_dim": 32},
        {"image_token_index": 5, "boi_token_index": 3, "eoi_token_index": 4}),
    "Qwen2VLForConditionalGeneration": ("qwen2_vl", "qwen2_vl_text", "Qwen2ForCausalLM", {
        "model_type": "qwen2_vl", "depth": 1, "embed_dim": 32, "hidden_size": 256, "num_heads": 2, "mlp_ratio": 2},
        {"image_token_id": 5, "video_token_id": 6, "vision_start_token_id": 3, "vision_end_token_id": 4}),
    "Qwen2_5_VLForConditionalGeneration": ("qwen2_5_vl", "qwen2_5_vl_text", "Qwen2ForCausalLM", {
        "model_type": "qwen2_5_vl", "depth": 1, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2,
        "out_hidden_size": 256, "fullatt_block_indexes": [0]},
        {"image_token_id": 5, "video_token_id": 6, "vision_start_token_id": 3, "vision_end_token_id": 4}),
    "Qwen3VLMoeForConditionalGeneration": ("qwen3_vl_moe", "qwen3_vl_moe_text", "Qwen3MoeForCausalLM", {
        "model_type": "qwen3_vl_moe", "depth": 1, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2,
        "out_hidden_size": 256, "deepstack_visual_indexes": [0], "num_position_embeddings": 16},
        {"image_token_id": 5, "video_token_id": 6, "vision_start_token_id": 3, "vision_end_token_id": 4}),
    "Qwen3VLForConditionalGeneration": ("qwen3_vl", "qwen3_vl_text", "Qwen3ForCausalLM", {
        "model_type": "qwen3_vl", "depth": 1, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2,
        "out_hidden_size": 256, "deepstack_visual_indexes": [0], "num_position_embeddings": 16},
        {"image_token_id": 5, "video_token_id": 6, "vision_start_token_id": 3, "vision_end_token_id": 4}),
}
# Where each wrapper's released files keep the text model: under `language_model.`, or (Qwen2.5-VL)
# a flat config and plain names beside `visual.`; Qwen3-VL's are transformers 5's layout.
_RELEASED = {"Qwen2VLForConditionalGeneration": "flat", "Qwen2_5_VLForConditionalGeneration": "flat",
             "Qwen3VLForConditionalGeneration": "transformers5", "Qwen3VLMoeForConditionalGeneration": "transformers5"}
# Their multimodal RoPE sections (half-dims of the tiny heads: 16 of 32 dims).
_MROPE = {"Qwen2VLForConditionalGeneration": {"type": "mrope", "mrope_section": [4, 6, 6]},
          "Qwen2_5_VLForConditionalGeneration": {"type": "mrope", "mrope_section": [4, 6, 6]},
          "Qwen3VLForConditionalGeneration": {"rope_type": "default", "mrope_section": [6, 5, 5],
                                              "mrope_interleaved": True},
          "Qwen3VLMoeForConditionalGeneration": {"rope_type": "default", "mrope_section": [6, 5, 5],
                                                 "mrope_interleaved": True}}


# Wrappers whose whole tower raycluster.model.tiny_qwen_vl writes (`vision_weights`).
_QWEN_VL = ("Qwen2VLForConditionalGeneration", "Qwen2_5_VLForConditionalGeneration")
# Text models a wrapper may hold besides its usual one (`text_architecture`): their model_type.
_OTHER_TEXT_TYPES = {"Ministral3ForCausalLM": "ministral3"}


def write_tiny_multimodal(path: str | os.PathLike, arch: str, seed: int = 0, layout: str = "released",
                          text_architecture: str | None = None, vision_weights: bool = False,
                          vision_options: dict | None = None, **overrides) -> str:
    """The tiny text checkpoint of `arch`'s text model wrapped as `arch` (an image-text model):
    config.json nesting it under `text_config` beside a tiny vision config, its tensors under
    `language_model.` (`layout` "released", as the hub's files and transformers' save_pretrained
    write them; Qwen2.5-VL's released files: a flat config, plain names beside `visual.`) or
    `model.language_model.` ("transformers5", the head as `lm_head.`), plus one vision tensor (the
    rest of the tower left out: a text-only server never reads it). `text_architecture`: another
    text model than the wrapper's usual one (Ministral 3 in Mistral 3). `vision_weights` (LLaVA,
    LLaVA-NeXT, Qwen2-VL and Qwen2.5-VL only): the whole seeded tower (and LLaVA's projector)
    instead, with `vision_options` as raycluster.model.tiny_llava.llava_fields takes them
    (image_size, vision_feature_layer, image_grid_pinpoints, ...), or
    raycluster.model.tiny_qwen_vl.qwen_vl_fields (vision_config fields, min_pixels, max_pixels)."""
    model_type, text_type, text_arch, vision, extra = _MULTIMODAL[arch]
    if vision_weights:
        from raycluster.model import tiny_llava, tiny_qwen_vl
        if arch in _QWEN_VL:
            vision, extra, overrides, processor = tiny_qwen_vl.qwen_vl_fields(arch, vision, extra, overrides,
                                                                             **(vision_options or {}))
        elif arch in ("LlavaForConditionalGeneration", "LlavaNextForConditionalGeneration"):
            vision, extra, overrides = tiny_llava.llava_fields(vision, extra, overrides, **(vision_options or {}))
        else:
            raise ValueError(f"vision_weights: only the tiny LLaVA, LLaVA-NeXT, Qwen2-VL and Qwen2.5-VL have a "
                             f"whole tower here, not {arch} (Qwen3-VL's and Gemma 3's: raycluster.model.tiny_qwen3_vl, "
                             f"raycluster.model.tiny_gemma3_vl)")
    if text_architecture is not None:
        text_type, text_arch = _OTHER_TEXT_TYPES[text_architecture], text_architecture
    path = write_tiny_model(path, seed, architectures=[text_arch], **overrides)
    with open(os.path.join(path, "config.json")) as f:
        text = {k: v for k, v in json.load(f).items() if k != "architectures"}
    if arch in _MROPE:
        theta = text.pop("rope_parameters", {}).get("rope_theta", 1e6)
        text.update(rope_theta=theta, rope_scaling=_MROPE[arch])
    style = _RELEASED.get(arch, "language_model") if layout == "released" else layout
    config = {"architectures": [arch], "model_type": model_type, "vision_config": vision, "dtype": "float32", **extra}
    if style == "flat":
        config.update({k: v for k, v in text.items() if k != "model_type"})
    else:
        config["text_config"] = {**text, "model_type": text_type}
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)
    from safetensors.torch import load_file
    tensors = load_file(os.path.join(path, "model.safetensors"))
    if arch == "Qwen3VLMoeForConditionalGeneration":
        tensors = _stacked_experts(tensors)
    tower = "visual.blocks.0.norm1.weight" if arch in _MROPE else "vision_tower.vision_model.post_layernorm.weight"
    if style == "language_model":
        out = {"language_model." + k: v for k, v in tensors.items()}
    elif style == "flat":
        out = dict(tensors)
    else:
        out = {("model.language_model." + k[len("model."):]) if k.startswith("model.") else k: v
               for k, v in tensors.items()}
        tower = "model." + tower
    if vision_weights and arch in _QWEN_VL:
        out.update(tiny_qwen_vl.vision_tensors(config, seed, style))
        tiny_qwen_vl.write_qwen_vl_files(path, config, processor)
    elif vision_weights:
        out.update(tiny_llava.vision_tensors(config, seed, style))
        tiny_llava.write_llava_files(path, config)
    else:
        out[tower] = torch.ones(vision.get("embed_dim", vision["hidden_size"]))
    save_file(out, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    return path


def _stacked_experts(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Each sparse layer's experts as Qwen3-VL-MoE stores them: gate_up_proj [E, H, 2I] (gate
    columns, then up) and down_proj [E, I, H]."""
    out, experts = {}, {}
    for name, t in tensors.items():
        head, sep, rest = name.partition(".mlp.experts.")
        if not sep:
            out[name] = t
            continue
        e, proj = rest.split(".")[:2]
        experts.setdefault(head, {})[(int(e), proj)] = t
    for head, parts in experts.items():
        n = 1 + max(e for e, _ in parts)
        out[f"{head}.mlp.experts.gate_up_proj"] = torch.stack(
            [torch.cat([parts[(e, "gate_proj")].t(), parts[(e, "up_proj")].t()], dim=-1) for e in range(n)]).contiguous()
        out[f"{head}.mlp.experts.down_proj"] = torch.stack([parts[(e, "down_proj")].t() for e in range(n)]).contiguous()
    return out
