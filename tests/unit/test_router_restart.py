"""Recovery from a router restart, without Ray.

RouterCore: each registration gives the instance a new epoch (in every poll reply), reports
made under an older epoch are not applied, an instance that registers again after applying work
starts its in-transit accounting from there, and a resubmitted request skips the admission bound
and resumes after the tokens its client has. InstanceWorker: a new epoch drops everything it
holds. End to end (real engine threads, a real RouterCore swapped for a fresh one mid-run,
`ClusterClient` in asyncio): every request finishes with the tokens an undisturbed engine makes,
and nothing is left behind. And the router's side of a gateway that goes away: after
`gateway_timeout_s` without a pull its requests are aborted and its buffer dropped.
"""

from __future__ import annotations

import asyncio
import time

import pytest
from switchboard import Switchboard

from raycluster.clock import VirtualClock
from raycluster.cluster.client import ClusterClient
from raycluster.cluster.instance import InstanceWorker
from raycluster.cluster.messages import (
    InstanceStats,
    PollReply,
    RequestMeta,
    StepReport,
    TokenEvent,
    WorkItem,
)
from raycluster.cluster.router_core import RouterConfig, RouterCore
from raycluster.engine.config import EngineConfig
from raycluster.engine.engine import LLMEngine
from raycluster.model.loader import load_model
from raycluster.request import SamplingParams


def _stats(iid: str, work_seen: int | None = None, waiting: int = 0) -> InstanceStats:
    return InstanceStats(instance_id=iid, role="mixed", kv_free_blocks=1000, kv_total_blocks=1000,
                         work_seen=work_seen, waiting=waiting)


def _meta(rid: str, max_tokens: int = 4, **kw) -> RequestMeta:
    return RequestMeta(request_id=rid, gateway_id="g", prompt_token_ids=[5, 6, 7],
                       sampling=SamplingParams(max_tokens=max_tokens), **kw)


def test_each_registration_has_its_own_epoch_and_older_reports_are_ignored():
    core = RouterCore(RouterConfig(heartbeat_timeout_s=1.0), VirtualClock(0.0), router_id="r1")
    first = core.on_poll("i1", _stats("i1")).epoch
    assert first == "r1.1" and core.on_poll("i1", _stats("i1")).epoch == first     # sticky
    core.submit(_meta("a"))
    assert [w.meta.request_id for w in core.on_poll("i1", _stats("i1")).work] == ["a"]
    core.on_report(StepReport(_stats("i1"), [TokenEvent("a", [11])], epoch=first))
    assert core.placements()["a"]["delivered"] == 1

    assert core.reap(now=5.0) == ["i1"]                  # silent: reaped, "a" re-queued
    second = core.on_poll("i1", _stats("i1")).epoch      # it comes back: a new registration
    assert second == "r1.2"
    core.on_report(StepReport(_stats("i1"), [TokenEvent("a", [12])], epoch=first))
    assert core.placements()["a"]["delivered"] == 1      # made before it dropped "a": not applied
    core.on_report(StepReport(_stats("i1"), [TokenEvent("a", [13], True, "length")], epoch=second))
    assert core.inflight() == 0
    ev = core.take_events("g")
    assert [e.token_ids for e in ev.events] == [[11], [13]] and ev.router_id == "r1"


def test_registration_counts_only_work_applied_afterwards():
    core = RouterCore(RouterConfig(max_local_waiting=1), VirtualClock(0.0), router_id="r2")
    core.on_poll("i1", _stats("i1", work_seen=5))        # applied 5 items under an older router
    core.submit(_meta("a"))
    core.submit(_meta("b"))
    assert len(core.on_poll("i1", _stats("i1", work_seen=5)).work) == 1
    assert core.placements()["b"]["queue"] == "mixed"    # "a" in transit fills the one slot
    core.on_poll("i1", _stats("i1", work_seen=5))
    assert core.placements()["b"]["queue"] == "mixed"
    assert len(core.on_poll("i1", _stats("i1", work_seen=6)).work) == 1   # "a" applied: "b" goes


def test_resumed_request_skips_the_bound_and_continues_after_its_tokens():
    core = RouterCore(RouterConfig(max_queue=1), VirtualClock(0.0), router_id="r3")
    core.on_poll("i1", _stats("i1", waiting=2))          # no free local slot: requests stay queued
    assert core.submit(_meta("a")).accepted
    assert not core.submit(_meta("b")).accepted          # the bound
    r = core.submit(_meta("c~1", max_tokens=6, output_token_ids=[21, 22], resumed=True))
    assert r.accepted and r.router_id == "r3"
    work = core.on_poll("i1", _stats("i1")).work
    assert [w.meta.request_id for w in work][0] == "c~1"    # ahead of the policy's queue
    assert work[0].output_token_ids == [21, 22]
    core.on_report(StepReport(_stats("i1"), [TokenEvent("c~1", [23, 24, 25, 26], True, "length")]))
    core.on_report(StepReport(_stats("i1"), [TokenEvent(w.meta.request_id, [1], True, "length")
                                             for w in work[1:]]))
    core.on_poll("i1", _stats("i1"))
    core.abort("a")
    assert core.inflight() == 0


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return load_model(tiny_model_dir)[0]


