"""Pool autoscaling with Ray Serve's autoscaler, on the router's load signals.

Requests never pass through Serve handles into pool replicas (the gateway submits them to the
router, instances long-poll it), so Serve's default metric, ongoing requests per replica, is
always zero here. A pool with `autoscaling` (config.PoolAutoscaling) is therefore deployed with
Serve's custom-metric autoscaling and a class policy, `PoolPolicy`, which Serve instantiates once
per deployment on its controller with the pool's `policy_kwargs` (targets, role, router name).

- Where the signal comes from: each replica's `record_autoscaling_stats` (EngineInstance) asks
  the router for four numbers (`router_autoscale.instance_stats`) and reports them as custom
  metrics:
    `INSTANCE_LOAD`:   requests the router has handed to this instance and not seen leave it
                       (`Instance.running`: queued or prefilling there, decoding there; a prefill
                       instance's request leaves when its prefill is done, a decode or mixed
                       one's when it finishes), in flight or applied alike;
    `POOL_QUEUE`:      requests waiting in the router's queues this instance's pool serves (new
                       prompts for a prefill or mixed pool, KV handoffs for a decode pool);
    `INSTANCE_TOKENS`: prompt tokens still to prefill on this instance (its reported prefill
                       backlog plus the prompts handed to it that its report does not show yet,
                       in transit or in its outbox: what placement's `load_key` weighs);
    `POOL_QUEUE_TOKENS`: prompt tokens of the requests in `POOL_QUEUE` (prompt plus tokens
                       already delivered, which a resumed request recomputes; handoffs: none).
  The router is where these are true at once: it hands the work out and hears each step's
  report, so a request is counted exactly once, either queued or on one instance, also while a
  reply is in flight. Asking the router from the replica keeps Serve's controller loop from
  ever waiting on another actor.
- With no running replica (a pool scaled to zero) no replica reports anything, so the policy
  probes the router itself for the whole pool's load (`RouterActor.pool_autoscale_stats(role)`:
  the same four numbers summed over the pool's registered instances, which includes a replica
  that polls while Serve still counts it as starting), without blocking: each call starts at most one
  router call and reads the previous one only if it has finished (the Serve controller calls the
  policy from its event loop; Serve's own queue-length policy for task consumers polls its
  broker the same way, one in-flight task at a time). The probe's answer is used only while
  no replica metrics are there; it drives 0 -> 1, and Serve scales a pool at zero up at once
  (no `upscale_delay_s` from zero).
- The decision (`desired_replicas`): the pool's request load is the sum of `INSTANCE_LOAD` over
  the running replicas plus the *mean* over replicas of `POOL_QUEUE` (every replica reports the
  same pool-level queue, sampled at slightly different times; a mean does not depend on how many
  replicas have reported yet, a sum or a per-replica share would); its token load likewise from
  the two token metrics. Desired replicas = the larger of ceil(request load / target requests)
  and ceil(token load / target tokens), for whichever targets are set, clamped to the capacity
  adjusted [min, max]. The larger, not the sum: both measure the same work, each bounds a
  different resource (slots and batch seats vs. prefill compute time), and the pool needs enough
  instances for the one that binds; a sum would count a request twice.
- Hysteresis is Serve's own: the policy's answer goes through Serve's wrapper, which applies
  `upscale_delay_s` / `downscale_delay_s` / `downscale_to_zero_delay_s` (a change must be
  wanted for that long; 1 -> 0 uses the last), the bounds, and the scaling factors (left at 1).

This module imports nothing of the project (and Ray only inside the probe): Serve cloudpickles
the policy's module by value, so the controller can run it without the project importable.
"""

from __future__ import annotations

import math
import time
from typing import Any, Mapping

INSTANCE_LOAD = "raycluster_instance_load"
POOL_QUEUE = "raycluster_pool_queue"
INSTANCE_TOKENS = "raycluster_instance_tokens"
POOL_QUEUE_TOKENS = "raycluster_pool_queue_tokens"
POLICY = "raycluster.cluster.autoscale:PoolPolicy"


def pool_load(instance_load: Mapping[Any, float], pool_queue: Mapping[Any, float]) -> float:
    """The pool's load in one unit: every replica's own plus the router's queue for the pool
    (the mean of what the replicas saw: each reports the whole queue)."""
    own = sum(float(v) for v in instance_load.values())
    queued = sum(float(v) for v in pool_queue.values()) / len(pool_queue) if pool_queue else 0.0
    return own + queued


def ceil_ratio(load: float, target: float) -> int:
    """ceil(load / target); load exactly at target asks for no extra replica."""
    if target <= 0:
        raise ValueError(f"target per instance must be > 0, got {target}")
    return math.ceil(max(0.0, load) / target - 1e-9)


def desired_replicas(total_load: float, target: float, lo: int, hi: int, tokens: float = 0.0,
                     target_tokens: float | None = None) -> int:
    """The larger of ceil(total_load / target) and, with `target_tokens`, ceil(tokens /
    target_tokens), clamped to [lo, hi]. A None `target` leaves the request count out."""
    want = ceil_ratio(total_load, target) if target is not None else 0
    if target_tokens is not None:
        want = max(want, ceil_ratio(tokens, target_tokens))
    return max(lo, min(hi, want))


