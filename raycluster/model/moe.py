"""The sparse mixture-of-experts feed-forward block of Mixtral, Qwen2-MoE, Qwen3-MoE and DeepSeek-V3 layers.

`SparseMoE(cfg)` holds the router (`gate`, [num_experts, H]), the experts (`experts.{e}`, each a
gated MLP of the experts' intermediate size, under the checkpoint's names: Mixtral's w1 / w3 /
w2, Qwen's gate/up/down_proj; or Qwen3-VL-MoE's stacked ones, raycluster.model.stacked_experts) and, for Qwen2-MoE, the shared expert and its sigmoid gate.
forward(x [T, H]) -> [T, H]: each token's router probabilities (softmax in fp32), its top k
experts and their weights (renormalised to sum to 1 when the config says so), each expert run
once on the rows routed to it, the weighted outputs summed per token in expert order (as
transformers does, so the sums round alike), then the shared expert's gated output added.
DeepSeek-V3 routes otherwise (`DeepseekRouter`, `_route_grouped`: sigmoid scores, a correction
bias for the choice, group-limited top k, scaled weights) and adds its `shared_experts` ungated.

Tensor parallelism cuts every expert as a dense MLP is cut (gate/up by output rows, down by input
columns: raycluster.parallel.shard); with expert parallelism each rank instead holds a whole
share of the experts (`MoEConfig.local_experts`) and runs only the rows routed to them. The router
and the shared expert's gate stay whole on every rank, so every rank routes alike. Either way a
rank's sum is a partial sum, which `reduce` (set by the shard builder; the identity on one
process) sums over the group once per layer, after the shared expert's partial output joins it.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from raycluster.model.config import ModelConfig
from raycluster.model.stacked_experts import StackedExperts, silu_glu


def _identity(t: torch.Tensor) -> torch.Tensor:
    return t


class GatedMLP(nn.Module):
    """down(silu(gate(x)) * up(x)) without biases: a Qwen expert or shared expert."""

    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class MixtralExpert(nn.Module):
    """The same MLP under Mixtral's names: w1 gate, w3 up, w2 down."""

    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.w1 = nn.Linear(hidden, intermediate, bias=False)
        self.w3 = nn.Linear(hidden, intermediate, bias=False)
        self.w2 = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class DeepseekRouter(nn.Module):
    """DeepSeek's router, under its checkpoint names: `weight` [E, H] and, on V3, the per-expert
    `e_score_correction_bias` that steers the choice (not the weights)."""

    def __init__(self, hidden: int, num_experts: int, bias: bool):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden))
        self.e_score_correction_bias = nn.Parameter(torch.zeros(num_experts)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.float(), self.weight.float())


