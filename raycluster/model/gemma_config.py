"""What the Gemma family (Gemma, Gemma 2, Gemma 3's text model) does differently from Llama, read
from config.json into a `GemmaSpec` the decoder (raycluster.model.llama) consults.

Gemma's layers are Llama's with these changes, as transformers' modeling code has them: RMSNorm
scales by (1 + weight) in fp32; the embeddings are multiplied by sqrt(hidden_size) (rounded to the
weights' dtype); the MLP gates with tanh-approximated GELU; attention scales scores by
query_pre_attn_scalar ** -0.5. Gemma 2 and 3 add a norm after attention and around the MLP
("sandwich" norms: post_attention_layernorm, pre_ / post_feedforward_layernorm) and alternate
sliding-window and full layers (`layer_types`, else Gemma 2's even layers, Gemma 3's five of
every six). Gemma 2 caps attention scores and final logits with cap * tanh(x / cap); Gemma 3
norms each query and key head (as Qwen3) and gives its sliding layers their own RoPE base
(`rope_local_base_freq`, or transformers 5's per-layer-type `rope_parameters`: ModelConfig's
`sliding_rope_theta`, read by raycluster.model.rope_config.layer_type_ropes).

Data enters as config.json's dict and leaves as keyword arguments for `ModelConfig`; errors name
the field. Gemma 3's multimodal checkpoints (Gemma3ForConditionalGeneration, weights under
`language_model.`) and bidirectional embedding variants are not read.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

# Architecture -> Gemma generation.
GEMMA_ARCHITECTURES = {"GemmaForCausalLM": 1, "Gemma2ForCausalLM": 2, "Gemma3ForCausalLM": 3}
GEMMA_ACTIVATIONS = ("gelu_pytorch_tanh", "gelu_new", "gelu")


@dataclass(frozen=True)
class GemmaSpec:
    version: int                       # 1, 2 or 3
    query_pre_attn_scalar: float       # attention scale = query_pre_attn_scalar ** -0.5
    attn_softcap: float | None = None  # Gemma 2: scores -> cap * tanh(scores / cap) before softmax
    final_softcap: float | None = None  # Gemma 2: the same on the output logits

    @property
    def attention_scale(self) -> float:
        return self.query_pre_attn_scalar ** -0.5


def gemma_fields(arch: str, d: dict[str, Any], layers: int, head_dim: int,
                 error: Callable[[str], Exception]) -> dict[str, Any]:
    """The Gemma-specific `ModelConfig` fields of config.json `d`: `gemma` (a GemmaSpec),
    `sliding_window` / `sliding_layers`, `qk_norm`, `block_norms`. `error(msg)` makes the exception to raise."""
    version = GEMMA_ARCHITECTURES[arch]
    act = d.get("hidden_activation") or d.get("hidden_act") or "gelu_pytorch_tanh"
    # Gemma's released configs said "gelu" while meaning the tanh form (vLLM reads it so too).
    if act not in GEMMA_ACTIVATIONS:
        raise error(f"config field 'hidden_activation' = {act!r} is not supported for {arch} "
                    f"(supported: {', '.join(GEMMA_ACTIVATIONS)})")
    if d.get("use_bidirectional_attention"):
        raise error("config field 'use_bidirectional_attention' = true (an embedding variant of Gemma) is not supported")
    scalar = _positive(d, "query_pre_attn_scalar", head_dim, error)
    spec = GemmaSpec(version, scalar)
    window, sliding = None, ()
    if version >= 2:
        spec = GemmaSpec(version, scalar, _cap(d, "attn_logit_softcapping", error),
                         _cap(d, "final_logit_softcapping", error))
        window = int(_positive(d, "sliding_window", 4096, error))
        sliding = _sliding(version, d, layers, error)
    return {"gemma": spec, "sliding_window": window if sliding else None, "sliding_layers": sliding,
            "qk_norm": version == 3, "block_norms": "sandwich" if version >= 2 else "pre"}


def _positive(d: dict[str, Any], name: str, default: float, error) -> float:
    v = d.get(name)
    if v is None:
        return default
    try:
        v = float(v)
    except (TypeError, ValueError):
        raise error(f"config field {name!r} has invalid value {d[name]!r}") from None
    if v <= 0:
        raise error(f"config field {name!r} = {v} must be positive")
    return v


def _cap(d: dict[str, Any], name: str, error) -> float | None:
    return None if d.get(name) is None else _positive(d, name, 0.0, error)


def _sliding(version: int, d: dict[str, Any], layers: int, error) -> tuple[int, ...]:
    layer_types = d.get("layer_types")
    if layer_types is not None:
        if not isinstance(layer_types, list) or len(layer_types) != layers:
            raise error(f"config field 'layer_types' must list one type per layer ({layers})")
        return tuple(i for i, t in enumerate(layer_types) if t == "sliding_attention")
    if version == 2:
        return tuple(i for i in range(layers) if i % 2 == 0)
    pattern = d.get("sliding_window_pattern", d.get("_sliding_window_pattern", 6))
    if not isinstance(pattern, int) or pattern < 1:
        raise error(f"config field 'sliding_window_pattern' must be a positive int, got {pattern!r}")
    return tuple(i for i in range(layers) if (i + 1) % pattern)
