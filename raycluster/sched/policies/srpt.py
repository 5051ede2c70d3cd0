"""Shortest remaining processing time: order by predicted remaining prefill time. The key only
changes on progress, and progress is always followed by a push, so the heap key is fresh."""

from __future__ import annotations

from raycluster.request import Request
from raycluster.sched.policies.common import SLOHeapPolicy


class SRPTPolicy(SLOHeapPolicy):
    name = "srpt"

    def key(self, req: Request) -> tuple:
        return (self.slo.remaining_work(req), req.arrival_time)
