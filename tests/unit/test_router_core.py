"""RouterCore without Ray: admission, policy order across instances, local caps, pool routing,
the prefill/decode handoff, aborts, instance death, and per-gateway event buffers.
Every scenario ends with an empty in-flight table."""

import pytest

from raycluster.clock import VirtualClock
from raycluster.cluster.messages import (InstanceStats, PrefillDone, RequestMeta, StepReport,
                                         TokenEvent)
from raycluster.cluster.router_core import RouterConfig, RouterCore
from raycluster.request import SamplingParams


def stats(iid, role="mixed", waiting=0, running=0, free=1000, total=1000, bs=16, steps=0, queued_tokens=0):
    return InstanceStats(instance_id=iid, role=role, waiting=waiting, running=running,
                         kv_free_blocks=free, kv_total_blocks=total, block_size=bs, steps=steps,
                         queued_tokens=queued_tokens)


def meta(rid, n=10, gw="g1", max_tokens=3, ttft=None, arrival=0.0, **kw):
    return RequestMeta(request_id=rid, gateway_id=gw, prompt_token_ids=list(range(1, n + 1)),
                       sampling=SamplingParams(max_tokens=max_tokens), ttft_slo_s=ttft, arrival_time=arrival, **kw)


def make(clock=None, **cfg):
    return RouterCore(RouterConfig(**cfg), clock or VirtualClock(0.0))


def ids(reply):
    return [w.meta.request_id for w in reply.work]


def finish_all(core, iid, reply, tokens=(7,)):
    """Fake instance: every work item gets `tokens` and finishes."""
    evs = [TokenEvent(w.meta.request_id, list(tokens), True, "length") for w in reply.work]
    core.on_report(StepReport(stats(iid), events=evs))


def test_rejects_without_instances_and_when_queue_full():
    core = make(max_queue=2, retry_after_s=3.0)
    r = core.submit(meta("a"))
    assert not r.accepted and r.reason == "no instances" and r.retry_after_s == 3.0
    core.on_poll("i1", stats("i1", waiting=2))           # registered, but no local slot
    assert core.submit(meta("a")).accepted and core.submit(meta("b")).accepted
    r = core.submit(meta("c"))
    assert not r.accepted and r.reason == "queue full" and r.retry_after_s == 3.0
    assert core.inflight() == 2 and not core.submit(meta("a")).accepted   # duplicate id
    assert core.take_events("g1").max_queue == 2
    for rid in ("a", "b"):
        core.abort(rid)
    assert core.inflight() == 0 and core.queue_depth() == 0


def test_edf_order_across_instances():
    clock = VirtualClock(0.0)
    core = make(clock, policy="edf", max_local_waiting=1)
    core.on_poll("i1", stats("i1", waiting=1))
    core.on_poll("i2", stats("i2", waiting=1))
    core.submit(meta("relaxed", ttft=10.0, arrival=0.0))
    clock.advance(0.1)
    core.submit(meta("urgent", ttft=0.5, arrival=0.1))
    core.submit(meta("middle", ttft=2.0, arrival=0.1))
    assert core.queue_depth() == 3
    r2 = core.on_poll("i2", stats("i2", waiting=0))      # capacity frees on i2 first
    assert ids(r2) == ["urgent"]
    r1 = core.on_poll("i1", stats("i1", waiting=0))
    assert ids(r1) == ["middle"]
    finish_all(core, "i2", r2)
    r2b = core.on_poll("i2", stats("i2", waiting=0))
    assert ids(r2b) == ["relaxed"]
    finish_all(core, "i1", r1)
    finish_all(core, "i2", r2b)
    assert core.inflight() == 0