class SparseMoE(nn.Module):
    def __init__(self, cfg: ModelConfig, reduce: Callable[[torch.Tensor], torch.Tensor] = _identity):
        super().__init__()
        moe = cfg.moe
        h = cfg.hidden_size
        self.top_k = moe.top_k
        self.norm_topk_prob = moe.norm_topk_prob
        # Mixtral multiplies an expert's output by its fp32 weight; Qwen casts the weight first.
        self.fp32_weights = moe.mixtral_names
        self.num_experts = moe.num_experts
        self.moe = moe
        self.gate = DeepseekRouter(h, moe.num_experts, moe.deepseek == "v3") if moe.deepseek else \
            nn.Linear(h, moe.num_experts, bias=False)
        expert = MixtralExpert if moe.mixtral_names else GatedMLP
        # Keyed by expert id (the checkpoint's `experts.{e}` names): every expert, or an
        # expert-parallel rank's [first, end) of them; or stacked (Qwen3-VL-MoE's checkpoints).
        self.first, end = moe.local_experts or (0, moe.num_experts)
        self.experts = StackedExperts(h, moe.intermediate_size, end - self.first, silu_glu, interleaved=False,
                                      bias=False) if moe.stacked else \
            nn.ModuleDict({str(e): expert(h, moe.intermediate_size) for e in range(self.first, end)})
        self.shared_expert = None
        if moe.shared_intermediate_size and moe.deepseek:     # ungated, under DeepSeek's name
            self.shared_experts = GatedMLP(h, moe.shared_intermediate_size)
        elif moe.shared_intermediate_size:
            self.shared_expert = GatedMLP(h, moe.shared_intermediate_size)
            self.shared_expert_gate = nn.Linear(h, 1, bias=False)
        self.reduce = reduce

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, k], expert ids [T, k]) of each token's top k experts."""
        if self.moe.deepseek:
            return self._route_grouped(x)
        probs = torch.softmax(self.gate(x).float(), dim=-1)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return (weights if self.fp32_weights else weights.to(x.dtype)), ids

    def _route_grouped(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """DeepSeek's: V3's sigmoid scores plus the bias choose, within the `topk_group` best
        groups (a group's worth: its two best biased scores); V2's softmax scores choose within
        the groups of the best single scores. The chosen experts' plain scores are the weights,
        renormalised if asked, times `routed_scaling`."""
        moe = self.moe
        logits = self.gate(x)
        v3 = moe.deepseek == "v3"
        scores = logits.sigmoid() if v3 else logits.softmax(dim=-1)
        choice = scores + self.gate.e_score_correction_bias.float() if v3 else scores
        if moe.n_group > 1:
            t, per = x.shape[0], moe.num_experts // moe.n_group
            grouped = choice.view(t, moe.n_group, per)
            worth = grouped.topk(min(2, per), dim=-1)[0].sum(dim=-1) if v3 else grouped.amax(dim=-1)
            groups = torch.topk(worth, moe.topk_group, dim=-1, sorted=False)[1]
            allowed = torch.zeros_like(worth).scatter_(1, groups, 1).bool().repeat_interleave(per, dim=1)
            # V3 rules the others out; V2 zeroes their scores (transformers' masked_fill 0.0).
            choice = choice.masked_fill(~allowed, float("-inf") if v3 else 0.0)
        ids = torch.topk(choice, self.top_k, dim=-1, sorted=False)[1]
        weights = scores.gather(1, ids)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * moe.routed_scaling, ids

    def forward(self, x: torch.Tensor, lora=None, index: int = 0) -> torch.Tensor:
        # `lora` is never given experts' updates: adapters on a sparse layer's MLP are refused at load.
        weights, ids = self.route(x)
        if isinstance(self.experts, StackedExperts):
            out = combine_experts(x, weights, ids, self.num_experts, self.first, self.experts.num_local,
                                  self.experts.run)
        else:
            experts = list(self.experts.values())
            out = combine_experts(x, weights, ids, self.num_experts, self.first, len(experts),
                                  lambda e, rows: experts[e](rows))
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        elif self.moe.shared_intermediate_size:
            out = out + self.shared_experts(x)
        return self.reduce(out)


def combine_experts(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, num_experts: int, first: int,
                    local: int, run: Callable[[int, torch.Tensor], torch.Tensor],
                    weight_inputs: bool = False) -> torch.Tensor:
    """sum over each token's routed slots of weight * expert(x[token]) (`weight_inputs`, Llama 4's:
    expert(weight * x[token])), for the `local` experts [first, first + local) this module holds
    (the rest contribute nothing here): `run(e, rows)` is local expert e on its rows. Each expert
    runs once, on the rows routed to it, and adds to the sum in expert order (as transformers
    does, so the sums round alike)."""
    k = ids.shape[1]
    flat = ids.flatten()
    order = torch.argsort(flat, stable=True)      # (token, slot) pairs grouped by expert
    counts = torch.bincount(flat, minlength=num_experts).tolist()
    rows = order // k
    pair_weights = weights.flatten()[order].unsqueeze(1)
    out = torch.zeros_like(x)
    start = sum(counts[:first])                   # the pairs of the experts held elsewhere come first
    for e, n in enumerate(counts[first:first + local]):
        if n:
            r, w = rows[start:start + n], pair_weights[start:start + n]
            y = run(e, (x[r] * w).to(x.dtype)) if weight_inputs else run(e, x[r]) * w
            out.index_add_(0, r, y.to(x.dtype))
            start += n
    return out
