"""Llama 4's mixture-of-experts block (`Llama4MoE`, a layer's `feed_forward`), under the
checkpoint's names: `router` (a linear layer [E, H]), `experts` (stacked,
gate and up in halves: raycluster.model.stacked_experts) and `shared_expert` (a gated MLP).

forward(x [T, H]) -> [T, H]: each token's top k experts by router logit, each run once on its rows
times sigmoid(that logit) (the score scales the expert's input, not its output), their outputs
summed per token, plus the shared expert's. A tensor-parallel rank holds every expert's share of
the columns and the shared expert's (a partial sum joining the experts' before `reduce`), an
expert-parallel rank whole experts [first, end). (Its NoPE layers' query temperature:
raycluster.model.query_scale.)
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from raycluster.model.config import ModelConfig
from raycluster.model.moe import GatedMLP, combine_experts
from raycluster.model.stacked_experts import StackedExperts, silu_glu


def _identity(t: torch.Tensor) -> torch.Tensor:
    return t


class Llama4MoE(nn.Module):
    def __init__(self, cfg: ModelConfig, reduce: Callable[[torch.Tensor], torch.Tensor] = _identity):
        super().__init__()
        moe = cfg.moe
        self.top_k, self.num_experts = moe.top_k, moe.num_experts
        self.first, end = moe.local_experts or (0, moe.num_experts)
        self.router = nn.Linear(cfg.hidden_size, moe.num_experts, bias=False)
        self.experts = StackedExperts(cfg.hidden_size, moe.intermediate_size, end - self.first, silu_glu,
                                      interleaved=moe.stacked == "interleaved", bias=False)
        self.shared_expert = GatedMLP(cfg.hidden_size, moe.shared_intermediate_size)
        self.reduce = reduce

    def forward(self, x: torch.Tensor, lora=None, index: int = 0) -> torch.Tensor:
        # `lora` is never given: adapters on a sparse layer's MLP are refused at load.
        top, ids = torch.topk(self.router(x), self.top_k, dim=-1)
        scores = torch.sigmoid(top.float()).to(x.dtype)
        routed = combine_experts(x, scores, ids, self.num_experts, self.first, self.experts.num_local,
                                 self.experts.run, weight_inputs=True)
        return self.reduce(self.shared_expert(x) + routed)
