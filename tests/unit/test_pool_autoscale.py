"""Autoscaled pools without Ray: the Serve policy on hand-made contexts (exact replica counts, in
requests and in prompt tokens), the router's load signal per role in both units, config
validation naming fields, the Serve options an autoscaled pool's deployment gets, and
`raycluster scale` refusing an autoscaled pool. Scale to zero: tests/unit/test_pool_scale_zero.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from pydantic import ValidationError

from raycluster.cluster.autoscale import (INSTANCE_LOAD, INSTANCE_TOKENS, POLICY, POOL_QUEUE, POOL_QUEUE_TOKENS,
                                          PoolPolicy, desired_replicas, pool_load)
from raycluster.cluster.config import ClusterConfig
from raycluster.cluster.router_autoscale import instance_stats, pool_stats

AUTO = {"min_instances": 1, "max_instances": 4, "target_per_instance": 2}


def ctx(own: dict, queue: dict, lo=1, hi=4, current=2, own_tok=None, queue_tok=None):
    metrics = {}
    for name, m in ((INSTANCE_LOAD, own), (POOL_QUEUE, queue), (INSTANCE_TOKENS, own_tok),
                    (POOL_QUEUE_TOKENS, queue_tok)):
        if m:
            metrics[name] = m
    return SimpleNamespace(aggregated_metrics=metrics, capacity_adjusted_min_replicas=lo,
                           capacity_adjusted_max_replicas=hi, current_num_replicas=current,
                           target_num_replicas=current, policy_state={"k": 1})


def pool_policy(c, target=2.0, tokens=None):
    return PoolPolicy(target_requests=target, target_tokens=tokens)(c)


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
    assert pool_policy(ctx({"a": 5}, {"a": 0}), target=0.5)[0] == 4


@pytest.mark.parametrize("own, queue, own_tok, queue_tok, target, tokens, want", [
    # Requests bind: 4 requests / 2 = 2 instances; 150 tokens / 100 = 2 (not more).
    ({"a": 2, "b": 2}, {"a": 0, "b": 0}, {"a": 100, "b": 50}, {"a": 0, "b": 0}, 2, 100, 2),
    # Tokens bind: 2 requests (1 instance's worth), but 250 own + mean(60, 40) = 300 tokens / 100 = 3.
    ({"a": 1, "b": 1}, {"a": 0, "b": 0}, {"a": 150, "b": 100}, {"a": 60, "b": 40}, 2, 100, 3),
    # Exactly at the token target: no extra instance.
    ({"a": 1, "b": 0}, {"a": 0, "b": 0}, {"a": 120, "b": 80}, {"a": 0, "b": 0}, 2, 100, 2),
    # One 30K-token prompt queued, nothing running: the token target scales where requests would not.
    ({"a": 0}, {"a": 1}, {"a": 0}, {"a": 30000}, 4, 8192, 4),
    # Tokens only (target_per_instance null): 9 requests do not count, 250 tokens / 100 do.
    ({"a": 5, "b": 4}, {"a": 0, "b": 0}, {"a": 200, "b": 50}, {"a": 0, "b": 0}, None, 100, 3),
    # Without a token target the token metrics are ignored.
    ({"a": 1, "b": 1}, {"a": 0, "b": 0}, {"a": 9000, "b": 9000}, {"a": 0, "b": 0}, 2, None, 1),
])
def test_policy_token_weighted_counts(own, queue, own_tok, queue_tok, target, tokens, want):
    n, state = pool_policy(ctx(own, queue, own_tok=own_tok, queue_tok=queue_tok), target=target, tokens=tokens)
    assert n == want and state == {"k": 1}


def test_policy_needs_a_target():
    with pytest.raises(ValueError, match="target_requests, target_tokens"):
        PoolPolicy(target_requests=None, target_tokens=None)


def test_signal_arithmetic():
    assert pool_load({"a": 1, "b": 2}, {"a": 4, "b": 6}) == 8.0
    assert pool_load({}, {}) == 0.0
    assert desired_replicas(4, 2, 1, 9) == 2 and desired_replicas(4.01, 2, 1, 9) == 3
    assert desired_replicas(0, 2, 1, 9) == 1 and desired_replicas(100, 2, 1, 9) == 9
    with pytest.raises(ValueError):
        desired_replicas(1, 0, 1, 2)
    assert desired_replicas(3, 2, 1, 9, tokens=450, target_tokens=100) == 5      # max(2, 5)
    assert desired_replicas(9, 2, 1, 9, tokens=450, target_tokens=100) == 5      # max(5, 5)
    assert desired_replicas(9, None, 0, 9, tokens=0, target_tokens=100) == 0


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


def reqs(core, iid: str, role: str) -> dict:
    """The request-count half of a replica's signal."""
    st = instance_stats(core, iid, role)
    return {INSTANCE_LOAD: st[INSTANCE_LOAD], POOL_QUEUE: st[POOL_QUEUE]}