def test_max_local_waiting_and_in_transit_accounting():
    core = make(policy="fcfs", max_local_waiting=2)
    core.on_poll("i1", stats("i1"))
    for k in range(5):
        core.submit(meta(f"r{k}", arrival=float(k)))
    r = core.on_poll("i1", stats("i1"))
    assert ids(r) == ["r0", "r1"]
    core.submit(meta("r5", arrival=5.0))
    assert core.take_outbox("i1").work == []             # 2 handed out, not yet in stats
    assert core.on_poll("i1", stats("i1", waiting=0, steps=1)).work == []   # maybe not applied yet
    assert core.on_poll("i1", stats("i1", waiting=2, steps=2)).work == []   # applied, still waiting
    r = core.on_poll("i1", stats("i1", waiting=0, running=2, steps=3))
    assert ids(r) == ["r2", "r3"]
    clock = core.clock
    clock.advance(core.cfg.transit_timeout_s + 1)        # no step proof: the timeout frees the slot
    assert ids(core.on_poll("i1", stats("i1", waiting=0, running=4, steps=3))) == ["r4", "r5"]
    for rid in ("r0", "r1", "r2", "r3", "r4", "r5"):
        core.abort(rid)
    assert core.inflight() == 0


def test_dispatch_prefers_the_smallest_prefill_backlog_in_tokens():
    """One long prompt queued outweighs three short ones; work handed out but not yet seen by
    the instance counts with its prompt tokens."""
    core = make(policy="fcfs", max_local_waiting=8)
    core.on_poll("long", stats("long", waiting=1, queued_tokens=8000))
    core.on_poll("shorts", stats("shorts", waiting=3, queued_tokens=300))
    core.submit(meta("a", n=100))
    core.dispatch()
    assert ids(core.take_outbox("shorts")) == ["a"] and core.take_outbox("long").work == []
    core.submit(meta("b", n=7800))                       # shorts: 300 + 100 in transit < 8000
    core.submit(meta("c", n=50))                         # shorts: 300 + 100 + 7800 > 8000
    core.dispatch()
    assert ids(core.take_outbox("shorts")) == ["b"] and ids(core.take_outbox("long")) == ["c"]
    assert core.queue_depth() == 0
    for rid in ("a", "b", "c"):
        core.abort(rid)
    assert core.inflight() == 0


def test_exact_accounting_with_work_seen():
    core = make(policy="fcfs", max_local_waiting=2)
    core.on_poll("i1", stats("i1"))
    for k in range(4):
        core.submit(meta(f"r{k}", arrival=float(k)))
    s = stats("i1")
    s.work_seen = 1                                      # one of the two applied, already running
    assert ids(core.on_poll("i1", stats("i1"))) == ["r0", "r1"]
    assert core.on_poll("i1", stats("i1")).work == []
    r = core.on_poll("i1", s)
    assert ids(r) == ["r2"]                              # the applied one's slot is free
    for k in range(4):
        core.abort(f"r{k}")
    assert core.inflight() == 0


def test_kv_gate_and_never_fits():
    core = make(policy="fcfs")
    core.on_poll("i1", stats("i1", free=2, total=100, bs=16))
    core.submit(meta("big", n=100))                      # needs 7 blocks, 2 free: waits
    core.submit(meta("small", n=10, arrival=1.0))        # behind it: global order is kept
    assert core.take_outbox("i1").work == []
    assert ids(core.on_poll("i1", stats("i1", free=50, total=100))) == ["big", "small"]
    r = core.submit(meta("huge", n=5000))                # 313 blocks > 100 total: never servable
    assert not r.accepted and r.retry_after_s == 0 and "too long" in r.reason
    core.abort("big")
    core.abort("small")
    assert core.inflight() == 0


