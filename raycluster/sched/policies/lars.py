"""Length-aware relative slack (Medha's LARS): serve the least rho = slack / total work.

rho_i(t) = (D_i - R_i - t) / W_i with D the TTFT deadline, R the remaining and W the total
predicted prefill work. Unlike plain slack, the order depends on now: a waiting request's rho
falls at rate 1/W_i, so short requests become urgent quickly and long ones slowly, and two
requests can swap order while neither is touched. A static-key heap is therefore wrong, and a
re-sort per decision is O(n log n).

Structure: a kinetic tournament tree (`common.KineticLineTree`) over the lines
(A_i - t) / B_i with A_i = D_i - R_i (fixed between progress events, refreshed on every push)
and B_i = W_i. It is exact: any two lines cross at most once, every watched internal node is
re-checked at the crossing time of its children's winners, comparisons at time t use
cross-multiplication, and a subtree is left unwatched only when none of its lines falls faster
than the winner above it (then none can ever overtake it). So W is never bucketed in a
comparison; buckets of W only choose leaf slots (similar slopes share subtrees, which is what
lets whole subtrees go unwatched). Each push/pop/remove is O(log n) plus the re-checks of
watched nodes whose certificates failed since the previous operation; order changes among
requests that cannot be next (e.g. a burst of arrivals sorting itself out) are not processed.
"""

from __future__ import annotations

import itertools

from raycluster.request import Request
from raycluster.sched.base import Policy, PolicyContext
from raycluster.sched.policies.common import KineticLineTree
from raycluster.sched.slo import SLOTracker, prefill_over


class LARSPolicy(Policy):
    name = "lars"

    def __init__(self, ctx: PolicyContext) -> None:
        super().__init__(ctx)
        self.slo = SLOTracker(ctx)
        self._tree = KineticLineTree(sign=1)
        self._reqs: dict[str, Request] = {}
        self._seq: dict[str, int] = {}          # first-push order: the arrival tie-break
        self._counter = itertools.count()

    def push(self, req: Request) -> None:
        rid = req.request_id
        seq = self._seq.setdefault(rid, next(self._counter))
        self._reqs[rid] = req
        a, b = self.slo.slack_and_work(req)
        self._tree.insert(rid, a, b, (req.arrival_time, seq), self.ctx.clock.now())

    def pop(self) -> Request | None:
        rid = self._tree.pop(self.ctx.clock.now())
        return None if rid is None else self._reqs.pop(rid)

    def remove(self, request_id: str) -> None:
        if self._tree.delete(request_id, self.ctx.clock.now()):
            del self._reqs[request_id]
        self._seq.pop(request_id, None)
        self.slo.forget(request_id)

    def __len__(self) -> int:
        return len(self._reqs)          # == len(self._tree): both change together; one call less

    def relative_slack(self, req: Request) -> float:
        return self.slo.relative_slack(req, self.ctx.clock.now())

    def on_progress(self, req: Request, num_tokens: int) -> None:
        if prefill_over(req):                    # (count already advanced)
            self._seq.pop(req.request_id, None)
            self.slo.forget(req.request_id)

    def on_finish(self, req: Request) -> None:
        self.remove(req.request_id)
