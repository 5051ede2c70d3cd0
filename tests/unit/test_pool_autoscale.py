"""Autoscaled pools without Ray: the Serve policy on hand-made contexts (exact replica counts),
the router's load signal per role, config validation naming fields, the Serve options an
autoscaled pool's deployment gets, and `raycluster scale` refusing an autoscaled pool."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from pydantic import ValidationError

from raycluster.cluster.autoscale import INSTANCE_LOAD, POLICY, POOL_QUEUE, desired_replicas, pool_load, pool_policy
from raycluster.cluster.config import ClusterConfig

AUTO = {"min_instances": 1, "max_instances": 4, "target_per_instance": 2}


def ctx(own: dict, queue: dict, target=2.0, lo=1, hi=4, current=2):
    metrics = {}
    if own:
        metrics[INSTANCE_LOAD] = own
    if queue:
        metrics[POOL_QUEUE] = queue
    return SimpleNamespace(aggregated_metrics=metrics, config=SimpleNamespace(target_ongoing_requests=target),
                           capacity_adjusted_min_replicas=lo, capacity_adjusted_max_replicas=hi,
                           current_num_replicas=current, target_num_replicas=current, policy_state={"k": 1})


@pytest.mark.parametrize("own, queue, want", [
    ({"a": 2, "b": 2}, {"a": 0, "b": 0}, 2),        # at target: stays
    ({"a": 2, "b": 2}, {"a": 1, "b": 1}, 3),        # one over: one more
    ({"a": 1, "b": 0}, {"a": 0, "b": 0}, 1),        # below: one is enough
    ({"a": 0, "b": 0}, {"a": 0, "b": 0}, 1),        # zero load: min
    ({"a": 4, "b": 4}, {"a": 30, "b": 30}, 4),      # far over: max
    ({"a": 0, "b": 0}, {"a": 6, "b": 6}, 3),        # queued only: the router's queue counts (once)
    ({"a": 0, "b": 0}, {"a": 5, "b": 7}, 3),        # replicas saw the queue at different times: mean
    ({"a": 3}, {"a": 2}, 3),                        # one replica reported so far
])
def test_policy_desired_counts(own, queue, want):
    n, state = pool_policy(ctx(own, queue))
    assert n == want
    assert state == {"k": 1}


def test_policy_keeps_the_target_before_any_metrics_and_clamps_to_capacity_bounds():
    assert pool_policy(ctx({}, {}, current=3))[0] == 3
    assert pool_policy(ctx({"a": 9}, {"a": 9}, lo=1, hi=2))[0] == 2
    assert pool_policy(ctx({"a": 0}, {"a": 0}, lo=2, hi=4))[0] == 2
    assert pool_policy(ctx({"a": 5}, {"a": 0}, target=0.5))[0] == 4


def test_signal_arithmetic():
    assert pool_load({"a": 1, "b": 2}, {"a": 4, "b": 6}) == 8.0
    assert pool_load({}, {}) == 0.0
    assert desired_replicas(4, 2, 1, 9) == 2 and desired_replicas(4.01, 2, 1, 9) == 3
    assert desired_replicas(0, 2, 1, 9) == 1 and desired_replicas(100, 2, 1, 9) == 9
    with pytest.raises(ValueError):
        desired_replicas(1, 0, 1, 2)


def _core(**cfg):
    from raycluster.clock import VirtualClock
    from raycluster.cluster.router_core import RouterConfig, RouterCore

    return RouterCore(RouterConfig(policy="fcfs", **cfg), VirtualClock(0.0))


def _meta(rid: str, n: int = 8):
    from raycluster.cluster.messages import RequestMeta
    from raycluster.request import SamplingParams

    return RequestMeta(request_id=rid, gateway_id="g", prompt_token_ids=list(range(10, 10 + n)),
                       sampling=SamplingParams(max_tokens=4))


def _stats(iid: str, role: str, free: int = 1000):
    from raycluster.cluster.messages import InstanceStats

    return InstanceStats(instance_id=iid, role=role, kv_free_blocks=free, kv_total_blocks=1000, block_size=16)


def test_router_signal_counts_each_request_once_queued_or_on_its_instance():
    core = _core(max_local_waiting=2)
    core.on_poll("m0", _stats("m0", "mixed"))
    for i in range(5):
        assert core.submit(_meta(f"r{i}")).accepted
    assert core.autoscale_stats("m0", "mixed") == {INSTANCE_LOAD: 2.0, POOL_QUEUE: 3.0}   # 2 local slots, 3 queued
    assert core.autoscale_stats("new", "mixed") == {INSTANCE_LOAD: 0.0, POOL_QUEUE: 3.0}  # before its first poll
    core.remove_instance("m0")                  # stopped: its requests go back to the queue
    assert core.autoscale_stats("m0", "mixed") == {INSTANCE_LOAD: 0.0, POOL_QUEUE: 5.0}


def test_router_signal_per_role_in_pd():
    """A prefill instance's request counts until its prefill is done; then the handoff counts
    for the decode pool: queued for it (no decode KV free), then on the decode instance."""
    from raycluster.cluster.messages import PrefillDone, StepReport

    core = _core(max_local_waiting=4)
    core.on_poll("p0", _stats("p0", "prefill-short"))
    core.on_poll("d0", _stats("d0", "decode", free=0))
    assert core.submit(_meta("r0")).accepted
    assert core.autoscale_stats("p0", "prefill-short") == {INSTANCE_LOAD: 1.0, POOL_QUEUE: 0.0}
    assert core.take_outbox("p0").work[0].mode == "prefill"
    core.on_report(StepReport(_stats("p0", "prefill-short"), [], [PrefillDone("r0", 5, None)], []))
    assert core.autoscale_stats("p0", "prefill-short") == {INSTANCE_LOAD: 0.0, POOL_QUEUE: 0.0}
    assert core.autoscale_stats("d0", "decode") == {INSTANCE_LOAD: 0.0, POOL_QUEUE: 1.0}
    core.on_poll("d0", _stats("d0", "decode"))
    assert core.autoscale_stats("d0", "decode") == {INSTANCE_LOAD: 1.0, POOL_QUEUE: 0.0}


def test_config_validation_names_the_field():
    with pytest.raises(ValidationError, match=r"pools\[1\]\.autoscaling\.max_instances"):
        ClusterConfig(pools=[{"role": "prefill-short"}, {"role": "prefill-long", "autoscaling":
                                                         {"min_instances": 3, "max_instances": 2}},
                             {"role": "decode"}])
    with pytest.raises(ValidationError, match=r"pools\[0\]\.instances: the pool starts with 3"):
        ClusterConfig(pools=[{"role": "mixed", "instances": 3, "autoscaling": {"max_instances": 2}}])
    with pytest.raises(ValidationError, match=r"pools\[0\]\.autoscaling\.look_back_period_s"):
        ClusterConfig(pools=[{"role": "mixed", "autoscaling": {"max_instances": 2, "metrics_interval_s": 5,
                                                               "look_back_period_s": 5}}])
    with pytest.raises(ValidationError, match=r"pools\.0\.autoscaling\.min_instances"):     # no scale to zero
        ClusterConfig(pools=[{"role": "mixed", "autoscaling": {"min_instances": 0, "max_instances": 2}}])
    with pytest.raises(ValidationError, match=r"pools\.0\.autoscaling\.max_instances"):     # required
        ClusterConfig(pools=[{"role": "mixed", "autoscaling": {}}])
    with pytest.raises(ValidationError, match=r"pools\.0\.autoscaling\.target_per_instance"):
        ClusterConfig(pools=[{"role": "mixed", "autoscaling": {"max_instances": 2, "target_per_instance": 0}}])
    cfg = ClusterConfig(pools=[{"role": "mixed", "instances": 2, "autoscaling": AUTO}])
    assert cfg.pools[0].autoscaling.max_instances == 4 and ClusterConfig().pools[0].autoscaling is None


def test_the_pressure_controller_and_autoscaling_are_refused_together():
    pools = [{"role": "prefill-short"}, {"role": "prefill-long", "autoscaling": {"max_instances": 2}},
             {"role": "decode"}]
    with pytest.raises(ValidationError, match=r"pools\[1\]\.autoscaling: the pressure controller"):
        ClusterConfig(pools=pools, controller={"enabled": True})
    ClusterConfig(pools=pools)


def test_an_autoscaled_pool_gets_serve_autoscaling_with_the_policy_and_no_num_replicas():
    from ray.serve.config import AutoscalingConfig

    from deployments.app import pool_options
    from deployments.engine_instance import EngineInstance

    cfg = ClusterConfig(pools=[{"role": "prefill-short"},
                               {"role": "prefill-long", "instances": 2, "autoscaling": {
                                   **AUTO, "upscale_delay_s": 1, "downscale_delay_s": 7}},
                               {"role": "decode", "instances": 2}])
    fixed, auto, dec = (pool_options(cfg, p) for p in cfg.pools)
    assert fixed["num_replicas"] == 1 and "autoscaling_config" not in fixed
    assert dec["num_replicas"] == 2
    assert "num_replicas" not in auto and auto["name"] == "pool-prefill-long"
    a = AutoscalingConfig(**auto["autoscaling_config"])
    assert (a.min_replicas, a.max_replicas, a.initial_replicas) == (1, 4, 2)
    assert a.target_ongoing_requests == 2 and (a.upscale_delay_s, a.downscale_delay_s) == (1, 7)
    assert a.policy.policy_function == POLICY and not a.policy.is_default_policy_function()
    assert a.policy.get_policy() is not None        # importable and picklable by Serve
    # What Serve's deployment gets from these options.
    dep = EngineInstance.options(**auto)
    dc = dep._deployment_config
    assert dc.autoscaling_config.max_replicas == 4 and dc.autoscaling_config.policy.policy_function == POLICY
    assert EngineInstance.options(**fixed)._deployment_config.autoscaling_config is None


def test_scale_refuses_an_autoscaled_pool():
    from deployments.scaling import scaled

    app = {"name": "raycluster", "args": {"pools": [{"role": "mixed", "instances": 1,
                                                     "autoscaling": {"min_instances": 1, "max_instances": 2}}]}}
    with pytest.raises(ValueError, match="pool 'mixed' autoscales.*max_instances 2"):
        scaled(app, "mixed", 2)
    app["args"]["pools"][0]["autoscaling"] = None
    assert scaled(app, "mixed", 2)["deployments"] == [{"name": "pool-mixed", "num_replicas": 2}]
