"""OLMo 2 / OLMo 3's q/k norms on a tensor-parallel rank: an RMSNorm over the whole projection
(every head), of which each rank holds its heads' part.

`HeadShardedRMSNorm(dim, eps, tp, reduce)` normalises the rank's [T, dim] slice by the RMS of the
whole row: each rank's sum of squares, summed over the group by `reduce` (one all_reduce of a
[T, 1] tensor), over `dim * tp` elements. When KV heads are replicated (tp > KV heads) each head's
squares are counted once per replica, and so is every element in `dim * tp`: the mean is the
same. The weight is the rank's slice of the full norm's (raycluster.parallel.shard.layer_part);
the op order is RMSNorm's (fp32, cast back, then scaled), so values match the unsharded norm up
to the order the squares are summed in. (Command R+'s per-head q/k norms need nothing of this:
each head is normed alone, so a rank norms its own with its rows of the weight.)
"""

from __future__ import annotations

from typing import Callable

import torch

from raycluster.model.llama import RMSNorm


class HeadShardedRMSNorm(RMSNorm):
    def __init__(self, dim: int, eps: float, tp: int, reduce: Callable[[torch.Tensor], torch.Tensor]) -> None:
        super().__init__(dim, eps)
        self.count, self.reduce = dim * tp, reduce

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.float()
        squares = self.reduce(x32.pow(2).sum(-1, keepdim=True))
        x32 = x32 * torch.rsqrt(squares / self.count + self.eps)
        return self.weight * x32.to(dtype)
