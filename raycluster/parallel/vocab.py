"""Vocab-parallel embedding and output head (vLLM's `VocabParallelEmbedding` / `ParallelLMHead`).

The vocabulary is padded up to a multiple of the TP width (`padded_vocab`: the padding rows are
zeros and no token id reaches them) and lane t of a TP group holds rows
[t * V' / tp, (t + 1) * V' / tp) of the embedding and of the output head (`vocab_rows`; a tied
model's head is the same tensor as the lane's embedding rows).

Embedding (`VocabParallelEmbedding`): each lane looks up the ids in its range, gives zeros for
the others, and the lanes sum the rows by `reduce` (one all_reduce over the lanes that embed
together, the subgroup the layers' row-parallel all_reduces use). Exactly one lane contributes a
non-zero row per token, so the sum is the full lookup, bit for bit.

Output head (`ParallelLMHead`): each lane computes the logits of its vocab slice for the rows
the step samples, and `gather_logits` brings the slices to rank 0 of a collective (the group's
leader), which concatenates them in lane order and drops the padding columns: one gather per
step, for every sampled and prompt-logprob row at once.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from raycluster.model.config import ModelConfig
from raycluster.model.llama import finish_logits

LOGITS_TAG = 6      # group tags 1-5: SPP hidden / rows, KV moves, plans, all_gather


def padded_vocab(vocab: int, tp: int) -> int:
    """The vocabulary padded up to a multiple of `tp` (vLLM pads the same way, to a multiple)."""
    return -(-vocab // tp) * tp


def vocab_rows(vocab: int, tp: int, lane: int) -> tuple[int, int, int]:
    """(lo, hi, rows): lane `lane` of `tp` holds `rows` rows, padded rows [lane * rows, (lane + 1)
    * rows) of the padded vocab, of which the real token ids are [lo, hi) (its first hi - lo
    rows; the rest is padding. A lane past the end of a tiny vocab has lo == hi == vocab)."""
    if not 0 <= lane < tp:
        raise ValueError(f"lane {lane} outside tp {tp}")
    rows = padded_vocab(vocab, tp) // tp
    lo = min(lane * rows, vocab)
    return lo, min(lane * rows + rows, vocab), rows


def pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    """A new contiguous tensor of `rows` rows: `t`'s, then zeros."""
    out = torch.zeros((rows,) + tuple(t.shape[1:]), dtype=t.dtype, device=t.device)
    out[:t.shape[0]].copy_(t)
    return out


class VocabParallelEmbedding(nn.Module):
    """One lane's embedding rows [rows, H] for token ids [lo, hi); `reduce` sums the lanes'
    lookups (each token found on one lane, zeros elsewhere)."""

    def __init__(self, weight: torch.Tensor, lo: int, hi: int, reduce: Callable[[torch.Tensor], torch.Tensor]):
        super().__init__()
        self.weight = weight if isinstance(weight, nn.Parameter) else nn.Parameter(weight, requires_grad=False)
        self.lo, self.hi, self.reduce = lo, hi, reduce

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        inside = (ids >= self.lo) & (ids < self.hi)
        out = F.embedding(torch.where(inside, ids - self.lo, 0), self.weight)
        out.masked_fill_(~inside.unsqueeze(-1), 0)
        return self.reduce(out)


class ParallelLMHead(nn.Module):
    """One lane's output-head rows [rows, H] (a tied model's: its embedding's `weight`, the same
    Parameter): the logits of its vocab slice, padding columns included, finished as the model
    family's (`config`: Granite's scaling, Gemma 2's cap; elementwise, so each slice alone)."""

    def __init__(self, weight: torch.Tensor, config: ModelConfig | None = None) -> None:
        super().__init__()
        self.weight = weight if isinstance(weight, nn.Parameter) else nn.Parameter(weight, requires_grad=False)
        self.config = config

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = F.linear(hidden, self.weight)
        return logits if self.config is None else finish_logits(logits, self.config)


def gather_logits(coll, local: torch.Tensor | None, lanes: list[int], vocab: int, n: int, rows: int,
                  dtype: torch.dtype, device: torch.device) -> torch.Tensor | None:
    """The full logits [n, vocab] on rank 0 of `coll`, from the slices [n, rows] the ranks
    `lanes` (ranks of `coll`, in lane order) computed (`local` on those ranks); None elsewhere.
    Rank 0 need not be one of the lanes (an SPP leader gathers from the last stage's)."""
    me = coll.rank
    if me != 0:
        if me in lanes and n:
            coll.send(local, 0, LOGITS_TAG).wait()
        return None
    if not n:
        return torch.empty((0, vocab), dtype=dtype, device=device)
    parts = [local if r == 0 else coll.recv(torch.empty((n, rows), dtype=dtype, device=device), r, LOGITS_TAG)
             for r in lanes]
    full = torch.cat(parts, 1)
    return full if full.shape[1] == vocab else full[:, :vocab].contiguous()


__all__ = ["LOGITS_TAG", "ParallelLMHead", "VocabParallelEmbedding", "gather_logits", "pad_rows", "padded_vocab",
           "vocab_rows"]
