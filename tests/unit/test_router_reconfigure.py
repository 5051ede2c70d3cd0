"""A redeployed config applied to a live RouterCore (router_reconfigure.py), without Ray: queued
requests keep their place in the new policy's order, running ones finish, bounds and the
controller take the new values at once, and a bad policy name changes nothing."""

from __future__ import annotations

import dataclasses

import pytest
from test_router_core import finish_all, make, meta, stats

from raycluster.cluster.router_core import RouterConfig
from raycluster.cluster.router_reconfigure import reconfigure
from raycluster.sched.pressure import PressureConfig
from raycluster.sched.registry import POLICIES as POLICY_CLASSES

POLICIES = ["fcfs", "edf", "srpt", "lrs", "lars", "kairos", "justitia", "vtc", "srjf", "priority"]


def _with(core, **changes) -> RouterConfig:
    return dataclasses.replace(core.cfg, **changes)


@pytest.mark.parametrize("old,new", list(zip(POLICIES, POLICIES[1:] + POLICIES[:1])))
def test_a_policy_change_keeps_every_request(old, new):
    """Two requests running, six queued when the policy changes: all eight finish, under the new
    policy's accounts for the queued ones and none for the running ones."""
    core = make(policy=old, max_local_waiting=1)
    core.on_poll("a", stats("a"))
    for k in range(8):
        assert core.submit(meta(f"r{k}", n=10 + 30 * k, arrival=0.01 * k, tenant=f"t{k % 2}")).accepted
    running = core.take_outbox("a")
    assert len(running.work) == 1 and core.queue_depth() == 7
    assert reconfigure(core, _with(core, policy=new)) == ["policy"]
    assert core.status()["policy"] == new and core.queue_depth() == 7
    assert all(type(p) is POLICY_CLASSES[new] for p in core.policies.values())
    finish_all(core, "a", running)
    done = len(running.work)
    for _ in range(20):
        r = core.on_poll("a", stats("a"))
        finish_all(core, "a", r)
        done += len(r.work)
    assert done == 8 and core.inflight() == 0 and core.queue_depth() == 0


def test_the_new_policy_orders_what_was_queued():
    """FCFS queued a relaxed request before an urgent one; after a switch to EDF the urgent one
    goes first."""
    core = make(policy="fcfs", max_local_waiting=1)
    core.on_poll("a", stats("a", waiting=1))            # no slot: everything queues
    core.submit(meta("relaxed", ttft=10.0, arrival=0.0))
    core.clock.advance(0.1)
    core.submit(meta("urgent", ttft=0.5, arrival=0.1))
    reconfigure(core, _with(core, policy="edf"))
    order = []
    for _ in range(4):
        r = core.on_poll("a", stats("a"))
        order += [w.meta.request_id for w in r.work]
        finish_all(core, "a", r)
    assert order == ["urgent", "relaxed"] and core.inflight() == 0


def test_bounds_take_effect_at_once():
    core = make(max_queue=8, max_local_waiting=1)
    core.on_poll("a", stats("a", waiting=1))
    for k in range(4):
        assert core.submit(meta(f"r{k}")).accepted
    assert reconfigure(core, _with(core, max_queue=4)) == ["max_queue"]
    r = core.submit(meta("over"))
    assert not r.accepted and r.reason == "queue full"
    # A larger local bound hands queued work out in the same call, before any poll.
    assert reconfigure(core, _with(core, max_local_waiting=3)) == ["max_local_waiting"]
    assert len(core.instances["a"].outbox.work) == 2 and core.queue_depth() == 2
    for k in range(4):
        core.abort(f"r{k}")
    assert core.inflight() == 0


def test_an_unknown_policy_changes_nothing():
    core = make(policy="lars", max_queue=8, max_local_waiting=1)
    core.on_poll("a", stats("a", waiting=1))            # no slot: "q" stays queued
    core.submit(meta("q"))
    before = core.policies["mixed"]
    with pytest.raises(ValueError, match="unknown name 'nope'"):
        reconfigure(core, _with(core, policy="nope", max_queue=2))
    assert core.cfg.policy == "lars" and core.cfg.max_queue == 8 and core.policies["mixed"] is before
    assert len(before) == 1
    core.abort("q")
    assert core.inflight() == 0


def test_the_classifier_restarts_only_when_its_settings_change():
    core = make(initial_l_m=300)
    clf = core.classifier
    assert reconfigure(core, _with(core, max_queue=9)) == ["max_queue"] and core.classifier is clf
    assert reconfigure(core, _with(core)) == []
    assert reconfigure(core, _with(core, initial_l_m=500)) == ["initial_l_m"]
    assert core.classifier is not clf and core.status()["l_m"] == 500


def test_the_controller_turns_on_and_off():
    core = make()
    assert core.pressure is None
    reconfigure(core, _with(core, pressure=PressureConfig(cooldown_s=1.0)))
    assert core.pressure is not None and core.pressure.cfg.cooldown_s == 1.0
    core.pressure.moves.append({"t": 1.0, "instance": "a", "from": "prefill-long", "to": "prefill-short"})
    core.pressure.last_move = 1.0
    reconfigure(core, _with(core, pressure=PressureConfig(cooldown_s=2.0)))      # new settings, same log
    assert core.pressure.cfg.cooldown_s == 2.0 and core.pressure.last_move == 1.0 and len(core.pressure.moves) == 1
    reconfigure(core, _with(core, pressure=None))
    assert core.pressure is None


def test_a_deploys_pools_hold_requests_until_their_instances_come():
    """While a redeploy replaces every replica, no instance is up for a while: requests arriving
    then wait in their own pool's queue (short and long apart) and go to the new instances when
    they register; the old instance's running request resumes there too. Past the window, with
    still no instance, requests are refused as before."""
    core = make(initial_l_m=100, max_local_waiting=4)
    core.on_poll("old", stats("old", "prefill-short"))
    core.submit(meta("running", n=20))
    assert [w.meta.request_id for w in core.take_outbox("old").work] == ["running"]
    core.expect_instances(["prefill-short", "prefill-long", "decode"], 60.0)
    core.remove_instance("old")                 # Serve stopped it; its replacement starts
    assert core.submit(meta("short", n=20)).accepted and core.submit(meta("long", n=300)).accepted
    places = core.placements()
    assert [places[r]["queue"] for r in ("running", "short", "long")] == ["prefill-short", "prefill-short",
                                                                          "prefill-long"]
    core.clock.advance(20.0)
    core.on_poll("d", stats("d", "decode"))
    got = core.on_poll("s", stats("s", "prefill-short")).work
    assert sorted(w.meta.request_id for w in got) == ["running", "short"]
    assert core.placements()["long"]["queue"] == "prefill-long"     # its own pool is still starting
    assert [w.meta.request_id for w in core.on_poll("l", stats("l", "prefill-long")).work] == ["long"]
    for rid in ("running", "short", "long"):
        core.abort(rid)
    assert core.inflight() == 0

    idle = make()
    idle.expect_instances(["mixed"], 30.0)
    assert idle.submit(meta("early")).accepted
    idle.clock.advance(31.0)
    r = idle.submit(meta("late"))
    assert not r.accepted and r.reason == "no instances"
    idle.abort("early")
    assert idle.inflight() == 0
