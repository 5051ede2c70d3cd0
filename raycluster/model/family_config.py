"""The per-family fields of the Llama-like decoders' config.json, as transformers' modeling code
reads them: which projections carry biases, and what each family changes in the shared layer
(raycluster.model.llama follows `ModelConfig`'s fields):

- Qwen2: q/k/v biases always; Qwen3: `attention_bias` on q/k/v and o_proj, q/k norms per head.
- Phi-3: q/k/v and gate/up stored fused (split at load).
- Granite (and Granite MoE, its experts: raycluster.model.granite_moe): embedding, residual and
  attention multipliers, a logits divisor.
- OLMo 2: norms after each block's output only, q/k norms across all heads. OLMo 3: the same, with
  sliding layers (`layer_types`, else three of every four) under `sliding_window` (default 4096),
  their RoPE plain at their own base (ModelConfig's `sliding_rope_theta`).
- GLM-4 / GLM-4-0414: gate/up fused, q/k/v biases, RoPE on interleaved pairs; GLM-4-0414's norms
  after attention and the MLP as well.
- SmolLM3: no RoPE on the layers `no_rope_layers` marks 0.
- EXAONE 4: norms after each block's output, q/k norms per head; with a `sliding_window`, the
  sliding layers (`layer_types`, else three of every four) keep RoPE and the full ones use none.
- StarCoder2: biases on every projection, LayerNorm with bias, an ungated GELU-tanh MLP (c_fc,
  c_proj), a window on every layer when `sliding_window` is set.
- Seed-OSS: o_proj's bias by `attention_out_bias`, apart from q/k/v's `attention_bias`.
- Ernie 4.5: one `use_bias` for every projection, RoPE on interleaved pairs of the whole head.
- Arcee (AFM): an ungated MLP, up_proj then down_proj with ReLU squared between.
- Hunyuan dense: per-head q/k norms applied after RoPE (`query_layernorm` / `key_layernorm`); its
  "dynamic" RoPE with a fixed `alpha` is a plain RoPE at base theta * alpha^(d / (d - 2))
  (`hunyuan_rope`), as transformers computes it.
- Apertus: the same with its learnt xIELU (`mlp.act_fn`), per-head q/k norms, its norms named
  attention_layernorm / feedforward_layernorm; llama3 RoPE at base 12e6 when the file states none
  (`apertus_rope`).
- GLM-4.5 (`Glm4MoeForCausalLM`): q/k/v biases, optional per-head q/k norms, DeepSeek-V3's routing.
- gpt-oss: biases on q/k/v and o_proj unless `attention_bias` is false (its sinks, windows and
  experts: raycluster.model.gpt_oss_config).
- DeepSeek-V2 / V3: multi-head latent attention (raycluster.model.mla); its routed experts are read
  with the other mixture-of-experts models (ModelConfig's `_moe`).

Gemma and Cohere have their own modules (gemma_config, cohere_config). Data enters as
config.json's dict and leaves as keyword arguments for `ModelConfig`; errors name the field.
"""

from __future__ import annotations

from typing import Any, Callable

from raycluster.model.mla_config import mla_fields

FUSED_PROJECTIONS = {"Phi3ForCausalLM": ("qkv_proj", "gate_up_proj"), "GlmForCausalLM": ("gate_up_proj",),
                     "Glm4ForCausalLM": ("gate_up_proj",)}
FAMILY_ARCHITECTURES = ("Phi3ForCausalLM", "Ministral3ForCausalLM", "GraniteForCausalLM", "GraniteMoeForCausalLM", "SeedOssForCausalLM",
                        "Ernie4_5ForCausalLM", "ArceeForCausalLM", "ApertusForCausalLM", "HunYuanDenseV1ForCausalLM", "Olmo2ForCausalLM", "Olmo3ForCausalLM", "GlmForCausalLM",
                        "Glm4ForCausalLM", "SmolLM3ForCausalLM", "Exaone4ForCausalLM", "DeepseekV2ForCausalLM",
                        "DeepseekV3ForCausalLM", "Glm4MoeForCausalLM", "Starcoder2ForCausalLM")


