"""Policies by name. `make_policy("lars", ctx)`; unknown names raise ValueError listing the known ones."""

from __future__ import annotations

from raycluster.sched.base import Policy, PolicyContext
from raycluster.sched.policies.fcfs import FCFSPolicy

POLICIES: dict[str, type[Policy]] = {
    cls.name: cls
    for cls in (
        FCFSPolicy,
    )
}


def policy_names() -> list[str]:
    return sorted(POLICIES)


def make_policy(name: str, ctx: PolicyContext) -> Policy:
    try:
        cls = POLICIES[name]
    except KeyError:
        raise ValueError(f"policy: unknown name {name!r}; choose one of {', '.join(policy_names())}") from None
    return cls(ctx)
