"""Scale to zero without Ray: the policy's decisions at zero running replicas (from its router
probe), the probe never waiting on the router, Serve's own wrapper taking a pool 0 -> 1 at once
and 1 -> 0 only after downscale_to_zero_delay_s, the router holding a standby pool's requests
(bounded, then dispatched to its first instance), and the config of a pool that scales to zero."""

from __future__ import annotations

import concurrent.futures
from types import SimpleNamespace

import pytest
from pydantic import ValidationError

from raycluster.cluster.autoscale import (INSTANCE_LOAD, INSTANCE_TOKENS, POOL_QUEUE, POOL_QUEUE_TOKENS, PoolPolicy,
                                          _Probe)
from raycluster.cluster.config import ClusterConfig
from test_pool_autoscale import _core, _meta, _stats     # a router on a virtual clock, requests, polls


class FakeProbe:
    def __init__(self, seen):
        self.seen, self.calls = seen, 0

    def poll(self):
        self.calls += 1
        return self.seen

    def reset(self):
        self.seen = None


def seen(load=0.0, queue=0.0, tokens=0.0, queue_tokens=0.0) -> dict:
    return {INSTANCE_LOAD: load, POOL_QUEUE: queue, INSTANCE_TOKENS: tokens, POOL_QUEUE_TOKENS: queue_tokens}


def ctx(current=0, target=0, lo=0, hi=3, metrics=None):
    return SimpleNamespace(aggregated_metrics=metrics or {}, capacity_adjusted_min_replicas=lo,
                           capacity_adjusted_max_replicas=hi, current_num_replicas=current,
                           target_num_replicas=target, policy_state={"s": 1})


def policy(probe_seen, target=2.0, tokens=None) -> PoolPolicy:
    pol = PoolPolicy(target_requests=target, target_tokens=tokens, role="mixed", router_name="r")
    pol.probe = FakeProbe(probe_seen)
    return pol


@pytest.mark.parametrize("probe_seen, tokens, want", [
    (seen(queue=1), None, 1),                       # one request waiting: the first instance
    (seen(queue=5), None, 3),                       # 5 / 2 -> 3
    (seen(load=1, queue=2), None, 2),               # a starting replica took one already: pool-wide load
    (seen(), None, 0),                              # idle: zero
    (seen(queue=1, queue_tokens=9000), 4096, 3),    # one long prompt: tokens bind
    (None, None, 0),                                # no answer yet: keep the target (0)
])
def test_policy_at_zero_replicas_decides_from_the_router_probe(probe_seen, tokens, want):
    pol = policy(probe_seen, tokens=tokens)
    assert pol(ctx()) == (want, {"s": 1})
    assert pol.probe.calls == 1


def test_policy_with_running_replicas_uses_their_metrics_not_the_probe():
    pol = policy(seen(queue=50))
    # Running but not reported yet: keep the size, no probe (its view lacks nothing, but Serve's
    # window over the replicas' reports is what the pool is sized by while it has replicas).
    assert pol(ctx(current=1, target=1, lo=0))[0] == 1 and pol.probe.calls == 0
    metrics = {INSTANCE_LOAD: {"a": 0.0}, POOL_QUEUE: {"a": 0.0}}
    assert pol(ctx(current=1, target=1, lo=0, metrics=metrics))[0] == 0 and pol.probe.calls == 0


def test_a_policy_without_router_name_has_no_probe():
    assert PoolPolicy(target_requests=2).probe is None
    assert PoolPolicy(target_requests=2)(ctx(target=1))[0] == 1


class _Call:
    """A stand-in router call: `.future()` is a concurrent Future the test completes."""

    def __init__(self, log):
        self.fut = concurrent.futures.Future()
        log.append(self)

    def future(self):
        return self.fut


def _probe(now):
    calls = []
    probe = _Probe("r", "ns", "mixed", interval_s=1.0, max_age_s=5.0, clock=lambda: now[0])
    probe.handle = SimpleNamespace(pool_autoscale_stats=SimpleNamespace(remote=lambda role: _Call(calls)))
    return probe, calls


def test_probe_never_waits_one_call_in_flight_at_most_and_answers_go_stale():
    now = [100.0]
    probe, calls = _probe(now)
    assert probe.poll() is None and len(calls) == 1         # started, not answered: no waiting
    now[0] += 5
    assert probe.poll() is None and len(calls) == 1         # still in flight: no second call
    calls[0].fut.set_result(seen(queue=3))
    assert probe.poll() == seen(queue=3) and len(calls) == 2    # read, and the next one started
    now[0] += 0.5
    calls[1].fut.set_result(seen(queue=1))
    assert probe.poll() == seen(queue=1) and len(calls) == 2    # interval not over: no new call
    now[0] += 1.0
    assert probe.poll() == seen(queue=1) and len(calls) == 3
    now[0] += 6.0                                               # last answer now older than max_age_s
    assert probe.poll() is None
    now[0] += 20.0
    calls[-1].fut.set_result(seen(queue=9))                     # asked 26 s ago, answered now: too old
    assert probe.poll() is None and len(calls) == 4


