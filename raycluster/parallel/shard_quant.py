"""Whether a quantized checkpoint's layers split over `tp` tensor-parallel ranks without cutting
through what its tensors hold together (raycluster.model.quant.formats): a scale group or FP8 block
along a row-split layer's input columns, a packed word or block along a column-split layer's output
rows. `check_tp_quant` raises a ValueError naming tp; raycluster.parallel.shard.check_tp calls it."""

from __future__ import annotations

from raycluster.model.config import ModelConfig
from raycluster.model.quant.config import QuantConfig


def check_tp_quant(cfg: ModelConfig, qc: QuantConfig, tp: int, expert_parallel: bool) -> None:
    """Refuse a quantized checkpoint whose scales, zero points or packed words a `tp`-way split
    would cut through: a row-split layer's input columns per rank must hold whole groups (or FP8
    blocks), a column-split one's output rows whole packed words and blocks."""
    if qc.act_order:
        raise ValueError("tp: an act-order checkpoint (quantization_config desc_act / actorder) maps input columns "
                         "to groups across the whole layer; it is served with tp 1")
    head_rows = cfg.num_attention_heads * cfg.head_dim // tp
    kv_rows = cfg.num_key_value_heads * cfg.head_dim // min(tp, cfg.num_key_value_heads)
    rows = {"q_proj": head_rows, "k_proj": kv_rows, "gate_proj": cfg.intermediate_size // tp}
    cols = {"o_proj": head_rows, "down_proj": cfg.intermediate_size // tp}
    if cfg.moe is not None and not expert_parallel:
        rows["experts' gate_proj"] = cfg.moe.intermediate_size // tp
        cols["experts' down_proj"] = cfg.moe.intermediate_size // tp
    col_unit = qc.group_size or 1
    row_unit = 8 if qc.layout in ("gptq", "awq") or (qc.layout == "ct-packed" and not qc.symmetric) else 1
    if qc.strategy == "block":
        row_unit, col_unit = qc.block
    for name, n in cols.items():
        if n % col_unit:
            raise ValueError(f"tp: {tp} ranks give each {n} input columns of {name}, not a multiple of the "
                             f"checkpoint's {col_unit}-column quantization groups (quantization_config); choose another tp")
    for name, n in rows.items():
        if n % row_unit:
            raise ValueError(f"tp: {tp} ranks give each {n} output rows of {name}, not a multiple of the "
                             f"{row_unit} rows its packed quantization tensors hold together; choose another tp")
