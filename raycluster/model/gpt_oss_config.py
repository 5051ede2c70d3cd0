"""OpenAI's gpt-oss (`GptOssForCausalLM`) as its config.json describes it, read as transformers
reads it (its attention biases: raycluster.model.family_config): a learnt sink logit per attention head,
sliding layers by `layer_types` (default: the even ones) under `sliding_window` (default 128), YaRN
RoPE (transformers' default when the file states none: base 150000, factor 32 over 4096 positions,
not truncated), and on every layer `num_local_experts` routed experts of `intermediate_size`,
`num_experts_per_tok` per token, behind a router with a bias whose chosen logits are softmaxed,
each expert a SwiGLU clamped at `swiglu_limit` with sigmoid gain `swiglu_alpha`. The released
checkpoints store the experts' weights as MXFP4 (`quantization_config.quant_method` "mxfp4":
raycluster.model.quant.mxfp4), dequantized at load; everything else in them is dense.

`gpt_oss_fields(d, layers, error)` returns ModelConfig keyword arguments; `gpt_oss_rope(d)` the
dict to read its RoPE from. The experts themselves are raycluster.model.gpt_oss.
"""

from __future__ import annotations

from typing import Any, Callable

from raycluster.model.moe_config import MoEConfig

ARCHITECTURE = "GptOssForCausalLM"
_DEFAULT_ROPE = {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                 "truncate": False, "original_max_position_embeddings": 4096}


def gpt_oss_rope(d: dict[str, Any]) -> dict[str, Any]:
    """`d`, or with transformers' default RoPE when it states none."""
    if d.get("rope_parameters") is not None or d.get("rope_scaling") is not None:
        return d
    theta = d.get("rope_theta", _DEFAULT_ROPE["rope_theta"])
    return {**d, "rope_parameters": {**_DEFAULT_ROPE, "rope_theta": theta}}


def _positive(d: dict[str, Any], name: str, default: float, error: Callable[[str], Exception]) -> float:
    v = d.get(name, default)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or v <= 0:
        raise error(f"config field {name!r} must be a positive number, got {v!r}")
    return float(v)


def gpt_oss_fields(d: dict[str, Any], layers: int, error: Callable[[str], Exception]) -> dict[str, Any]:

    window = d.get("sliding_window", 128)
    layer_types = d.get("layer_types")
    if layer_types is None:     # transformers' default: layers 0, 2, 4, ... slide
        layer_types = ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(layers)]
    if not isinstance(layer_types, list) or len(layer_types) != layers or \
            any(t not in ("sliding_attention", "full_attention") for t in layer_types):
        raise error(f"config field 'layer_types' must list 'sliding_attention' or 'full_attention' per layer ({layers})")
    sliding = tuple(i for i, t in enumerate(layer_types) if t == "sliding_attention")
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise error(f"config field 'sliding_window' must be a positive int, got {window!r}")
    if window is None or not sliding:
        window, sliding = None, ()

    def count(name: str, default: int | None) -> int:
        v = d.get(name, default)
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise error(f"config field {name!r} must be a positive int, got {v!r}")
        return v

    experts, top_k = count("num_local_experts", 128), count("num_experts_per_tok", 4)
    if top_k > experts:
        raise error(f"config field 'num_experts_per_tok' = {top_k} exceeds the {experts} experts")
    quant = d.get("quantization_config")
    mxfp4 = isinstance(quant, dict) and quant.get("quant_method") == "mxfp4"
    inter = count("intermediate_size", None)
    if mxfp4 and (inter % 32 or d.get("hidden_size", 0) % 32):
        raise error(f"config field 'quantization_config': MXFP4 experts pack blocks of 32 inputs; hidden_size "
                    f"{d.get('hidden_size')} and intermediate_size {inter} must be multiples of 32")
    moe = MoEConfig(experts, top_k, inter, True, tuple(range(layers)), gpt_oss=True,
                    swiglu_alpha=_positive(d, "swiglu_alpha", 1.702, error),
                    swiglu_limit=_positive(d, "swiglu_limit", 7.0, error), mxfp4=mxfp4, stacked="interleaved")
    return {"attention_sinks": True,
            "sliding_window": window, "sliding_layers": sliding, "moe": moe}
