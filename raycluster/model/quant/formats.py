"""How each quantized checkpoint layout stores one linear layer's weight, and how it unpacks.

`checkpoint_tensors(qc, out_features, in_features)` names the tensors a layer of `out` x `in`
stores under its prefix (beside an optional `bias`), each with its shape, its integer dtype (None:
a float tensor, held in the model's dtype) and which of its dims run over output rows and input
columns: what a tensor-parallel rank cuts (raycluster.parallel.shard). `unpack(qc, tensors,
out, in)` turns them into one canonical form, `IntWeights` (integer layouts) or a dense float
weight (FP8), which raycluster.model.quant.linear turns into a kernel's operands.

The layouts (N output rows, K input columns, G = K / group_size groups, or 1 per channel):

- `ct-packed` (compressed-tensors pack-quantized): `weight_packed` int32 [N, K b / 32], value j
  of a word at bits [b j, b j + b), stored offset by 2^(b-1); `weight_scale` [N, G];
  asymmetric: `weight_zero_point` int32 [N b / 32, G], packed the same way along rows;
  `weight_shape` int64 [2]; act order: `weight_g_idx` int32 [K].
- `ct-int8` (int-quantized): `weight` int8 [N, K], `weight_scale` [N, G], asymmetric:
  `weight_zero_point` int8 [N, G].
- `ct-fp8` (float-quantized): `weight` FP8 [N, K], `weight_scale` [1] (tensor), [N, 1] (channel)
  or [N / bn, K / bk] (block).
- `gptq`: `qweight` int32 [K b / 32, N] (packed along K), `qzeros` int32 [G, N b / 32] (stored
  minus one in the v1 format), `scales` [G, N], `g_idx` int32 [K].
- `awq` (GEMM): `qweight` int32 [K, N / 8] and `qzeros` int32 [G, N / 8], each word's eight
  nibbles holding columns in AWQ's order 0 2 4 6 1 3 5 7; `scales` [G, N].
- `fp8`: `weight` FP8 [N, K] with `weight_scale_inv` [N / bn, K / bk] (block; multiplied in despite
  its name) or `weight_scale` [1] (per tensor).

Every integer layout dequantizes as w = (q - z) * s with q and z unsigned b-bit values.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from raycluster.model.quant.config import QuantConfig

# AWQ packs the columns c*8 + i of a word in this nibble order; reading nibble j gives column ORDER[j].
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


@dataclass(frozen=True)
class TensorSpec:
    """One checkpoint tensor of a quantized layer: shape, integer dtype (None: float, held in the
    model's dtype), and the dims running over output rows (`n_dim`) and input columns (`k_dim`)."""
    shape: tuple[int, ...]
    dtype: torch.dtype | None
    n_dim: int | None
    k_dim: int | None


@dataclass
class IntWeights:
    """An integer weight unpacked: q [N, K] unsigned b-bit values (int32), scale and zero [N, G]
    (float32; zero in q's units), `group` columns per scale (K for one per row), and `g_idx` [K]
    (each column's group; None when groups are contiguous runs of `group` columns)."""
    q: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor
    group: int
    bits: int
    g_idx: torch.Tensor | None = None

    def dense(self) -> torch.Tensor:
        """The float32 weight [N, K] these values stand for: (q - z) * s, column by column."""
        cols = self.column_groups()
        return (self.q.float() - self.zero[:, cols]) * self.scale[:, cols]

    def column_groups(self) -> torch.Tensor:
        """Each input column's group index [K]."""
        if self.g_idx is not None:
            return self.g_idx.long()
        return torch.arange(self.q.shape[1]) // self.group


def tensor_dims(qc: QuantConfig, name: str) -> tuple[int | None, int | None]:
    """(dim over output rows, dim over input columns) of a quantized layer's tensor `name`
    (None: the tensor has no such dim and is whole on every tensor-parallel rank)."""
    bn, bk = qc.block or (1, 1)
    # Sizes every packing, group and block of the layout divides: the dims do not depend on them.
    spec = checkpoint_tensors(qc, 256 * bn, 256 * bk * (qc.group_size or 1)).get(name)
    if spec is None:
        raise ValueError(f"{name!r} is not a tensor of a {qc.layout} layer")
    return spec.n_dim, spec.k_dim


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


def _groups(qc: QuantConfig, k: int) -> int:
    if qc.group_size is None:
        return 1
    if k % qc.group_size:
        raise ValueError(f"quantization_config.group_size: {qc.group_size} does not divide a layer's {k} input columns")
    return k // qc.group_size


def checkpoint_tensors(qc: QuantConfig, n: int, k: int) -> dict[str, TensorSpec]:
    """The tensors a quantized linear layer of `n` outputs and `k` inputs stores (bias aside)."""
    g = _groups(qc, k)
    group_dim = 1 if qc.group_size else None     # a per-row scale has no column dim to split
    out: dict[str, TensorSpec]
    if qc.layout == "ct-packed":
        words = _ceil(k * qc.bits, 32)
        out = {"weight_packed": TensorSpec((n, words), torch.int32, 0, 1),
               "weight_scale": TensorSpec((n, g), None, 0, group_dim),
               "weight_shape": TensorSpec((2,), torch.int64, None, None)}
        if not qc.symmetric:
            out["weight_zero_point"] = TensorSpec((_ceil(n * qc.bits, 32), g), torch.int32, 0, group_dim)
        if qc.act_order:
            out["weight_g_idx"] = TensorSpec((k,), torch.int32, None, 0)
    elif qc.layout == "ct-int8":
        out = {"weight": TensorSpec((n, k), torch.int8, 0, 1), "weight_scale": TensorSpec((n, g), None, 0, group_dim)}
        if not qc.symmetric:
            out["weight_zero_point"] = TensorSpec((n, g), torch.int8, 0, group_dim)
        if qc.act_order:
            out["weight_g_idx"] = TensorSpec((k,), torch.int32, None, 0)
    elif qc.layout == "gptq":
        per = 32 // qc.bits
        kdim = 0 if qc.group_size else None
        out = {"qweight": TensorSpec((k // per, n), torch.int32, 1, 0),
               "qzeros": TensorSpec((g, _ceil(n, per)), torch.int32, 1, kdim),
               "scales": TensorSpec((g, n), None, 1, kdim),
               "g_idx": TensorSpec((k,), torch.int32, None, 0)}
    elif qc.layout == "awq":
        out = {"qweight": TensorSpec((k, n // 8), torch.int32, 1, 0),
               "qzeros": TensorSpec((g, n // 8), torch.int32, 1, 0),
               "scales": TensorSpec((g, n), None, 1, 0)}
    elif qc.layout in ("ct-fp8", "fp8"):
        out = {"weight": TensorSpec((n, k), None, 0, 1)}
        name = "weight_scale_inv" if qc.layout == "fp8" and qc.block else "weight_scale"
        if qc.strategy == "block":
            bn, bk = qc.block
            out[name] = TensorSpec((_ceil(n, bn), _ceil(k, bk)), None, 0, 1)
        elif qc.strategy == "channel":
            out[name] = TensorSpec((n, 1), None, 0, None)
        else:
            out[name] = TensorSpec((1,), None, None, None)
    else:       # pragma: no cover - parse_quant_config makes only the layouts above
        raise ValueError(f"unknown quantized layout {qc.layout!r}")
    if qc.input_scale:
        out["input_scale"] = TensorSpec((1,), None, None, None)
    return out


def unpack_words(words: torch.Tensor, bits: int, count: int) -> torch.Tensor:
    """The `count` b-bit values packed along the last dim of int32 `words` (value j of a word at
    bits [b j, b j + b)), as int32 in [0, 2^b)."""
    per = 32 // bits
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    vals = (words.to(torch.int32).unsqueeze(-1) >> shifts) & ((1 << bits) - 1)
    return vals.reshape(*words.shape[:-1], words.shape[-1] * per)[..., :count]


def _group_of(g_idx: torch.Tensor | None, qc: QuantConfig, k: int) -> tuple[int, torch.Tensor | None]:
    """(group size, g_idx when it is not plain contiguous runs)."""
    group = qc.group_size or k
    if g_idx is None:
        return group, None
    g_idx = g_idx.to(torch.int64)
    if torch.equal(g_idx - g_idx[0], torch.arange(k) // group) and (not qc.act_order or g_idx[0] == 0):
        return group, None          # runs in order (a TP rank's slice of them starts further on)
    if not qc.act_order:
        raise ValueError("g_idx reorders the input columns but the config does not say act order (desc_act)")
    return group, g_idx


def unpack(qc: QuantConfig, t: dict[str, torch.Tensor], n: int, k: int) -> IntWeights | torch.Tensor:
    """A layer's checkpoint tensors (`checkpoint_tensors`' names) as IntWeights, or for FP8
    layouts as the dense float32 weight [N, K]."""
    b = qc.bits
    if qc.layout == "ct-packed":
        q = unpack_words(t["weight_packed"], b, k)
        if qc.symmetric:
            zero = torch.full_like(t["weight_scale"], float(1 << (b - 1)), dtype=torch.float32)
        else:
            zero = unpack_words(t["weight_zero_point"].t().contiguous(), b, n).t().float()
        group, g_idx = _group_of(t.get("weight_g_idx"), qc, k)
        return IntWeights(q, t["weight_scale"].float(), zero, group, b, g_idx)
    if qc.layout == "ct-int8":
        q = t["weight"].to(torch.int32) + 128
        zero = (torch.full_like(t["weight_scale"], 128.0, dtype=torch.float32) if qc.symmetric
                else t["weight_zero_point"].float() + 128)
        group, g_idx = _group_of(t.get("weight_g_idx"), qc, k)
        return IntWeights(q, t["weight_scale"].float(), zero, group, b, g_idx)
    if qc.layout == "gptq":
        q = unpack_words(t["qweight"].t().contiguous(), b, k)
        zero = (unpack_words(t["qzeros"], b, n) + qc.gptq_zero_offset) & ((1 << b) - 1)
        group, g_idx = _group_of(t["g_idx"], qc, k)
        return IntWeights(q, t["scales"].float().t().contiguous(), zero.t().float().contiguous(), group, b, g_idx)
    if qc.layout == "awq":
        order = torch.tensor(AWQ_ORDER).argsort()     # column i of a word is nibble order.argsort()[i]
        cols = (torch.arange(n).view(-1, 8) // 8 * 8 + order).view(-1)
        q = unpack_words(t["qweight"], 4, n)[:, cols].t().contiguous()
        zero = unpack_words(t["qzeros"], 4, n)[:, cols].t().float().contiguous()
        return IntWeights(q, t["scales"].float().t().contiguous(), zero, qc.group_size, 4)
    # FP8: the values are exact in any float dtype the model holds them in.
    w = t["weight"].float()
    scale = t.get("weight_scale_inv", t.get("weight_scale")).float()
    if qc.strategy == "block":
        bn, bk = qc.block
        scale = scale.repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
    return w * scale