def test_short_long_routing_and_fallbacks():
    core = make(initial_l_m=100)
    for iid, role in (("s", "prefill-short"), ("l", "prefill-long"), ("d", "decode")):
        core.on_poll(iid, stats(iid, role))
    core.submit(meta("short", n=50))
    core.submit(meta("long", n=200))
    rs, rl = core.take_outbox("s"), core.take_outbox("l")
    assert ids(rs) == ["short"] and ids(rl) == ["long"]
    assert rs.work[0].mode == rl.work[0].mode == "prefill"
    assert core.status()["l_m"] == 100
    for rid in ("short", "long"):
        core.abort(rid)

    core2 = make(initial_l_m=100)                        # no short pool: short goes long
    core2.on_poll("l", stats("l", "prefill-long"))
    core2.on_poll("d", stats("d", "decode"))
    core2.submit(meta("short", n=50))
    assert ids(core2.take_outbox("l")) == ["short"] and core2.placements()["short"]["mode"] == "prefill"
    core2.abort("short")

    core3 = make(initial_l_m=100)                        # mixed only: full mode
    core3.on_poll("m", stats("m"))
    core3.submit(meta("short", n=50))
    core3.submit(meta("long", n=200))
    r = core3.take_outbox("m")
    assert sorted(ids(r)) == ["long", "short"] and {w.mode for w in r.work} == {"full"}
    core3.abort("short")
    core3.abort("long")
    assert core.inflight() == core2.inflight() == core3.inflight() == 0


def pd_core(**cfg):
    core = make(**cfg)
    core.on_poll("p", stats("p", "prefill-short"))
    core.on_poll("d", stats("d", "decode"))
    return core


def test_pd_flow_and_two_gateways():
    core = pd_core()
    core.submit(meta("a", gw="g1", max_tokens=3))
    core.submit(meta("b", gw="g2", max_tokens=1))
    w = core.on_poll("p", stats("p", "prefill-short")).work
    assert [x.mode for x in w] == ["prefill", "prefill"] and w[0].first_token_time is None
    # a: first token 11 with a KV handle; b: max_tokens=1, the instance ends it itself.
    core.clock.advance(0.25)
    core.on_report(StepReport(stats("p", "prefill-short"),
                              events=[TokenEvent("b", [21], True, "length", prefill_s=0.5)],
                              prefilled=[PrefillDone("a", 11, kv="HANDLE-a", prefill_s=0.125)]))
    core.clock.advance(0.1)
    dw = core.on_poll("d", stats("d", "decode")).work
    assert len(dw) == 1 and dw[0].mode == "decode" and dw[0].kv == "HANDLE-a"
    assert dw[0].output_token_ids == [11]
    assert dw[0].first_token_time == 0.25            # when the client got it, not when handed out
    assert core.placements()["a"]["kv_at"] == "p"
    core.on_report(StepReport(stats("d", "decode"), admitted=["a"],
                              events=[TokenEvent("a", [12])]))
    assert core.on_poll("p", stats("p", "prefill-short")).releases == ["a"]
    core.on_report(StepReport(stats("d", "decode"), events=[TokenEvent("a", [13], True, "length")]))
    e1, e2 = core.take_events("g1").events, core.take_events("g2").events
    assert [(e.request_id, e.token_ids, e.finished) for e in e1] == [
        ("a", [11], False), ("a", [12], False), ("a", [13], True)]
    assert [(e.request_id, e.token_ids, e.finished) for e in e2] == [("b", [21], True)]
    # The prefill instance's prefill time reaches the gateway with the first token.
    assert [e.prefill_s for e in e1] == [0.125, None, None] and e2[0].prefill_s == 0.5
    assert core.take_events("g1").events == [] and core.inflight() == 0


def test_pd_first_token_reaches_max_tokens_releases_kv():
    core = pd_core()
    core.submit(meta("a", max_tokens=1))
    core.on_poll("p", stats("p", "prefill-short"))
    core.on_report(StepReport(stats("p", "prefill-short"), prefilled=[PrefillDone("a", 5, kv="H")]))
    ev = core.take_events("g1").events
    assert [(e.token_ids, e.finished, e.finish_reason) for e in ev] == [([5], True, "length")]
    assert core.on_poll("p", stats("p", "prefill-short")).releases == ["a"]
    assert core.take_outbox("d").work == [] and core.inflight() == 0


