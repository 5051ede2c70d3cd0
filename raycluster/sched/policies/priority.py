"""vLLM's priority scheduling (`--scheduling-policy priority`): order by the request's `priority`,
lower first (vLLM's convention), then by arrival. Under this policy a client's `priority` field
decides who goes first; the other policies order by arrival, deadlines or fairness and ignore it."""

from __future__ import annotations

from raycluster.request import Request
from raycluster.sched.policies.heap import KeyedHeapPolicy


class PriorityPolicy(KeyedHeapPolicy):
    name = "priority"

    def key(self, req: Request) -> tuple:
        return (req.priority, req.arrival_time)
