"""Sampling options through the cluster's gateway path, without Ray: `ClusterClient` ->
`RouterCore` -> `InstanceWorker` -> `LLMEngine`, all in this process.

- Every `SamplingParams` field reaches the engine's `Request.sampling` (and the router's policy
  `Request`) unchanged: `RequestMeta` carries the whole object, so no field can be dropped by a
  hand-written copy on the way.
- Stop strings (applied by the gateway's `TextStream`) honour `min_tokens` as vLLM v1 does: not
  checked while at most `min_tokens` tokens were generated, and a match must end in text decoded
  after them (it may start before).
"""

from __future__ import annotations

import asyncio
import dataclasses
import time

from switchboard import Switchboard

from raycluster.cluster.client import ClusterClient
from raycluster.cluster.instance import InstanceWorker
from raycluster.cluster.router_core import RouterConfig, RouterCore
from raycluster.engine.config import EngineConfig
from raycluster.engine.engine import LLMEngine
from raycluster.engine.text import TextStream
from raycluster.model.tokenizer import IncrementalDetokenizer
from raycluster.request import SamplingParams

PROMPT_TEXT = "The river ran down to the sea and the"


class _Board(Switchboard):
    """The switchboard, also recording the sampling parameters of the router's policy request."""

    def __init__(self, lora: dict[str, str]) -> None:
        super().__init__(lambda rid: RouterCore(RouterConfig(policy="fcfs", lora=lora), router_id=rid))
        self.policy_sampling: dict[str, SamplingParams] = {}

    async def submit(self, meta):
        with self.lock:
            reply = self.core.submit(meta)
            st = self.core.requests.get(meta.request_id)
            if st is not None:
                self.policy_sampling[meta.request_id] = st.req.sampling
            return reply


def _run(model, tokenizer, requests: list[tuple[list[int], SamplingParams]], lora_modules: list[str] = ()):
    """Serve `requests` through client -> router -> instance; returns (text, finish reason, token
    ids) per request and the `Request`s the engine was given."""
    board = _Board({n: p for n, _, p in (m.partition("=") for m in lora_modules)})
    engine = LLMEngine(EngineConfig(policy="fcfs", packer="token", kv_cache_tokens=4096, chunk_size=64,
                                    lora_modules=list(lora_modules)), model)
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


def _every_field_set() -> list[SamplingParams]:
    """Three requests that between them set every field (guided_regex and guided_grammar exclude
    each other; a pooling request samples no token)."""
    sp = SamplingParams(max_tokens=7, temperature=0.7, top_p=0.9, top_k=50, min_p=0.05, seed=1234, stop=["zz"],
                        stop_token_ids=[3], ignore_eos=True, logprobs=2, presence_penalty=0.5,
                        frequency_penalty=-0.25, repetition_penalty=1.1, logit_bias={5: 1.5}, min_tokens=2,
                        prompt_logprobs=1, guided_regex="[a-z ]{1,40}",
                        allowed_token_ids=list(range(1000)),     # every byte token: the patterns stay reachable
                        include_stop_str_in_output=True, skip_special_tokens=False,
                        bad_words_token_ids=[[7], [8, 9]], lora_adapter="sql")
    grammar = dataclasses.replace(sp, guided_regex=None, guided_grammar='start: "(" start ")" | "x"')
    pooling = SamplingParams(max_tokens=1, embed=True, lora_adapter="sql", pair_start=2, pool_tokens=True)
    defaults = SamplingParams()
    # A prompt's images need a model with a vision tower: tests/ray/test_images_on_ray.py serves
    # them gateway -> router -> prefill group -> decode instance.
    unset = [f.name for f in dataclasses.fields(SamplingParams) if f.name != "images"
             and all(getattr(s, f.name) == getattr(defaults, f.name) for s in (sp, grammar, pooling))]
    assert not unset, f"give these new SamplingParams fields a non-default value here: {unset}"
    return [sp, grammar, pooling]


def test_every_sampling_field_reaches_the_engine(loaded, tiny_model_dir, tmp_path):
    from raycluster.model.tiny import write_tiny_lora

    model, _ = loaded
    sps = _every_field_set()
    want = [dataclasses.replace(sp) for sp in sps]      # what the caller asked for, whatever happens to `sp`
    adapter = write_tiny_lora(tmp_path / "sql", tiny_model_dir, seed=1)
    results, given, board = _run(model, None, [([11, 12, 13, 14], sp) for sp in sps], [f"sql={adapter}"])
    assert [r.request_id for r in given] == ["q0", "q1", "q2"]
    for i, sp in enumerate(sps):
        assert given[i].sampling == want[i]
        assert given[i].sampling is not sp      # the meta owns its copy, not the caller's object
        assert board.policy_sampling[f"q{i}"] == want[i]
        _, reason, ids = results[i]
        assert reason in ("length", "stop") and (len(ids) == 0 if sp.embed else 1 <= len(ids) <= 7)


def _pieces(tokenizer, prompt: list[int], ids: list[int]) -> list[str]:
    det = IncrementalDetokenizer(tokenizer, prompt)
    return [det.add(t) for t in ids]


