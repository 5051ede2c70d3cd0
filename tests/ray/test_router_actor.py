"""The router actor on a local Ray cluster: long-polls, a fake instance streaming tokens through
it to two fake gateways (batched per step / per pull), the named-actor lookup, and a redeploy's
config applied live and kept across a restart, and LoRA adapter loads (kept across a restart too)."""

import asyncio
import time
import uuid

import pytest
import ray

from raycluster.cluster.messages import InstanceStats, RequestMeta, StepReport, TokenEvent
from raycluster.cluster.router_actor import RouterActor, get_or_create_router
from raycluster.cluster.router_core import RouterConfig
from raycluster.request import SamplingParams

pytestmark = pytest.mark.ray


def stats(iid, waiting=0, running=0):
    return InstanceStats(instance_id=iid, role="mixed", waiting=waiting, running=running,
                         kv_free_blocks=1000, kv_total_blocks=1000, block_size=16)


def meta(rid, gw, max_tokens):
    return RequestMeta(request_id=rid, gateway_id=gw, prompt_token_ids=[1, 2, 3],
                       sampling=SamplingParams(max_tokens=max_tokens), arrival_time=time.time())


def test_long_poll_times_out_then_wakes_on_work(ray_cluster):
    router = RouterActor.remote(RouterConfig(policy="fcfs"))
    t0 = time.monotonic()
    reply = ray.get(router.poll.remote("i1", stats("i1"), 0.3), timeout=30)
    dt = time.monotonic() - t0
    assert reply.work == [] and 0.25 <= dt < 5.0

    ref = router.poll.remote("i1", stats("i1"), 10.0)          # parked
    time.sleep(0.3)
    t1 = time.monotonic()
    assert ray.get(router.submit.remote(meta("r1", "g", 2))).accepted
    reply = ray.get(ref, timeout=30)
    assert [w.meta.request_id for w in reply.work] == ["r1"]
    assert time.monotonic() - t1 < 5.0                         # woke on the submit, not at 10 s
    assert ray.get(router.abort.remote("r1")) and ray.get(router.inflight.remote()) == 0
    ray.kill(router)


async def fake_instance(router, iid, stop):
    """An engine stand-in: pulls work, emits one token per running request per step, and
    reports each step as one push. Token value encodes (request, position) for order checks."""
    running: dict[str, list] = {}
    while not stop.is_set():
        reply = await router.poll.remote(iid, stats(iid, running=len(running)),
                                         0.0 if running else 0.2)
        for w in reply.work:
            running[w.meta.request_id] = [w.meta.sampling.max_tokens, len(w.output_token_ids)]
        for rid in reply.aborts:
            running.pop(rid, None)
        if not running:
            continue
        events = []
        for rid, st in list(running.items()):
            st[1] += 1
            done = st[1] >= st[0]
            events.append(TokenEvent(rid, [int(rid[1:]) * 1000 + st[1]], done, "length" if done else None))
            if done:
                del running[rid]
        await router.push.remote(StepReport(stats(iid, running=len(running)), events=events))
        await asyncio.sleep(0.005)


async def fake_gateway(router, gid, expected, got):
    while any(not got.get(r, (None, False))[1] for r in expected):
        reply = await router.pull.remote(gid, 0.5)
        assert reply.max_queue == 64
        for ev in reply.events:
            assert ev.request_id in expected, "event routed to the wrong gateway"
            toks, fin = got.get(ev.request_id, ([], False))
            assert not fin
            got[ev.request_id] = (toks + ev.token_ids, ev.finished)


