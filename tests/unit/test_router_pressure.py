"""The PLA pressure controller on the router's state, without Ray: the signals it reads (checked
by hand), the move it makes when short prompts pile up, how the moved instance learns its new
role (and why stale stats cannot undo it), and that the requests still all finish; with
`decode` balancing, a decode backlog pulls a prefill instance into the decode pool and a prefill
backlog sends it back."""

import pytest

from raycluster.clock import VirtualClock
from raycluster.cluster.messages import InstanceStats, PrefillDone, StepReport, TokenEvent
from raycluster.kv_transfer.base import KVHandle
from raycluster.cluster.router_core import RouterConfig, RouterCore
from raycluster.cluster.router_pressure import decode_signals, pressure_signals
from raycluster.request import SamplingParams
from raycluster.sched.pressure import PressureConfig


def stats(iid, role, waiting=0, busy_s=0.0, work_seen=None):
    return InstanceStats(instance_id=iid, role=role, waiting=waiting, kv_free_blocks=1000,
                         kv_total_blocks=1000, block_size=16, busy_s=busy_s, work_seen=work_seen)


def make(clock, **cfg):
    from raycluster.cluster.messages import RequestMeta

    core = RouterCore(RouterConfig(policy="fcfs", max_local_waiting=2, initial_l_m=100,
                                   pressure=PressureConfig(cooldown_s=0.0), **cfg), clock)

    def submit(rid, n, ttft=None):
        m = RequestMeta(request_id=rid, gateway_id="g", prompt_token_ids=list(range(1, n + 1)),
                        sampling=SamplingParams(max_tokens=2), ttft_slo_s=ttft, arrival_time=clock.now())
        assert core.submit(m).accepted
    return core, submit


def test_signals_by_hand():
    clock = VirtualClock(10.0)
    core, submit = make(clock)
    core.on_poll("s0", stats("s0", "prefill-short", busy_s=1.0))
    core.on_poll("l0", stats("l0", "prefill-long", busy_s=4.0))
    core.on_poll("d0", stats("d0", "decode"))
    for k in range(6):                                       # 2 go to s0, 4 wait in the router
        submit(f"r{k}", 20, ttft=1.0)
    assert [w.meta.request_id for w in core.take_outbox("s0").work] == ["r0", "r1"]
    sig = pressure_signals(core, clock.now())
    # s0: 2 handed out (not yet in its stats) + 4 queued / 1 instance; nothing late; no mark yet
    assert [(s.instance_id, s.queue, s.sla_deviation, s.utilization) for s in sig.short] == [("s0", 6.0, 0.0, 0.0)]
    assert [(s.instance_id, s.queue) for s in sig.long] == [("l0", 0.0)]
    clock.advance(2.0)                                       # both past their 1 s TTFT SLO
    # s0 has applied both items (work_seen): they leave transit and count as its waiting
    core.on_report(StepReport(stats("s0", "prefill-short", waiting=2, busy_s=2.5, work_seen=2)))
    core.on_report(StepReport(stats("l0", "prefill-long", busy_s=4.0)))
    s0 = pressure_signals(core, clock.now()).short[0]
    assert (s0.queue, s0.sla_deviation, s0.utilization) == (6.0, 1.0, 0.75)   # (2.5 - 1.0) / 2 s
    for k in range(6):
        core.abort(f"r{k}")
    assert core.inflight() == 0


def test_short_backlog_moves_a_long_instance_and_every_request_finishes():
    clock = VirtualClock(0.0)
    core, submit = make(clock)
    core.on_poll("s0", stats("s0", "prefill-short"))
    core.on_poll("l0", stats("l0", "prefill-long"))
    core.on_poll("l1", stats("l1", "prefill-long"))
    core.on_poll("d0", stats("d0", "decode"))
    for k in range(12):
        submit(f"r{k}", 20)
    held = core.take_outbox("s0").work                      # s0 holds 2, 10 wait for a short slot
    assert len(held) == 2 and core.queue_depth() == 10
    assert core.pressure.step(core, clock.now()) == [
        {"t": 0.0, "instance": "l0", "from": "prefill-long", "to": "prefill-short"}]
    assert core.instances["l0"].role == "prefill-short"
    assert core.pressure.step(core, clock.now()) == []      # min_per_pool: l1 stays long
    # l0's next poll still reports the old role: the router keeps the move, and tells it.
    r = core.on_poll("l0", stats("l0", "prefill-long"))
    assert r.role == "prefill-short" and len(r.work) == 2   # and it now takes short work
    assert core.instances["l0"].role == "prefill-short" and core.instances["l0"].moving_to == "prefill-short"
    core.on_poll("l0", stats("l0", "prefill-short", waiting=2))
    assert core.instances["l0"].moving_to is None
    assert core.status()["controller"]["moves"][0]["instance"] == "l0"
    # Drain: the prefill instances finish what they get (first token, then the request ends).
    work = {"s0": held, "l0": r.work}
    for _ in range(20):
        for iid, items in work.items():
            evs = [TokenEvent(w.meta.request_id, [7], True, "length") for w in items]
            core.on_report(StepReport(stats(iid, "prefill-short"), events=evs))
        work = {iid: core.on_poll(iid, stats(iid, "prefill-short")).work for iid in ("s0", "l0")}
        if core.inflight() == 0:
            break
    assert core.inflight() == 0 and core.queue_depth() == 0


