"""Structures shared by the priority policies.

- `SLOHeapPolicy`: a `KeyedHeapPolicy` with an `SLOTracker` whose cache is dropped when a request
  leaves prefill (edf, srpt, lrs).
- `KineticLineTree` (re-exported from `kinetic`): exact minimum of time-dependent keys
  sigma * (A_i - t) / B_i (B_i > 0) as the clock advances (lars, kairos).
- `GroupQueue`: requests grouped by application/tenant; a heap of groups keyed by a policy
  callback, FIFO (arrival order) within a group (justitia, vtc, srjf).
"""

from __future__ import annotations

import heapq
import itertools
import math
from typing import Callable, Hashable

from raycluster.request import Request
from raycluster.sched.base import PolicyContext
from raycluster.sched.policies.heap import KeyedHeapPolicy
from raycluster.sched.policies.kinetic import KineticLineTree  # noqa: F401  (re-export)
from raycluster.sched.slo import SLOTracker, prefill_over

INF = math.inf


class SLOHeapPolicy(KeyedHeapPolicy):
    def __init__(self, ctx: PolicyContext) -> None:
        super().__init__(ctx)
        self.slo = SLOTracker(ctx)

    def remove(self, request_id: str) -> None:
        super().remove(request_id)
        self.slo.forget(request_id)

    def on_progress(self, req: Request, num_tokens: int) -> None:
        # The scheduler advances num_computed_tokens before calling us: 0 left ends prefill,
        # and the request will not be pushed again (unless preempted, when it is recomputed).
        if prefill_over(req):
            self.slo.forget(req.request_id)

    def on_finish(self, req: Request) -> None:
        self.slo.forget(req.request_id)


class GroupQueue:
    """Requests in groups. `pop` serves the group with the least `key_fn(group)` (a tuple that
    ends in a tie-breaker), then that group's earliest-pushed request.

    Group heap entries are lazy: an entry whose stored key differs from `key_fn` at pop time is
    re-inserted with the current key. That alone is correct for keys that only grow (VTC
    counters, Justitia finish tags); a policy whose group key can shrink must call `touch`.
    """

    def __init__(self, key_fn: Callable[[Hashable], tuple]) -> None:
        self.key_fn = key_fn
        self._heap: list[tuple[tuple, int, Hashable]] = []
        self._groups: dict[Hashable, list] = {}     # gid -> [entry version, n_live, request heap]
        self._live: dict[str, tuple[Hashable, int]] = {}   # request_id -> (gid, version)
        self._seq: dict[str, int] = {}              # first-push order, kept across pop/push
        self._counter = itertools.count()
        self._versions = itertools.count()

    def __len__(self) -> int:
        return len(self._live)

    def group_size(self, gid: Hashable) -> int:
        g = self._groups.get(gid)
        return g[1] if g else 0

    def push(self, req: Request, gid: Hashable) -> None:
        self.remove(req.request_id, forget_seq=False)
        seq = self._seq.setdefault(req.request_id, next(self._counter))
        g = self._groups.get(gid)
        if g is None:
            g = self._groups[gid] = [-1, 0, []]
        ver = next(self._versions)
        self._live[req.request_id] = (gid, ver)
        heapq.heappush(g[2], (req.arrival_time, seq, ver, req))
        g[1] += 1
        if g[1] == 1:
            self.touch(gid)

    def touch(self, gid: Hashable) -> None:
        """Re-key a group now (needed when its key decreased)."""
        g = self._groups.get(gid)
        if g is None or g[1] == 0:
            return
        g[0] = next(self._versions)
        heapq.heappush(self._heap, (self.key_fn(gid), g[0], gid))
        if len(self._heap) > 64 and len(self._heap) > 4 * len(self._groups):
            self._heap = [e for e in self._heap
                          if e[2] in self._groups and self._groups[e[2]][0] == e[1]]
            heapq.heapify(self._heap)

    def pop(self) -> Request | None:
        heap = self._heap
        while heap:
            key, ver, gid = heap[0]
            g = self._groups.get(gid)
            if g is None or g[0] != ver:
                heapq.heappop(heap)
                continue
            cur = self.key_fn(gid)
            if cur != key:
                heapq.heapreplace(heap, (cur, ver, gid))
                continue
            rheap = g[2]
            while True:
                _, _, rver, req = heapq.heappop(rheap)
                if self._live.get(req.request_id, (None, -1))[1] == rver:
                    break
            del self._live[req.request_id]
            g[1] -= 1
            if g[1] == 0:
                heapq.heappop(heap)
                del self._groups[gid]
            return req
        return None

    def remove(self, request_id: str, forget_seq: bool = True) -> Hashable | None:
        """Drop a queued request; returns its group id (None if it was not queued)."""
        if forget_seq:
            self._seq.pop(request_id, None)
        entry = self._live.pop(request_id, None)
        if entry is None:
            return None
        gid = entry[0]
        g = self._groups[gid]
        g[1] -= 1
        if g[1] == 0:
            del self._groups[gid]          # its heap entry goes stale
        elif len(g[2]) > 32 and len(g[2]) > 2 * g[1]:
            g[2] = [e for e in g[2] if self._live.get(e[3].request_id, (None, -1))[1] == e[2]]
            heapq.heapify(g[2])
        return gid

    def forget(self, request_id: str) -> None:
        self._seq.pop(request_id, None)