def test_abort_queued_running_and_parked():
    core = pd_core(max_local_waiting=1)
    core.on_poll("d", stats("d", "decode", waiting=1))   # decode full: handoffs park
    core.submit(meta("run"))
    core.submit(meta("queued", arrival=1.0))
    assert core.abort("queued") and core.queue_depth() == 0
    core.on_poll("p", stats("p", "prefill-short"))       # "run" handed out
    core.submit(meta("unsent", arrival=2.0))             # p's one slot is taken: queued
    assert core.placements()["unsent"]["queue"] == "prefill-short"
    assert core.abort("run")                             # running: the instance is told
    r = core.take_outbox("p")
    assert r.aborts == ["run"] and ids(r) == ["unsent"]  # and its slot goes to the next one
    core.on_report(StepReport(stats("p", "prefill-short"), prefilled=[PrefillDone("unsent", 3, kv="H")]))
    assert core.placements()["unsent"]["queue"] == "decode"
    core.abort("unsent")                                  # KV parked on p, never dispatched
    out = core.take_outbox("p")
    assert out.releases == ["unsent"] and core.take_outbox("d").aborts == []
    assert [e.token_ids for e in core.take_events("g1").events] == [[3]]
    core.on_report(StepReport(stats("p", "prefill-short"), events=[TokenEvent("run", [], True, "abort")]))
    assert core.take_events("g1").events == [] and core.inflight() == 0


def test_abort_before_pickup_removes_from_outbox():
    core = make()
    core.on_poll("m", stats("m"))
    core.submit(meta("a"))
    core.abort("a")
    out = core.take_outbox("m")
    assert out.work == [] and out.aborts == [] and core.inflight() == 0


def test_reap_requeues_with_delivered_tokens_at_front():
    clock = VirtualClock(0.0)
    core = make(clock, policy="fcfs", max_local_waiting=1, heartbeat_timeout_s=10.0)
    core.on_poll("old", stats("old"))
    core.submit(meta("a", max_tokens=5, arrival=0.0))
    core.on_report(StepReport(stats("old", running=1), events=[TokenEvent("a", [1, 2])]))
    clock.advance(5.0)
    core.on_poll("new", stats("new", waiting=1))          # replica came back with a new id, busy
    core.submit(meta("b", arrival=5.0))
    clock.advance(6.0)
    assert core.reap() == ["old"]
    assert core.placements()["a"]["queue"] == "mixed" and core.status()["resumed"] == 1
    r = core.on_poll("new", stats("new"))
    assert ids(r) == ["a"]                                # resumed ahead of the policy order
    assert r.work[0].mode == "full" and r.work[0].output_token_ids == [1, 2]
    # A late report from the dead instance is ignored and told to stop.
    core.on_report(StepReport(stats("old"), events=[TokenEvent("a", [99])]))
    assert core.take_outbox("old").aborts == ["a"]
    core.remove_instance("old")
    core.on_report(StepReport(stats("new"), events=[TokenEvent("a", [3, 4, 5], True, "length")]))
    assert ids(core.on_poll("new", stats("new"))) == ["b"]
    finish_all(core, "new", core.take_outbox("new"))
    core.on_report(StepReport(stats("new"), events=[TokenEvent("b", [1], True, "length")]))
    toks = [t for e in core.take_events("g1").events if e.request_id == "a" for t in e.token_ids]
    assert toks == [1, 2, 3, 4, 5] and core.inflight() == 0


