"""LoRA adapters loaded and unloaded while serving (vLLM's runtime LoRA updating).

On one engine: an adapter added at run time gives the tokens of the base model with it merged
into its weights; an unloaded adapter serves no new request while the running ones finish on it;
a name loaded again over other weights never matches the prefix-cache blocks the old weights made.
In the router: the table of adapters every instance must hold, sent once per version, committed
only once every instance serves it, taken back if one cannot load it, and kept for requests
still running on an unloaded one. End to end without Ray: client -> router -> two instance
workers, an adapter loaded through the client is served by both, a bad path is refused by
every instance (and left on none), and an instance that registers later gets the table."""

from __future__ import annotations

import asyncio
import time

import pytest

from raycluster.cluster.client import ClusterClient, LoRACalls
from raycluster.cluster.instance import InstanceWorker
from raycluster.cluster.messages import InstanceStats, RequestMeta
from raycluster.cluster.router_core import RouterConfig, RouterCore
from raycluster.engine.config import EngineConfig
from raycluster.engine.engine import InvalidRequestError, LLMEngine
from raycluster.model.lora import AdapterError, AdapterNotFound, LoRAAdapter, LoRASet
from raycluster.model.tiny import write_tiny_lora
from raycluster.request import SamplingParams
from switchboard import Switchboard

BASE = dict(policy="fcfs", packer="token", predictor="none", kv_cache_tokens=8192)
PROMPT = list(range(100, 141))          # 41 tokens: two full 16-token blocks to cache


