"""Virtual token counter (VTC, Sheng et al.), the fair-share baseline of Justitia.

Each tenant has a counter of service received: w_in per prefill token, w_out per decode token
(1 and 2 by default, VTC's weights), charged in `on_progress`. The queued request of the tenant
with the least counter runs next (FIFO within a tenant). A tenant that becomes active (its
first unfinished request arrives) has its counter lifted to the least counter of the tenants
already active, so idling never banks credit; active means queued or running (not finished).

Counters only grow, so heap entries hold lower bounds of the true keys; a stale top is
re-inserted with its current counter before it is trusted (lazy re-keying). That makes
`on_progress` O(1) and pop amortised O(log n).
"""

from __future__ import annotations

import heapq
import itertools

from raycluster.request import Request
from raycluster.sched.base import Policy, PolicyContext
from raycluster.sched.policies.common import GroupQueue


class VTCPolicy(Policy):
    name = "vtc"

    def __init__(self, ctx: PolicyContext, w_in: float = 1.0, w_out: float = 2.0) -> None:
        super().__init__(ctx)
        self.w_in, self.w_out = w_in, w_out
        self.counter: dict[str, float] = {}
        self._order: dict[str, int] = {}        # tenant first-seen order: the tie-break
        self._active: dict[str, int] = {}       # tenant -> unfinished requests
        self._owner: dict[str, str] = {}        # request id -> tenant (active requests)
        self._amin: list[tuple[float, int, str]] = []   # lazy min-heap over active tenants
        self._counter = itertools.count()
        self._q = GroupQueue(self._key)

    def _key(self, tenant: str) -> tuple[float, int]:
        return (self.counter[tenant], self._order[tenant])

    def _min_active(self) -> float | None:
        h = self._amin
        while h:
            c, order, tenant = h[0]
            if tenant not in self._active:
                heapq.heappop(h)
            elif c != self.counter[tenant]:
                heapq.heapreplace(h, (self.counter[tenant], order, tenant))
            else:
                return c
        return None

    def push(self, req: Request) -> None:
        rid, tenant = req.request_id, req.tenant
        if rid not in self._owner:
            if tenant not in self._order:
                self._order[tenant] = next(self._counter)
                self.counter[tenant] = 0.0
            if tenant not in self._active:
                floor = self._min_active()
                if floor is not None and floor > self.counter[tenant]:
                    self.counter[tenant] = floor
                self._active[tenant] = 0
                heapq.heappush(self._amin, (self.counter[tenant], self._order[tenant], tenant))
            self._active[tenant] += 1
            self._owner[rid] = tenant
        self._q.push(req, tenant)

    def pop(self) -> Request | None:
        return self._q.pop()

    def remove(self, request_id: str) -> None:
        self._q.remove(request_id)
        tenant = self._owner.pop(request_id, None)
        if tenant is not None:
            self._active[tenant] -= 1
            if self._active[tenant] == 0:
                del self._active[tenant]

    def __len__(self) -> int:
        return len(self._q)

    def on_progress(self, req: Request, num_tokens: int) -> None:
        tenant = self._owner.get(req.request_id)
        if tenant is None:
            return
        # Output tokens are decode work: the engine reports a decode step as 1 token after the
        # first sampled one, the router reports k delivered tokens after appending them. More
        # tokens than outputs so far is prompt (or recompute) work.
        decode = 0 < num_tokens <= len(req.output_token_ids)
        self.counter[tenant] += num_tokens * (self.w_out if decode else self.w_in)

    def on_finish(self, req: Request) -> None:
        self.remove(req.request_id)
