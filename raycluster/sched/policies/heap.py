"""A binary-heap priority queue with lazy deletion: the base of every static-key policy.

A subclass gives `key(req)`; smaller keys pop first. Keys are recomputed only on push, so a
policy whose key changes with progress (srpt) stays O(log n) per push/pop. Ties fall back to the
first-push sequence number, which is arrival order.
"""

from __future__ import annotations

import heapq
import itertools
from abc import abstractmethod

from raycluster.request import Request
from raycluster.sched.base import Policy, PolicyContext


class KeyedHeapPolicy(Policy):
    def __init__(self, ctx: PolicyContext) -> None:
        super().__init__(ctx)
        self._heap: list[tuple[tuple, int, int, Request]] = []
        self._seq: dict[str, int] = {}          # first-push order, kept across pop/push
        self._live: dict[str, int] = {}         # request_id -> version of its valid heap entry
        self._versions = itertools.count()
        self._counter = itertools.count()

    @abstractmethod
    def key(self, req: Request) -> tuple: ...

    def push(self, req: Request) -> None:
        seq = self._seq.setdefault(req.request_id, next(self._counter))
        version = next(self._versions)
        self._live[req.request_id] = version
        heapq.heappush(self._heap, (self.key(req), seq, version, req))

    def pop(self) -> Request | None:
        while self._heap:
            _, _, version, req = heapq.heappop(self._heap)
            if self._live.get(req.request_id) == version:
                del self._live[req.request_id]
                return req
        return None

    def remove(self, request_id: str) -> None:
        self._live.pop(request_id, None)
        self._seq.pop(request_id, None)
        # Stale entries are skipped by pop; compact when they dominate so memory stays O(n).
        if len(self._heap) > 64 and len(self._heap) > 4 * len(self._live):
            self._heap = [e for e in self._heap if self._live.get(e[3].request_id) == e[2]]
            heapq.heapify(self._heap)

    def __len__(self) -> int:
        return len(self._live)