def family_fields(arch: str, d: dict[str, Any], layers: int, error: Callable[[str], Exception]) -> dict[str, Any]:
    """Biases and the family's own fields; sliding fields given here replace the generic reading."""
    ab = bool(d.get("attention_bias", False))
    if arch in ("Qwen2ForCausalLM", "Qwen2MoeForCausalLM"):
        return {"qkv_bias": True, "o_bias": False, "mlp_bias": False}
    if arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM"):
        return {"qkv_bias": ab, "o_bias": ab, "mlp_bias": False, "qk_norm": True}
    if arch in ("GlmForCausalLM", "Glm4ForCausalLM"):
        return {"qkv_bias": bool(d.get("attention_bias", True)), "o_bias": False, "mlp_bias": False,
                "rope_interleaved": True, "block_norms": "glm4" if arch == "Glm4ForCausalLM" else "pre"}
    if arch == "Starcoder2ForCausalLM":     # biases everywhere (use_bias), LayerNorm, ungated GELU MLP
        bias = bool(d.get("use_bias", True))
        eps = d.get("norm_epsilon", 1e-5)
        if isinstance(eps, bool) or not isinstance(eps, (int, float)) or eps <= 0:
            raise error(f"config field 'norm_epsilon' must be a positive number, got {eps!r}")
        act = d.get("hidden_act", "gelu_pytorch_tanh")
        if act not in ("gelu_pytorch_tanh", "gelu_new"):
            raise error(f"config field 'hidden_act' = {act!r} is not supported for {arch} (gelu_pytorch_tanh)")
        return {"qkv_bias": bias, "o_bias": bias, "mlp_bias": bias, "layer_norm_bias": True, "plain_mlp": True,
                "rms_norm_eps": float(eps)}
    if arch == "Glm4MoeForCausalLM":        # GLM-4.5: q/k/v biases, optional per-head q/k norms
        return {"qkv_bias": ab, "o_bias": False, "mlp_bias": False, "qk_norm": bool(d.get("use_qk_norm", False))}
    if arch == "GptOssForCausalLM":     # attention biases by default (its own fields: gpt_oss_config)
        bias = bool(d.get("attention_bias", True))
        return {"qkv_bias": bias, "o_bias": bias, "mlp_bias": False}
    if arch == "SeedOssForCausalLM":        # o_proj's bias apart from q/k/v's
        return {"qkv_bias": ab, "o_bias": bool(d.get("attention_out_bias", False)),
                "mlp_bias": bool(d.get("mlp_bias", False))}
    if arch == "Ernie4_5ForCausalLM":       # one `use_bias` for every projection; RoPE on interleaved pairs
        bias = bool(d.get("use_bias", False))
        return {"qkv_bias": bias, "o_bias": bias, "mlp_bias": bias, "rope_interleaved": True}
    if arch == "ArceeForCausalLM":          # an ungated MLP, up then down, ReLU squared between
        act = d.get("hidden_act", "relu2")
        if act != "relu2":
            raise error(f"config field 'hidden_act' = {act!r} is not supported for {arch} (relu2)")
        return {"qkv_bias": ab, "o_bias": ab, "mlp_bias": bool(d.get("mlp_bias", False)), "ungated_mlp": "relu2"}
    if arch == "HunYuanDenseV1ForCausalLM":     # per-head q/k norms after RoPE, under their own names
        return {"qkv_bias": ab, "o_bias": ab, "mlp_bias": False, "qk_norm_after_rope": True}
    if arch == "ApertusForCausalLM":        # per-head q/k norms, an ungated xIELU MLP, its norms' own names
        act = d.get("hidden_act", "xielu")
        if act != "xielu":
            raise error(f"config field 'hidden_act' = {act!r} is not supported for {arch} (xielu)")
        return {"qkv_bias": ab, "o_bias": ab, "mlp_bias": False, "qk_norm": True, "ungated_mlp": "xielu",
                "block_norms": "apertus"}
    if arch in ("MistralForCausalLM", "MixtralForCausalLM", "Phi3ForCausalLM"):
        return {"qkv_bias": False, "o_bias": False, "mlp_bias": False}
    if arch == "Ministral3ForCausalLM":     # Mistral's layers, queries scaled past the pretraining context
        return {"qkv_bias": False, "o_bias": False, "mlp_bias": False,
                "query_scaling": _ministral3_query_scaling(ministral3_rope(d), error)}
    out = {"qkv_bias": ab, "o_bias": ab, "mlp_bias": bool(d.get("mlp_bias", False))}
    if arch in ("GraniteForCausalLM", "GraniteMoeForCausalLM"):
        out.update(_granite(d, error))
    elif arch == "Olmo2ForCausalLM":
        out.update(qk_norm_across_heads=True, block_norms="post")
    elif arch == "Olmo3ForCausalLM":
        out.update(qk_norm_across_heads=True, block_norms="post", **_olmo3_layers(d, layers, error))
    elif arch == "SmolLM3ForCausalLM":
        out["nope_layers"] = _smollm3_nope(d, layers, error)
    elif arch == "Exaone4ForCausalLM":
        out.update(block_norms="post", qk_norm=True, **_exaone4_layers(d, layers, error))
    elif arch in ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM"):
        out.update(mla_fields(d, error))
    return out


