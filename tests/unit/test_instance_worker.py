"""InstanceWorker without Ray or threads: the stats it heartbeats carry the engine's prefill
backlog in tokens, and a handed-off request keeps the client's first-token time (converted from
the router's epoch clock to the engine's) for the decode side's TPOT pacing; a controller move
in a poll reply, applied by the step thread, changes the role and the scheduling (the target
pool's) it reports, and its busy time (the controller's utilization)
accumulates per step."""

from __future__ import annotations

import time

import pytest

from raycluster.cluster.instance import InstanceWorker
from raycluster.cluster.messages import PollReply, RequestMeta, WorkItem
from raycluster.engine.config import EngineConfig
from raycluster.engine.engine import LLMEngine
from raycluster.kv_transfer.base import KVConnector, KVHandle, KVLayoutError, KVTransferUnquiesced
from raycluster.model.loader import load_model
from raycluster.request import SamplingParams


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return load_model(tiny_model_dir)[0]


def _worker(model, connector=None) -> InstanceWorker:
    eng = LLMEngine(EngineConfig(policy="fcfs", packer="token", kv_cache_tokens=4096, chunk_size=32), model)
    return InstanceWorker(eng, "mixed", "i0", poll_fn=lambda *a: PollReply(), push_fn=lambda r: None,
                          connector=connector)


def _meta(rid: str, n: int) -> RequestMeta:
    return RequestMeta(request_id=rid, gateway_id="g", prompt_token_ids=[7] * n,
                       sampling=SamplingParams(max_tokens=4, ignore_eos=True), arrival_time=time.time())


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
    short = EngineConfig(policy="fcfs", packer="awd", chunk_size=32)
    w = InstanceWorker(eng, "prefill-long", "i0", poll_fn=poll, push_fn=lambda r: None,
                       role_configs={"prefill-short": short})
    w._poll_loop()                          # one poll: the reply carries the new role
    assert seen == ["prefill-long"] and w.stats().role == "prefill-long"
    assert w.stats().scheduling == "fcfs/token/all"
    w._apply(w._replies.get_nowait())       # the step thread applies it between steps
    assert w.stats().role == "prefill-short" and w.stats().scheduling == "fcfs/awd/all"
    assert w.stats().busy_s == 0.0
    w._apply(PollReply(work=[WorkItem(_meta("a", 40))]))
    for _ in range(20):
        if not w.engine.has_unfinished():
            break
        w._step()
    assert w.steps > 0 and w.stats().busy_s > 0.0 and w.stats().busy_s == w.busy_s


class _NoPull(KVConnector):
    """Offers like any connector; a pull would mean the KV was moved, which adoption must not."""

    def pull(self, handle, dst, timeout_s):
        raise AssertionError("pulled KV the instance already holds")


def test_moved_to_decode_adopts_its_own_parked_kv(model):
    sp = SamplingParams(max_tokens=12, ignore_eos=True)
    prompt = [11 + i % 40 for i in range(70)]
    want = LLMEngine(EngineConfig(policy="fcfs", packer="token", kv_cache_tokens=4096, chunk_size=32),
                     model).generate([prompt], sp)[0]
    w = _worker(model)
    w.connector = _NoPull(w.engine.runner.kv_cache, "i0", lease_s=30.0)
    meta = RequestMeta(request_id="a", gateway_id="g", prompt_token_ids=prompt, sampling=sp)
    w._apply(PollReply(work=[WorkItem(meta, mode="prefill")]))
    while not w.engine.scheduler.parked:
        w._step()
    [done] = [p for _ in range(w._reports.qsize()) for p in w._reports.get_nowait().prefilled]
    assert done.first_token == want[0] and done.kv.src_instance == "i0"
    used = w.engine.kv.num_blocks - w.engine.kv.num_free_blocks
    # The router hands the decode to this same instance (it moved to the decode pool meanwhile).
    w._apply(PollReply(work=[WorkItem(meta, mode="decode", output_token_ids=[done.first_token], kv=done.kv)]))
    assert not w.engine.scheduler.parked and w.connector.offered_ids() == []
    assert w.engine.kv.num_blocks - w.engine.kv.num_free_blocks == used        # nothing copied
    while w.engine.has_unfinished():
        w._step()
    events = [e for _ in range(w._reports.qsize()) for e in w._reports.get_nowait().events]
    assert [done.first_token] + [t for e in events for t in e.token_ids] == want
    w._apply(PollReply(releases=["a"]))                                       # the router's release
    assert w.engine.kv.num_free_blocks == w.engine.kv.num_blocks