def _vllm_stop_text(pieces: list[str], stop: list[str], min_tokens: int) -> tuple[str, bool]:
    """vLLM v1's rule, token by token: no stop check while n <= min_tokens; then a match must end
    in text decoded after the first min_tokens tokens and after the text already checked."""
    text, checked = "", 0
    for n, piece in enumerate(pieces, 1):
        text += piece
        if n <= min_tokens:
            checked = len(text)
            continue
        for s in stop:
            at = text.find(s, max(0, checked - len(s) + 1))
            if at >= 0:
                return text[:at], True
        checked = len(text)
    return text, False


def _cases(pieces: list[str]) -> list[tuple[list[str], int]]:
    k = 5
    head, nxt = "".join(pieces[:k]), pieces[k]
    first_e = head.find("e")
    assert 0 <= first_e and "e" in "".join(pieces[k:]), pieces    # the tiny model's text allows the cases
    return [
        (["e"], 0),                             # plain stop string: the first "e"
        (["e"], k),                             # vLLM: the first "e" after k tokens
        ([head[-3:] + nxt[:2]], k),             # starts inside the first k tokens' text, ends after
        ([head[first_e:first_e + 3], "x" * 20], k),     # only inside them (a longer stop widens the hold)
    ]


def test_text_stream_checks_stop_strings_only_after_min_tokens(loaded):
    model, tok = loaded
    prompt = tok.encode(PROMPT_TEXT)
    eng = LLMEngine(EngineConfig(policy="fcfs", packer="token", kv_cache_tokens=4096), model, tok)
    ids = eng.generate([prompt], SamplingParams(max_tokens=24, ignore_eos=True))[0]
    pieces = _pieces(tok, prompt, ids)
    outcomes = []
    for stop, min_tokens in _cases(pieces):
        ts = TextStream(tok, prompt, stop, min_tokens)
        text, hit = "", False
        for t in ids:
            d, hit = ts.add(t)
            text += d
            if hit:
                break
        if not hit:
            text += ts.flush()
        want = _vllm_stop_text(pieces, stop, min_tokens)
        assert (text, hit) == want, (stop, min_tokens)
        outcomes.append(want)
    # The cases are not vacuous: min_tokens moves the first one, the boundary-spanning stop string
    # truncates inside the first k tokens' text, the one inside them never stops the request.
    k = 5
    head = "".join(pieces[:k])
    assert outcomes[0][1] and outcomes[1][1] and len(outcomes[1][0]) >= len(head) > len(outcomes[0][0])
    assert outcomes[2] == (head[:-3], True)
    assert outcomes[3] == ("".join(pieces), False)


def test_gateway_stop_strings_honour_min_tokens(loaded):
    model, tok = loaded
    prompt = tok.encode(PROMPT_TEXT)
    free = SamplingParams(max_tokens=24, ignore_eos=True)
    eng = LLMEngine(EngineConfig(policy="fcfs", packer="token", kv_cache_tokens=4096), model)
    ids = eng.generate([prompt], free)[0]
    pieces = _pieces(tok, prompt, ids)
    cases = _cases(pieces)
    requests = [(prompt, dataclasses.replace(free, stop=stop, min_tokens=m)) for stop, m in cases]
    results, _, board = _run(model, tok, requests)
    for (stop, m), (text, reason, got) in zip(cases, results):
        want, hit = _vllm_stop_text(pieces, stop, m)
        assert (text, reason) == (want, "stop" if hit else "length"), (stop, m)
        assert got == ids[:len(got)]
    deadline = time.monotonic() + 10        # stopped at the gateway: the router aborts the rest
    while board.core.inflight() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert board.core.inflight() == 0


def test_a_stop_token_adds_no_text_through_the_gateway_as_on_one_engine(loaded):
    """vLLM v1's rule on both paths: the EOS or stop token id that ends a request counts in its
    ids but adds no text, unless include_stop_str_in_output; a stop string still ends the text."""
    model, tok = loaded
    prompt = tok.encode(PROMPT_TEXT)
    eng = LLMEngine(EngineConfig(policy="fcfs", packer="token", kv_cache_tokens=4096), model, tok)
    ids = eng.generate([prompt], SamplingParams(max_tokens=12, ignore_eos=True))[0]
    k = next(i for i in range(2, len(ids)) if ids[i] not in ids[:i] and tok.decode([ids[i]]).strip())
    cases = [SamplingParams(max_tokens=12, ignore_eos=True, stop_token_ids=[ids[k]]),
             SamplingParams(max_tokens=12, ignore_eos=True, stop_token_ids=[ids[k]], include_stop_str_in_output=True)]
    results, _, _ = _run(model, tok, [(prompt, sp) for sp in cases])
    for sp, (text, reason, got) in zip(cases, results):
        keep = k + 1 if sp.include_stop_str_in_output else k
        assert (text, reason, got) == (tok.decode(ids[:keep]), "stop", ids[:k + 1])
        req = eng.add_request(f"one-{keep}", prompt, sp)
        pieces = []
        for _ in range(100):
            if not eng.has_unfinished():
                break
            pieces += [o.new_text for o in eng.step().outputs if o.request_id == req.request_id]
        assert "".join(pieces) == text