def _granite(d: dict[str, Any], error) -> dict[str, float]:
    """Granite's four multipliers (transformers' defaults 1.0), each a positive number."""
    out = {}
    for name in ("embedding_multiplier", "residual_multiplier", "attention_multiplier", "logits_scaling"):
        v = d.get(name, 1.0)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or v <= 0:
            raise error(f"config field {name!r} must be a positive number, got {v!r}")
        out[name] = float(v)
    return out


def _smollm3_nope(d: dict[str, Any], layers: int, error) -> tuple[int, ...]:
    flags = d.get("no_rope_layers")
    if flags is None:           # transformers' default: every `no_rope_layer_interval`-th layer
        interval = d.get("no_rope_layer_interval", 4)
        if not isinstance(interval, int) or interval < 1:
            raise error(f"config field 'no_rope_layer_interval' must be a positive int, got {interval!r}")
        flags = [int((i + 1) % interval != 0) for i in range(layers)]
    if not isinstance(flags, list) or len(flags) != layers or any(f not in (0, 1) for f in flags):
        raise error(f"config field 'no_rope_layers' must list a 0 or 1 per layer ({layers})")
    return tuple(i for i, use in enumerate(flags) if not use)


def _olmo3_layers(d: dict[str, Any], layers: int, error) -> dict[str, Any]:
    window = d.get("sliding_window", 4096)
    if window is None:
        return {"sliding_window": None, "sliding_layers": ()}
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise error(f"config field 'sliding_window' must be a positive int, got {window!r}")
    layer_types = d.get("layer_types")
    if layer_types is None:
        layer_types = ["sliding_attention" if (i + 1) % 4 else "full_attention" for i in range(layers)]
    if not isinstance(layer_types, list) or len(layer_types) != layers:
        raise error(f"config field 'layer_types' must list one type per layer ({layers})")
    sliding = tuple(i for i, t in enumerate(layer_types) if t == "sliding_attention")
    return {"sliding_window": window if sliding else None, "sliding_layers": sliding}


