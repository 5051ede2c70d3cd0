"""Sampling options through the cluster's gateway path, without Ray: `ClusterClient` ->
`RouterCore` -> `InstanceWorker` -> `LLMEngine`, all in this process.

- Every `SamplingParams` field reaches the engine's `Request.sampling` (and the router's policy
  `Request`) unchanged: `RequestMeta` carries the whole object, so no field can be dropped by a
  hand-written copy on the way.
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time

import pytest

from raycluster.cluster.client import ClusterClient
from raycluster.cluster.instance import InstanceWorker
from raycluster.cluster.router_core import RouterConfig, RouterCore
from raycluster.engine.config import EngineConfig
from raycluster.engine.engine import LLMEngine
from raycluster.model.loader import load_model
from raycluster.model.tokenizer import Tokenizer
from raycluster.request import SamplingParams


@pytest.fixture(scope="module")
def loaded(tiny_model_dir):
    model, mcfg = load_model(tiny_model_dir)
    return model, Tokenizer(tiny_model_dir, mcfg.eos_token_id)


class _Board:
    """A RouterCore behind one lock, with the callables ClusterClient and InstanceWorker take."""

    def __init__(self) -> None:
        self.core = RouterCore(RouterConfig(policy="fcfs"), router_id="r0001")
        self.lock = threading.Lock()
        self.policy_sampling: dict[str, SamplingParams] = {}

    def poll(self, iid, stats, timeout):
        deadline = time.monotonic() + timeout
        while True:
            with self.lock:
                reply = self.core.on_poll(iid, stats)
            if reply.work or reply.aborts or reply.releases or time.monotonic() > deadline:
                return reply
            time.sleep(0.005)

    def push(self, report):
        with self.lock:
            self.core.on_report(report)

    async def submit(self, meta):
        with self.lock:
            reply = self.core.submit(meta)
            st = self.core.requests.get(meta.request_id)
            if st is not None:
                self.policy_sampling[meta.request_id] = st.req.sampling
            return reply

    async def abort(self, rid):
        with self.lock:
            return self.core.abort(rid)

    async def pull(self, gid, timeout):
        deadline = time.monotonic() + timeout
        while True:
            with self.lock:
                if self.core.has_events(gid) or time.monotonic() > deadline:
                    return self.core.take_events(gid)
            await asyncio.sleep(0.005)

    async def status(self):
        with self.lock:
            return self.core.status()


def _run(model, tokenizer, requests: list[tuple[list[int], SamplingParams]]):
    """Serve `requests` through client -> router -> instance; returns (text, finish reason, token
    ids) per request and the `Request`s the engine was given."""
    board = _Board()
    engine = LLMEngine(EngineConfig(policy="fcfs", packer="token", kv_cache_tokens=4096, chunk_size=64), model)
    given = []
    add_request = engine.add_request

    def recording_add_request(*args, **kwargs):
        req = add_request(*args, **kwargs)
        given.append(req)
        return req
    engine.add_request = recording_add_request
    worker = InstanceWorker(engine, "mixed", "i0", board.poll, board.push, poll_timeout_s=0.05).start()
    client = ClusterClient(board.submit, board.abort, board.pull, board.status, tokenizer=tokenizer,
                           max_model_len=2048, vocab_size=4096, eos_token_ids=(), pull_timeout_s=0.05)

    async def one(i: int, prompt: list[int], sp: SamplingParams):
        text, reason, ids = "", None, []
        async for out in client.generate(f"q{i}", prompt, sp):
            text, reason, ids = text + out.new_text, out.finish_reason, ids + out.new_token_ids
        return text, reason, ids

    async def run():
        return await asyncio.wait_for(asyncio.gather(*(one(i, p, sp) for i, (p, sp) in enumerate(requests))), 60)

    try:
        results = asyncio.run(run())
    finally:
        worker.stop()
    return results, given, board


def _every_field_set() -> SamplingParams:
    sp = SamplingParams(max_tokens=7, temperature=0.7, top_p=0.9, top_k=50, seed=1234, stop=["zz"],
                        stop_token_ids=[3], ignore_eos=True, logprobs=2, presence_penalty=0.5,
                        frequency_penalty=-0.25, repetition_penalty=1.1, logit_bias={5: 1.5}, min_tokens=2)
    defaults = SamplingParams()
    unset = [f.name for f in dataclasses.fields(SamplingParams) if getattr(sp, f.name) == getattr(defaults, f.name)]
    assert not unset, f"give these new SamplingParams fields a non-default value here: {unset}"
    return sp


def test_every_sampling_field_reaches_the_engine(loaded):
    model, _ = loaded
    sp = _every_field_set()
    want = dataclasses.replace(sp)          # what the caller asked for, whatever happens to `sp`
    (result,), given, board = _run(model, None, [([11, 12, 13, 14], sp)])
    assert [r.request_id for r in given] == ["q0"]
    assert given[0].sampling == want
    assert given[0].sampling is not sp      # the meta owns its copy, not the caller's object
    assert board.policy_sampling["q0"] == want
    _, reason, ids = result
    assert reason in ("length", "stop") and 1 <= len(ids) <= 7

