"""Experts stored stacked, as gpt-oss and Llama 4 checkpoints store them: `gate_up_proj` [E, H, 2I]
(input-major; gate and up interleaved column by column, or as two halves), `down_proj` [E, I, H],
and with biases (gpt-oss) `gate_up_proj_bias` [E, 2I], `down_proj_bias` [E, H].

`StackedExperts.run(e, x [n, H]) -> [n, H]` is local expert e on its rows: x @ gate_up (+ bias),
split into gate and up, the family's gated activation `glu(gate, up)`, then @ down (+ bias). A
module holds `experts` of them (an expert-parallel rank's share) of `intermediate` columns each
(a tensor-parallel rank's share: `stacked_expert_part` says which, for raycluster.parallel.shard:
interleaved pairs, or a run of each half).
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from raycluster.model.tensor_parts import WHOLE, HalvesPart, TensorPart


def silu_glu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """SwiGLU: silu(gate) * up (Llama 4)."""
    return F.silu(gate) * up


class ClampedSwiGLU:
    """gpt-oss's: gate clamped from above and up both sides at `limit`, then
    (up + 1) * gate * sigmoid(alpha * gate)."""

    def __init__(self, alpha: float, limit: float) -> None:
        self.alpha, self.limit = alpha, limit

    def __call__(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        gate = gate.clamp(max=self.limit)
        up = up.clamp(min=-self.limit, max=self.limit)
        return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))


class StackedExperts(nn.Module):
    def __init__(self, hidden: int, intermediate: int, experts: int, glu: Callable, interleaved: bool, bias: bool):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(experts, hidden, 2 * intermediate))
        self.down_proj = nn.Parameter(torch.empty(experts, intermediate, hidden))
        self.gate_up_proj_bias = nn.Parameter(torch.empty(experts, 2 * intermediate)) if bias else None
        # None also on a tp rank other than 0 (raycluster.parallel.shard): the bias joins the sum once.
        self.down_proj_bias = nn.Parameter(torch.empty(experts, hidden)) if bias else None
        self.glu, self.interleaved = glu, interleaved

    @property
    def num_local(self) -> int:
        return self.gate_up_proj.shape[0]

    def run(self, e: int, x: torch.Tensor) -> torch.Tensor:
        gate_up = x @ self.gate_up_proj[e]
        if self.gate_up_proj_bias is not None:
            gate_up = gate_up + self.gate_up_proj_bias[e]
        gate, up = (gate_up[:, ::2], gate_up[:, 1::2]) if self.interleaved else gate_up.chunk(2, dim=-1)
        out = self.glu(gate, up) @ self.down_proj[e]
        return out if self.down_proj_bias is None else out + self.down_proj_bias[e]


# A tp rank's part of a stacked expert tensor ([E, ...] each): the dim holding its
# intermediate columns (gpt-oss's interleaved gate / up pairs stay together: a contiguous run of
# 2I / tp columns; Llama 4's halves, under `feed_forward`, give a run from each); None: the down
# bias, added once, by rank 0.
_STACKED_SPLIT = {"gate_up_proj": 2, "gate_up_proj_bias": 1, "down_proj": 1, "down_proj_bias": None}


def stacked_expert_part(param: str, rank: int, tp: int, expert_parallel: bool,
                         halves: bool) -> TensorPart | HalvesPart | None:
    """A tp rank's part of stacked expert tensor `param` (`halves`: gate / up stored in halves):
    under expert parallelism its share of the experts (dim 0: the contiguous share of
    raycluster.parallel.shard.expert_range), else every expert's share of columns."""
    if expert_parallel:
        return TensorPart(0, rank, tp)
    dim = _STACKED_SPLIT[param]
    if dim is None:
        return WHOLE if rank == 0 else None
    if halves and param.startswith("gate_up_proj"):
        return HalvesPart(dim, rank, tp)
    return TensorPart(dim, rank, tp)
