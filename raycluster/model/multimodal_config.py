"""Image-text checkpoints served on their text alone: Gemma 3 (`Gemma3ForConditionalGeneration`, the
4B / 12B / 27B releases), Mistral 3 (`Mistral3ForConditionalGeneration`: Mistral Small 3.1 / 3.2) and
LLaVA (`LlavaForConditionalGeneration`, over a Llama, Mistral or Qwen2 text model).

Their config.json nests the text model's config under `text_config`; `text_config_of(arch, d)`
returns (the text model's architecture, its config dict): `text_config` with transformers' defaults
for the fields a release leaves out (Gemma 3's sparse text configs) and the top-level ids, dtype and
tying it inherits. The weights sit under the text model's prefix (`language_model.` in the released
files, `model.language_model.` in transformers 5's own layout; raycluster.model.loader maps them);
the vision tower and projector are never read, and requests with image parts are refused.
"""

from __future__ import annotations

from typing import Any, Callable

MULTIMODAL_ARCHITECTURES = ("Gemma3ForConditionalGeneration", "Mistral3ForConditionalGeneration",
                            "LlavaForConditionalGeneration")
# A text config's model_type -> its causal LM architecture (when it names none itself).
_TEXT_ARCHITECTURES = {"gemma3_text": "Gemma3ForCausalLM", "mistral": "MistralForCausalLM",
                       "llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}
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
    text = d.get("text_config")
    if not isinstance(text, dict):
        raise error(f"config field 'text_config' must be an object describing {arch}'s text model, got {text!r}")
    if d.get("quantization_config") is not None:
        raise error(f"config field 'quantization_config': quantized {arch} checkpoints are not supported")
    named = text.get("architectures")
    text_arch = "Gemma3ForCausalLM" if arch == "Gemma3ForConditionalGeneration" else \
        named[0] if isinstance(named, list) and named else _TEXT_ARCHITECTURES.get(text.get("model_type", "llama"))
    if text_arch is None:
        raise error(f"config field 'text_config.model_type' = {text.get('model_type')!r} is not a text model served "
                    f"here (supported: {', '.join(_TEXT_ARCHITECTURES)})")
    out = dict(_GEMMA3_TEXT_DEFAULTS) if text_arch == "Gemma3ForCausalLM" else {}
    out.update({k: d[k] for k in _INHERITED if d.get(k) is not None})
    out.update({k: v for k, v in text.items() if v is not None or k not in out})
    out["architectures"] = [text_arch]
    return text_arch, out
