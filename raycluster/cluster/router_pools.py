"""Which pools take which queue's work: the router's view of its pools, from the instances alive now.

`PoolView` answers, for `RouterCore`: the live instances of some roles (cached until `changed()`:
asked on every arrival and dispatch, while the set changes only when an instance appears, leaves
or changes role), which pools are held while they have no instance (autoscaled from zero:
`cfg.standby_roles`; being deployed: `expect`), the queue a new prompt goes to, the roles that
serve a queue, and the mode an instance runs a request in. It reads the router's `instances`,
`cfg` and `clock` and changes none of them.
"""

from __future__ import annotations

from raycluster.cluster.messages import ROLES
from raycluster.cluster.router_state import Instance

PREFILL_ROLES = ("prefill-short", "prefill-long")
_SERVING_CHAIN = {"prefill-short": (("prefill-short",), ("prefill-long",), ("mixed",)),
                  "prefill-long": (("prefill-long",), ("prefill-short",), ("mixed",)),
                  "mixed": (("mixed",), PREFILL_ROLES)}


class PoolView:
    def __init__(self, core) -> None:
        self._core = core
        self._cache: dict[tuple[str, ...], list[Instance]] = {}
        self.expected: dict[str, float] = {}            # role -> until when a deploy's pool counts as present

    def changed(self) -> None:
        self._cache.clear()

    def alive(self, *roles: str) -> list[Instance]:
        """Instances serving any of `roles`. Read-only."""
        found = self._cache.get(roles)
        if found is None:
            found = self._cache[roles] = [i for i in self._core.instances.values() if i.role in roles]
        return found

    def expect(self, roles: list[str], for_s: float) -> None:
        """A deploy is (re)starting instances of `roles`: for `for_s` those pools count as present."""
        until = self._core.clock.now() + for_s
        self.expected = {r: until for r in roles}

    def held(self, role: str) -> bool:
        """A pool with no instance whose queue waits for one: standby, or a deploy's."""
        return role in self._core.cfg.standby_roles or self.expected.get(role, 0.0) > self._core.clock.now()

    def awaiting_first(self) -> bool:
        """Some held pool has no instance yet (its KV size is unknown). Asked on every arrival:
        with no standby pool and no deploy window, no clock is read."""
        if not (self._core.cfg.standby_roles or self.expected):
            return False
        return any(not self.alive(r) and self.held(r) for r in ROLES)

    def present(self, role: str) -> bool:
        """A pool that takes work now, or will: live instances, or a held pool."""
        return bool(self.alive(role)) or self.held(role)

    def route(self, length_class: str) -> str:
        """Queue for a new (or resumed) prompt given the pools present now."""
        short, long_ = self.present("prefill-short"), self.present("prefill-long")
        if length_class == "short":
            return "prefill-short" if short else "prefill-long" if long_ else "mixed"
        return "prefill-long" if long_ else "prefill-short" if short else "mixed"

    def serving_roles(self, queue: str) -> tuple[str, ...]:
        """Roles that take a queue's work: its own pool, else the nearest pool that exists
        (a queue stranded by a topology change drains instead of waiting forever)."""
        if queue == "decode":
            return ("decode",)
        if not self.alive(queue) and self.held(queue):
            return ()                           # its pool scales up from zero or is starting: hold it
        for roles in _SERVING_CHAIN[queue]:
            if self.alive(*roles):
                return roles
        return ()

    def mode_for(self, inst: Instance) -> str:
        if inst.role == "decode":
            return "decode"
        if inst.role in PREFILL_ROLES and self.alive("decode"):
            return "prefill"
        return "full"
