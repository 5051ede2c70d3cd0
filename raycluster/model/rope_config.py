"""The RoPE of a config.json, read as transformers reads it: the base (`rope_theta`), the scaling
(default, linear, llama3, YaRN, Phi-3's LongRoPE), the share of each head it turns
(`partial_rotary_factor`), and the context a scaled RoPE serves.

Accepts transformers-5 files (`rope_parameters`) and older ones (top-level `rope_theta` /
`rope_scaling` with `rope_type` or `type`, a top-level `partial_rotary_factor`). `parse_rope(d)`
returns (theta, scaling dict or None, partial_rotary_factor); errors name the field
(`RopeConfigError`, which the model config re-raises as its own).

LongRoPE carries two factor lists, one for sequences within the pretraining context
(`original_max_position_embeddings`) and one beyond it. transformers switches between them by the
length of the sequence in each forward pass, which a paged KV cache cannot follow (keys cached
under one set would be read under the other). As vLLM does (choosing by its max_model_len), the
set is fixed per model here: the long one when the served context exceeds the pretraining one
(`longrope_for_context`), recorded in the scaling dict as `ext_factors`, with the attention factor
sqrt(1 + ln(factor) / ln(original)) as transformers computes it.
"""

from __future__ import annotations

import math
from typing import Any

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope")


class RopeConfigError(ValueError):
    pass


def parse_rope(d: dict[str, Any]) -> tuple[float, dict[str, Any] | None, float]:
    params = d.get("rope_parameters")
    if params is None:
        params = dict(d.get("rope_scaling") or {})
        if "rope_theta" in d:
            params.setdefault("rope_theta", d["rope_theta"])
    else:
        params = dict(params)
    theta = float(params.get("rope_theta", d.get("rope_theta", 10000.0)))
    partial = float(params.get("partial_rotary_factor", d.get("partial_rotary_factor", 1.0)))
    if not 0.0 < partial <= 1.0:
        raise RopeConfigError(f"config field 'partial_rotary_factor' = {partial} must be in (0, 1]")
    rtype = params.get("rope_type", params.get("type")) or "default"
    if rtype == "su":           # LongRoPE's first name, in the first Phi-3 configs
        rtype = "longrope"
    if rtype not in SUPPORTED_ROPE_TYPES:
        raise RopeConfigError(
            f"config field 'rope_scaling.rope_type' = {rtype!r} is not supported "
            f"(supported: {', '.join(SUPPORTED_ROPE_TYPES)}; 'dynamic' depends on the batch's "
            "longest sequence and cannot be served per request)")
    if rtype == "default":
        return theta, None, partial
    scaling = {k: v for k, v in params.items() if k not in ("type", "rope_theta", "partial_rotary_factor")}
    scaling["rope_type"] = rtype
    if rtype == "longrope":
        return theta, _longrope(scaling, d), partial
    if "factor" not in scaling:
        raise RopeConfigError(f"config field 'rope_scaling.factor' is required for rope_type {rtype!r}")
    if rtype == "llama3":
        for k in ("low_freq_factor", "high_freq_factor"):
            if k not in scaling:
                raise RopeConfigError(f"config field 'rope_scaling.{k}' is required for rope_type 'llama3'")
        scaling.setdefault("original_max_position_embeddings", d.get("max_position_embeddings"))
    if rtype == "yarn":
        scaling.setdefault("original_max_position_embeddings", d.get("max_position_embeddings"))
    return theta, scaling, partial


def _longrope(scaling: dict[str, Any], d: dict[str, Any]) -> dict[str, Any]:
    for k in ("short_factor", "long_factor"):
        v = scaling.get(k)
        if not isinstance(v, list) or not v or not all(isinstance(x, (int, float)) and x > 0 for x in v):
            raise RopeConfigError(f"config field 'rope_scaling.{k}' must be a list of positive numbers")
    if len(scaling["short_factor"]) != len(scaling["long_factor"]):
        raise RopeConfigError("config fields 'rope_scaling.short_factor' and 'long_factor' differ in length")
    orig = scaling.get("original_max_position_embeddings", d.get("original_max_position_embeddings"))
    if not isinstance(orig, int) or orig < 2:
        raise RopeConfigError("config field 'original_max_position_embeddings' is required for LongRoPE (an int >= 2)")
    scaling["original_max_position_embeddings"] = orig
    if scaling.get("factor") is None:     # transformers: the ratio of the two contexts
        scaling["factor"] = float(d.get("max_position_embeddings", orig)) / orig
    if scaling.get("attention_factor") is None:
        f = float(scaling["factor"])
        scaling["attention_factor"] = 1.0 if f <= 1.0 else math.sqrt(1 + math.log(f) / math.log(orig))
    return scaling


def longrope_for_context(scaling: dict[str, Any] | None, context: int) -> dict[str, Any] | None:
    """`scaling` with LongRoPE's factor set fixed for a served context of `context` tokens."""
    if not scaling or scaling["rope_type"] != "longrope":
        return scaling
    long = context > scaling["original_max_position_embeddings"]
    return {**scaling, "ext_factors": list(scaling["long_factor" if long else "short_factor"])}


def scaled_context(max_pos: int, scaling: dict[str, Any] | None) -> int:
    """The context a scaled rope serves, as vLLM derives it: linear scaling stretches
    max_position_embeddings by `factor`, YaRN the original context; llama3's and LongRoPE's
    configs state the long context in max_position_embeddings already."""
    if not scaling or scaling["rope_type"] in ("llama3", "longrope"):
        return max_pos
    factor = float(scaling["factor"])
    if scaling["rope_type"] == "yarn":
        return int(float(scaling["original_max_position_embeddings"]) * factor)
    return int(max_pos * factor)


def layer_type_ropes(d: dict[str, Any], legacy_local_theta: float) -> tuple[dict[str, Any], dict[str, Any]]:
    """(full layers', sliding layers') RoPE of a model whose sliding layers turn by their own plain
    RoPE (Gemma 3, OLMo 3), each as a one-RoPE config dict for `parse_rope`: transformers 5 nests
    them by layer type in `rope_parameters`; older files give the full layers' at the top level
    (scaling included) and the sliding layers take the default RoPE at `legacy_local_theta`."""
    params = d.get("rope_parameters")
    if isinstance(params, dict) and "full_attention" in params:
        local = params.get("sliding_attention") or {"rope_type": "default", "rope_theta": legacy_local_theta}
        return {**d, "rope_parameters": params["full_attention"]}, {**d, "rope_parameters": local}
    local = {"rope_type": "default", "rope_theta": float(legacy_local_theta)}
    return d, {**d, "rope_parameters": local, "rope_scaling": None}

