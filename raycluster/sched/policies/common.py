"""Structures shared by the priority policies.

- `SLOHeapPolicy`: a `KeyedHeapPolicy` with an `SLOTracker` whose cache is dropped when a request
  leaves prefill (edf, srpt, lrs).
- `KineticLineTree`: exact minimum of time-dependent keys sigma * (A_i - t) / B_i (B_i > 0) as
  the clock advances: a kinetic tournament tree (lars, kairos).
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
from raycluster.sched.slo import SLOTracker, remaining_prefill_tokens

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
        if remaining_prefill_tokens(req) == 0:
            self.slo.forget(req.request_id)

    def on_finish(self, req: Request) -> None:
        self.slo.forget(req.request_id)


class KineticLineTree:
    """Items are lines v_i(t) = sigma * (A_i - t) / B_i; `top(t)` returns the id with the least
    v_i(t), ties broken by a per-item tie key (arrival order), for non-decreasing t.

    A tournament tree over leaf slots: every internal node keeps the winner of its subtree at
    the last time it was checked and a "melt" time, the earliest time any winner in its
    subtree can change (the crossing time of its two children's winners, or a child's melt).
    Advancing the clock re-plays only nodes whose melt has passed; insert/delete recompute one
    leaf-to-root path. Two lines cross at most once, so this is exact: comparisons at time t
    are done by cross-multiplication (no division), so integer-valued inputs compare exactly;
    only crossing times are divided, and a node is re-checked no later than the rounded crossing.
    Cost: O(log n) per insert/delete, plus O(log n) per kinetic event on a query.
    """

    def __init__(self, sign: int = 1, capacity: int = 64) -> None:
        self.sign = 1 if sign >= 0 else -1
        self._t = -INF
        self._alloc(capacity)
        self._slot: dict[Hashable, int] = {}

    def _alloc(self, cap: int) -> None:
        self._cap = cap
        self._win = [-1] * (2 * cap)
        self._melt = [INF] * (2 * cap)
        self._a = [0.0] * cap
        self._b = [1.0] * cap
        self._tie: list = [None] * cap
        self._id: list = [None] * cap
        self._free = list(range(cap - 1, -1, -1))

    def __len__(self) -> int:
        return len(self._slot)

    def __contains__(self, item_id: Hashable) -> bool:
        return item_id in self._slot

    def _recompute(self, n: int, t: float) -> None:
        # Hot path (every level of every update): comparisons inlined.
        win, melt = self._win, self._melt
        c = 2 * n
        l, r = win[c], win[c + 1]
        ml, mr = melt[c], melt[c + 1]
        m = ml if ml < mr else mr
        if l < 0 or r < 0:
            win[n], melt[n] = (r, mr) if l < 0 else (l, ml)
            return
        a, b, sign = self._a, self._b, self.sign
        al, bl, ar, br = a[l], b[l], a[r], b[r]
        x, y = (al - t) * br, (ar - t) * bl
        if x == y:
            l_first = self._tie[l] < self._tie[r]
        else:
            l_first = (x < y) if sign > 0 else (x > y)
        if l_first:
            w, aw, bw, alo, blo = l, al, bl, ar, br
        else:
            w, aw, bw, alo, blo = r, ar, br, al, bl
        # The loser's line falls faster (overtakes later) iff sigma / B_lo > sigma / B_w.
        if (blo < bw) if sign > 0 else (blo > bw):
            tc = (aw * blo - alo * bw) / (blo - bw)
            if tc <= t:           # rounding: re-check strictly later so a query makes progress
                tc = math.nextafter(t, INF)
            if tc < m:
                m = tc
        win[n], melt[n] = w, m

    def rebuild(self, items, t: float) -> None:
        """Replace the contents with [(id, a, b, tie)] in O(n) (bottom-up, no per-item paths)."""
        items = list(items)
        cap = 64
        while cap < len(items):
            cap *= 2
        self._alloc(cap)
        self._slot = {}
        self._t = t
        for i, (item_id, a, b, tie) in enumerate(items):
            self._a[i], self._b[i], self._tie[i], self._id[i] = float(a), float(b), tie, item_id
            self._win[i + cap] = i
            self._slot[item_id] = i
        self._free = list(range(cap - 1, len(items) - 1, -1))
        for n in range(cap - 1, 0, -1):
            self._recompute(n, t)

    def _advance(self, t: float) -> float:
        if t < self._t:      # clocks never go back; tolerate a caller passing a stale time
            t = self._t
        self._t = t
        if self._melt[1] > t:
            return t
        cap, melt = self._cap, self._melt
        stack, order = [1], []
        while stack:
            n = stack.pop()
            if n < cap and melt[n] <= t:
                order.append(n)
                stack.append(2 * n)
                stack.append(2 * n + 1)
        for n in reversed(order):      # children before parents
            self._recompute(n, t)
        return t

    def _update_path(self, leaf: int, t: float) -> None:
        n = (leaf + self._cap) >> 1
        while n:
            self._recompute(n, t)
            n >>= 1

    def insert(self, item_id: Hashable, a: float, b: float, tie, t: float) -> None:
        if item_id in self._slot:
            self.delete(item_id, t)
        t = self._advance(t)
        if not self._free:
            self._grow(t)
        i = self._free.pop()
        self._a[i], self._b[i], self._tie[i], self._id[i] = float(a), float(b), tie, item_id
        self._win[i + self._cap] = i
        self._slot[item_id] = i
        self._update_path(i, t)

    def delete(self, item_id: Hashable, t: float) -> bool:
        i = self._slot.pop(item_id, None)
        if i is None:
            return False
        t = self._advance(t)
        self._win[i + self._cap] = -1
        self._id[i] = self._tie[i] = None
        self._free.append(i)
        self._update_path(i, t)
        return True

    def top(self, t: float) -> Hashable | None:
        self._advance(t)
        w = self._win[1]
        return None if w < 0 else self._id[w]

    def pop(self, t: float) -> Hashable | None:
        """Remove and return the winner at time t (None when empty)."""
        item = self.top(t)
        if item is not None:
            self.delete(item, t)
        return item

    def _grow(self, t: float) -> None:
        old = (self._a, self._b, self._tie, self._id, self._cap)
        self._alloc(2 * self._cap)
        a, b, tie, ids, cap = old
        self._a[:cap], self._b[:cap], self._tie[:cap], self._id[:cap] = a, b, tie, ids
        self._free = list(range(2 * cap - 1, cap - 1, -1))
        for i in range(cap):
            if ids[i] is not None:
                self._win[i + self._cap] = i
        for n in range(self._cap - 1, 0, -1):
            self._recompute(n, t)


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