def toks(core, iid: str, role: str) -> tuple[float, float]:
    """The token half: (instance backlog, pool queue)."""
    st = instance_stats(core, iid, role)
    return st[INSTANCE_TOKENS], st[POOL_QUEUE_TOKENS]


def test_router_signal_counts_each_request_once_queued_or_on_its_instance():
    core = _core(max_local_waiting=2)
    core.on_poll("m0", _stats("m0", "mixed"))
    for i in range(5):
        assert core.submit(_meta(f"r{i}")).accepted
    assert reqs(core, "m0", "mixed") == {INSTANCE_LOAD: 2.0, POOL_QUEUE: 3.0}   # 2 local slots, 3 queued
    assert reqs(core, "new", "mixed") == {INSTANCE_LOAD: 0.0, POOL_QUEUE: 3.0}  # before its first poll
    core.remove_instance("m0")                  # stopped: its requests go back to the queue
    assert reqs(core, "m0", "mixed") == {INSTANCE_LOAD: 0.0, POOL_QUEUE: 5.0}


def test_router_signal_per_role_in_pd():
    """A prefill instance's request counts until its prefill is done; then the handoff counts
    for the decode pool: queued for it (no decode KV free), then on the decode instance."""
    from raycluster.cluster.messages import PrefillDone, StepReport

    core = _core(max_local_waiting=4)
    core.on_poll("p0", _stats("p0", "prefill-short"))
    core.on_poll("d0", _stats("d0", "decode", free=0))
    assert core.submit(_meta("r0")).accepted
    assert reqs(core, "p0", "prefill-short") == {INSTANCE_LOAD: 1.0, POOL_QUEUE: 0.0}
    assert core.take_outbox("p0").work[0].mode == "prefill"
    core.on_report(StepReport(_stats("p0", "prefill-short"), [], [PrefillDone("r0", 5, None)], []))
    assert reqs(core, "p0", "prefill-short") == {INSTANCE_LOAD: 0.0, POOL_QUEUE: 0.0}
    assert reqs(core, "d0", "decode") == {INSTANCE_LOAD: 0.0, POOL_QUEUE: 1.0}
    core.on_poll("d0", _stats("d0", "decode"))
    assert reqs(core, "d0", "decode") == {INSTANCE_LOAD: 1.0, POOL_QUEUE: 0.0}


def test_router_token_signal_follows_prompts_from_queue_to_outbox_transit_and_backlog():
    """Tokens still to prefill, counted once: queued in the router, in the instance's outbox, in
    transit (handed out, not in its stats yet), then in its reported backlog; a re-queued
    request counts its prompt plus the tokens it had delivered (it recomputes both)."""
    from raycluster.cluster.messages import StepReport, TokenEvent

    core = _core(max_local_waiting=2)
    core.on_poll("m0", _stats("m0", "mixed"))
    for i, n in enumerate((10, 20, 30, 40, 50)):
        assert core.submit(_meta(f"r{i}", n)).accepted
    assert toks(core, "m0", "mixed") == (30.0, 120.0)          # r0 + r1 in its outbox; r2..r4 queued
    assert len(core.take_outbox("m0").work) == 2
    assert toks(core, "m0", "mixed") == (30.0, 120.0)          # in transit now
    s = _stats("m0", "mixed")
    s.queued_tokens, s.waiting, s.work_seen = 30, 2, 2
    core.on_poll("m0", s)                                       # applied: its stats carry them
    assert not core.instances["m0"].transit
    assert toks(core, "m0", "mixed") == (30.0, 120.0)
    s = _stats("m0", "mixed")
    s.queued_tokens, s.running, s.work_seen = 0, 2, 2
    core.on_report(StepReport(s, [TokenEvent("r0", [7, 8], False, None), TokenEvent("r1", [9], False, None)], [], []))
    # r0, r1 prefilled and decoding: their slots went to r2 + r3 (in its outbox); r4 still queued.
    assert toks(core, "m0", "mixed") == (70.0, 50.0)
    assert pool_stats(core, "mixed") == {INSTANCE_LOAD: 4.0, POOL_QUEUE: 1.0, INSTANCE_TOKENS: 70.0,
                                         POOL_QUEUE_TOKENS: 50.0}
    core.remove_instance("m0")          # all back: r0 (10 + 2 delivered), r1 (20 + 1), 30, 40, 50
    assert toks(core, "m0", "mixed") == (0.0, 153.0)
    assert pool_stats(core, "mixed") == {INSTANCE_LOAD: 0.0, POOL_QUEUE: 5.0, INSTANCE_TOKENS: 0.0,
                                         POOL_QUEUE_TOKENS: 153.0}


