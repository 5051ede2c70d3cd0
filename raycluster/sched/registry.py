"""Policies by name. `make_policy("lars", ctx)`; unknown names raise ValueError listing the known ones.

Keyword options go to the policy's constructor (e.g. `make_policy("justitia", ctx, rate=2e5)` fixes
Justitia's GPS service rate instead of measuring it); an option the policy does not take raises
ValueError."""

from __future__ import annotations

from raycluster.sched.base import Policy, PolicyContext
from raycluster.sched.policies.edf import EDFPolicy
from raycluster.sched.policies.fcfs import FCFSPolicy
from raycluster.sched.policies.justitia import JustitiaPolicy
from raycluster.sched.policies.kairos import KairosPolicy
from raycluster.sched.policies.lars import LARSPolicy
from raycluster.sched.policies.lrs import LRSPolicy
from raycluster.sched.policies.priority import PriorityPolicy
from raycluster.sched.policies.srjf import SRJFPolicy
from raycluster.sched.policies.srpt import SRPTPolicy
from raycluster.sched.policies.vtc import VTCPolicy

POLICIES: dict[str, type[Policy]] = {
    cls.name: cls
    for cls in (
        FCFSPolicy,
        EDFPolicy,
        SRPTPolicy,
        LRSPolicy,
        LARSPolicy,
        KairosPolicy,
        JustitiaPolicy,
        VTCPolicy,
        SRJFPolicy,
        PriorityPolicy,
    )
}


def policy_names() -> list[str]:
    return sorted(POLICIES)


def make_policy(name: str, ctx: PolicyContext, **options) -> Policy:
    try:
        cls = POLICIES[name]
    except KeyError:
        raise ValueError(f"policy: unknown name {name!r}; choose one of {', '.join(policy_names())}") from None
    try:
        return cls(ctx, **options)
    except TypeError as e:
        if not options:
            raise
        raise ValueError(f"policy {name!r}: bad options {sorted(options)}: {e}") from None