def test_decode_death_rehands_parked_kv_and_prefill_death_recomputes():
    clock = VirtualClock(0.0)
    core = make(clock, heartbeat_timeout_s=10.0)
    core.on_poll("p", stats("p", "prefill-short"))
    core.on_poll("d1", stats("d1", "decode"))
    core.submit(meta("a", max_tokens=4))
    core.on_poll("p", stats("p", "prefill-short"))
    core.on_report(StepReport(stats("p", "prefill-short"), prefilled=[PrefillDone("a", 9, kv="H")]))
    assert ids(core.take_outbox("d1")) == ["a"]
    clock.advance(11.0)
    core.on_poll("p", stats("p", "prefill-short"))
    core.on_poll("d2", stats("d2", "decode"))
    assert core.reap() == ["d1"]                          # not admitted yet: KV still on p
    w = core.take_outbox("d2").work
    assert w[0].mode == "decode" and w[0].kv == "H" and w[0].output_token_ids == [9]
    clock.advance(11.0)
    core.on_poll("d2", stats("d2", "decode"))
    core.on_poll("p2", stats("p2", "prefill-short"))
    assert core.reap() == ["p"]                           # KV gone: d2 keeps its own recompute
    core.on_report(StepReport(stats("d2", "decode"), admitted=["a"],
                              events=[TokenEvent("a", [10, 11, 12], True, "length")]))
    toks = [t for e in core.take_events("g1").events for t in e.token_ids]
    assert toks == [9, 10, 11, 12] and core.inflight() == 0


def test_decode_pool_gone_recomputes_through_prefill():
    clock = VirtualClock(0.0)
    core = make(clock, max_local_waiting=1)
    core.on_poll("p", stats("p", "prefill-short"))
    core.on_poll("d", stats("d", "decode", waiting=1))
    core.submit(meta("a", max_tokens=3))
    core.on_poll("p", stats("p", "prefill-short"))
    core.on_report(StepReport(stats("p", "prefill-short"), prefilled=[PrefillDone("a", 4, kv="H")]))
    clock.advance(20.0)
    core.on_poll("p", stats("p", "prefill-short"))
    assert core.reap() == ["d"]
    r = core.on_poll("p", stats("p", "prefill-short"))
    assert r.releases == ["a"] and r.work[0].mode == "full" and r.work[0].output_token_ids == [4]
    core.on_report(StepReport(stats("p", "prefill-short"), events=[TokenEvent("a", [5, 6], True, "length")]))
    assert [t for e in core.take_events("g1").events for t in e.token_ids] == [4, 5, 6]
    assert core.inflight() == 0


@pytest.mark.parametrize("policy", ["fcfs", "edf", "srpt", "lrs", "lars", "kairos", "justitia", "vtc", "srjf",
                                    "priority"])
def test_every_policy_drains(policy):
    core = make(policy=policy, max_local_waiting=2)
    core.on_poll("a", stats("a"))
    core.on_poll("b", stats("b"))
    for k in range(8):
        assert core.submit(meta(f"r{k}", n=10 + 30 * k, arrival=0.01 * k, tenant=f"t{k % 2}")).accepted
    done = 0
    for _ in range(20):
        for iid in ("a", "b"):
            r = core.on_poll(iid, stats(iid))
            finish_all(core, iid, r)
            done += len(r.work)
    assert done == 8 and core.inflight() == 0 and core.queue_depth() == 0


def test_priority_policy_dispatches_lower_values_first():
    """A request's `priority` field reaches the router's queue: lower values go first."""
    core = make(policy="priority", max_local_waiting=1)
    core.on_poll("i", stats("i", waiting=1))            # no slot: everything queues
    for k, prio in enumerate([3, 1, 2]):
        core.submit(meta(f"r{k}", arrival=0.1 * k, priority=prio))
    order = []
    for _ in range(6):
        r = core.on_poll("i", stats("i"))
        order += ids(r)
        finish_all(core, "i", r)
    assert order == ["r1", "r2", "r0"] and core.inflight() == 0


def test_a_draining_instance_gets_no_new_work_and_finishes_its_own():
    """Serve is stopping instance "a": new requests go to "b" only, "a" still reports its running
    request to the end, and removing it then re-queues nothing."""
    core = make(max_local_waiting=4)
    core.on_poll("a", stats("a"))
    core.submit(meta("mine", max_tokens=3))
    mine = core.take_outbox("a")
    assert ids(mine) == ["mine"]
    core.on_poll("b", stats("b"))
    assert core.drain_instance("a") and not core.drain_instance("nope")
    assert core.status()["instances"][0]["draining"]
    for k in range(3):
        core.submit(meta(f"new{k}"))
    assert ids(core.on_poll("a", stats("a", running=1))) == []
    assert sorted(ids(core.on_poll("b", stats("b")))) == ["new0", "new1", "new2"]
    finish_all(core, "a", mine)
    core.remove_instance("a")
    assert core.placements().keys() == {"new0", "new1", "new2"}    # nothing of "a" re-queued
    assert core.status()["resumed"] == 0
    for k in range(3):
        core.abort(f"new{k}")
    assert core.inflight() == 0