def _exaone4_layers(d: dict[str, Any], layers: int, error) -> dict[str, Any]:
    window = d.get("sliding_window", 4096)     # transformers' default when the field is absent
    if window is None:
        return {}
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise error(f"config field 'sliding_window' must be a positive int, got {window!r}")
    layer_types = d.get("layer_types")
    if layer_types is not None:
        if not isinstance(layer_types, list) or len(layer_types) != layers:
            raise error(f"config field 'layer_types' must list one type per layer ({layers})")
        sliding = tuple(i for i, t in enumerate(layer_types) if t == "sliding_attention")
    else:
        pattern = d.get("sliding_window_pattern", 4)
        if not isinstance(pattern, int) or pattern < 1:
            raise error(f"config field 'sliding_window_pattern' must be a positive int, got {pattern!r}")
        sliding = tuple(i for i in range(layers) if (i + 1) % pattern)
    return {"sliding_window": window if sliding else None, "sliding_layers": sliding,
            "nope_layers": tuple(i for i in range(layers) if i not in sliding)}


_APERTUS_ROPE = {"rope_type": "llama3", "rope_theta": 12_000_000.0, "factor": 8.0,
                 "original_max_position_embeddings": 8192, "low_freq_factor": 1.0, "high_freq_factor": 4.0}


def apertus_rope(d: dict[str, Any]) -> dict[str, Any]:
    """`d`, or with transformers' default Apertus RoPE when it states none."""
    if d.get("rope_parameters") is not None or d.get("rope_scaling") is not None:
        return d
    return {**d, "rope_parameters": {**_APERTUS_ROPE, "rope_theta": d.get("rope_theta", _APERTUS_ROPE["rope_theta"])}}


# transformers' Ministral3Config default, for a file that states no RoPE.
_MINISTRAL3_ROPE = {"rope_type": "yarn", "rope_theta": 1_000_000.0, "factor": 16.0,
                    "original_max_position_embeddings": 16384, "beta_fast": 32.0, "beta_slow": 1.0,
                    "mscale_all_dim": 1.0, "mscale": 1.0, "llama_4_scaling_beta": 0.1}


def ministral3_rope(d: dict[str, Any]) -> dict[str, Any]:
    """`d`, or with transformers' default Ministral 3 RoPE when it states none."""
    if d.get("rope_parameters") is not None or d.get("rope_scaling") is not None:
        return d
    return {**d, "rope_parameters": dict(_MINISTRAL3_ROPE)}


def _ministral3_query_scaling(d: dict[str, Any], error: Callable[[str], Exception]) -> tuple[float, int] | None:
    """(beta, original context) of Ministral 3's query factor (raycluster.model.query_scale),
    from its RoPE parameters; None without a beta (no factor)."""
    params = d.get("rope_parameters") or d.get("rope_scaling") or {}
    beta = params.get("llama_4_scaling_beta")
    if beta is None:
        return None
    if isinstance(beta, bool) or not isinstance(beta, (int, float)) or beta < 0:
        raise error(f"config field 'rope_parameters.llama_4_scaling_beta' must be a number >= 0, got {beta!r}")
    original = params.get("original_max_position_embeddings", d.get("max_position_embeddings"))
    if isinstance(original, bool) or not isinstance(original, int) or original < 1:
        raise error("config field 'rope_parameters.original_max_position_embeddings' must be a positive int "
                    f"(the context Ministral 3's query factor counts in), got {original!r}")
    return float(beta), original


def hunyuan_rope(d: dict[str, Any], head_dim: int) -> dict[str, Any]:
    """`d` with Hunyuan's "dynamic" RoPE of a fixed `alpha` as the plain RoPE it amounts to: the
    base stretched to theta * alpha^(head_dim / (head_dim - 2)), independent of the length."""
    params = d.get("rope_parameters") or d.get("rope_scaling")
    if not isinstance(params, dict) or params.get("rope_type", params.get("type")) != "dynamic" \
            or not params.get("alpha"):
        return d
    theta = float(params.get("rope_theta", d.get("rope_theta", 10000.0)))
    base = theta * float(params["alpha"]) ** (head_dim / (head_dim - 2))
    return {**d, "rope_parameters": {"rope_type": "default", "rope_theta": base}, "rope_scaling": None}

