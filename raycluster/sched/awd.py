"""PLA-Serve's Adaptive Wait-Depth (AWD) batching of short prefills (Alg. 1).

Owns: when to dispatch a batch of short prefills and which requests go in it. Requests enter by
`add(req, now)` (already classified short, e.g. by `raycluster.sched.boundary`); the engine polls
`ready_batch(now)` (a list to run now, or None to keep waiting) and sleeps until
`next_wakeup(now)`; after running a batch it reports `observe(BatchOutcome)`.

Model:
  - Length buckets (powers of two, e.g. 8..256): a request is padded to the smallest bucket
    holding its new tokens, as a captured CUDA-graph shape would be. A batch is anchored on the
    bucket of its most urgent request and filled (earliest deadline first) from that bucket and
    smaller ones (they pad up for free), within the token budget M >= depth * padded length and
    the largest captured depth; a backlog leaves in one batch.
  - Target depth D: a captured batch size; starts at the largest one whose memory fits M.
  - Waiting window W: a round starts when a request finds the queue idle (or right after a
    dispatch that left work); the round's window is clip(min(W, W_GR), [W_min, W_max]) with
    W_GR = (D - queued) / r_s, the expected time for the arrival rate r_s to fill the batch.
  - Dispatch when depth >= D (or the budget admits no more), the round's window expired, the head-of-line request waited
    T_max, or some request in the batch or next in line has slack DDL - (now + S) <= sigma
    (SLA early dispatch; S = service-time estimate, DDL = arrival + TTFT SLO).
  - After a dispatch of depth d that took tau to fill: if d >= D, W <- clip(tau); else D <- d
    (Alg. 1 lines 12-15). Added here: D <- d also when d > D (a backlog batch), rounded down to
    a captured depth, so D recovers after a lull instead of only ever shrinking.
  - `observe` updates S by an EMA of measured batch service times.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field
from typing import Sequence

from raycluster.request import Request
from raycluster.sched.base import SLOConfig


@dataclass
class AWDConfig:
    buckets: Sequence[int] = (8, 16, 32, 64, 128, 256)
    depths: Sequence[int] = (1, 2, 4, 8, 16, 32, 64)
    token_budget: int = 8192          # M: padded tokens per batch
    sigma_s: float = 0.005            # dispatch early when some slack <= sigma
    w_min_s: float = 0.0
    w_max_s: float = 0.020
    t_max_s: float = 0.050            # head-of-line wait cap
    service_s: float = 0.010          # initial S; `observe` refines it
    ema: float = 0.2
    rate_ema: float = 0.1


@dataclass
class BatchOutcome:
    depth: int
    service_s: float


@dataclass
class _Entry:
    req: Request
    enqueued: float
    deadline: float
    padded: int


@dataclass
class AWDBatcher:
    cfg: AWDConfig = field(default_factory=AWDConfig)
    slo: SLOConfig = field(default_factory=SLOConfig)

    def __post_init__(self) -> None:
        self.buckets = sorted(self.cfg.buckets)
        self.depths = sorted(self.cfg.depths)
        feasible = [d for d in self.depths if d * self.buckets[0] <= self.cfg.token_budget]
        if not feasible:
            raise ValueError("AWD: no captured depth fits the token budget")
        self.max_depth = feasible[-1]
        self.depth_target = self.max_depth                  # D
        self.window = self.cfg.w_max_s                      # W
        self.service = self.cfg.service_s                   # S hat
        self.queue: list[_Entry] = []
        self.round_start: float | None = None
        self.round_window = self.window
        self.mean_gap: float | None = None                  # EMA of inter-arrival time
        self.last_arrival: float | None = None

    # -- inputs ---------------------------------------------------------------------------------
    def padded_len(self, n: int) -> int:
        i = bisect.bisect_left(self.buckets, n)
        return self.buckets[i] if i < len(self.buckets) else n   # too long for a graph: no padding

    def deadline(self, req: Request) -> float:
        ttft = req.slo.ttft_s if req.slo.ttft_s is not None else self.slo.ttft_ms / 1000.0
        return req.arrival_time + ttft

    def add(self, req: Request, now: float) -> None:
        if self.last_arrival is not None:
            gap = max(0.0, now - self.last_arrival)
            self.mean_gap = gap if self.mean_gap is None else self.mean_gap + self.cfg.rate_ema * (gap - self.mean_gap)
        self.last_arrival = now
        self.queue.append(_Entry(req, now, self.deadline(req), self.padded_len(max(1, req.num_uncomputed_tokens))))
        if self.round_start is None:
            self._start_round(now)

    def observe(self, outcome: BatchOutcome) -> None:
        self.service += self.cfg.ema * (outcome.service_s - self.service)

    # -- decisions ------------------------------------------------------------------------------
    def arrival_rate(self) -> float:
        return 1.0 / self.mean_gap if self.mean_gap else 0.0

    def _start_round(self, now: float) -> None:
        self.round_start = now
        missing = max(0, self.depth_target - len(self.queue))
        rate = self.arrival_rate()
        w_gr = missing / rate if rate > 0 else math.inf
        self.round_window = min(max(min(self.window, w_gr), self.cfg.w_min_s), self.cfg.w_max_s)

    def _candidate(self) -> list[_Entry]:
        """Anchor on the most urgent request's bucket; fill EDF from that bucket and smaller ones
        up to the largest depth the token budget allows (a backlog leaves in one batch; D only
        decides when to stop waiting)."""
        by_deadline = sorted(self.queue, key=lambda e: (e.deadline, e.enqueued))
        anchor = by_deadline[0].padded
        cap = max(1, min(self.max_depth, self.cfg.token_budget // anchor))
        batch: list[_Entry] = []
        for e in by_deadline:
            if len(batch) >= cap:
                break
            if e.padded <= anchor:
                batch.append(e)
        return batch

    def _full(self, batch: list[_Entry]) -> bool:
        cap = max(1, min(self.max_depth, self.cfg.token_budget // batch[0].padded))
        return len(batch) >= min(self.depth_target, cap)

    def _wakeups(self, batch: list[_Entry]) -> tuple[float, float, float]:
        """(window expiry, head-of-line cap, earliest SLA trigger) as absolute times."""
        assert self.round_start is not None
        window_at = self.round_start + self.round_window
        hol_at = min(e.enqueued for e in self.queue) + self.cfg.t_max_s
        # Slack of a request hits sigma at DDL - S - sigma; "B u {next}" = the batch plus the most
        # urgent request left out of it.
        ids = {id(e) for e in batch}
        rest = [e for e in self.queue if id(e) not in ids]
        watched = batch + ([min(rest, key=lambda e: e.deadline)] if rest else [])
        sla_at = min(e.deadline - self.service - self.cfg.sigma_s for e in watched)
        return window_at, hol_at, sla_at

    def ready_batch(self, now: float) -> list[Request] | None:
        if not self.queue:
            return None
        batch = self._candidate()
        if not self._full(batch) and now < min(self._wakeups(batch)):
            return None
        return self._dispatch(batch, now)

    def _dispatch(self, batch: list[_Entry], now: float) -> list[Request]:
        assert self.round_start is not None
        d, tau = len(batch), now - self.round_start
        ids = {id(e) for e in batch}
        self.queue = [e for e in self.queue if id(e) not in ids]
        if d >= self.depth_target:
            self.window = min(max(tau, self.cfg.w_min_s), self.cfg.w_max_s)
        # D <- d, rounded down to a captured depth so the target stays a real graph shape; a
        # backlog batch deeper than D raises it (the seed only ever lowers D).
        i = bisect.bisect_right(self.depths, d) - 1
        self.depth_target = min(self.max_depth, self.depths[max(0, i)])
        self.round_start = None
        if self.queue:
            self._start_round(now)
        return [e.req for e in batch]

    def next_wakeup(self, now: float) -> float | None:
        """Absolute time when `ready_batch` may next return a batch without a new arrival."""
        if not self.queue:
            return None
        batch = self._candidate()
        if self._full(batch):
            return now
        return max(now, min(self._wakeups(batch)))

    def release_all(self) -> list[Request]:
        """Empty the queue: its requests in the order they were added (the round ends)."""
        reqs = [e.req for e in self.queue]
        self.queue, self.round_start = [], None
        return reqs

    def __len__(self) -> int:
        return len(self.queue)