def test_tokens_stream_in_order_to_the_right_gateway(ray_cluster):
    router = RouterActor.remote(RouterConfig(policy="lars", max_queue=64, max_local_waiting=2))

    async def scenario():
        stop = asyncio.Event()
        insts = [asyncio.create_task(fake_instance(router, f"inst{k}", stop)) for k in range(2)]
        for _ in range(300):                                  # registered by their first poll
            if len((await router.status.remote())["instances"]) == 2:
                break
            await asyncio.sleep(0.1)
        plan = {f"r{k}": ("gA" if k % 2 else "gB", 3 + k % 5) for k in range(12)}
        for rid, (gw, n) in plan.items():
            assert (await router.submit.remote(meta(rid, gw, n))).accepted
        got = {}
        gws = [fake_gateway(router, g, {r for r, (gw, _) in plan.items() if gw == g}, got)
               for g in ("gA", "gB")]
        await asyncio.wait_for(asyncio.gather(*gws), timeout=40)
        stop.set()
        await asyncio.gather(*insts)
        return plan, got

    plan, got = asyncio.run(scenario())
    for rid, (_, n) in plan.items():
        toks, fin = got[rid]
        assert fin and toks == [int(rid[1:]) * 1000 + i for i in range(1, n + 1)]
    st = ray.get(router.status.remote())
    assert st["inflight"] == 0 and st["queue_depth"] == 0
    assert {i["id"] for i in st["instances"]} == {"inst0", "inst1"}
    ray.kill(router)


def test_named_router_is_found_twice(ray_cluster):
    name = f"router-test-{uuid.uuid4().hex[:6]}"
    a = get_or_create_router(RouterConfig(policy="edf"), name=name)
    b = get_or_create_router(None, name=name)
    assert a._actor_id == b._actor_id
    assert ray.get(b.status.remote())["policy"] == "edf"
    assert ray.get_actor(name, namespace="raycluster")._actor_id == a._actor_id
    ray.kill(a)


def _status_when(router, ok, timeout_s: float = 60.0) -> dict:
    """The router's status once `ok(status)` holds (through a restart: calls fail meanwhile)."""
    deadline, st = time.monotonic() + timeout_s, None
    while time.monotonic() < deadline:
        try:
            st = ray.get(router.status.remote(), timeout=10)
            if ok(st):
                return st
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
            pass
        time.sleep(0.2)
    raise AssertionError(f"router status not as expected within {timeout_s} s: {st}")


def test_a_redeploy_reconfigures_the_live_router_and_a_restart_keeps_it(ray_cluster):
    """`reconfigure` (what every build_app sends) changes a running router's policy and bounds
    with a request queued in it; Ray restarts a dead router with its creation args, yet it comes
    back with the config last applied; a router created anew under the name starts from its own."""
    name = f"router-test-{uuid.uuid4().hex[:6]}"
    router = get_or_create_router(RouterConfig(policy="fcfs", max_queue=64, max_local_waiting=1), name=name)
    assert ray.get(router.reconfigure.remote(RouterConfig(policy="fcfs", max_queue=64, max_local_waiting=1))) == []
    ray.get(router.poll.remote("i", stats("i", waiting=1), 0.0))      # no slot: requests queue
    assert ray.get(router.submit.remote(meta("q", "g", 2))).accepted
    changed = ray.get(router.reconfigure.remote(RouterConfig(policy="edf", max_queue=7, max_local_waiting=1)))
    assert changed == ["policy", "max_queue"]
    st = ray.get(router.status.remote())
    assert (st["policy"], st["max_queue"], st["queue_depth"]) == ("edf", 7, 1)
    ray.get(router.abort.remote("q"))

    first_id = st["router_id"]
    ray.kill(router, no_restart=False)
    st = _status_when(router, lambda st: st["router_id"] != first_id)
    assert (st["policy"], st["max_queue"]) == ("edf", 7)

    ray.kill(router)                                   # for good: the next one is a new router
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            ray.get_actor(name, namespace="raycluster")
            time.sleep(0.2)
        except ValueError:
            break
    fresh = get_or_create_router(RouterConfig(policy="lars", max_queue=5), name=name)
    st = _status_when(fresh, lambda st: True)
    assert (st["policy"], st["max_queue"]) == ("lars", 5)
    ray.kill(fresh)