@pytest.fixture(scope="module")
def adapters(tiny_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("lora_rt")
    return {"one": str(write_tiny_lora(root / "one", tiny_model_dir, seed=1)),
            "two": str(write_tiny_lora(root / "two", tiny_model_dir, seed=2))}


def _merged_tokens(merged_lora, adapter_dir, prompt, n):
    return LLMEngine(EngineConfig(**BASE), merged_lora(adapter_dir)).generate(
        [prompt], SamplingParams(max_tokens=n, ignore_eos=True))[0]


def _finish(eng, reqs, limit=500):
    for _ in range(limit):
        if not eng.has_unfinished():
            break
        eng.step()
    assert not eng.has_unfinished()
    return [r.output_token_ids for r in reqs]


# ---- LoRASet -------------------------------------------------------------------------------
def test_lora_set_serves_retires_and_roots_each_load_apart():
    s = LoRASet()
    s.add(LoRAAdapter("a", "/p", 8))
    assert "a" in s and s.names() == ["a"] and s.root_key("a") == "a"
    with pytest.raises(AdapterError, match="already been loaded"):
        s.add(LoRAAdapter("a", "/q", 8))
    s.retire("a")
    assert "a" not in s and s.names() == [] and "a" in s.adapters      # weights kept while in use
    with pytest.raises(AdapterError, match="still being unloaded"):
        s.add(LoRAAdapter("a", "/q", 8))
    with pytest.raises(AdapterNotFound):
        s.retire("a")
    assert s.collect({"a"}) == [] and "a" in s.adapters
    assert s.collect({None, "b"}) == ["a"] and "a" not in s.adapters
    s.add(LoRAAdapter("a", "/q", 8))
    assert s.root_key("a") == "a#2"       # a second load of the name: other chains


# ---- one engine ------------------------------------------------------------------------------
def test_an_adapter_added_at_run_time_gives_the_merged_models_tokens(adapters, merged_lora, loaded):
    model, tok = loaded
    eng = LLMEngine(EngineConfig(**BASE), model, tok)
    with pytest.raises(InvalidRequestError, match="'one' is not served"):
        eng.add_request("x", PROMPT, SamplingParams(lora_adapter="one"))
    eng.lora.add(eng.read_lora("one", adapters["one"]))
    got = _finish(eng, [eng.add_request("a", PROMPT, SamplingParams(max_tokens=10, ignore_eos=True,
                                                                      lora_adapter="one")),
                        eng.add_request("b", PROMPT, SamplingParams(max_tokens=10, ignore_eos=True))])
    assert got[0] == _merged_tokens(merged_lora, adapters["one"], PROMPT, 10)
    assert got[1] == LLMEngine(EngineConfig(**BASE), model).generate([PROMPT], SamplingParams(
        max_tokens=10, ignore_eos=True))[0]
    with pytest.raises(AdapterNotFound, match="no adapter found"):
        eng.read_lora("three", "/nonexistent/dir")


def test_unloading_lets_running_requests_finish_on_the_adapter(adapters, merged_lora, loaded):
    model, tok = loaded
    eng = LLMEngine(EngineConfig(**BASE, lora_modules=[f"one={adapters['one']}"]), model, tok)
    r = eng.add_request("a", PROMPT, SamplingParams(max_tokens=12, ignore_eos=True, lora_adapter="one"))
    for _ in range(3):
        eng.step()
    eng.unload_lora("one")
    assert eng.lora.names() == [] and "one" in eng.lora.adapters
    with pytest.raises(InvalidRequestError, match="not served"):
        eng.add_request("b", PROMPT, SamplingParams(lora_adapter="one"))
    with pytest.raises(AdapterNotFound):
        eng.unload_lora("one")
    assert _finish(eng, [r])[0] == _merged_tokens(merged_lora, adapters["one"], PROMPT, 12)
    assert "one" not in eng.lora.adapters            # gone with its last request
    # With nothing running on it, an unload drops the weights at once.
    eng.lora.add(eng.read_lora("two", adapters["two"]))
    eng.unload_lora("two")
    assert eng.lora.adapters == {}


def test_a_name_loaded_again_never_matches_the_old_weights_kv(adapters, merged_lora, loaded):
    model, tok = loaded
    eng = LLMEngine(EngineConfig(**BASE, enable_prefix_caching=True, lora_modules=[f"x={adapters['one']}"]), model, tok)

    def run(rid):
        r = eng.add_request(rid, PROMPT, SamplingParams(max_tokens=6, ignore_eos=True, lora_adapter="x"))
        return r, _finish(eng, [r])[0]

    assert run("a")[0].num_cached_tokens == 0
    assert run("b")[0].num_cached_tokens == 32        # its own blocks, cached
    eng.unload_lora("x")
    eng.lora.add(eng.read_lora("x", adapters["two"]))
    r, toks = run("c")
    assert r.num_cached_tokens == 0                    # the old weights' KV is not this adapter's
    assert toks == _merged_tokens(merged_lora, adapters["two"], PROMPT, 6)
    assert run("d")[0].num_cached_tokens == 32


# ---- the router's table --------------------------------------------------------------------
def _stats(iid, adapters=(), failed=None, version=-1):
    return InstanceStats(iid, "mixed", kv_free_blocks=1000, kv_total_blocks=1000,
                         lora_adapters=list(adapters), lora_failed=dict(failed or {}), lora_version=version)


def _meta(rid, adapter=None):
    return RequestMeta(rid, "g", [5] * 8, SamplingParams(max_tokens=4, lora_adapter=adapter), arrival_time=time.time())


def test_router_table_goes_out_once_per_version_and_commits_when_all_serve_it():
    core = RouterCore(RouterConfig(policy="fcfs", lora={"s": "/s"}))
    core.on_poll("i0", _stats("i0", ["s"]))
    assert core.take_outbox("i0").lora is None          # started on the static set: nothing to send
    core.adapters.load("n", "/n")
    with pytest.raises(AdapterError, match="being loaded"):
        core.adapters.load("n", "/n")
    assert core.has_outbox("i0")
    reply = core.take_outbox("i0")
    assert reply.lora == {"s": "/s", "n": "/n"} and reply.lora_version == 1
    assert core.take_outbox("i0").lora is None and not core.has_outbox("i0")      # once per version
    core.on_poll("i1", _stats("i1", ["s"]))             # a new instance: the table with its first reply
    assert core.take_outbox("i1").lora is None          # (on_poll took it already)
    # Not served until every instance serves it: a request naming it is the client's error.
    assert core.submit(_meta("r0", "n")).invalid_field == "model"
    core.on_poll("i0", _stats("i0", ["s", "n"], version=1))
    assert core.adapters.progress("n", core.instances.values()) == (["i1"], {})
    core.on_poll("i1", _stats("i1", ["s"], failed={"n": "n: no adapter found at /n"}, version=1))
    assert core.adapters.progress("n", core.instances.values()) == ([], {"i1": "n: no adapter found at /n"})
    core.adapters.rollback("n")
    assert core.adapters.loaded == {"s": "/s"} and core.take_outbox("i0").lora == {"s": "/s"}
    core.adapters.load("n", "/n2")
    # An instance still on an older table (serving the name from before) has not loaded this one.
    core.on_poll("i0", _stats("i0", ["s", "n"], version=1))
    assert core.adapters.progress("n", core.instances.values(), since=3) == (["i0", "i1"], {})
    core.on_poll("i0", _stats("i0", ["s", "n"], version=3))
    core.on_poll("i1", _stats("i1", ["s", "n"], version=3))
    assert core.adapters.progress("n", core.instances.values(), since=3) == ([], {})
    core.adapters.commit("n")
    assert core.submit(_meta("r1", "n")).accepted and core.status()["lora_adapters"] == {"s": "/s", "n": "/n2"}


def test_an_unloaded_adapter_stays_on_the_instances_while_requests_use_it():
    core = RouterCore(RouterConfig(policy="fcfs", lora={"s": "/s"}))
    core.on_poll("i0", _stats("i0", ["s"]))
    assert core.submit(_meta("r0", "s")).accepted and core.submit(_meta("r1")).accepted
    core.adapters.unload("s")
    assert not core.collect_adapters()                  # r0 still runs on it
    assert core.adapters.loaded == {"s": "/s"} and not core.submit(_meta("r2", "s")).accepted
    with pytest.raises(AdapterNotFound):
        core.adapters.unload("s")
    core.abort("r1")
    assert core.adapters.loaded == {"s": "/s"}
    core.abort("r0")                                     # its last request: the instances drop it
    assert core.adapters.loaded == {} and core.take_outbox("i0").lora == {}


def test_a_redeploy_serves_added_static_adapters_and_unloads_dropped_ones():
    from raycluster.cluster.router_reconfigure import reconfigure
    core = RouterCore(RouterConfig(policy="fcfs", lora={"a": "/a", "b": "/b"}))
    core.adapters.load("rt", "/rt")
    core.adapters.commit("rt")
    reconfigure(core, RouterConfig(policy="fcfs", lora={"a": "/a", "c": "/c"}))
    assert core.adapters.served == {"a": "/a", "rt": "/rt", "c": "/c"} == core.adapters.loaded


# ---- client -> router -> instances, no Ray ---------------------------------------------------
def test_adapters_loaded_through_the_client_are_served_by_every_instance(adapters, merged_lora, loaded):
    model, tok = loaded
    board = Switchboard(lambda rid: RouterCore(RouterConfig(policy="fcfs"), router_id=rid))
    workers = [InstanceWorker(LLMEngine(EngineConfig(**BASE), model, tok), "mixed", f"i{i}", board.poll, board.push,
                              poll_timeout_s=0.05).start() for i in range(2)]
    client = ClusterClient(board.submit, board.abort, board.pull, board.status, tokenizer=None, max_model_len=2048,
                           vocab_size=4096, eos_token_ids=(), pull_timeout_s=0.05,
                           lora=LoRACalls(board.lora_names, board.load_lora, board.unload_lora))
    want = _merged_tokens(merged_lora, adapters["one"], PROMPT, 8)

    async def generate(rid, adapter):
        ids = []
        async for out in client.generate(rid, PROMPT, SamplingParams(max_tokens=8, ignore_eos=True,
                                                                      lora_adapter=adapter)):
            ids += out.new_token_ids
        return ids

    async def scenario():
        deadline = time.monotonic() + 30
        while len(board.core.instances) < 2 and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        with pytest.raises(InvalidRequestError, match="does not exist"):
            await generate("x0", "one")
        await client.load_lora("one", adapters["one"])
        assert client.lora_adapters() == {"one": adapters["one"]}
        assert all(w.engine.lora.names() == ["one"] for w in workers)
        got = await asyncio.gather(*(generate(f"a{i}", "one") for i in range(4)))
        assert got == [want] * 4
        with pytest.raises(AdapterError, match="already been loaded"):
            await client.load_lora("one", adapters["two"])
        with pytest.raises(AdapterNotFound, match="no adapter found"):
            await client.load_lora("bad", "/nonexistent/adapter")
        assert all(w.engine.lora.names() == ["one"] for w in workers) and list(client.lora_adapters()) == ["one"]
        # An instance that registers now gets the table before any work.
        late = InstanceWorker(LLMEngine(EngineConfig(**BASE), model, tok), "mixed", "i2", board.poll, board.push,
                              poll_timeout_s=0.05).start()
        workers.append(late)
        while late.engine.lora.names() != ["one"] and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        assert late.engine.lora.names() == ["one"]
        await client.unload_lora("one")
        assert client.lora_adapters() == {}
        with pytest.raises(InvalidRequestError, match="does not exist"):
            await generate("x1", "one")
        while any(w.engine.lora.adapters for w in workers) and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        assert all(w.engine.lora.adapters == {} for w in workers)
        with pytest.raises(AdapterNotFound, match="cannot be found"):
            await client.unload_lora("one")

    try:
        asyncio.run(asyncio.wait_for(scenario(), 60))
    finally:
        for w in workers:
            w.stop()
    for w in workers:
        assert w.engine.kv.num_free_blocks == w.engine.kv.num_blocks
    assert board.core.inflight() == 0


def test_an_instance_given_another_path_for_a_name_swaps_the_adapter(adapters, merged_lora, loaded):
    """A table naming a served adapter at another path (a load taken back and made again before
    the instance saw the first table): the instance drops the old weights and serves the new."""
    from raycluster.cluster.messages import PollReply
    model, tok = loaded
    w = InstanceWorker(LLMEngine(EngineConfig(**BASE, lora_modules=[f"x={adapters['one']}"]), model, tok), "mixed",
                       "i0", poll_fn=lambda *a: PollReply(), push_fn=lambda r: None)
    w._apply(PollReply(lora={"x": adapters["two"]}, lora_version=3))
    st = w.stats()
    assert (st.lora_adapters, st.lora_failed, st.lora_version) == (["x"], {}, 3)
    assert w.engine.lora.adapters["x"].path == adapters["two"]
    r = w.engine.add_request("a", PROMPT, SamplingParams(max_tokens=6, ignore_eos=True, lora_adapter="x"))
    _finish(w.engine, [r])
    assert r.output_token_ids == _merged_tokens(merged_lora, adapters["two"], PROMPT, 6)
