"""Image-text checkpoints' text models (served on their text alone when the files hold no vision
tower, or the architecture's images are not served here): Gemma 3 (`Gemma3ForConditionalGeneration`, the
4B / 12B / 27B releases), Mistral 3 (`Mistral3ForConditionalGeneration`: Mistral Small 3.1 / 3.2, and
Ministral 3 over its `ministral3` text model),
LLaVA (`LlavaForConditionalGeneration`, over a Llama, Mistral or Qwen2 text model), LLaVA-NeXT
(`LlavaNextForConditionalGeneration`: llava-v1.6, over Mistral or Llama), LLaVA-OneVision
(`LlavaOnevisionForConditionalGeneration`: llava-onevision-qwen2, over Qwen2), Qwen2-VL and
Qwen2.5-VL (over Qwen2), Qwen3-VL (over Qwen3), Qwen3-VL-MoE (over Qwen3-MoE, its experts stored
stacked) and Llama 4 (Scout, Maverick).

Their config.json nests the text model's config under `text_config` (Qwen2-VL's and Qwen2.5-VL's
released files keep it at the top level); `text_config_of(arch, d)` returns (the text model's
architecture, its config dict): the text config with transformers' defaults for the fields a
release leaves out (Gemma 3's sparse text configs) and the top-level ids, dtype and tying it
inherits. The Qwen-VL models' multimodal RoPE (`mrope`) turns every section of a head by the same
position when the input is text alone, which is plain RoPE. The weights sit under the text model's
prefix (`language_model.` in the released Gemma / Mistral / LLaVA / LLaVA-NeXT / LLaVA-OneVision files,
`model.language_model.` in transformers 5's own layout, plain `model.` beside `visual.` in the
released Qwen-VL files;
raycluster.model.loader maps them). The text model alone is built here; the image encoders of
the architectures that take images (LLaVA, LLaVA-NeXT, Qwen2-VL, Qwen2.5-VL, Qwen3-VL,
Qwen3-VL-MoE, Gemma 3, Mistral 3, Llama 4) are raycluster.model.llava's (LLaVA-OneVision's:
raycluster.model.llava_onevision), and `mrope_of` reads the
Qwen-VL models' multimodal RoPE, which turns image prompts (raycluster.model.mrope). A checkpoint
stored without its tower serves its text alone and refuses image parts.
"""

from __future__ import annotations

from typing import Any, Callable

from raycluster.model.mrope import MRopeSpec

MULTIMODAL_ARCHITECTURES = ("Gemma3ForConditionalGeneration", "Mistral3ForConditionalGeneration",
                            "LlavaForConditionalGeneration", "LlavaNextForConditionalGeneration",
                            "LlavaOnevisionForConditionalGeneration",
                            "Qwen2VLForConditionalGeneration",
                            "Qwen2_5_VLForConditionalGeneration", "Qwen3VLForConditionalGeneration",
                            "Qwen3VLMoeForConditionalGeneration", "Llama4ForConditionalGeneration")
# Wrappers whose text model stores its experts stacked (gate / up in halves), unlike its
# causal LM's own checkpoints: ModelConfig's `moe.stacked`.
STACKED_EXPERTS = {"Qwen3VLMoeForConditionalGeneration": "halves"}
# Wrappers whose text model is fixed (the others name it by its text config's model_type).
_FIXED_TEXT = {"Gemma3ForConditionalGeneration": "Gemma3ForCausalLM",
               "Qwen2VLForConditionalGeneration": "Qwen2ForCausalLM",
               "Qwen2_5_VLForConditionalGeneration": "Qwen2ForCausalLM",
               "Qwen3VLForConditionalGeneration": "Qwen3ForCausalLM",
               "Qwen3VLMoeForConditionalGeneration": "Qwen3MoeForCausalLM",
               "Llama4ForConditionalGeneration": "Llama4ForCausalLM"}
# The wrapper's own top-level fields, never the text model's (a flat Qwen-VL config holds both).
_WRAPPER_FIELDS = ("architectures", "model_type", "vision_config", "text_config", "image_token_id",
                   "video_token_id", "vision_start_token_id", "vision_end_token_id", "vision_token_id")
