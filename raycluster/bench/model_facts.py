"""What `raycluster bench engine` needs to know of a model to turn times into MBU and MFU: its
shape, the matmul weights a token runs (a mixture-of-experts model's: its top k experts), the
weight bytes a decode step reads and the FLOPs of a prefill. `model_facts(model)` takes a loaded
model and returns a plain dict (it goes into the bench's JSON as is). A quantized checkpoint's
layers count their weights as the matmuls hold them (raycluster.model.quant: packed int4 / int8
plus scales, or dequantized)."""

from __future__ import annotations

import torch

from raycluster.model.quant.linear import QuantLinear


def _matmul_params(module: torch.nn.Module) -> int:
    """Weights of the linear layers under `module`, quantized or not, as parameters."""
    return sum(m.in_features * m.out_features for m in module.modules() if isinstance(m, (torch.nn.Linear, QuantLinear)))


def _bytes(module: torch.nn.Module) -> int:
    """Bytes `module`'s weights take: its parameters, and each quantized layer's matmul operands."""
    return (sum(p.numel() * p.element_size() for p in module.parameters())
            + sum(m.weight_bytes() for m in module.modules() if isinstance(m, QuantLinear)))


def model_facts(model) -> dict:
    c = model.config
    linear = _matmul_params(model.model.layers)
    head = model.model.embed_tokens.weight if model.lm_head is None else model.lm_head.weight
    elt = head.element_size()
    # Routed experts: a token runs top_k of num_experts (the router and shared experts always).
    sparse = [layer.ffn.experts for i, layer in enumerate(model.model.layers) if c.is_moe_layer(i)]
    experts = sum(_matmul_params(e) for e in sparse)
    moe = c.moe
    active_share = moe.top_k / moe.num_experts if moe else 1.0
    return {
        "architecture": c.architecture, "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size,
        "num_hidden_layers": c.num_hidden_layers, "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.num_key_value_heads, "head_dim": c.head_dim, "vocab_size": c.vocab_size,
        "tie_word_embeddings": model.lm_head is None,
        "total_params": sum(p.numel() for p in model.parameters())     # a quantized layer's weight is not a Parameter
        + sum(m.in_features * m.out_features for m in model.modules() if isinstance(m, QuantLinear)),
        "matmul_params_per_token": linear - experts + round(experts * active_share),   # the Linear weights a token runs
        "lm_head_params": head.numel(),
        "dtype_bytes": elt,
        # Weights a decode step must read: all layers, the final norm, the whole LM head.
        "decode_weight_bytes": _bytes(model.model.layers) + (model.model.norm.weight.numel() + head.numel()) * elt,
        "kv_bytes_per_token": 2 * c.num_hidden_layers * c.num_key_value_heads * c.head_dim * elt,
        "expert_weight_bytes": sum(_bytes(e) for e in sparse),       # within decode_weight_bytes
        "quantization": None if c.quant is None else f"{c.quant.method}/{c.quant.layout}/{c.quant.bits}-bit",
        "num_experts": moe.num_experts if moe else 0, "experts_per_token": moe.top_k if moe else 0,
    }


def decode_weight_bytes(facts: dict, batch: int) -> float:
    """Weights a decode step of `batch` tokens reads: every weight but the experts, and of those
    the share a batch is expected to touch when each token picks k of E experts uniformly,
    1 - (1 - k/E)^batch (all of them for a dense model)."""
    e, k = facts.get("num_experts", 0), facts.get("experts_per_token", 0)
    touched = 1.0 - (1.0 - k / e) ** batch if e else 1.0
    experts = facts.get("expert_weight_bytes", 0)
    return facts["decode_weight_bytes"] - experts + experts * touched


def prefill_flops(facts: dict, tokens: int) -> dict:
    linear = 2 * facts["matmul_params_per_token"] * tokens + 2 * facts["hidden_size"] * facts["vocab_size"]
    attn = facts["num_hidden_layers"] * 4 * facts["num_attention_heads"] * facts["head_dim"] * tokens * (tokens + 1) // 2
    return {"linear": linear, "attention": attn, "total": linear + attn}