def test_router_token_signal_in_pd_counts_prompts_for_prefill_and_none_for_handoffs():
    from raycluster.cluster.messages import PrefillDone, StepReport

    core = _core(max_local_waiting=1)
    core.on_poll("p0", _stats("p0", "prefill-short"))
    core.on_poll("d0", _stats("d0", "decode", free=0))
    assert core.submit(_meta("r0", 12)).accepted and core.submit(_meta("r1", 40)).accepted
    assert toks(core, "p0", "prefill-short") == (12.0, 40.0)
    assert toks(core, "d0", "decode") == (0.0, 0.0)
    core.take_outbox("p0")
    core.on_report(StepReport(_stats("p0", "prefill-short"), [], [PrefillDone("r0", 5, None)], []))
    assert toks(core, "p0", "prefill-short") == (40.0, 0.0)    # r1 dispatched in r0's place
    assert reqs(core, "d0", "decode") == {INSTANCE_LOAD: 0.0, POOL_QUEUE: 1.0}
    assert toks(core, "d0", "decode") == (0.0, 0.0)            # a queued handoff has no prompt to compute


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
    with pytest.raises(ValidationError, match=r"pools\.0\.autoscaling\.min_instances"):
        ClusterConfig(pools=[{"role": "mixed", "autoscaling": {"min_instances": -1, "max_instances": 2}}])
    pd = [{"role": "prefill-short"}, {"role": "prefill-long"}]
    with pytest.raises(ValidationError, match=r"pools\[2\]\.autoscaling\.target_tokens_per_instance: a decode pool"):
        ClusterConfig(pools=pd + [{"role": "decode", "autoscaling": {"max_instances": 2,
                                                                      "target_tokens_per_instance": 4096}}])
    with pytest.raises(ValidationError, match=r"pools\.0\.autoscaling\.target_tokens_per_instance"):
        ClusterConfig(pools=[{"role": "mixed", "autoscaling": {"max_instances": 2, "target_tokens_per_instance": 0}}])
    with pytest.raises(ValidationError, match=r"pools\[0\]\.autoscaling\.target_per_instance: null needs"):
        ClusterConfig(pools=[{"role": "mixed", "autoscaling": {"max_instances": 2, "target_per_instance": None}}])
    ok = ClusterConfig(pools=pd + [{"role": "decode", "autoscaling": {"max_instances": 2}}])
    ok = ClusterConfig(pools=[{"role": "prefill-short", "autoscaling": {"max_instances": 2, "target_per_instance": None,
                                                                        "target_tokens_per_instance": 4096}},
                              {"role": "decode"}])
    assert ok.pools[0].autoscaling.target_tokens_per_instance == 4096
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
                                   **AUTO, "upscale_delay_s": 1, "downscale_delay_s": 7,
                                   "target_tokens_per_instance": 3000}},
                               {"role": "decode", "instances": 2}])
    fixed, auto, dec = (pool_options(cfg, p) for p in cfg.pools)
    assert fixed["num_replicas"] == 1 and "autoscaling_config" not in fixed
    assert dec["num_replicas"] == 2
    assert "num_replicas" not in auto and auto["name"] == "pool-prefill-long"
    a = AutoscalingConfig(**auto["autoscaling_config"])
    assert (a.min_replicas, a.max_replicas, a.initial_replicas) == (1, 4, 2)
    assert a.target_ongoing_requests == 2 and (a.upscale_delay_s, a.downscale_delay_s) == (1, 7)
    assert a.policy.policy_function == POLICY and not a.policy.is_default_policy_function()
    assert a.policy.policy_kwargs == {"target_requests": 2, "target_tokens": 3000, "role": "prefill-long",
                                      "router_name": "raycluster-router", "namespace": "raycluster",
                                      "probe_interval_s": 2.0}
    # As Serve's controller makes it: the class from its cloudpickled bytes, with the kwargs.
    from ray.serve._private.autoscaling_state import _resolve_policy_callable
    pol = _resolve_policy_callable(a.policy)
    assert (pol.target_requests, pol.target_tokens, pol.probe.role) == (2, 3000, "prefill-long")
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


def test_apply_keeps_resized_pools_unless_a_whole_app_file_replaces_them():
    from deployments.scaling import applied

    app = {"name": "raycluster", "args": {"policy": "lars", "pools": [{"role": "mixed", "instances": 1}]},
           "deployments": [{"name": "pool-mixed", "num_replicas": 2}]}
    new = {**app["args"], "policy": "edf"}
    kept = applied(app, new, replace=False)
    assert kept["args"]["policy"] == "edf" and kept["deployments"] == app["deployments"]
    assert "deployments" not in applied(app, new, replace=True)
    assert app["args"]["policy"] == "lars"              # the deployed config is not modified
