"""gpt-oss's mixture-of-experts block (`GptOssMoE`, a layer's `mlp`), under its checkpoint names:
`router` (weight [E, H], bias [E]) and `experts`, every expert stacked in four tensors
(raycluster.model.stacked_experts: gate and up interleaved column by column, with biases).

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
from raycluster.model.stacked_experts import ClampedSwiGLU, StackedExperts


def _identity(t: torch.Tensor) -> torch.Tensor:
    return t


class GptOssRouter(nn.Module):
    def __init__(self, hidden: int, num_experts: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden))
        self.bias = nn.Parameter(torch.empty(num_experts))


class GptOssMoE(nn.Module):
    def __init__(self, cfg: ModelConfig, reduce: Callable[[torch.Tensor], torch.Tensor] = _identity):
        super().__init__()
        moe = cfg.moe
        self.top_k, self.num_experts = moe.top_k, moe.num_experts
        self.first, end = moe.local_experts or (0, moe.num_experts)
        self.router = GptOssRouter(cfg.hidden_size, moe.num_experts)
        self.experts = StackedExperts(cfg.hidden_size, moe.intermediate_size, end - self.first,
                                      ClampedSwiGLU(moe.swiglu_alpha, moe.swiglu_limit),
                                      interleaved=moe.stacked == "interleaved", bias=True)
        self.reduce = reduce

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, k], expert ids [T, k]): the softmax of each token's top k router logits."""
        logits = F.linear(x, self.router.weight, self.router.bias)
        top, ids = torch.topk(logits, self.top_k, dim=-1)
        return torch.softmax(top, dim=-1), ids

    def forward(self, x: torch.Tensor, lora=None, index: int = 0) -> torch.Tensor:
        # `lora` is never given: adapters on a sparse layer's MLP are refused at load.
        weights, ids = self.route(x)
        out = combine_experts(x, weights, ids, self.num_experts, self.first, self.experts.num_local, self.experts.run)
        return self.reduce(out)
