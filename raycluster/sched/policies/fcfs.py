"""First come, first served: order by arrival time."""

from __future__ import annotations

from raycluster.request import Request
from raycluster.sched.policies.heap import KeyedHeapPolicy


class FCFSPolicy(KeyedHeapPolicy):
    name = "fcfs"

    def key(self, req: Request) -> tuple:
        return (req.arrival_time,)
