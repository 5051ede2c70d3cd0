"""Kairos urgency-based prefill priority (Kairos Alg. 1-2).

Alg. 2 predicts each queued request's prefill finish time under FCFS: a cursor starts at now
and walks the queue in arrival order adding each request's remaining prefill duration, so
finish_r = now + P_r with P_r the sum of remaining durations of requests that arrived no later
than r (r included; partially prefilled and in-flight requests count their remainder), divided
by `ctx.num_servers` when k instances drain the queue (the router's pool queues; an engine's own
queue has one server).
Alg. 1 scores
    u_r = (SLO_r - (finish_r - a_r)) / SLO_r / L_r        (L_r: prompt length)
and serves the LARGEST u first (the paper sorts descending: a short request with slack gets an
amplified positive score; a request already past its SLO gets a negative one and waits).

u_r(t) = (X_r - t) / (SLO_r * L_r) with X_r = a_r + SLO_r - P_r: a line in t, so the same exact
kinetic tree as LARS (sign -1: maximise) keeps the order as time passes. P_r comes from a
Fenwick tree over arrival order of remaining durations, O(log n) per push.

Approximation, documented: X_r is computed at r's push. Progress on (or departure of) an
earlier-arrived request lowers P_r of everyone behind it, which only raises their true u; their
stored key is refreshed when they are next pushed, and all keys are rebuilt once every
max(256, n) operations (O(n log n) per n operations, i.e. O(log n) amortised: the Fenwick tree
is re-indexed, every X_r re-read, and the kinetic tree re-derives its nodes in place), bounding
the staleness instead of re-sorting the whole queue every step as the paper does. That re-key
is one O(n log n) step (about 1 s at 100k queued in CPython here), not spread over decisions.
Durations come from the predictor (or the token proxy), the paper's tokens / throughput.
"""

from __future__ import annotations

import itertools

from raycluster.request import Request
from raycluster.sched.base import Policy, PolicyContext
from raycluster.sched.policies.common import KineticLineTree
from raycluster.sched.slo import SLOTracker, prefill_over


class _Fenwick:
    """Prefix sums over an append-only index (arrival order)."""

    def __init__(self) -> None:
        self._t = [0.0]          # 1-based

    def append(self) -> int:
        i = len(self._t)
        low = i & (-i)
        self._t.append(self.prefix(i - 1) - self.prefix(i - low))
        return i

    def extend(self, values) -> None:
        """`append()` then `add(pos, v)` for each v, the same float operations, inlined."""
        t = self._t
        for v in values:
            i = len(t)
            s1, j = 0.0, i - 1
            while j > 0:
                s1 += t[j]
                j -= j & (-j)
            s2, j = 0.0, i - (i & (-i))
            while j > 0:
                s2 += t[j]
                j -= j & (-j)
            t.append(s1 - s2)
            t[i] += v

    def add(self, i: int, delta: float) -> None:
        t, n = self._t, len(self._t)
        while i < n:
            t[i] += delta
            i += i & (-i)

    def prefix(self, i: int) -> float:
        t, s = self._t, 0.0
        while i > 0:
            s += t[i]
            i -= i & (-i)
        return s


class KairosPolicy(Policy):
    name = "kairos"

    def __init__(self, ctx: PolicyContext) -> None:
        super().__init__(ctx)
        self.slo = SLOTracker(ctx)
        self._tree = KineticLineTree(sign=-1)
        self._reqs: dict[str, Request] = {}     # queued
        self._known: dict[str, list] = {}       # prefilling (queued or in flight): [pos, dur, seq, req]
        self._fw = _Fenwick()
        self._counter = itertools.count()
        self._ops = 0

    # ---- FCFS prefix of remaining durations ------------------------------------------------
    def _track(self, req: Request) -> list:
        st = self._known.get(req.request_id)
        if st is None:
            st = self._known[req.request_id] = [self._fw.append(), 0.0, next(self._counter), req]
        dur = self.slo.remaining_work(req)
        if dur != st[1]:
            self._fw.add(st[0], dur - st[1])
            st[1] = dur
        return st

    def _untrack(self, request_id: str) -> None:
        st = self._known.pop(request_id, None)
        if st is not None and st[1]:
            self._fw.add(st[0], -st[1])
        self.slo.forget(request_id)

    def urgency_line(self, req: Request) -> tuple[float, float]:
        """(X, B): u(t) = (X - t) / B."""
        st = self._track(req)
        s = self.slo.static(req)
        x = req.arrival_time + s.ttft - self._fw.prefix(st[0]) / max(1, self.ctx.num_servers)
        return x, s.ttft * max(1, req.num_prompt_tokens)

    def urgency(self, req: Request) -> float:
        x, b = self.urgency_line(req)
        return (x - self.ctx.clock.now()) / b

    # ---- Policy ------------------------------------------------------------------------------
    def push(self, req: Request) -> None:
        self._tick()
        x, b = self.urgency_line(req)
        st = self._known[req.request_id]
        self._reqs[req.request_id] = req
        self._tree.insert(req.request_id, x, b, (req.arrival_time, st[2]), self.ctx.clock.now())

    def pop(self) -> Request | None:
        self._tick()
        rid = self._tree.pop(self.ctx.clock.now())
        return None if rid is None else self._reqs.pop(rid)

    def remove(self, request_id: str) -> None:
        if self._tree.delete(request_id, self.ctx.clock.now()):
            del self._reqs[request_id]
        self._untrack(request_id)

    def __len__(self) -> int:
        return len(self._reqs)

    def on_progress(self, req: Request, num_tokens: int) -> None:
        if req.request_id not in self._known:
            return
        if prefill_over(req):
            self._untrack(req.request_id)
        else:
            self._track(req)

    def on_finish(self, req: Request) -> None:
        self.remove(req.request_id)

    # ---- periodic exact rebuild ------------------------------------------------------------
    def _tick(self) -> None:
        self._ops += 1
        if self._ops >= max(256, len(self._known)):
            self._rebuild()

    def _rebuild(self) -> None:
        """Re-index arrival order compactly and recompute every queued key from fresh P_r."""
        self._ops = 0
        items = sorted(self._known.values(), key=lambda st: (st[3].arrival_time, st[2]))
        self._fw = _Fenwick()
        self._fw.extend(st[1] for st in items)
        self._known = {st[3].request_id: [pos, st[1], st[2], st[3]]
                       for pos, st in enumerate(items, 1)}
        # Queued requests' durations are current (every push and progress report re-tracks
        # them), so only P_r is re-read here, without asking the predictor again; slopes and
        # tie keys do not change, so the tree keeps its layout and only re-derives its nodes.
        known, fw, k = self._known, self._fw, max(1, self.ctx.num_servers)
        xs = []
        for rid, req in self._reqs.items():
            st = known[rid]
            xs.append((rid, req.arrival_time + self.slo.static(req).ttft - fw.prefix(st[0]) / k))
        self._tree.reset_intercepts(xs, self.ctx.clock.now())
