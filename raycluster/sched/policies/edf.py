"""Earliest deadline first: order by TTFT deadline (arrival + TTFT SLO, or the work-scaled
default from `raycluster.sched.slo`). Static key, so a plain heap is O(log n) per decision."""

from __future__ import annotations

from raycluster.request import Request
from raycluster.sched.policies.common import SLOHeapPolicy


class EDFPolicy(SLOHeapPolicy):
    name = "edf"

    def key(self, req: Request) -> tuple:
        return (self.slo.deadline(req), req.arrival_time)
