"""Least remaining slack: slack = deadline - now - remaining work.

Between progress events every queued request's slack falls at the same rate (one second per
second), so slack_i - slack_j does not depend on now and the static key deadline - remaining
work orders exactly like slack; it is recomputed on every push, i.e. after every progress.
"""

from __future__ import annotations

from raycluster.request import Request
from raycluster.sched.policies.common import SLOHeapPolicy


class LRSPolicy(SLOHeapPolicy):
    name = "lrs"

    def key(self, req: Request) -> tuple:
        return (self.slo.static_slack(req), req.arrival_time)
