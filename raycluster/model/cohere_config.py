"""What Cohere's Command models (`CohereForCausalLM`: Command R / R+, Aya; `Cohere2ForCausalLM`:
Command R7B, Command A) do differently from Llama, read from config.json into `ModelConfig`'s
shared fields (the decoder, raycluster.model.llama, follows them).

As transformers' modeling code: LayerNorm without bias (mean-centred, fp32) instead of RMSNorm;
one norm per layer feeding attention and the MLP side by side, both added to the residual
(`block_norms` "parallel"); RoPE rotating interleaved pairs (dims 2i, 2i + 1) rather than halves;
the logits multiplied by `logit_scale`; Command R+'s `use_qk_norm`: a LayerNorm over each query
and key head, its weight one row per head. Cohere 2 alternates sliding-window layers (three of
every four, `layer_types` or `sliding_window_pattern`) with full-attention layers that use no
position embedding at all (`nope_layers`).

Data enters as config.json's dict and leaves as keyword arguments for `ModelConfig`; errors name
the field.
"""

from __future__ import annotations

from typing import Any, Callable

COHERE_ARCHITECTURES = ("CohereForCausalLM", "Cohere2ForCausalLM")


def cohere_fields(arch: str, d: dict[str, Any], layers: int, error: Callable[[str], Exception]) -> dict[str, Any]:
    scale = d.get("logit_scale", 0.0625)
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or scale <= 0:
        raise error(f"config field 'logit_scale' must be a positive number, got {scale!r}")
    eps = d.get("layer_norm_eps", 1e-5)
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or eps <= 0:
        raise error(f"config field 'layer_norm_eps' must be a positive number, got {eps!r}")
    fields: dict[str, Any] = {"layer_norm": True, "block_norms": "parallel", "rope_interleaved": True,
                              "logit_scale": float(scale), "rms_norm_eps": float(eps),
                              "qk_norm_per_head_weights": bool(d.get("use_qk_norm", False)),
                              "qk_norm": bool(d.get("use_qk_norm", False))}
    if arch == "Cohere2ForCausalLM":
        window = d.get("sliding_window")
        if not isinstance(window, int) or window < 1:
            raise error(f"config field 'sliding_window' must be a positive int, got {window!r}")
        sliding = _sliding(d, layers, error)
        fields.update(sliding_window=window if sliding else None, sliding_layers=sliding,
                      nope_layers=tuple(i for i in range(layers) if i not in sliding))
    return fields


def _sliding(d: dict[str, Any], layers: int, error) -> tuple[int, ...]:
    layer_types = d.get("layer_types")
    if layer_types is not None:
        if not isinstance(layer_types, list) or len(layer_types) != layers:
            raise error(f"config field 'layer_types' must list one type per layer ({layers})")
        return tuple(i for i, t in enumerate(layer_types) if t == "sliding_attention")
    pattern = d.get("sliding_window_pattern", 4)
    if not isinstance(pattern, int) or pattern < 1:
        raise error(f"config field 'sliding_window_pattern' must be a positive int, got {pattern!r}")
    return tuple(i for i in range(layers) if (i + 1) % pattern)