class PoolPolicy:
    """Serve's custom autoscaling policy for one pool (`AutoscalingPolicy.policy_function`,
    instantiated with `policy_kwargs`): `__call__(ctx)` returns (replicas, policy state).

    `target_requests` / `target_tokens`: per-instance targets (either may be None, not both).
    `role`, `router_name`, `namespace`: where `_Probe` asks for the pool's queue when no replica
    reports (None `router_name`: no probe, as for a pool that never scales to zero)."""

    def __init__(self, target_requests: float | None = 4.0, target_tokens: float | None = None,
                 role: str = "mixed", router_name: str | None = None, namespace: str = "raycluster",
                 probe_interval_s: float = 1.0) -> None:
        if target_requests is None and target_tokens is None:
            raise ValueError("PoolPolicy: set target_requests, target_tokens or both")
        self.target_requests, self.target_tokens = target_requests, target_tokens
        self.probe = _Probe(router_name, namespace, role, probe_interval_s) if router_name else None

    def __call__(self, ctx) -> tuple[int, dict]:
        metrics = ctx.aggregated_metrics or {}
        own, queue = metrics.get(INSTANCE_LOAD) or {}, metrics.get(POOL_QUEUE) or {}
        own_tok, queue_tok = metrics.get(INSTANCE_TOKENS) or {}, metrics.get(POOL_QUEUE_TOKENS) or {}
        lo, hi = ctx.capacity_adjusted_min_replicas, ctx.capacity_adjusted_max_replicas
        if ctx.current_num_replicas > 0 and self.probe is not None:
            # Its answers describe a zero-replica period that is over: the next one must start
            # afresh (an answer kept from just before the first replica ran would show the
            # request that replica has long served, and scale the pool straight back up from 0).
            self.probe.reset()
        if own or queue:
            return desired_replicas(pool_load(own, queue), self.target_requests, lo, hi,
                                    pool_load(own_tok, queue_tok), self.target_tokens), ctx.policy_state
        # No running replica, so no metrics: the router's own view of the whole pool (its queue
        # plus what instances still starting may have taken from it), if the probe has one.
        # Replicas running but not reported yet: keep the size until they do.
        seen = self.probe.poll() if self.probe is not None and ctx.current_num_replicas == 0 else None
        if seen is None:
            return ctx.target_num_replicas, ctx.policy_state
        load = float(seen.get(INSTANCE_LOAD, 0.0)) + float(seen.get(POOL_QUEUE, 0.0))
        tokens = float(seen.get(INSTANCE_TOKENS, 0.0)) + float(seen.get(POOL_QUEUE_TOKENS, 0.0))
        return desired_replicas(load, self.target_requests, lo, hi, tokens, self.target_tokens), ctx.policy_state


class _Probe:
    """The pool's load as the router sees it, read from Serve's controller without ever
    waiting: `poll()` starts a router call when none is in flight (at most every `interval_s`)
    and returns the latest finished answer (None before the first, or when it was asked more
    than `max_age_s` ago: a router slow to answer must not leave an old view standing).
    The actor lookup runs on a thread (it is a blocking GCS call); a failed call drops the
    handle so the next one looks the router up again (it may have been replaced)."""

    def __init__(self, router_name: str, namespace: str, role: str, interval_s: float,
                 max_age_s: float | None = None, clock=time.monotonic) -> None:
        self.router_name, self.namespace, self.role = router_name, namespace, role
        self.interval_s, self.clock = interval_s, clock
        self.max_age_s = max_age_s if max_age_s is not None else max(10.0, 3 * interval_s)
        self.handle = None
        self.lookup = None           # concurrent Future of the actor lookup
        self.inflight = None         # concurrent Future of the router call
        self.started = -math.inf
        self.latest: tuple[float, dict] | None = None

    def reset(self) -> None:
        """Forget every answer, and the call in flight (its answer would be from before now)."""
        self.latest, self.inflight, self.started = None, None, -math.inf

    def poll(self) -> dict | None:
        now = self.clock()
        if self.inflight is not None and self.inflight.done():
            try:
                self.latest = (self.started, dict(self.inflight.result()))     # as of when asked
            except Exception:       # router restarting or gone: find it again next time
                self.handle = None
            self.inflight = None
        if self.inflight is None and now - self.started >= self.interval_s:
            self._start(now)
        if self.latest is None or now - self.latest[0] > self.max_age_s:
            return None
        return self.latest[1]

    def _start(self, now: float) -> None:
        if self.handle is None:
            if self.lookup is None:
                import concurrent.futures

                import ray
                pool = concurrent.futures.ThreadPoolExecutor(max_workers=1)
                self.lookup = pool.submit(ray.get_actor, self.router_name, namespace=self.namespace)
                pool.shutdown(wait=False)
            if not self.lookup.done():
                return
            try:
                self.handle = self.lookup.result()
            except Exception:       # not there (yet): look again on the next call
                self.lookup = None
                self.started = now
                return
            self.lookup = None
        self.started = now
        try:
            # ObjectRef.future(): a concurrent Future completed by Ray's callback, read with done().
            self.inflight = self.handle.pool_autoscale_stats.remote(self.role).future()
        except Exception:           # a handle Ray no longer accepts calls on: look the router up again
            self.handle = None