def test_probe_max_age_covers_a_few_intervals():
    assert _Probe("r", "ns", "mixed", interval_s=0.5).max_age_s == 10.0
    assert _Probe("r", "ns", "mixed", interval_s=8.0).max_age_s == 24.0


def test_probe_failure_drops_the_handle_and_looks_the_router_up_again(monkeypatch):
    import ray

    now = [0.0]
    probe, calls = _probe(now)
    probe.poll()
    calls[0].fut.set_exception(RuntimeError("router died"))
    found = []
    monkeypatch.setattr(ray, "get_actor", lambda name, namespace: found.append((name, namespace)) or
                        SimpleNamespace(pool_autoscale_stats=SimpleNamespace(remote=lambda role: _Call(calls))))
    now[0] += 1.0
    assert probe.poll() is None                                 # the failed call: no answer
    for _ in range(50):                                         # the lookup runs on its own thread
        if len(calls) == 2:
            break
        if probe.lookup is not None:
            probe.lookup.result(timeout=5)
        now[0] += 1.0
        probe.poll()
    assert found == [("r", "ns")] and probe.handle is not None and len(calls) == 2


def test_an_answer_from_before_the_replicas_ran_is_not_used_when_the_pool_is_back_at_zero():
    """0 -> 1 on a queued request; the replica serves it; 1 -> 0: the probe's last answer (the
    request queued) is from the previous zero period and must not scale the pool straight up."""
    now = [0.0]
    probe, calls = _probe(now)
    pol = PoolPolicy(target_requests=2, role="mixed", router_name="r")
    pol.probe = probe
    assert pol(ctx())[0] == 0 and len(calls) == 1          # asked, no answer yet: keep 0
    calls[0].fut.set_result(seen(queue=1))
    now[0] += 1.0
    assert pol(ctx())[0] == 1                               # the request: first replica
    late = calls[-1]                                        # in flight while the replica starts
    assert len(calls) == 2 and not late.fut.done()
    now[0] += 2.0
    metrics = {INSTANCE_LOAD: {"a": 0.0}, POOL_QUEUE: {"a": 0.0}}
    assert pol(ctx(current=1, target=1, metrics=metrics))[0] == 0      # served, idle
    late.fut.set_result(seen(load=1))                       # answers from before: dropped
    now[0] += 0.5
    assert pol(ctx(current=0, target=0))[0] == 0            # back at zero: a fresh question
    calls[-1].fut.set_result(seen())
    assert pol(ctx(current=0, target=0))[0] == 0


def test_serve_wrapper_scales_from_zero_at_once_and_to_zero_after_its_delay():
    """The policy as Serve's controller runs it: wrapped by `_apply_autoscaling_config`, with
    Serve's delays (upscale 30 s would hold 0 -> 1 back if it applied; it does not)."""
    from ray.serve.autoscaling_policy import _apply_autoscaling_config
    from ray.serve.config import AutoscalingConfig

    cfg = AutoscalingConfig(min_replicas=0, max_replicas=2, initial_replicas=0, upscale_delay_s=30,
                            downscale_delay_s=60, downscale_to_zero_delay_s=0.3, metrics_interval_s=0.1,
                            look_back_period_s=1)
    pol = policy(seen(queue=1))
    wrapped = _apply_autoscaling_config(pol)

    def run(current, target, metrics=None, state=None):
        c = SimpleNamespace(aggregated_metrics=metrics or {}, capacity_adjusted_min_replicas=0,
                            capacity_adjusted_max_replicas=2, current_num_replicas=current,
                            target_num_replicas=target, policy_state=dict(state or {}), config=cfg,
                            total_num_requests=0.0)
        return wrapped(c)

    n, state = run(0, 0)
    assert n == 1                                           # at once from zero
    idle = {INSTANCE_LOAD: {"a": 0.0}, POOL_QUEUE: {"a": 0.0}}
    n, state = run(1, 1, idle)
    assert n == 1                                           # 1 -> 0 must be wanted for 0.3 s
    import time
    time.sleep(0.35)
    n, state = run(1, 1, idle, state)
    assert n == 0


