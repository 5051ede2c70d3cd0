"""Granite's mixture-of-experts block (`GraniteMoeForCausalLM`: granite-3.0 / 3.1 1b-a400m and
3b-a800m), a layer's `block_sparse_moe`, under its checkpoint names: `router.layer` (a linear layer
[E, H]), `input_linear.weight` [E, 2I, H] (every expert's gate rows, then its up rows) and
`output_linear.weight` [E, H, I].

forward(x [T, H]) -> [T, H]: each token's top k router logits (in fp32), their softmax as the
weights (cast to x's dtype), each expert run once on its rows (silu(gate) * up, then down), the
weighted outputs summed per token (moe.combine_experts). A tensor-parallel rank holds every
expert's share of the intermediate rows (`granite_expert_part`: a run of each half of
input_linear, the matching columns of output_linear), an expert-parallel rank whole experts
[first, end); either way its sum is partial and `reduce` sums it over the group.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from raycluster.model.config import ModelConfig
from raycluster.model.moe import combine_experts
from raycluster.model.stacked_experts import silu_glu
from raycluster.model.tensor_parts import HalvesPart, TensorPart


def _identity(t: torch.Tensor) -> torch.Tensor:
    return t


class _Stacked(nn.Module):
    """One stacked weight under the checkpoint's `<name>.weight`."""

    def __init__(self, *shape: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(shape))


class _Router(nn.Module):
    def __init__(self, hidden: int, experts: int):
        super().__init__()
        self.layer = nn.Linear(hidden, experts, bias=False)


class GraniteMoE(nn.Module):
    def __init__(self, cfg: ModelConfig, reduce: Callable[[torch.Tensor], torch.Tensor] = _identity):
        super().__init__()
        moe, h = cfg.moe, cfg.hidden_size
        self.top_k, self.num_experts = moe.top_k, moe.num_experts
        self.first, end = moe.local_experts or (0, moe.num_experts)
        self.router = _Router(h, moe.num_experts)
        self.input_linear = _Stacked(end - self.first, 2 * moe.intermediate_size, h)
        self.output_linear = _Stacked(end - self.first, h, moe.intermediate_size)
        self.reduce = reduce

    def run(self, e: int, x: torch.Tensor) -> torch.Tensor:
        gate, up = F.linear(x, self.input_linear.weight[e]).chunk(2, dim=-1)
        return F.linear(silu_glu(gate, up), self.output_linear.weight[e])

    def forward(self, x: torch.Tensor, lora=None, index: int = 0) -> torch.Tensor:
        # `lora` is never given: adapters on a sparse layer's MLP are refused at load.
        top, ids = torch.topk(self.router.layer(x).float(), self.top_k, dim=-1)
        weights = torch.softmax(top, dim=-1).to(x.dtype)
        out = combine_experts(x, weights, ids, self.num_experts, self.first, self.input_linear.weight.shape[0],
                              self.run)
        return self.reduce(out)


def granite_expert_part(module: str, rank: int, tp: int, expert_parallel: bool) -> TensorPart | HalvesPart:
    """A tp rank's part of `input_linear.weight` / `output_linear.weight` (module docstring)."""
    if expert_parallel:
        return TensorPart(0, rank, tp)
    return HalvesPart(1, rank, tp) if module == "input_linear" else TensorPart(2, rank, tp)
