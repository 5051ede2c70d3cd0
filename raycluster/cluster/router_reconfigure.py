"""A new `RouterConfig` applied to a live `RouterCore`: what a redeployed Serve config changes.

The router is a detached named actor that outlives redeploys (`raycluster apply`, `serve deploy`
with new args): `deployments.app.build_app` hands it the config every time, and this
function applies what differs. Nothing in flight is dropped. Queued requests move into the new
policy's queues (it orders them from now on; a fair-queuing policy starts its accounts afresh,
and requests already running finish under accounts it never opened, which it ignores). The
short/long classifier restarts from the new prior only when its own settings change; the
pressure controller starts, stops or takes its new settings. LoRA adapters added to or dropped
from the instances' `lora_modules` are served or unloaded (those loaded at run time stay). Instances and gateways read their
own settings from their deployment's args, which Serve redeploys itself.
"""

from __future__ import annotations

import dataclasses

from raycluster.cluster.router_pressure import PressureLoop
from raycluster.cluster.router_state import RouterConfig
from raycluster.sched.boundary import LengthClassifier
from raycluster.sched.predictor import LinearBatchPredictor
from raycluster.sched.registry import make_policy


def changed_fields(old: RouterConfig, new: RouterConfig) -> list[str]:
    return [f.name for f in dataclasses.fields(RouterConfig) if getattr(old, f.name) != getattr(new, f.name)]


def reconfigure(core, cfg: RouterConfig) -> list[str]:
    """Apply `cfg` to `core` (a `RouterCore`); returns the names of the fields that changed."""
    changed = changed_fields(core.cfg, cfg)
    if not changed:
        return []
    # Built first: an unknown policy name raises before anything changed.
    policies = {q: make_policy(cfg.policy, core.ctxs[q]) for q in core.policies} if "policy" in changed else {}
    old, core.cfg = core.cfg, cfg
    if "lora" in changed:
        core.adapters.set_static(old.lora, cfg.lora)
        core.collect_adapters()
    if "slo" in changed:
        for ctx in core.ctxs.values():
            ctx.slo = cfg.slo
    if "predictor" in changed:
        core.set_predictor(LinearBatchPredictor(**cfg.predictor) if cfg.predictor else None)
    for q, new in policies.items():
        old = core.policies[q]
        while (req := old.pop()) is not None:
            new.push(req)
        core.policies[q] = new
    if "initial_l_m" in changed or "beta_prior" in changed:
        core.classifier = LengthClassifier(initial_l_m=cfg.initial_l_m, beta_prior=cfg.beta_prior)
    if "pressure" in changed:
        prev = core.pressure
        core.pressure = None if cfg.pressure is None else PressureLoop(cfg.pressure) if prev is None else \
            PressureLoop(cfg.pressure, last_move=prev.last_move, moves=prev.moves)   # keeps its cooldown and log
    if "standby_roles" in changed:
        core.topology_changed()
    core.dispatch()                 # a larger max_local_waiting (or a pool no longer on standby) frees work now
    return changed
