"""`QuantLinear`: a linear layer whose weight a quantized checkpoint stores, and the kernels it runs.

A QuantLinear is built (on the meta device, like the rest of the model) with one parameter per
checkpoint tensor of its layout (raycluster.model.quant.formats), under the checkpoint's names,
so the strict loader fills it as it fills any layer. `finalize(kernels)` then unpacks those
tensors once and keeps only what its matmul needs, dropping the checkpoint's:

- `Int4Matmul`: 4-bit weights packed for torch's weight-only int4 kernel (CPU:
  `_weight_int4pack_mm_for_cpu`; CUDA: tinygemm's `_weight_int4pack_mm`, never run here), with
  per-group scales and zeros; act-order columns are sorted into contiguous groups once and each
  input permuted to match.
- `Int8Matmul`: symmetric 8-bit weights with one scale per output row (`_weight_int8pack_mm`).
- `DenseMatmul`: the weight dequantized into the compute dtype at load: FP8 checkpoints, layouts
  the kernels do not take (8-bit groups, group sizes below 32, rows not a multiple of 16), and
  `kernels="dense"`. It costs a dense model's memory and runs at its speed.

`kernels`: "quantized" uses a quantized kernel wherever one applies, "dense" never, "auto" only
for bf16 / fp16 activations: on CPU the int kernels with fp32 activations are slower than a
dense fp32 matmul (4-bit: 30 ms vs 4 ms for a 4096 x 4096 weight and one row), with bf16 ones
3x faster for one row. Inputs enter as [T, in_features] and leave as [T, out_features].
`RowParallelQuantLinear` is the tensor-parallel row-split form: `partial(x)` is this rank's
share, `reduce` sums it over the group (raycluster.parallel.shard's RowParallelLinear for
quantized weights).
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Literal

import torch
import torch.nn.functional as F
from torch import nn

from raycluster.model.quant.config import QuantConfig
from raycluster.model.quant.formats import IntWeights, checkpoint_tensors, unpack

Kernels = Literal["auto", "quantized", "dense"]
# Group sizes the int4 kernels take; a per-row scale (or a larger group) is repeated over groups of
# the largest of these dividing it, which changes no value.
INT4_GROUPS = (256, 128, 64, 32)


class DenseMatmul(nn.Module):
    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.register_buffer("weight", weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)

    def weight_bytes(self) -> int:
        return self.weight.numel() * self.weight.element_size()


class Int4Matmul(nn.Module):
    """y = x W^T with W = (q - 8) s + z per group of `group` input columns: torch's int4
    weight-only kernels' form (z = (8 - zero) s for an unsigned zero point)."""

    def __init__(self, w: IntWeights, group: int, perm: torch.Tensor | None, dtype: torch.dtype) -> None:
        super().__init__()
        n, k = w.q.shape
        reps = w.group // group
        scale = w.scale.repeat_interleave(reps, 1)
        zero = w.zero.repeat_interleave(reps, 1)
        shift = (8.0 - zero) * scale
        self.group = group
        self.cuda_layout = w.q.is_cuda
        q = w.q if perm is None else w.q[:, perm]
        if self.cuda_layout:      # pragma: no cover - no GPU here
            packed = torch._convert_weight_to_int4pack((q[:, ::2] << 4 | q[:, 1::2]).to(torch.uint8), 8)
        else:
            packed = torch._convert_weight_to_int4pack_for_cpu(q.to(torch.int32).contiguous(), 1)
        self.register_buffer("packed", packed)
        self.register_buffer("scale_and_zeros", torch.stack([scale.t(), shift.t()], -1).to(dtype).contiguous())
        self.register_buffer("perm", perm)
        self.shape = (n, k)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.perm is not None:
            x = x.index_select(-1, self.perm)
        x = x.contiguous()
        if self.cuda_layout:      # pragma: no cover - no GPU here
            return torch._weight_int4pack_mm(x, self.packed, self.group, self.scale_and_zeros)
        return torch._weight_int4pack_mm_for_cpu(x, self.packed, self.group, self.scale_and_zeros)

    def weight_bytes(self) -> int:
        return self.packed.numel() * self.packed.element_size() + self.scale_and_zeros.numel() * self.scale_and_zeros.element_size()


class Int8Matmul(nn.Module):
    """y = (x W8^T) * s per output row: symmetric int8 weights, one scale per row."""

    def __init__(self, w: IntWeights, dtype: torch.dtype) -> None:
        super().__init__()
        self.register_buffer("q8", (w.q - 128).to(torch.int8).contiguous())
        self.register_buffer("scales", w.scale[:, 0].to(dtype).contiguous())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch._weight_int8pack_mm(x.contiguous(), self.q8, self.scales)

    def weight_bytes(self) -> int:
        return self.q8.numel() + self.scales.numel() * self.scales.element_size()


def _int4_group(w: IntWeights, n: int, k: int) -> int | None:
    """The group size an int4 kernel can run this weight with, or None."""
    if w.bits != 4 or n % 16:
        return None
    return next((g for g in INT4_GROUPS if w.group % g == 0 and k % g == 0), None)


