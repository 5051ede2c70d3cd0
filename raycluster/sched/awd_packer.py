"""The prefill-short pool's packer: PLA-Serve's AWD decides when a batch of short prefills runs.

Fresh short prompts (at most the largest AWD bucket, nothing computed yet) leave the policy
queue for the `AWDBatcher`, which holds them for at most its waiting window to gather a batch
of its target depth (or dispatches early on SLA slack); a released batch runs whole prompts in
one step. Everything else (long prompts, recomputes after preemption) is chunked by a
`TokenBudgetPacker` in the budget the AWD batch leaves. `observe` feeds measured step times
back into AWD's service-time estimate.
"""

from __future__ import annotations

from typing import Sequence

from raycluster.request import Request
from raycluster.sched.awd import AWDBatcher, AWDConfig, BatchOutcome
from raycluster.sched.base import Clock, KVAllocator, PackLimits, Packer, Policy, SLOConfig
from raycluster.sched.token_packer import TokenBudgetPacker


class AWDPacker(Packer):
    def __init__(self, clock: Clock, slo: SLOConfig | None = None, cfg: AWDConfig | None = None,
                 chunk_size: int | None = 512) -> None:
        self.clock = clock
        self.awd = AWDBatcher(cfg or AWDConfig(), slo or SLOConfig())
        self.max_short = max(self.awd.buckets)
        self.rest = TokenBudgetPacker(chunk_size)
        self._last_batch = 0

    def plan(self, decodes: Sequence[Request], policy: Policy, limits: PackLimits,
             kv: KVAllocator) -> list[tuple[Request, int]]:
        now = self.clock.now()
        others: list[Request] = []
        while (req := policy.pop()) is not None:
            if req.num_computed_tokens == 0 and not req.output_token_ids and req.num_prompt_tokens <= self.max_short:
                self.awd.add(req, now)
            else:
                others.append(req)
        for req in others:
            policy.push(req)
        chunks: list[tuple[Request, int]] = []
        tokens_left = limits.max_num_batched_tokens - len(decodes)
        seqs_left = limits.max_num_seqs - len(decodes)
        # Requests aborted while AWD held them are dropped here (their KV was never allocated).
        batch = [r for r in self.awd.ready_batch(now) or [] if not r.status.finished]
        for i, req in enumerate(batch):
            n = req.num_uncomputed_tokens
            if n > tokens_left or seqs_left <= 0 or not kv.try_allocate(req, n):
                for late in batch[i:]:          # no room this step: back to the policy, AWD sees them again
                    policy.push(late)
                break
            chunks.append((req, n))
            tokens_left -= n
            seqs_left -= 1
        self._last_batch = len(chunks)
        if tokens_left > 0 and seqs_left > 0:
            chunks += self.rest.plan(list(decodes) + [r for r, _ in chunks], policy,
                                     PackLimits(limits.max_num_batched_tokens - sum(n for _, n in chunks),
                                                limits.max_num_seqs), kv)
        return chunks

    def num_held(self) -> int:
        return len(self.awd)

    def release_held(self) -> list[Request]:
        return self.awd.release_all()

    def next_release_time(self, now: float) -> float | None:
        # AWD's own wake-up: window expiry, head-of-line cap or SLA trigger of the held batch.
        return self.awd.next_wakeup(now)

    def observe(self, chunks: Sequence[tuple[Request, int]], seconds: float) -> None:
        if self._last_batch:
            self.awd.observe(BatchOutcome(self._last_batch, seconds))
