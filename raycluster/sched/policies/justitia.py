"""Justitia: applications served in the order they would finish under fair sharing (GPS).

Cost of an inference is its KV token-time c = p*d + d^2/2 (p prompt tokens, d expected output
tokens: `expected_output_tokens`, else `max_tokens`); an application (`app_id`, or the request
id when none) costs the sum over its inferences. GPS shares M = ctx.num_slots service units
equally among the N_t applications active in GPS, so virtual time runs at dV/dt = M * rate / N_t
(`rate`: cost units one slot serves per clock second; 1.0 when costs are measured in slot-time,
as in the tests). An application arriving at a with cost C gets finish tag F = V(a) + C; a
further inference of an application still active in GPS extends it, F = max(F, V(a)) + c (the
application-level total, as when all of it arrives at once). Pending requests are served by
smallest F (ties: application first seen), FIFO within an application.

V(t) is tracked exactly by replaying GPS departures: active applications sit in a heap by F;
between events V grows linearly, and an application leaves GPS when V reaches its F, which
changes the slope. Amortised O(log n) per push/pop; tags never change after they are set
(only grow by new arrivals), so the group heap needs no eager re-keying.
"""

from __future__ import annotations

import heapq
import itertools

from raycluster.request import Request
from raycluster.sched.base import Policy, PolicyContext
from raycluster.sched.policies.common import GroupQueue


def expected_output(req: Request) -> int:
    d = req.expected_output_tokens
    return int(d if d is not None else req.sampling.max_tokens)


def kv_token_time(p: int, d: int) -> float:
    """KV token-time of one inference: sum over its d decode iterations of the KV it holds."""
    return p * d + d * d / 2.0


def request_cost(req: Request) -> float:
    return kv_token_time(req.num_prompt_tokens, expected_output(req))


def app_of(req: Request) -> str:
    return req.app_id if req.app_id is not None else req.request_id


class VirtualClockGPS:
    """Virtual time of an M-server fluid GPS over applications; exact, event-driven."""

    def __init__(self, servers: float) -> None:
        self.servers = float(servers)
        self.v = 0.0
        self.t = 0.0
        self.finish: dict[str, float] = {}      # active (in GPS) app -> finish tag
        self._heap: list[tuple[float, str]] = []

    def advance(self, now: float) -> float:
        heap, finish = self._heap, self.finish
        while now > self.t:
            while heap and finish.get(heap[0][1]) != heap[0][0]:
                heapq.heappop(heap)                 # superseded tag
            if not heap:
                self.t = now                        # idle GPS: V stands still
                break
            f, app = heap[0]
            rate = self.servers / len(finish)
            t_dep = self.t + (f - self.v) / rate
            if t_dep > now:
                self.v += (now - self.t) * rate
                self.t = now
                break
            self.v, self.t = f, max(self.t, t_dep)
            heapq.heappop(heap)
            del finish[app]
        # Departures due exactly now (also after an idle period) leave before new arrivals.
        while heap and heap[0][0] <= self.v:
            f, app = heapq.heappop(heap)
            if finish.get(app) == f:
                del finish[app]
        return self.v

    def arrive(self, app: str, cost: float, now: float) -> float:
        v = self.advance(now)
        f = max(self.finish.get(app, v), v) + cost
        self.finish[app] = f
        heapq.heappush(self._heap, (f, app))
        return f


class JustitiaPolicy(Policy):
    name = "justitia"

    def __init__(self, ctx: PolicyContext, rate: float = 1.0) -> None:
        super().__init__(ctx)
        self.gps = VirtualClockGPS(max(1, ctx.num_slots) * rate)
        self._tag: dict[str, tuple[float, int]] = {}     # app -> (F, first-seen order)
        self._members: dict[str, int] = {}               # app -> requests not yet finished
        self._charged: dict[str, str] = {}               # request id -> app (cost charged)
        self._counter = itertools.count()
        self._q = GroupQueue(self._tag.__getitem__)

    def finish_tag(self, app: str) -> float:
        return self._tag[app][0]

    def push(self, req: Request) -> None:
        rid = req.request_id
        if rid not in self._charged:                      # arrival: charge its cost once
            app = app_of(req)
            f = self.gps.arrive(app, request_cost(req), self.ctx.clock.now())
            seq = self._tag[app][1] if app in self._tag else next(self._counter)
            self._tag[app] = (f, seq)
            self._charged[rid] = app
            self._members[app] = self._members.get(app, 0) + 1
        self._q.push(req, self._charged[rid])

    def pop(self) -> Request | None:
        return self._q.pop()

    def remove(self, request_id: str) -> None:
        self._q.remove(request_id)
        app = self._charged.pop(request_id, None)
        if app is not None:
            self._members[app] -= 1
            if self._members[app] == 0:
                # No request left to order: a later request of the app re-derives its tag from
                # GPS (which still remembers F while the app is active there).
                del self._members[app]
                self._tag.pop(app, None)

    def __len__(self) -> int:
        return len(self._q)

    def on_finish(self, req: Request) -> None:
        self.remove(req.request_id)