def test_router_holds_a_standby_pools_requests_bounded_until_its_first_instance():
    from raycluster.cluster.router_autoscale import pool_stats

    assert _core().submit(_meta("x")).reason == "no instances"      # no standby pool: refused as before
    core = _core(standby_roles=("mixed",), max_queue=3)
    for i in range(3):
        assert core.submit(_meta(f"r{i}", 10 * (i + 1))).accepted
    refused = core.submit(_meta("r3"))
    assert not refused.accepted and refused.reason == "queue full"  # the usual admission bound
    assert pool_stats(core, "mixed") == {INSTANCE_LOAD: 0.0, POOL_QUEUE: 3.0, INSTANCE_TOKENS: 0.0,
                                         POOL_QUEUE_TOKENS: 60.0}
    reply = core.on_poll("m0", _stats("m0", "mixed"))                # the first instance registers
    assert [w.meta.request_id for w in reply.work] == ["r0", "r1"]   # max_local_waiting 2
    core.remove_instance("m0")                                       # scaled back to zero: held again
    assert core.queue_depth() == 3 and core.placements()["r0"]["queue"] == "mixed"
    assert core.submit(_meta("r4", 1)).reason == "queue full"


def test_router_holds_a_standby_prefill_pool_queue_instead_of_routing_it_to_the_other_pool():
    core = _core(standby_roles=("prefill-short",), initial_l_m=100)
    core.on_poll("p-long", _stats("p-long", "prefill-long"))
    core.on_poll("d0", _stats("d0", "decode"))
    assert core.submit(_meta("short", 20)).accepted and core.submit(_meta("long", 200)).accepted
    where = core.placements()
    assert where["short"]["queue"] == "prefill-short" and where["short"]["instance"] is None
    assert where["long"]["instance"] == "p-long"
    core.on_poll("p-short", _stats("p-short", "prefill-short"))
    assert core.placements()["short"]["instance"] == "p-short"
    # Without the standby role the short prompt would have gone to the long pool (as before).
    core = _core(initial_l_m=100)
    core.on_poll("p-long", _stats("p-long", "prefill-long"))
    core.on_poll("d0", _stats("d0", "decode"))
    assert core.submit(_meta("short", 20)).accepted and core.placements()["short"]["instance"] == "p-long"


def test_config_of_a_pool_that_scales_to_zero():
    from ray.serve.config import AutoscalingConfig

    from deployments.app import pool_options, router_config

    auto = {"min_instances": 0, "max_instances": 2, "downscale_to_zero_delay_s": 15}
    cfg = ClusterConfig(pools=[{"role": "mixed", "instances": 0, "autoscaling": auto}])
    assert cfg.standby_roles() == ("mixed",) and [p.role for p in cfg.deployed_pools()] == ["mixed"]
    assert router_config(cfg).standby_roles == ("mixed",)
    a = AutoscalingConfig(**pool_options(cfg, cfg.pools[0])["autoscaling_config"])
    assert (a.min_replicas, a.initial_replicas, a.downscale_to_zero_delay_s) == (0, 0, 15)
    assert router_config(ClusterConfig()).standby_roles == ()
    pd = [{"role": "prefill-short", "instances": 0, "autoscaling": {"min_instances": 0, "max_instances": 1}},
          {"role": "decode"}]
    assert ClusterConfig(pools=pd).standby_roles() == ("prefill-short",)
    with pytest.raises(ValidationError, match=r"pools\[1\]\.autoscaling\.min_instances: a decode pool cannot scale"):
        ClusterConfig(pools=[pd[0], {"role": "decode", "instances": 0,
                                     "autoscaling": {"min_instances": 0, "max_instances": 1}}])
    with pytest.raises(ValidationError, match=r"pools\[0\]\.autoscaling\.downscale_to_zero_delay_s"):
        ClusterConfig(pools=[{"role": "mixed", "autoscaling": {"max_instances": 2, "downscale_to_zero_delay_s": 5}}])
    with pytest.raises(ValidationError, match="at least one pool needs instances"):
        ClusterConfig(pools=[{"role": "mixed", "instances": 0}])


def test_gateway_is_healthy_with_no_instance_only_when_a_pool_scales_from_zero():
    import asyncio

    from raycluster.cluster.client import ClusterClient
    from raycluster.cluster.messages import GatewayReply

    async def health(status: dict) -> bool:
        async def pull(gid, timeout):
            await asyncio.sleep(timeout)
            return GatewayReply([], 0, 8, "")

        async def get_status():
            return status

        c = ClusterClient(submit=None, abort=None, pull=pull, status=get_status, tokenizer=None,
                          max_model_len=64, vocab_size=100, eos_token_ids=(0,), pull_timeout_s=0.01)
        ok, _ = await c.health()
        c._pull_task.cancel()
        return ok

    assert asyncio.run(health({"instances": [], "config": {"standby_roles": ["mixed"]}}))
    assert not asyncio.run(health({"instances": [], "config": {"standby_roles": []}}))
    assert asyncio.run(health({"instances": [{"id": "m0"}], "config": {}}))