def test_l_m_kept_without_beta_prior_and_fitted_with_one():
    core = make(initial_l_m=300)
    core.on_poll("m", stats("m"))
    samples = [(n, 0, 1e-6 * n * n + 1e-3 * n) for n in (32, 64, 128, 256, 512, 1024, 2048, 4096)]
    core.on_report(StepReport(stats("m"), prefill_samples=samples))
    assert core.status()["l_m"] == 300 and "no beta_prior" in core.status()["l_m_source"]
    core2 = make(initial_l_m=300, beta_prior=2e-4)
    core2.on_poll("m", stats("m"))
    core2.on_report(StepReport(stats("m"), prefill_samples=samples))
    st = core2.status()
    assert st["l_m_source"] == "fitted" and st["l_m"] != 300
    assert st["instances"][0]["id"] == "m" and st["queues"]["mixed"] == 0


def test_stranded_queue_drains_elsewhere_and_unservable_fails():
    clock = VirtualClock(0.0)
    core = make(clock, initial_l_m=100, max_local_waiting=1, heartbeat_timeout_s=10.0)
    core.on_poll("s", stats("s", "prefill-short", waiting=1))
    core.on_poll("l", stats("l", "prefill-long", waiting=1, free=10, total=10))
    core.on_poll("d", stats("d", "decode"))
    core.submit(meta("short", n=50))                     # queued for the short pool (busy)
    core.submit(meta("mid", n=400))                      # 26 blocks: only "s" could hold it
    assert core.placements()["short"]["queue"] == "prefill-short"
    clock.advance(11.0)
    core.on_poll("l", stats("l", "prefill-long", free=10, total=10))
    core.on_poll("d", stats("d", "decode"))
    assert core.reap() == ["s"]
    assert ids(core.take_outbox("l")) == ["short"]       # short pool gone: the long pool serves it
    ev = core.take_events("g1").events
    assert [(e.request_id, e.finish_reason) for e in ev] == [("mid", "error")]
    core.abort("short")
    assert core.inflight() == 0


def test_queue_server_counts_follow_instances_and_scale_kairos_backlog():
    """Each queue's policy context counts the instances serving it; Kairos divides its FCFS
    backlog by that count (k instances drain the router's queue in parallel)."""
    clock = VirtualClock(0.0)
    core = make(clock, policy="kairos", max_local_waiting=0)    # nothing leaves the queues
    core.on_poll("p1", stats("p1", role="prefill-short"))
    core.on_poll("d1", stats("d1", role="decode"))
    assert core.ctxs["prefill-short"].num_servers == 1 and core.ctxs["decode"].num_servers == 1
    assert core.ctxs["prefill-long"].num_servers == 1           # served by prefill-short: 1
    core.submit(meta("a", n=1000, ttft=10.0))
    pol = core.policies["prefill-short"]
    req = core.requests["a"].req
    x1, b = pol.urgency_line(req)
    backlog = 10.0 - x1                                          # arrival 0, SLO 10 s: x = 10 - P
    assert backlog > 0 and b == 10.0 * 1000
    for i in (2, 3):
        core.on_poll(f"p{i}", stats(f"p{i}", role="prefill-short"))
    assert core.ctxs["prefill-short"].num_servers == 3
    x3, _ = pol.urgency_line(req)
    assert x3 == pytest.approx(10.0 - backlog / 3)
    core.remove_instance("p3")
    assert core.ctxs["prefill-short"].num_servers == 2 and core.ctxs["decode"].num_servers == 1
    core.abort("a")
    assert core.inflight() == 0