def _engine(model) -> LLMEngine:
    return LLMEngine(EngineConfig(policy="fcfs", packer="token", kv_cache_tokens=4096, chunk_size=64), model)


def test_new_epoch_drops_everything_the_instance_holds(model):
    reports: list[StepReport] = []
    w = InstanceWorker(_engine(model), "mixed", "i0", poll_fn=lambda *a: PollReply(), push_fn=reports.append)
    items = [WorkItem(RequestMeta(f"r{i}", "g", [9] * (40 + 30 * i),
                                  SamplingParams(max_tokens=50, ignore_eos=True))) for i in range(3)]
    w._apply(PollReply(work=items, epoch="x.1"))
    for _ in range(3):
        w._step()
    assert w.engine.has_unfinished() and w.engine.kv.num_free_blocks < w.engine.kv.num_blocks
    assert {w._reports.get_nowait().epoch for _ in range(3)} == {"x.1"} and w._reports.empty()
    w._apply(PollReply(work=[WorkItem(RequestMeta("n", "g", [3] * 10, SamplingParams(max_tokens=2)))], epoch="y.1"))
    assert list(w.engine.scheduler.requests) == ["n"]      # the old work is gone, the new applied
    w._step()
    w.engine.abort_request("n")
    assert w.engine.kv.num_free_blocks == w.engine.kv.num_blocks
    while not w._reports.empty():
        r = w._reports.get_nowait()
        assert r.epoch == "y.1" and {e.request_id for e in r.events} <= {"n"}


def test_requests_resume_across_a_router_restart(model):
    prompts = [[(7 * i + j) % 900 + 6 for j in range(20 + 37 * i)] for i in range(8)]
    max_tokens = 40
    ref = _engine(model).generate(prompts, [SamplingParams(max_tokens=max_tokens, ignore_eos=True)] * 8)

    board = Switchboard(lambda rid: RouterCore(RouterConfig(policy="fcfs", max_local_waiting=8), router_id=rid))
    engines = [_engine(model), _engine(model)]
    workers = [InstanceWorker(e, "mixed", f"i{k}", board.poll, board.push, poll_timeout_s=0.05).start()
               for k, e in enumerate(engines)]
    client = ClusterClient(board.submit, board.abort, board.pull, board.status, tokenizer=None,
                           max_model_len=2048, vocab_size=4096, eos_token_ids=(), pull_timeout_s=0.05,
                           router_wait_s=10.0)

    async def one(i: int, got: list[int]) -> None:
        async for out in client.generate(f"q{i}", prompts[i], SamplingParams(max_tokens=max_tokens,
                                                                            ignore_eos=True)):
            got.extend(out.new_token_ids)

    async def run() -> list[list[int]]:
        got: list[list[int]] = [[] for _ in prompts]
        tasks = [asyncio.create_task(one(i, got[i])) for i in range(len(prompts))]
        deadline = time.monotonic() + 60
        while sum(map(len, got)) < 40 and time.monotonic() < deadline:   # mid-stream
            await asyncio.sleep(0.01)
        assert not all(len(g) == max_tokens for g in got), "finished before the restart"
        board.restart()
        await asyncio.wait_for(asyncio.gather(*tasks), 120)
        return got

    try:
        got = asyncio.run(run())
        assert client.resubmitted > 0
        assert got == ref
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and any(e.has_unfinished() for e in engines):
            time.sleep(0.05)
        for e in engines:
            assert not e.has_unfinished() and not e.scheduler.parked
            assert e.kv.num_free_blocks == e.kv.num_blocks
        assert board.core.inflight() == 0
    finally:
        for w in workers:
            w.stop()


def test_a_gateway_that_stops_pulling_has_its_requests_aborted():
    clock = VirtualClock(0.0)
    core = RouterCore(RouterConfig(gateway_timeout_s=5.0), clock)
    core.on_poll("i1", _stats("i1"))
    for rid, gw in (("a", "live"), ("b", "gone"), ("c", "gone")):
        core.submit(RequestMeta(request_id=rid, gateway_id=gw, prompt_token_ids=[5] * 4,
                                sampling=SamplingParams(max_tokens=9)))
    handed = [w.meta.request_id for w in core.on_poll("i1", _stats("i1")).work]
    core.on_report(StepReport(_stats("i1"), [TokenEvent(r, [3]) for r in handed]))
    for t in (2.0, 4.0, 6.0):                 # "live" pulls every 2 s, "gone" never again
        clock.advance(2.0)
        core.take_events("live")
        assert core.reap_gateways() == ([] if t < 6.0 else ["gone"])
    assert sorted(core.requests) == ["a"] and "gone" not in core.gateways
    aborts = core.take_outbox("i1").aborts
    assert sorted(aborts) == sorted(r for r in handed if r != "a")    # handed out: the instance stops them
    core.abort("a")
    assert core.inflight() == 0