def test_decode_balancing_moves_instances_both_ways():
    from raycluster.cluster.messages import RequestMeta

    clock = VirtualClock(0.0)
    core = RouterCore(RouterConfig(policy="fcfs", max_local_waiting=2, initial_l_m=100,
                                   pressure=PressureConfig(cooldown_s=0.0, balance_decode=True)), clock)
    for iid, role in (("s0", "prefill-short"), ("l0", "prefill-long"), ("l1", "prefill-long")):
        core.on_poll(iid, stats(iid, role))
    core.on_poll("d0", stats("d0", "decode", waiting=2))              # full: handoffs queue up
    for k in range(4):
        core.submit(RequestMeta(f"r{k}", "g", [5] * 20, SamplingParams(max_tokens=8), arrival_time=0.0))
    for _ in range(2):                                               # s0 prefills 2 at a time
        done = [PrefillDone(w.meta.request_id, 7, KVHandle(w.meta.request_id, "s0", [0, 1], 20, (), "float32"))
                for w in core.on_poll("s0", stats("s0", "prefill-short")).work]
        core.on_report(StepReport(stats("s0", "prefill-short"), prefilled=done))
    assert core.status()["queues"]["decode"] == 4
    [d0] = decode_signals(core, clock.now())
    assert (d0.queue, d0.sla_deviation) == (2 + 4, 0.0)
    assert core.pressure.step(core, clock.now()) == [
        {"t": 0.0, "instance": "l0", "from": "prefill-long", "to": "decode"}]
    r = core.on_poll("l0", stats("l0", "prefill-long"))
    assert r.role == "decode" and [w.mode for w in r.work] == ["decode", "decode"]
    assert core.pressure.step(core, clock.now()) == []                # each prefill pool keeps one

    # Decode catches up (the queue drains, d0 idle), while short prompts pile up: l0 goes back
    # to the busier prefill pool.
    work = {"l0": r.work, "d0": core.on_poll("d0", stats("d0", "decode")).work}
    for iid, items in work.items():
        core.on_report(StepReport(stats(iid, "decode"), admitted=[w.meta.request_id for w in items],
                                  events=[TokenEvent(w.meta.request_id, [9] * 7, True, "length") for w in items]))
    assert core.inflight() == 0 and sorted(core.take_outbox("s0").releases) == [f"r{k}" for k in range(4)]
    for k in range(6):
        core.submit(RequestMeta(f"n{k}", "g", [5] * 20, SamplingParams(max_tokens=8), arrival_time=0.0))
    clock.advance(1.0)
    assert core.pressure.step(core, clock.now()) == [
        {"t": 1.0, "instance": "d0", "from": "decode", "to": "prefill-short"}]


def test_moves_only_between_the_pd_pools():
    clock = VirtualClock(0.0)
    core, _ = make(clock)
    core.on_poll("m0", stats("m0", "mixed"))
    core.on_poll("d0", stats("d0", "decode"))
    core.on_poll("s0", stats("s0", "prefill-short"))
    with pytest.raises(ValueError, match="only between"):
        core.move_instance("m0", "prefill-short")
    with pytest.raises(ValueError, match="only between"):
        core.move_instance("s0", "mixed")
    core.move_instance("d0", "prefill-short")
    core.move_instance("s0", "decode")
    assert {i: core.instances[i].role for i in ("d0", "s0")} == {"d0": "prefill-short", "s0": "decode"}
    assert core.take_outbox("s0").role == "decode"


def test_cluster_config_turns_the_controller_on_only_with_both_prefill_pools():
    from pydantic import ValidationError

    from deployments.app import router_config
    from raycluster.cluster.config import ClusterConfig

    with pytest.raises(ValidationError, match="controller: it moves instances between"):
        ClusterConfig(controller={"enabled": True})                      # one mixed pool
    pools = [{"role": "prefill-short"}, {"role": "prefill-long", "instances": 2}, {"role": "decode"}]
    off = router_config(ClusterConfig(pools=pools))
    assert off.pressure is None
    on = router_config(ClusterConfig(pools=pools, controller={"enabled": True, "period_s": 2, "tau": 0.3,
                                                               "cooldown_s": 7}))
    assert (on.pressure_period_s, on.pressure.tau, on.pressure.cooldown_s, on.pressure.min_per_pool) == (2, 0.3, 7, 1)
    assert RouterCore(on, VirtualClock(0.0)).status()["controller"] == {"period_s": 2, "moves": []}
