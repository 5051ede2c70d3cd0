"""Sarathi-style packing under a token budget: chunked prefill with a fixed maximum chunk size.

Decodes take one token each; prefill chunks fill what is left of `max_num_batched_tokens` in
policy order, each at most `chunk_size` tokens (None: whole prompts only, i.e. a non-preemptive,
unchunked prefill that waits until its whole prompt fits the budget).
"""

from __future__ import annotations

from typing import Sequence

from raycluster.request import Request
from raycluster.sched.base import KVAllocator, PackLimits, Packer, Policy


class TokenBudgetPacker(Packer):
    def __init__(self, chunk_size: int | None = 512) -> None:
        if chunk_size is not None and chunk_size <= 0:
            raise ValueError(f"chunk_size must be >= 1 or None, got {chunk_size}")
        self.chunk_size = chunk_size

    def plan(self, decodes: Sequence[Request], policy: Policy, limits: PackLimits,
             kv: KVAllocator) -> list[tuple[Request, int]]:
        budget = limits.max_num_batched_tokens - len(decodes)
        seqs_left = limits.max_num_seqs - len(decodes)
        chunks: list[tuple[Request, int]] = []
        deferred: list[Request] = []
        while budget > 0 and seqs_left > 0:
            req = policy.pop()
            if req is None:
                break
            need = req.num_uncomputed_tokens
            if self.chunk_size is None:
                if need > budget and (chunks or decodes):
                    deferred.append(req)
                    break       # whole prompt does not fit next to others: wait (head of line)
                n = need        # alone in the step, an over-budget prompt still runs
            else:
                n = min(need, self.chunk_size, budget)
            if not kv.try_allocate(req, n):
                deferred.append(req)
                break           # KV is full: keep order, let running work finish first
            chunks.append((req, n))
            budget -= n
            seqs_left -= 1
        for req in deferred:
            policy.push(req)
        return chunks
