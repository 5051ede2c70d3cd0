"""InstanceWorker without Ray or threads: the stats it heartbeats carry the engine's prefill
backlog in tokens, and a handed-off request keeps the client's first-token time (converted from
the router's epoch clock to the engine's) for the decode side's TPOT pacing; a controller move
in a poll reply changes the role it reports, and its busy time (the controller's utilization)
accumulates per step."""

from __future__ import annotations

import time

import pytest

from raycluster.cluster.instance import InstanceWorker
from raycluster.cluster.messages import PollReply, RequestMeta, WorkItem
from raycluster.engine.config import EngineConfig
from raycluster.engine.engine import LLMEngine
from raycluster.kv_transfer.base import KVHandle
from raycluster.model.loader import load_model


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return load_model(tiny_model_dir)[0]


def _worker(model, connector=None) -> InstanceWorker:
    eng = LLMEngine(EngineConfig(policy="fcfs", packer="token", kv_cache_tokens=4096, chunk_size=32), model)
    return InstanceWorker(eng, "mixed", "i0", poll_fn=lambda *a: PollReply(), push_fn=lambda r: None,
                          connector=connector)


def _meta(rid: str, n: int) -> RequestMeta:
    return RequestMeta(request_id=rid, gateway_id="g", prompt_token_ids=[7] * n, max_tokens=4,
                       arrival_time=time.time(), ignore_eos=True)


def test_stats_report_prefill_backlog_in_tokens(model):
    w = _worker(model)
    assert w.stats().queued_tokens == 0
    w._apply(PollReply(work=[WorkItem(_meta("a", 100)), WorkItem(_meta("b", 20))]))
    assert w.stats().queued_tokens == 120 and w.stats().waiting == 2
    w.engine.step()                          # one 32-token chunk of a (FCFS, chunk_size 32)
    assert w.stats().queued_tokens == 120 - w.engine.scheduler.requests["a"].num_computed_tokens - \
        w.engine.scheduler.requests["b"].num_computed_tokens
    for _ in range(50):
        if not w.engine.has_unfinished():
            break
        w.engine.step()
    assert w.stats().queued_tokens == 0


class _FillConnector:
    """Stands in for a KV connector: 'pulls' by leaving the reserved blocks as they are."""

    def pull(self, handle, dst, timeout_s):
        return None

    def local_descriptor(self):
        return {}

    def expire(self):
        return []

    def release(self, request_id):
        return None


def test_handoff_keeps_client_first_token_time(model):
    w = _worker(model, connector=_FillConnector())
    ft = time.time() - 0.3                   # the client got its first token 300 ms ago
    handle = KVHandle(request_id="h", src_instance="p", src_block_ids=[0], num_tokens=10,
                      block_shape=(), dtype="float32")
    w._apply(PollReply(work=[WorkItem(_meta("h", 10), mode="decode", output_token_ids=[5], kv=handle,
                                      first_token_time=ft)]))
    req = w.engine.scheduler.requests["h"]
    age = w.engine.clock.now() - req.first_token_time
    assert 0.3 <= age < 1.0


def test_a_move_changes_the_role_it_reports_and_busy_time_accumulates(model):
    seen = []

    def poll(iid, stats, timeout_s):        # the router moves it, then tells it to stop
        seen.append(stats.role)
        return PollReply(role="prefill-short", shutdown=True)

    eng = LLMEngine(EngineConfig(policy="fcfs", packer="token", kv_cache_tokens=4096, chunk_size=32), model)
    w = InstanceWorker(eng, "prefill-long", "i0", poll_fn=poll, push_fn=lambda r: None)
    w._poll_loop()                          # one poll: the reply carries the new role
    assert seen == ["prefill-long"] and w.stats().role == "prefill-short"
    assert w.stats().busy_s == 0.0
    w._apply(PollReply(work=[WorkItem(_meta("a", 40))]))
    for _ in range(20):
        if not w.engine.has_unfinished():
            break
        w._step()
    assert w.steps > 0 and w.stats().busy_s > 0.0 and w.stats().busy_s == w.busy_s
