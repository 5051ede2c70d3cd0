"""What a tensor-parallel group of `tp` ranks can serve of a model, checked before any rank
starts: `check_tp` raises a ValueError naming the field or flag (raycluster.parallel.shard
holds the slicing rules these checks follow)."""

from __future__ import annotations

from raycluster.model.config import ModelConfig
from raycluster.parallel.shard_quant import check_tp_quant


def check_tp(cfg: ModelConfig, tp: int, expert_parallel: bool = False) -> None:
    """Refuse a model whose query heads or MLP do not split evenly over `tp` ranks, or whose KV
    heads neither split evenly over them nor replicate evenly (`kv_split`: tp must divide the
    KV heads, or be a multiple of them); with `expert_parallel`, whose experts do not share out
    evenly over them (else each expert's intermediate size must split)."""
    sizes = {"num_attention_heads": cfg.num_attention_heads, "intermediate_size": cfg.intermediate_size}
    if cfg.moe is not None:
        if expert_parallel:
            if cfg.moe.num_experts % tp:
                raise ValueError(f"enable_expert_parallel: {tp} ranks do not share the model's {cfg.moe.num_experts} "
                                 "experts evenly; choose a tp that divides the number of experts")
        else:
            sizes["moe_intermediate_size"] = cfg.moe.intermediate_size
        sizes["shared_expert_intermediate_size"] = cfg.moe.shared_intermediate_size
    for name, n in sizes.items():
        if n % tp:
            raise ValueError(f"tp: {tp} ranks do not divide the model's {name} ({n}); choose a tp that "
                             "divides the attention heads and the (experts') intermediate size")
    kv = cfg.num_key_value_heads
    if kv % tp and tp % kv:
        raise ValueError(f"tp: {tp} ranks neither divide the model's num_key_value_heads ({kv}) nor are a "
                         "multiple of them (to replicate each KV head on tp / num_key_value_heads ranks)")
    if cfg.quant is not None and tp > 1:
        check_tp_quant(cfg, cfg.quant, tp, expert_parallel)
