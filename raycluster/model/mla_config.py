"""DeepSeek's multi-head latent attention as config.json describes it (`MLASpec`, `mla_fields`:
ModelConfig keyword arguments, errors naming the field) and its softmax scale; the attention
itself is raycluster.model.mla."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable


@dataclass(frozen=True)
class MLASpec:
    q_lora_rank: int | None        # None: one q_proj (DeepSeek-V2-Lite), else q_a -> norm -> q_b
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int

    @property
    def latent_width(self) -> int:
        """A cache row's width: the latent and the rotary key."""
        return self.kv_lora_rank + self.qk_rope_head_dim


def mla_fields(d: dict[str, Any], error: Callable[[str], Exception]) -> dict[str, Any]:
    """ModelConfig fields of a DeepSeek-V2 / V3 config.json: `mla`, the cache's one latent KV
    head (`num_key_value_heads` 1, `head_dim` the latent width) and the interleaved RoPE."""
    def size(name: str, default: int | None = None) -> int:
        v = d.get(name, default)
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise error(f"config field {name!r} must be a positive int, got {v!r}")
        return v

    # An explicit null: one q_proj (DeepSeek-V2-Lite); absent: transformers' default rank.
    q_rank = d.get("q_lora_rank", 1536)
    spec = MLASpec(None if q_rank is None else size("q_lora_rank", 1536), size("kv_lora_rank"),
                   size("qk_nope_head_dim"), size("qk_rope_head_dim"), size("v_head_dim"))
    if spec.qk_rope_head_dim % 2:
        raise error(f"config field 'qk_rope_head_dim' must be even, got {spec.qk_rope_head_dim}")
    return {"mla": spec, "num_key_value_heads": 1, "head_dim": spec.latent_width,
            "rope_interleaved": bool(d.get("rope_interleave", True))}


def softmax_scale(spec: MLASpec, scaling: dict | None) -> float:
    """qk_head_dim ** -0.5, times YaRN's mscale squared (by `mscale_all_dim`), as transformers."""
    scale = (spec.qk_nope_head_dim + spec.qk_rope_head_dim) ** -0.5
    if scaling and scaling.get("mscale_all_dim") and float(scaling["factor"]) > 1:
        m = 0.1 * float(scaling["mscale_all_dim"]) * math.log(float(scaling["factor"])) + 1.0
        scale *= m * m
    return scale