def _act_order_perm(w: IntWeights) -> tuple[torch.Tensor | None, bool]:
    """(the column order that makes act-order groups contiguous runs, whether it does): sorting
    columns by group works when every group has `group` columns (GPTQ's act order)."""
    if w.g_idx is None:
        return None, True
    perm = torch.argsort(w.g_idx.long(), stable=True)
    runs = torch.arange(w.q.shape[1]) // w.group
    return perm, bool(torch.equal(w.g_idx.long()[perm], runs))


def make_matmul(w: IntWeights | torch.Tensor, dtype: torch.dtype, kernels: Kernels) -> nn.Module:
    """The matmul module for an unpacked weight (`formats.unpack`'s result) in `dtype`."""
    if isinstance(w, torch.Tensor):             # FP8: already dense
        return DenseMatmul(w.to(dtype).contiguous())
    n, k = w.q.shape
    quantized = kernels == "quantized" or (kernels == "auto" and dtype in (torch.bfloat16, torch.float16))
    if quantized:
        group = _int4_group(w, n, k)
        perm, contiguous = _act_order_perm(w)
        cuda_ok = not w.q.is_cuda or (dtype == torch.bfloat16 and k % 128 == 0 and n % 8 == 0)
        if group is not None and contiguous and cuda_ok:
            if perm is not None:    # sorted, groups are runs: the scales' columns are the groups in order
                w = dataclasses.replace(w, g_idx=None)
            return Int4Matmul(w, group, perm, dtype)
        if (w.bits == 8 and w.scale.shape[1] == 1 and w.g_idx is None and not w.q.is_cuda
                and bool((w.zero == 128).all())):
            return Int8Matmul(w, dtype)
    return DenseMatmul(w.dense().to(dtype).contiguous())


class QuantLinear(nn.Module):
    """A linear layer of a quantized checkpoint: the checkpoint's tensors until `finalize`, then
    the matmul they unpack to (plus the bias, kept in the compute dtype)."""

    def __init__(self, in_features: int, out_features: int, bias: bool, qc: QuantConfig) -> None:
        super().__init__()
        self.in_features, self.out_features, self.qc = in_features, out_features, qc
        self._names = []
        for name, spec in checkpoint_tensors(qc, out_features, in_features).items():
            dtype = spec.dtype or torch.get_default_dtype()
            self.register_parameter(name, nn.Parameter(torch.empty(spec.shape, dtype=dtype), requires_grad=False))
            self._names.append(name)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None
        self.matmul: nn.Module | None = None

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, layout={self.qc.layout}, "
                f"bits={self.qc.bits}, matmul={type(self.matmul).__name__ if self.matmul else 'not finalized'}")

    @torch.no_grad()
    def finalize(self, kernels: Kernels = "auto") -> None:
        """Unpack the loaded checkpoint tensors into this layer's matmul and drop them."""
        tensors = {name: getattr(self, name) for name in self._names}
        dtype = next(t.dtype for t in tensors.values() if t.is_floating_point())
        w = unpack(self.qc, tensors, self.out_features, self.in_features)
        self.matmul = make_matmul(w, dtype, kernels)
        for name in self._names:
            delattr(self, name)
        self._names = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.matmul(x)
        return y if self.bias is None else y + self.bias

    def weight_bytes(self) -> int:
        """Bytes the finalized weight holds in memory (scales included)."""
        return self.matmul.weight_bytes()


class RowParallelQuantLinear(QuantLinear):
    """A rank's input-column share of a quantized layer: `partial` is this rank's output, summed
    over the tensor-parallel group by `reduce` (the bias, on one rank, joins once)."""

    def __init__(self, in_features: int, out_features: int, bias: bool, qc: QuantConfig,
                 reduce: Callable[[torch.Tensor], torch.Tensor]) -> None:
        super().__init__(in_features, out_features, bias, qc)
        self.reduce = reduce

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.reduce(self.partial(x))

    def partial(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x)


def dense_weight(linear: nn.Module) -> torch.Tensor:
    """The [out, in] weight of a linear layer that holds one dense: an nn.Linear's, or a
    QuantLinear's dequantized at load (DenseMatmul: FP8 checkpoints). A layer whose weight is
    read as a tensor, not only multiplied (DeepSeek's absorbed kv_b_proj), needs one."""
    if isinstance(linear, QuantLinear):
        if not isinstance(linear.matmul, DenseMatmul):
            raise ValueError(f"{linear}: its weight is kept packed ({type(linear.matmul).__name__}), not dense")
        return linear.matmul.weight
    return linear.weight


def quantize_linears(module: nn.Module, qc: QuantConfig, prefix: str) -> None:
    """Replace every nn.Linear under `module` (whose parameters are named `prefix`.<name>) that
    the checkpoint stores quantized (`qc.quantizes`) by a QuantLinear of the same shape."""
    for name, child in list(module.named_modules()):
        if type(child) is nn.Linear and qc.quantizes(f"{prefix}.{name}"):
            parent_name, _, attr = name.rpartition(".")
            parent = module.get_submodule(parent_name) if parent_name else module
            setattr(parent, attr, QuantLinear(child.in_features, child.out_features, child.bias is not None, qc))


def finalize_quantized(model: nn.Module, kernels: Kernels = "auto") -> None:
    """Finalize every QuantLinear of a loaded model."""
    for m in model.modules():
        if isinstance(m, QuantLinear) and m.matmul is None:
            m.finalize(kernels)


def is_quantized(model: nn.Module) -> bool:
    return any(isinstance(m, QuantLinear) for m in model.modules())