class _UnquiescedPull(_FillConnector):
    def pull(self, handle, dst, timeout_s):
        raise KVTransferUnquiesced(f"blocks {dst} may still be written")


def test_a_transfer_that_cannot_be_stopped_stops_the_worker_for_good(model):
    """Its blocks may still be written: neither recomputed into nor reused. The step thread
    applies no more work and every thread stops (no heartbeat: the router resumes the requests
    elsewhere), and `fatal` says why (the replica's health check raises it)."""
    w = _worker(model, connector=_UnquiescedPull())
    handle = KVHandle(request_id="h", src_instance="p", src_block_ids=[0, 1], num_tokens=20,
                      block_shape=(), dtype="float32")
    w._replies.put(PollReply(work=[WorkItem(_meta("h", 20), mode="decode", output_token_ids=[5], kv=handle)]))
    w._replies.put(PollReply(work=[WorkItem(_meta("later", 8))]))
    t0 = time.monotonic()
    w._step_loop()                          # returns: it does not go on serving
    assert time.monotonic() - t0 < 5
    assert w.fatal is not None and "may still be written" in w.fatal and w._stop.is_set()
    assert "later" not in w.engine.scheduler.requests and w._replies.qsize() == 1
    assert w.steps == 0                     # nothing ran on those blocks


def _guided_engine(model, tok, guided_cls) -> LLMEngine:
    eng = LLMEngine(EngineConfig(policy="fcfs", packer="token", kv_cache_tokens=4096, chunk_size=32,
                                 num_threads=1), model, tokenizer=tok)
    eng._guided = guided_cls(tok.token_bytes(), eng.eos_token_ids)
    return eng


def _scripted_worker(eng: LLMEngine):
    """A started worker whose polls return what the test puts on `script`, and the token
    events it pushes, as they arrive: (worker, script, events)."""
    import queue

    script: queue.Queue = queue.Queue()
    events: list = []

    def poll(iid, stats, timeout):
        try:
            return script.get(timeout=timeout)
        except queue.Empty:
            return PollReply()

    w = InstanceWorker(eng, "mixed", "i0", poll_fn=poll, push_fn=lambda r: events.extend(r.events),
                       poll_timeout_s=0.02).start()
    return w, script, events


def test_a_pattern_compiles_off_the_step_thread_and_replies_keep_their_order(model, tiny_model_dir):
    """While request b's structured-output pattern compiles (held here until released), the step
    thread keeps decoding a; b's abort, polled after b, is applied after b (b ends aborted and
    frees its KV), and c, polled later with a pattern compiled already, waits its turn too."""
    import threading

    from raycluster.engine.guided import GuidedDecoding, Regex
    from raycluster.model.tokenizer import Tokenizer

    tok = Tokenizer(tiny_model_dir)
    release = threading.Event()
    slow, fast = "[a-z]{1,8}", "[0-9]{1,3}"

    class HeldCompile(GuidedDecoding):
        def index(self, constraint):
            if constraint == Regex(slow) and not self.compiled(constraint):
                assert release.wait(30)
            return super().index(constraint)

    eng = _guided_engine(model, tok, HeldCompile)
    eng.guided_decoding().index(Regex(fast))
    w, script, events = _scripted_worker(eng)

    def meta(rid, regex, max_tokens):
        return RequestMeta(request_id=rid, gateway_id="g", prompt_token_ids=[7] * 20, arrival_time=time.time(),
                           sampling=SamplingParams(max_tokens=max_tokens, ignore_eos=regex is None,
                                                   guided_regex=regex))

    def tokens(rid):
        return [t for e in list(events) if e.request_id == rid for t in e.token_ids]

    try:
        # Long enough to still decode a second after b arrives on a fast host (400 took 0.5 s).
        script.put(PollReply(work=[WorkItem(meta("a", None, 2000))]))
        deadline = time.monotonic() + 30
        while not tokens("a") and time.monotonic() < deadline:
            time.sleep(0.01)
        script.put(PollReply(work=[WorkItem(meta("b", slow, 50))]))
        script.put(PollReply(aborts=["b"]))
        script.put(PollReply(work=[WorkItem(meta("c", fast, 5))]))
        time.sleep(0.5)
        during = len(tokens("a"))
        time.sleep(0.5)
        assert len(tokens("a")) > during > 0               # a decodes while b's pattern compiles
        assert "b" not in eng.scheduler.requests and not tokens("c")   # both wait behind b's compile
        release.set()
        while (eng.has_unfinished() or not w._to_compile.empty() or not w._replies.empty()) \
                and time.monotonic() < deadline + 30:
            time.sleep(0.02)
        assert not eng.has_unfinished()
        assert not tokens("b")                              # admitted, then aborted before any step
        assert tok.decode(tokens("c")).isdigit()
        assert eng.kv.num_free_blocks == eng.kv.num_blocks
    finally:
        release.set()
        w.stop()


