"""gpt-oss's mixture-of-experts block (`GptOssMoE`, a layer's `mlp`), under its checkpoint names:
`router` (weight [E, H], bias [E]) and `experts`, every expert stacked in four tensors --
gate_up_proj [E, H, 2I] (stored input-major, gate and up interleaved column by column),
gate_up_proj_bias [E, 2I], down_proj [E, I, H], down_proj_bias [E, H].

forward(x [T, H]) -> [T, H]: each token's router logits (with the bias), its top k experts, their
weights the softmax of the chosen logits; each expert runs once on its rows (moe.combine_experts):
gate and up clamped at the limit (the gate from above, up both sides), (up + 1) * gate *
sigmoid(alpha * gate), then down with its bias; the weighted outputs summed per token.

A tensor-parallel rank holds every expert's share of the intermediate columns (its pairs of
interleaved gate / up columns, the matching down rows; the down bias on rank 0 only) and an
expert-parallel rank whole experts [first, end) (`MoEConfig.local_experts`); either way its sum
is partial and `reduce` (set by the shard builder) sums it over the group. The router stays whole.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from raycluster.model.config import ModelConfig
from raycluster.model.moe import combine_experts


def _identity(t: torch.Tensor) -> torch.Tensor:
    return t


class GptOssRouter(nn.Module):
    def __init__(self, hidden: int, num_experts: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden))
        self.bias = nn.Parameter(torch.empty(num_experts))


class GptOssExperts(nn.Module):
    """`experts` stacked experts of `intermediate` columns each (a tp rank's share of them)."""

    def __init__(self, hidden: int, intermediate: int, experts: int, alpha: float, limit: float):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(experts, hidden, 2 * intermediate))
        self.gate_up_proj_bias = nn.Parameter(torch.empty(experts, 2 * intermediate))
        self.down_proj = nn.Parameter(torch.empty(experts, intermediate, hidden))
        self.down_proj_bias = nn.Parameter(torch.empty(experts, hidden))
        self.alpha, self.limit = alpha, limit

    def run(self, e: int, x: torch.Tensor) -> torch.Tensor:
        """Local expert `e` on its rows x [n, H]."""
        gate_up = x @ self.gate_up_proj[e] + self.gate_up_proj_bias[e]
        gate = gate_up[:, ::2].clamp(max=self.limit)
        up = gate_up[:, 1::2].clamp(min=-self.limit, max=self.limit)
        out = ((up + 1) * (gate * torch.sigmoid(gate * self.alpha))) @ self.down_proj[e]
        # None on a tp rank other than 0 (raycluster.parallel.shard): the bias joins the sum once.
        return out if self.down_proj_bias is None else out + self.down_proj_bias[e]


class GptOssMoE(nn.Module):
    def __init__(self, cfg: ModelConfig, reduce: Callable[[torch.Tensor], torch.Tensor] = _identity):
        super().__init__()
        moe = cfg.moe
        self.top_k, self.num_experts = moe.top_k, moe.num_experts
        self.first, end = moe.local_experts or (0, moe.num_experts)
        self.router = GptOssRouter(cfg.hidden_size, moe.num_experts)
        self.experts = GptOssExperts(cfg.hidden_size, moe.intermediate_size, end - self.first,
                                     moe.swiglu_alpha, moe.swiglu_limit)
        self.reduce = reduce

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, k], expert ids [T, k]): the softmax of each token's top k router logits."""
        logits = F.linear(x, self.router.weight, self.router.bias)
        top, ids = torch.topk(logits, self.top_k, dim=-1)
        return torch.softmax(top, dim=-1), ids

    def forward(self, x: torch.Tensor, lora=None, index: int = 0) -> torch.Tensor:
        # `lora` is never given: adapters on a sparse layer's MLP are refused at load.
        weights, ids = self.route(x)
        out = combine_experts(x, weights, ids, self.num_experts, self.first, self.experts.gate_up_proj.shape[0],
                              self.experts.run)
        return self.reduce(out)
