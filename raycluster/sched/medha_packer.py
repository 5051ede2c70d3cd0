"""Medha's time-budget batch packer (Alg. 1-2) and its prefill-time cache (Alg. 3).

Owns: choosing prefill chunk sizes for one step so the whole batch stays within a time budget
`t_target` (derived from the TPOT SLO). Data enters through `MedhaPacker.plan(decodes, policy,
limits, kv)`: the decodes already chosen for this step, a `Policy` to pop candidates from, token /
sequence limits and a KV allocator. It leaves as [(request, chunk_tokens)] in execution order;
popped-but-unscheduled requests are pushed back (same discipline as `TokenBudgetPacker`).

Algorithm (per step):
  1. Decodes first: their predicted time is the baseline.
  2. Pop prefills in policy order. For each, binary-search the largest chunk n such that
     predictor.batch_time(chunks so far + (n, kv_before), decode kv lens) <= budget, where
     budget = t_target, or t_target * (1 - min(rho, rho_max)) for a long prefill when short
     prefills wait behind it (space sharing: a long request with relative slack rho yields that
     share of the step so shorts ride along).
  3. At most one long prefill (prompt >= long_threshold) per batch; a second one is pushed back.
  4. Several prefills may share a step (multi-prefill batching) until time, tokens or seqs run out.
  5. If no prefill chunk fits at all, one chunk of `min_chunk` tokens runs anyway (progress never
     stalls even when decodes alone fill the budget). That is the only way a plan exceeds t_target.

Adaptive chunking is not coded separately: a chunk's attention cost grows with kv_before, so the
same budget buys fewer tokens as a prefill advances.

`PrefillTimeCache` simulates a prefill alone under the same budget once (chunk boundaries and
cumulative time) and answers "time to prefill tokens [a, b)" by bisection; the default relative
slack (LARS: rho = (deadline - now - remaining work) / total work) reads it.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Callable, Sequence

from raycluster.request import Request
from raycluster.sched.base import BatchPredictor, Clock, KVAllocator, PackLimits, Packer, Policy, SLOConfig


def largest_fitting_chunk(predictor: BatchPredictor, prefills: list[tuple[int, int]],
                          decode_kv: Sequence[int], kv_before: int, max_tokens: int,
                          budget_s: float) -> int:
    """Largest n in [1, max_tokens] with batch_time(prefills + [(n, kv_before)], decode_kv) <=
    budget_s, or 0 if even n=1 does not fit. Assumes batch time is non-decreasing in n."""
    limit = budget_s + 1e-12          # absorb float noise (0.05 * 0.6 != 300 * 1e-4 exactly)

    def fits(n: int) -> bool:
        return predictor.batch_time(prefills + [(n, kv_before)], decode_kv) <= limit

    if max_tokens <= 0 or not fits(1):
        return 0
    lo, hi = 1, max_tokens            # invariant: fits(lo)
    if fits(hi):
        return hi
    while hi - lo > 1:                # invariant: fits(lo) and not fits(hi)
        mid = (lo + hi) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid
    return lo


@dataclass
class PrefillTimeCache:
    """Alg. 3: cumulative isolated prefill time under adaptive chunking at budget t_target.

    One simulated prefill is extended lazily up to the longest length asked for; `bounds[i]` is
    the KV length after i chunks and `times[i]` the time spent reaching it. A length between two
    boundaries is charged the boundary time plus the exact clipped last chunk, so lookups equal
    SimulatePrefill(L) of the paper without a fixed granularity."""
    predictor: BatchPredictor
    t_target: float
    max_chunk: int = 1 << 16
    bounds: list[int] = field(default_factory=lambda: [0])
    times: list[float] = field(default_factory=lambda: [0.0])

    def _extend(self, length: int) -> None:
        while self.bounds[-1] < length:
            kv = self.bounds[-1]
            n = largest_fitting_chunk(self.predictor, [], [], kv, self.max_chunk, self.t_target) or 1
            self.times.append(self.times[-1] + self.predictor.batch_time([(n, kv)], []))
            self.bounds.append(kv + n)

    def time_to(self, length: int) -> float:
        """Isolated time to prefill the first `length` tokens."""
        if length <= 0:
            return 0.0
        self._extend(length)
        i = bisect.bisect_right(self.bounds, length) - 1
        base, rest = self.bounds[i], length - self.bounds[i]
        tail = self.predictor.batch_time([(rest, base)], []) if rest > 0 else 0.0
        return self.times[i] + tail

    def remaining(self, total: int, processed: int) -> float:
        return max(0.0, self.time_to(total) - self.time_to(processed))


RelativeSlack = Callable[[Request, float], float]


class MedhaPacker(Packer):
    def __init__(self, predictor: BatchPredictor, clock: Clock, slo: SLOConfig | None = None, *,
                 t_target_s: float | None = None, long_threshold: int = 8192,
                 rho_max: float = 0.4, min_chunk: int = 1, max_skips: int = 8,
                 relative_slack: RelativeSlack | None = None,
                 prefill_cache: PrefillTimeCache | None = None) -> None:
        self.predictor = predictor
        self.clock = clock
        self.slo = slo or SLOConfig()
        # Default budget: one step may take the whole TPOT SLO (a decode then meets it exactly).
        self.t_target = t_target_s if t_target_s is not None else self.slo.tpot_ms / 1000.0
        if self.t_target <= 0:
            raise ValueError(f"t_target_s must be > 0, got {self.t_target}")
        if not 0.0 <= rho_max < 1.0:
            raise ValueError(f"rho_max must be in [0, 1), got {rho_max}")
        if min_chunk < 1:
            raise ValueError(f"min_chunk must be >= 1, got {min_chunk}")
        self.long_threshold = long_threshold
        self.rho_max = rho_max
        self.min_chunk = min_chunk
        self.max_skips = max_skips     # bound pops of requests that do not fit, per step
        self.cache = prefill_cache or PrefillTimeCache(predictor, self.t_target)
        self.relative_slack = relative_slack or self.default_relative_slack

    # -- LARS relative slack from the request's SLO and the prefill-time cache ---------------
    def deadline_s(self, req: Request) -> float:
        """TTFT budget: the request's own, else the larger of the default and ttft_scale times
        its isolated prefill time (long prompts get proportionally longer deadlines)."""
        if req.slo.ttft_s is not None:
            return req.slo.ttft_s
        return max(self.slo.ttft_ms / 1000.0, self.slo.ttft_scale * self.cache.time_to(req.num_prompt_tokens))

    def default_relative_slack(self, req: Request, now: float) -> float:
        total = self.cache.time_to(req.num_tokens)
        if total <= 0:
            return 0.0
        left = self.cache.remaining(req.num_tokens, req.num_computed_tokens)
        slack = req.arrival_time + self.deadline_s(req) - now - left
        return slack / total

    def is_long(self, req: Request) -> bool:
        return req.num_prompt_tokens >= self.long_threshold

    # -- Alg. 1 ------------------------------------------------------------------------------
    def plan(self, decodes: Sequence[Request], policy: Policy, limits: PackLimits,
             kv: KVAllocator) -> list[tuple[Request, int]]:
        decode_kv = getattr(decodes, "kv_lens", None)       # see Packer.plan
        if decode_kv is None:
            decode_kv = [r.num_computed_tokens for r in decodes]
        tokens_left = limits.max_num_batched_tokens - len(decodes)
        seqs_left = limits.max_num_seqs - len(decodes)
        chunks: list[tuple[Request, int]] = []
        shapes: list[tuple[int, int]] = []     # (chunk, kv_before), mirrors chunks for the predictor
        deferred: list[Request] = []
        lookahead: list[Request] = []          # popped to peek for waiting shorts, still in order
        has_long = False
        skips = 0
        now = self.clock.now()
        step_s = 0.0                           # batch_time(shapes, decode_kv), kept as chunks are added

        def next_candidate() -> Request | None:
            return lookahead.pop(0) if lookahead else policy.pop()

        while tokens_left > 0 and seqs_left > 0 and skips <= self.max_skips:
            if chunks and step_s >= self.t_target - 1e-12:
                break
            req = next_candidate()
            if req is None:
                break
            long = self.is_long(req)
            if long and has_long:
                deferred.append(req)           # Alg. 2 line 3: one long prefill per batch
                skips += 1
                continue
            budget = self.t_target
            if long and self.rho_max > 0 and self._short_waiting(policy, lookahead, seqs_left):
                rho = min(self.rho_max, max(0.0, self.relative_slack(req, now)))
                budget = self.t_target * (1.0 - rho)
            need = min(req.num_uncomputed_tokens, tokens_left)
            n = largest_fitting_chunk(self.predictor, shapes, decode_kv, req.num_computed_tokens,
                                      need, budget)
            if n == 0:
                if chunks:
                    deferred.append(req)       # Alg. 1 line 17: requeue, try the next one
                    skips += 1
                    continue
                n = min(self.min_chunk, need)  # nothing fits: one minimal chunk keeps progress
            if not kv.try_allocate(req, n):
                deferred.append(req)
                break                          # KV is full: keep order, let running work finish
            chunks.append((req, n))
            shapes.append((n, req.num_computed_tokens))
            has_long = has_long or long
            tokens_left -= n
            seqs_left -= 1
            step_s = self.predictor.batch_time(shapes, decode_kv)
            if step_s > self.t_target + 1e-12:
                break                          # only the minimal-chunk case gets here: stop
        for req in deferred + lookahead:
            policy.push(req)
        return chunks

    def _short_waiting(self, policy: Policy, lookahead: list[Request], seqs_left: int) -> bool:
        """Is a short prefill queued right behind this long one (within the seqs this step can
        still take)? Peeks by popping into `lookahead`, which keeps policy order."""
        limit = max(0, seqs_left - 1)
        i = 0
        while i < limit:
            if i >= len(lookahead):
                nxt = policy.pop()
                if nxt is None:
                    return False
                lookahead.append(nxt)
            if not self.is_long(lookahead[i]):
                return True
            i += 1
        return False
