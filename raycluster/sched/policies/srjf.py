"""Application-level shortest remaining job first: Justitia's efficient but starving baseline.

An application's (app_id, or request id when none) remaining job is the predicted KV
token-time still ahead of its unfinished requests: for a request with prompt p, expected output
d and g tokens generated, p*(d-g) + (d^2-g^2)/2 (the tail of Justitia's p*d + d^2/2). The
application with the least remaining job is served (ties: first seen), FIFO inside it. Keys
shrink with progress, so the application is re-keyed eagerly (O(log n)) when its total moves.
"""

from __future__ import annotations

import itertools

from raycluster.request import Request
from raycluster.sched.base import Policy, PolicyContext
from raycluster.sched.policies.common import GroupQueue
from raycluster.sched.policies.justitia import app_of, expected_output


def remaining_cost(req: Request) -> float:
    p, d = req.num_prompt_tokens, expected_output(req)
    g = min(len(req.output_token_ids), d)
    return p * (d - g) + (d * d - g * g) / 2.0


class SRJFPolicy(Policy):
    name = "srjf"

    def __init__(self, ctx: PolicyContext) -> None:
        super().__init__(ctx)
        self.remaining: dict[str, float] = {}    # app -> remaining job
        self._order: dict[str, int] = {}
        self._members: dict[str, int] = {}
        self._charged: dict[str, list] = {}      # request id -> [app, charged cost]
        self._counter = itertools.count()
        self._q = GroupQueue(lambda app: (self.remaining[app], self._order[app]))

    def _recharge(self, req: Request) -> None:
        entry = self._charged[req.request_id]
        cost = remaining_cost(req)
        if cost != entry[1]:
            self.remaining[entry[0]] += cost - entry[1]
            entry[1] = cost
            self._q.touch(entry[0])

    def push(self, req: Request) -> None:
        rid = req.request_id
        if rid not in self._charged:
            app = app_of(req)
            if app not in self._members:
                self._members[app] = 0
                self.remaining[app] = 0.0
                self._order[app] = next(self._counter)
            self._members[app] += 1
            self._charged[rid] = [app, 0.0]
        self._q.push(req, self._charged[rid][0])
        self._recharge(req)

    def pop(self) -> Request | None:
        return self._q.pop()

    def remove(self, request_id: str) -> None:
        self._q.remove(request_id)
        entry = self._charged.pop(request_id, None)
        if entry is None:
            return
        app = entry[0]
        self.remaining[app] -= entry[1]
        self._members[app] -= 1
        if self._members[app] == 0:
            for d in (self._members, self.remaining, self._order):
                del d[app]
        else:
            self._q.touch(app)

    def __len__(self) -> int:
        return len(self._q)

    def on_progress(self, req: Request, num_tokens: int) -> None:
        if req.request_id in self._charged:
            self._recharge(req)

    def on_finish(self, req: Request) -> None:
        self.remove(req.request_id)
