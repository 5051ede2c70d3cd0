"""Llama 4's text model (`Llama4ForCausalLM`; Scout and Maverick's `Llama4ForConditionalGeneration`
serve it through raycluster.model.multimodal_config) as its config.json describes it, read as
transformers reads it:

- RoPE on interleaved pairs (llama3 scaling), on the layers `no_rope_layers` marks 1; the others
  (every `no_rope_layer_interval`-th by default) use none, and there transformers' temperature
  tuning scales each query by log1p(floor((position + 1) / `floor_scale`)) * `attn_scale` + 1;
- `use_qk_norm`: a weightless RMS norm of every query and key head on the RoPE layers;
- `moe_layers` (default: every `interleave_moe_layer_step`-th) route each token to its top
  `num_experts_per_tok` of `num_local_experts` stacked experts of `intermediate_size`, plus a
  shared expert as wide (raycluster.model.llama4); the other layers' MLP is `intermediate_size_mlp`;
- the RoPE layers attend within chunks of `attention_chunk_size` tokens (the attention backend's
  `chunk`: a query sees only its own chunk's keys).

`llama4_fields(d, layers, error)` returns ModelConfig keyword arguments (a `Llama4Spec` and the
MoE config among them); errors name the field.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from raycluster.model.moe_config import MoEConfig

ARCHITECTURE = "Llama4ForCausalLM"


@dataclass(frozen=True)
class Llama4Spec:
    l2_qk_norm: bool                    # a weightless RMS norm of q / k heads on the RoPE layers
    temperature: tuple[float, float] | None     # (floor_scale, attn_scale) on the NoPE layers; None: off
    attention_chunk_size: int | None    # the RoPE layers' attention chunk (None: they attend causally)


def _int(d: dict[str, Any], name: str, default: int | None, error, minimum: int = 1) -> int:
    v = d.get(name, default)
    if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
        raise error(f"config field {name!r} must be an int >= {minimum}, got {v!r}")
    return v


def llama4_fields(d: dict[str, Any], layers: int, error: Callable[[str], Exception]) -> dict[str, Any]:

    flags = d.get("no_rope_layers")
    if not flags:       # transformers' default: no RoPE on every `no_rope_layer_interval`-th layer
        interval = _int(d, "no_rope_layer_interval", 4, error)
        flags = [int((i + 1) % interval != 0) for i in range(layers)]
    if not isinstance(flags, list) or len(flags) != layers or any(f not in (0, 1) for f in flags):
        raise error(f"config field 'no_rope_layers' must list a 0 or 1 per layer ({layers})")
    step = _int(d, "interleave_moe_layer_step", 1, error)
    moe_layers = d.get("moe_layers")
    if moe_layers is None:
        moe_layers = list(range(step - 1, layers, step))
    if not isinstance(moe_layers, list) or any(not isinstance(i, int) or not 0 <= i < layers for i in moe_layers):
        raise error(f"config field 'moe_layers' must list layer indices below {layers}, got {moe_layers!r}")
    experts, top_k = _int(d, "num_local_experts", 16, error), _int(d, "num_experts_per_tok", 1, error)
    if top_k > experts:
        raise error(f"config field 'num_experts_per_tok' = {top_k} exceeds the {experts} experts")
    inter = _int(d, "intermediate_size", 8192, error)
    chunk = d.get("attention_chunk_size", 8192)
    if chunk is not None:
        chunk = _int(d, "attention_chunk_size", 8192, error)
    temperature = None
    if d.get("attn_temperature_tuning", True):
        scale = d.get("attn_scale", 0.1)
        if isinstance(scale, bool) or not isinstance(scale, (int, float)):
            raise error(f"config field 'attn_scale' must be a number, got {scale!r}")
        temperature = (float(_int(d, "floor_scale", 8192, error)), float(scale))
    nope = tuple(i for i, use in enumerate(flags) if not use)
    return {"llama4": Llama4Spec(bool(d.get("use_qk_norm", True)), temperature, chunk if len(nope) < layers else None),
            "nope_layers": nope, "rope_interleaved": True, "qkv_bias": bool(d.get("attention_bias", False)),
            "o_bias": bool(d.get("attention_bias", False)), "mlp_bias": False,
            "intermediate_size": _int(d, "intermediate_size_mlp", 16384, error),
            "moe": MoEConfig(experts, top_k, inter, False, tuple(sorted(moe_layers)), shared_intermediate_size=inter,
                             llama4=True, stacked="halves")}
