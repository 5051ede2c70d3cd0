"""vLLM's priority scheduling (`--scheduling-policy priority`): order by the request's `priority`,
lower first (vLLM's convention), then by arrival. Under this policy a client's `priority` field
decides who goes first, and, when KV runs out, who is preempted: the running request with the
highest (priority, arrival), as vLLM does. The other policies order by arrival, deadlines or
fairness and ignore it."""

from __future__ import annotations

from typing import Sequence

from raycluster.request import Request
from raycluster.sched.policies.heap import KeyedHeapPolicy


class PriorityPolicy(KeyedHeapPolicy):
    name = "priority"

    def key(self, req: Request) -> tuple:
        return (req.priority, req.arrival_time)

    def preemption_victim(self, asking: Request, holders: Sequence[Request]) -> Request:
        # max keeps the first of equals: the latest admitted holder goes, `asking` only when it
        # ranks strictly last (as under FCFS, a decode does not give way to an equal).
        return max((*reversed(holders), asking), key=lambda r: (r.priority, r.arrival_time))