def test_controller_tick_moves_an_instance_and_wakes_its_parked_poll(ray_cluster):
    """The router actor runs the pressure controller every period: short prompts pile up behind
    the one short instance, a long instance is moved, and its parked poll returns the new role."""
    from raycluster.sched.pressure import PressureConfig

    router = RouterActor.remote(RouterConfig(policy="fcfs", max_local_waiting=1, initial_l_m=100,
                                             pressure=PressureConfig(cooldown_s=0.0), pressure_period_s=0.2))

    def st(iid, role):
        return InstanceStats(instance_id=iid, role=role, kv_free_blocks=1000, kv_total_blocks=1000,
                             block_size=16)

    roles = {"s0": "prefill-short", "l0": "prefill-long", "l1": "prefill-long", "d0": "decode"}
    ray.get([router.poll.remote(i, st(i, r), 0.0) for i, r in roles.items()], timeout=30)
    for k in range(8):
        assert ray.get(router.submit.remote(meta(f"r{k}", "g", 2))).accepted   # 3 tokens: short
    t0 = time.monotonic()
    reply = ray.get(router.poll.remote("l0", st("l0", "prefill-long"), 20.0), timeout=60)
    assert reply.role == "prefill-short" and time.monotonic() - t0 < 10.0
    status = ray.get(router.status.remote())
    assert status["controller"]["moves"][0]["instance"] == "l0"
    assert {i["id"]: i["role"] for i in status["instances"]}["l0"] == "prefill-short"
    for k in range(8):
        ray.get(router.abort.remote(f"r{k}"))
    assert ray.get(router.inflight.remote()) == 0
    ray.kill(router)


def test_lora_loads_wait_for_every_instance_and_a_restart_keeps_the_adapters(ray_cluster):
    """`load_lora` answers once each instance reports serving the adapter (its table arrives in
    a poll reply), fails and takes the adapter back when an instance cannot load it, and a
    restarted router serves the adapters loaded before (an instance registering then is sent
    them)."""
    name = f"router-lora-{uuid.uuid4().hex[:6]}"
    router = get_or_create_router(RouterConfig(policy="fcfs", lora={"s": "/s"}), name=name)

    def lora_stats(iid, served, version=-1, failed=None):
        return InstanceStats(instance_id=iid, role="mixed", kv_free_blocks=1000, kv_total_blocks=1000,
                             lora_adapters=list(served), lora_failed=dict(failed or {}), lora_version=version)

    assert ray.get(router.poll.remote("i", lora_stats("i", ["s"]), 0.0)).lora is None     # on the static set
    pending = router.load_lora.remote("rt", "/rt", 30.0)
    reply = ray.get(router.poll.remote("i", lora_stats("i", ["s"]), 5.0))    # parked poll woken with the table
    assert (reply.lora, reply.lora_version) == ({"s": "/s", "rt": "/rt"}, 1)
    ready, _ = ray.wait([pending], timeout=0.3)
    assert not ready                                   # the instance has not said it serves it yet
    ray.get(router.poll.remote("i", lora_stats("i", ["s", "rt"], 1), 0.0))
    assert ray.get(pending, timeout=10) == {"ok": True}
    assert ray.get(router.lora_adapters.remote()) == {"s": "/s", "rt": "/rt"}

    pending = router.load_lora.remote("bad", "/nowhere", 30.0)
    reply = ray.get(router.poll.remote("i", lora_stats("i", ["s", "rt"], 1), 5.0))
    ray.get(router.poll.remote("i", lora_stats("i", ["s", "rt"], reply.lora_version,
                                               {"bad": "bad: no adapter found at /nowhere"}), 0.0))
    out = ray.get(pending, timeout=10)
    assert not out["ok"] and out["not_found"] and "no adapter found" in out["error"]
    assert ray.get(router.lora_adapters.remote()) == {"s": "/s", "rt": "/rt"}

    first_id = ray.get(router.status.remote())["router_id"]
    ray.kill(router, no_restart=False)
    st = _status_when(router, lambda st: st["router_id"] != first_id)
    assert st["lora_adapters"] == {"s": "/s", "rt": "/rt"}
    reply = ray.get(router.poll.remote("j", lora_stats("j", ["s"]), 0.0))
    assert reply.lora == {"s": "/s", "rt": "/rt"}      # a new registration gets the whole table
    assert ray.get(router.unload_lora.remote("rt")) == {"ok": True}
    assert ray.get(router.unload_lora.remote("rt"))["not_found"]
    ray.kill(router)