# A text config's model_type -> its causal LM architecture (when it names none itself).
_TEXT_ARCHITECTURES = {"gemma3_text": "Gemma3ForCausalLM", "mistral": "MistralForCausalLM",
                       "ministral3": "Ministral3ForCausalLM",
                       "llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
# transformers' Gemma3TextConfig defaults: the released text configs state only what differs.
_GEMMA3_TEXT_DEFAULTS = {
    "vocab_size": 262208, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26,
    "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256, "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-6, "rope_theta": 1_000_000.0, "rope_local_base_freq": 10_000.0, "query_pre_attn_scalar": 256,
    "sliding_window": 4096, "sliding_window_pattern": 6, "hidden_activation": "gelu_pytorch_tanh",
    "bos_token_id": 2, "eos_token_id": 1, "pad_token_id": 0}
# Top-level fields the text model takes from the wrapper when its own config has none.
_INHERITED = ("bos_token_id", "eos_token_id", "pad_token_id", "dtype", "torch_dtype", "tie_word_embeddings")


def text_config_of(arch: str, d: dict[str, Any], error: Callable[[str], Exception]) -> tuple[str, dict[str, Any]]:
    """(text architecture, text config dict) of image-text config.json `d` (module docstring);
    `error(msg)` makes the exception to raise, naming the field."""
    flat = arch.startswith("Qwen2") and "text_config" not in d     # Qwen2(.5)-VL's released files
    text = {k: v for k, v in d.items() if k not in _WRAPPER_FIELDS} if flat else d.get("text_config")
    if not isinstance(text, dict):
        raise error(f"config field 'text_config' must be an object describing {arch}'s text model, got {text!r}")
    named = text.get("architectures")
    text_arch = _FIXED_TEXT.get(arch) or \
        (named[0] if isinstance(named, list) and named else _TEXT_ARCHITECTURES.get(text.get("model_type", "llama")))
    if text_arch is None:
        raise error(f"config field 'text_config.model_type' = {text.get('model_type')!r} is not a text model served "
                    f"here (supported: {', '.join(_TEXT_ARCHITECTURES)})")
    out = dict(_GEMMA3_TEXT_DEFAULTS) if text_arch == "Gemma3ForCausalLM" else {}
    out.update({k: d[k] for k in _INHERITED if d.get(k) is not None})
    out.update({k: v for k, v in text.items() if v is not None or k not in out})
    out["architectures"] = [text_arch]
    if isinstance(d.get("quantization_config"), dict):      # the text model's weights are what is quantized
        out["quantization_config"] = text_quant_config(d["quantization_config"])
    for key in ("rope_parameters", "rope_scaling"):
        rope = out.get(key)
        if isinstance(rope, dict) and "mrope_section" in rope:     # on text alone: plain RoPE
            out[key] = {k: v for k, v in rope.items() if k not in ("type", "rope_type", "mrope_section",
                                                                    "mrope_interleaved")} or None
            if out[key] is not None:
                out[key]["rope_type"] = "default"
    return text_arch, out


# Where released files and transformers 5 keep the text model, as the names its layers go by.
_TEXT_MODULE_PREFIXES = (("language_model.model.", "model."), ("language_model.", ""), ("model.language_model.", "model."))
_IGNORE_KEYS = ("ignore", "modules_to_not_convert", "ignored_layers")


def text_quant_config(raw: dict[str, Any]) -> dict[str, Any]:
    """An image-text checkpoint's `quantization_config` for its text model: module names its
    ignore lists give under the wrapper's text prefix (`language_model.model.layers.0...`,
    `model.language_model.layers.0...`) as the text model calls them (`model.layers.0...`);
    patterns (`re:`) and other names as they are (the tower's entries then match nothing)."""
    out = dict(raw)
    for key in _IGNORE_KEYS:
        if isinstance(raw.get(key), list):
            out[key] = [n if not isinstance(n, str) or n.startswith("re:") else text_module_name(n) for n in raw[key]]
    return out


def text_module_name(name: str) -> str:
    """A stored module name under the wrapper's text prefix as the text model calls it; other
    names (the tower's, Qwen-VL's flat `model.layers...`) as they are."""
    for prefix, into in _TEXT_MODULE_PREFIXES:
        if name.startswith(prefix):
            return into + name[len(prefix):]
    return name


def mrope_of(arch: str, d: dict[str, Any]) -> MRopeSpec | None:
    """The multimodal RoPE of a Qwen-VL config.json (its text config's rope parameters'
    `mrope_section`, interleaved on Qwen3-VL), else None."""
    flat = arch.startswith("Qwen2") and "text_config" not in d
    text = d if flat else (d.get("text_config") or {})
    for key in ("rope_parameters", "rope_scaling"):
        rope = text.get(key)
        if isinstance(rope, dict) and rope.get("mrope_section") is not None:
            section = tuple(int(x) for x in rope["mrope_section"])
            if len(section) != 3:
                raise ValueError(f"config field 'text_config.{key}.mrope_section' must hold 3 numbers, got {list(section)}")
            return MRopeSpec(section, bool(rope.get("mrope_interleaved", False)))
    return None