class _CountingConnector(_FillConnector):
    """A decode-side connector whose second pull fails (the worker recomputes that prefill)."""

    def __init__(self) -> None:
        self.pull_counts = {"ok": 0, "failed": 0, "blocks": 0, "seconds": 0.0}
        self.calls = 0

    def pull(self, handle, dst, timeout_s):
        from raycluster.kv_transfer.base import KVTransferError
        self.calls += 1
        if self.calls == 2:
            raise KVTransferError("peer gone")


def test_kv_pull_outcomes_reach_the_stats_and_the_gateways_metrics(model):
    from raycluster.cluster.client import ClusterClient
    from raycluster.cluster.router_state import Instance, instance_summary

    w = _worker(model, connector=_CountingConnector())
    for rid, n in (("a", 40), ("b", 20)):           # 3 blocks, then 2 blocks of 16
        handle = KVHandle(request_id=rid, src_instance="p", src_block_ids=list(range(-(-n // 16))), num_tokens=n,
                          block_shape=(), dtype="float32")
        w._apply(PollReply(work=[WorkItem(_meta(rid, n), mode="decode", output_token_ids=[5], kv=handle)]))
    for _ in range(20):
        if not w.engine.has_unfinished():
            break
        w._step()
    st = w.stats()
    assert (st.kv_pulls_ok, st.kv_pulls_failed, st.kv_pull_blocks) == (1, 1, 3) and st.kv_pull_s >= 0
    summary = instance_summary(Instance("i0", "decode", st, time.monotonic()), time.monotonic())
    client = ClusterClient(submit=None, abort=None, pull=None, status=None, tokenizer=None, max_model_len=64,
                           vocab_size=10, eos_token_ids=(), gateway_id="g")
    client._last_status = {"instances": [summary]}
    text = client.prometheus_text()
    assert 'raycluster_instance_kv_pulls_total{instance="i0",pool="decode",outcome="ok"} 1' in text
    assert 'raycluster_instance_kv_pulls_total{instance="i0",pool="decode",outcome="recomputed"} 1' in text
    assert 'raycluster_instance_kv_pull_blocks_total{instance="i0",pool="decode"} 3' in text


class _OfferRaises(_NoPull):
    """An offer that raises (as the object store's did for a bf16 KV cache)."""

    def _offer_extra(self, handle):
        raise TypeError("Got unsupported ScalarType BFloat16")


@pytest.mark.parametrize("on_failure", ["recompute", "fail"])
def test_a_failed_offer_frees_the_blocks_and_never_strands_the_request(model, on_failure):
    """The prefill's first token still reaches the router: with "recompute" as a handoff without
    KV (the decode instance recomputes the prompt), with "fail" as an error; the parked blocks
    are freed at once, and the other requests of the same step are reported as usual."""
    w = _worker(model)
    w.connector = _OfferRaises(w.engine.runner.kv_cache, "i0", lease_s=30.0)
    w.on_transfer_failure = on_failure
    sp = SamplingParams(max_tokens=3, ignore_eos=True)
    w._apply(PollReply(work=[WorkItem(RequestMeta(request_id="p", gateway_id="g", prompt_token_ids=[9] * 20,
                                                  sampling=sp), mode="prefill"),
                             WorkItem(RequestMeta(request_id="m", gateway_id="g", prompt_token_ids=[8] * 5,
                                                  sampling=sp))]))
    for _ in range(20):
        if not w.engine.has_unfinished():
            break
        w._step()
    reports = [w._reports.get_nowait() for _ in range(w._reports.qsize())]
    prefilled = [p for r in reports for p in r.prefilled]
    events = [e for r in reports for e in r.events]
    if on_failure == "recompute":
        assert [(p.request_id, p.kv) for p in prefilled] == [("p", None)]
        assert not [e for e in events if e.request_id == "p"]
    else:
        assert prefilled == []
        [err] = [e for e in events if e.request_id == "p"]
        assert err.finished and err.finish_reason == "error" and "BFloat16" in err.error
    assert sum(len(e.token_ids) for e in events if e.request_id == "m") == 3    # the mixed request
    assert w.offer_failures == 1 and w.connector.offered_ids() == []
    assert not w.engine.scheduler.parked and w.engine.kv.num_free_blocks == w.engine.kv.num_blocks


def test_a_failed_step_also_ends_the_requests_it_parked(model):
    """A step that raises after parking a prefilled request (before its offer) must not leave
    it parked and unreported: `_fail_all` ends it with an error and frees its blocks; the
    request still prefilling ends too."""
    w = _worker(model)
    w.connector = _NoPull(w.engine.runner.kv_cache, "i0", lease_s=30.0)
    sp = SamplingParams(max_tokens=3, ignore_eos=True)
    w._apply(PollReply(work=[WorkItem(RequestMeta(request_id="p", gateway_id="g", prompt_token_ids=[9] * 20,
                                                  sampling=sp), mode="prefill"),
                             WorkItem(RequestMeta(request_id="long", gateway_id="g", prompt_token_ids=[8] * 300,
                                                  sampling=sp), mode="prefill")]))
    real_step = w.engine.step

    def step_then_fail():
        result = real_step()
        if w.engine.scheduler.parked:
            raise RuntimeError("a bug after the forward")
        return result
    w.engine.step = step_then_fail
    for _ in range(20):
        try:
            w._step()
        except RuntimeError:
            w._fail_all("engine step failed")
            break
    events = [e for _ in range(w._reports.qsize()) for e in w._reports.get_nowait().events]
    assert sorted((e.request_id, e.finish_reason) for e in events) == [("long", "error"), ("p", "error")]
    assert not w.engine.scheduler.parked and not w.engine.scheduler.requests
    assert w.engine.kv.num_free_blocks == w.engine.kv.num_blocks


class _PullRaises(_FillConnector):
    def __init__(self, exc):
        self.exc = exc

    def pull(self, handle, dst, timeout_s):
        raise self.exc


@pytest.mark.parametrize("exc", [KVLayoutError("source block (2, 16, 2, 32) float32, destination ..."),
                                 TypeError("Got unsupported ScalarType BFloat16")])
def test_a_pull_that_raises_ends_its_request_frees_its_blocks_and_the_worker_serves_on(model, exc):
    """Not a KVTransferError (no recompute): a layout mismatch or a connector bug. The handoff's
    reserved blocks are freed (the request is not decoded on KV that never came), the router hears
    an error, and the next work item is served."""
    w = _worker(model, connector=_PullRaises(exc))
    handle = KVHandle(request_id="h", src_instance="p", src_block_ids=[0, 1], num_tokens=20,
                      block_shape=(), dtype="float32")
    w._apply(PollReply(work=[WorkItem(_meta("h", 20), mode="decode", output_token_ids=[5], kv=handle),
                             WorkItem(_meta("next", 8))]))
    assert "h" not in w.engine.scheduler.requests
    while w.engine.has_unfinished():
        w._step()
    events = [e for _ in range(w._reports.qsize()) for e in w._reports.get_nowait().events]
    [err] = [e for e in events if e.request_id == "h"]
    assert err.finished and err.finish_reason == "error" and str(exc) in err.error
    assert sum(len(e.token_ids) for e in events if e.request_id == "next") == 4
    assert w.engine.kv.num_free_blocks == w.engine.kv.num_blocks


def test_a_duplicate_work_item_leaves_the_running_request_alone(model):
    w = _worker(model)
    w._apply(PollReply(work=[WorkItem(_meta("a", 8))]))
    w._apply(PollReply(work=[WorkItem(_meta("a", 8))]))        # the same id again
    assert "a" in w.engine.scheduler.requests
    while w.engine.has_unfinished():
        w._step()
    events = [e for _ in range(w._reports.qsize()) for e in w._reports.get_nowait().events]
    assert [e.finish_reason for e in events if e.finished] == ["error", "length"]


def test_a_compiler_that_raises_ends_that_request_and_the_worker_serves_on(model, tiny_model_dir):
    """Not a ValueError (a compiler bug, say): the compile thread must not die with the reply,
    or every later reply would queue behind it for good while the instance kept heartbeating."""

    from raycluster.engine.guided import GuidedDecoding
    from raycluster.model.tokenizer import Tokenizer

    tok = Tokenizer(tiny_model_dir)

    class Broken(GuidedDecoding):
        def index(self, constraint):
            raise RecursionError("maximum recursion depth exceeded")

    def meta(rid, regex):
        return RequestMeta(request_id=rid, gateway_id="g", prompt_token_ids=[7] * 10, arrival_time=time.time(),
                           sampling=SamplingParams(max_tokens=4, ignore_eos=True, guided_regex=regex))

    eng = _guided_engine(model, tok, Broken)
    w, script, events = _scripted_worker(eng)
    try:
        script.put(PollReply(work=[WorkItem(meta("g", "[a-z]+"))]))
        script.put(PollReply(work=[WorkItem(meta("plain", None))]))
        deadline = time.monotonic() + 30
        while not any(e.finished and e.request_id == "plain" for e in list(events)) \
                and time.monotonic() < deadline:
            time.sleep(0.02)
        done = {e.request_id: e for e in list(events) if e.finished}
        assert done["g"].finish_reason == "error" and "RecursionError" in done["g"].error
        assert done["plain"].finish_reason == "length"
        assert eng.kv.num_free_blocks == eng.kv.num_blocks
    finally:
        w.stop()


def test_drain_waits_for_the_running_request_and_its_last_report(model):
    """A stopping replica drains: `drain` returns once the request it runs has finished and the
    report with its last token went out (not before), and gives up at its timeout."""
    replies = [PollReply(work=[WorkItem(RequestMeta(
        request_id="d", gateway_id="g", prompt_token_ids=[7] * 20,
        sampling=SamplingParams(max_tokens=40, ignore_eos=True), arrival_time=time.time()))])]
    reports = []

    def poll(iid, stats, timeout):
        if replies:
            return replies.pop(0)
        time.sleep(min(timeout, 0.05))
        return PollReply()

    eng = LLMEngine(EngineConfig(policy="fcfs", packer="token", kv_cache_tokens=4096), model)
    w = InstanceWorker(eng, "mixed", "i0", poll_fn=poll, push_fn=reports.append, poll_timeout_s=0.05).start()
    try:
        deadline = time.monotonic() + 30
        while not eng.has_unfinished() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert eng.has_unfinished()
        assert not w.drain(0.0)                  # running: not drained at once
        assert w.drain(60.0, quiet_s=0.2)
        events = [e for r in reports for e in r.events if e.request_id == "d"]
        assert sum(len(e.token_ids) for e in events) == 40 and events[-1].finished
        assert not eng.has_unfinished()
    finally:
        w.stop()
