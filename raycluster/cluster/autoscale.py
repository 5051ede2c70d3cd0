"""Pool autoscaling with Ray Serve's autoscaler, on the router's load signals.

Requests never pass through Serve handles into pool replicas (the gateway submits them to the
router, instances long-poll it), so Serve's default metric, ongoing requests per replica, is
always zero here. A pool with `autoscaling` (config.PoolAutoscaling) is therefore deployed with
Serve's custom-metric autoscaling instead:

- Where the signal comes from: each replica's `record_autoscaling_stats` (EngineInstance) asks
  the router for two numbers (`RouterCore.autoscale_stats`) and reports them as custom metrics:
    `INSTANCE_LOAD`: requests the router has handed to this instance and not seen leave it
                     (`Instance.running`: queued or prefilling there, decoding there; a prefill
                     instance's request leaves when its prefill is done, a decode or mixed one's
                     when it finishes), in flight or applied alike;
    `POOL_QUEUE`:    requests waiting in the router's queues this instance's pool serves (new
                     prompts for a prefill or mixed pool, KV handoffs for a decode pool).
  The router is where both are true at once: it hands the work out and hears each step's
  report, so a request is counted exactly once, either queued or on one instance, also while a
  reply is in flight. Asking the router from the replica (rather than in the policy) keeps the
  policy a pure function of the context: it runs on Serve's controller, whose control loop must
  not block on another actor.
- The policy (`pool_policy`, run by Serve's controller with an `AutoscalingContext`) sums
  `INSTANCE_LOAD` over the running replicas and adds the *mean* over replicas of `POOL_QUEUE`
  (every replica reports the same pool-level queue, sampled at slightly different times; a
  mean does not depend on how many replicas have reported yet, a sum or a per-replica share
  would). Desired replicas = ceil(total load / target per instance), clamped to the capacity
  adjusted [min, max]. The target is the deployment's `target_ongoing_requests` (the unit is
  the same: requests per instance).
- Hysteresis is Serve's own: the policy's answer goes through Serve's wrapper, which applies
  `upscale_delay_s` / `downscale_delay_s` (a change must be wanted for that long), the bounds,
  and the up/down scaling factors (left at 1).

Load is counted in requests for every role, so one target unit serves prefill, decode and mixed
pools; a prefill pool's token backlog would weigh long prompts better but needs a per-role unit
(not done). Scale to zero is not supported (min_instances >= 1): a pool with no instance has no
poll to report from, and the router would route its queue elsewhere.

This module imports nothing of the project: Serve cloudpickles the policy's module by value, so
the controller can run it without the project importable.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

INSTANCE_LOAD = "raycluster_instance_load"
POOL_QUEUE = "raycluster_pool_queue"
POLICY = "raycluster.cluster.autoscale:pool_policy"


def pool_load(instance_load: Mapping[Any, float], pool_queue: Mapping[Any, float]) -> float:
    """The pool's load: every replica's own requests plus the router's queue for the pool
    (the mean of what the replicas saw: each reports the whole queue)."""
    own = sum(float(v) for v in instance_load.values())
    queued = sum(float(v) for v in pool_queue.values()) / len(pool_queue) if pool_queue else 0.0
    return own + queued


def desired_replicas(total_load: float, target: float, lo: int, hi: int) -> int:
    """ceil(total_load / target) clamped to [lo, hi] (zero load: lo)."""
    if target <= 0:
        raise ValueError(f"target per instance must be > 0, got {target}")
    want = math.ceil(max(0.0, total_load) / target - 1e-9)   # load exactly at target: no extra replica
    return max(lo, min(hi, want))


def pool_policy(ctx) -> tuple[int, dict]:
    """Serve custom autoscaling policy (`AutoscalingConfig.policy`): the replica count the
    pool's load asks for. With no replica's metrics yet (just deployed) it keeps the target."""
    metrics = ctx.aggregated_metrics or {}
    own, queue = metrics.get(INSTANCE_LOAD) or {}, metrics.get(POOL_QUEUE) or {}
    if not own and not queue:
        return ctx.target_num_replicas, ctx.policy_state
    target = ctx.config.target_ongoing_requests
    return desired_replicas(pool_load(own, queue), target, ctx.capacity_adjusted_min_replicas,
                            ctx.capacity_adjusted_max_replicas), ctx.policy_state
