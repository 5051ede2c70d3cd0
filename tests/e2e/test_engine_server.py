"""The single-engine OpenAI server over real HTTP on 127.0.0.1 (uvicorn in a thread)."""

from __future__ import annotations

import json
import time

import httpx
import pytest
from engine_http import serve_engine, tiny_parts

from raycluster.engine.config import EngineConfig
from raycluster.engine.engine import LLMEngine
from raycluster.model.loader import load_model
from raycluster.model.tokenizer import Tokenizer
from raycluster.request import SamplingParams
from raycluster.server.async_engine import AsyncEngine

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    model, mcfg = load_model(tiny_model_dir)
    tok = Tokenizer(tiny_model_dir, mcfg.eos_token_id)
    # Prefix caching on in the served engine, off in the reference: every exact comparison
    # below also checks that cached prefixes change no token.
    cfg = EngineConfig(kv_cache_tokens=8192, policy="fcfs", packer="token", enable_prefix_caching=True)
    with serve_engine(cfg, model, tok, names=("tiny", "tiny-alias")) as (url, aeng):
        # A reference engine on the same weights, for exact greedy comparisons.
        ref = LLMEngine(EngineConfig(kv_cache_tokens=8192, policy="fcfs", packer="token"), model, tok)
        yield url, aeng, tok, ref


def _all_free(aeng: AsyncEngine, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        kv = aeng.engine.kv
        if kv.num_free_blocks == kv.num_blocks and not aeng.engine.has_unfinished():
            kv.check()
            return True
        time.sleep(0.02)
    return False


def test_completion_matches_engine_greedy(server):
    url, aeng, tok, ref = server
    prompt = "Once upon a time, a small robot"
    r = httpx.post(f"{url}/v1/completions", json={"prompt": prompt, "max_tokens": 12, "temperature": 0,
                                                    "ignore_eos": True}, timeout=30)
    assert r.status_code == 200, r.text
    body = r.json()
    expected = ref.generate([tok.encode(prompt)], SamplingParams(max_tokens=12, ignore_eos=True))[0]
    assert body["choices"][0]["text"] == tok.decode(expected)
    usage = dict(body["usage"])
    assert usage.pop("prompt_tokens_details")["cached_tokens"] in (0, 16)     # 0 unless run before
    assert usage == {"prompt_tokens": len(tok.encode(prompt)), "completion_tokens": 12,
                     "total_tokens": len(tok.encode(prompt)) + 12}
    assert body["choices"][0]["finish_reason"] == "length"
    assert _all_free(aeng)


def test_streaming_sse_concatenates_to_same_text(server):
    url, aeng, tok, _ = server
    payload = {"prompt": [5, 6, 7, 8], "max_tokens": 10, "temperature": 0, "ignore_eos": True}
    full = httpx.post(f"{url}/v1/completions", json=payload, timeout=30).json()["choices"][0]["text"]
    chunks, usage = [], None
    with httpx.stream("POST", f"{url}/v1/completions", timeout=30,
                      json={**payload, "stream": True, "stream_options": {"include_usage": True}}) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            ev = json.loads(line[6:])
            if ev["choices"]:
                chunks.append(ev["choices"][0]["text"])
            else:
                usage = ev["usage"]
    assert "".join(chunks) == full
    assert usage["completion_tokens"] == 10
    # vLLM's continuous_usage_stats: every chunk carries the counts so far, rising to the total.
    running = []
    with httpx.stream("POST", f"{url}/v1/completions", timeout=30, json={
            **payload, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                ev = json.loads(line[6:])
                running.append((bool(ev["choices"]), ev["usage"]["prompt_tokens"], ev["usage"]["completion_tokens"]))
    assert all(p == 4 for _, p, _ in running) and not running[-1][0] and running[-1][2] == 10
    counts = [c for has_choice, _, c in running if has_choice]
    assert counts == sorted(counts) and counts[-1] == 10 and len(counts) >= 2
    assert _all_free(aeng)


def test_chat_and_models_and_health_and_metrics(server):
    url, aeng, _, _ = server
    r = httpx.post(f"{url}/v1/chat/completions", timeout=30,
                   json={"messages": [{"role": "user", "content": "hi there"}], "max_tokens": 5, "temperature": 0})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["role"] == "assistant"
    assert [m["id"] for m in httpx.get(f"{url}/v1/models").json()["data"]] == ["tiny", "tiny-alias"]
    assert httpx.get(f"{url}/health").json()["status"] == "ok"
    metrics = httpx.get(f"{url}/metrics").text
    assert "raycluster_ttft_seconds_bucket" in metrics and "raycluster_kv_usage" in metrics
    assert httpx.get(f"{url}/openapi.json").status_code == 200


def _samples(url: str) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{url}/metrics", timeout=10).text
    return {s.name: s.value for fam in text_string_to_metric_families(text) for s in fam.samples if not s.labels
            or set(s.labels) == {"le"} and s.labels["le"] == "+Inf"}


def test_metrics_count_prompt_tokens_and_request_latency(server):
    url, aeng, _, _ = server
    before = _samples(url)
    r = httpx.post(f"{url}/v1/completions", json={"prompt": [5] * 37, "max_tokens": 3, "n": 2, "ignore_eos": True}, timeout=30)
    assert r.status_code == 200
    after = _samples(url)
    assert after["raycluster_prompt_tokens_total"] - before.get("raycluster_prompt_tokens_total", 0) == 74
    assert after["raycluster_e2e_request_latency_seconds_count"] - \
        before.get("raycluster_e2e_request_latency_seconds_count", 0) == 2
    assert after["raycluster_generated_tokens_total"] - before.get("raycluster_generated_tokens_total", 0) == 6
    assert _all_free(aeng)
    # vLLM's names over the same counts (labelled model_name: the first served name), and the
    # engine's prefix-cache totals (this server caches prefixes).
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{url}/metrics", timeout=10).text
    vllm = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples
            if s.name.startswith("vllm:") and s.labels.get("model_name") == "tiny" and "le" not in s.labels
            and "finished_reason" not in s.labels}
    assert vllm["vllm:prompt_tokens_total"] == after["raycluster_prompt_tokens_total"]
    assert vllm["vllm:generation_tokens_total"] == after["raycluster_generated_tokens_total"]
    assert vllm["vllm:num_requests_running"] == 0 and vllm["vllm:kv_cache_usage_perc"] == 0
    assert vllm["vllm:prefix_cache_queries_total"] == aeng.engine.kv.query_tokens > 0
    assert vllm["vllm:prefix_cache_hits_total"] == aeng.engine.kv.hit_tokens


@pytest.mark.parametrize("payload, param", [
    ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "", "max_tokens": 3}, "prompt"),
    ({"prompt": "x", "temperature": -1}, "temperature"),
    ({"max_tokens": 3}, "prompt"),
    ({"prompt": [1, 2, 10 ** 9]}, "prompt"),
    ({"prompt": "x" * 1, "top_p": 2}, "top_p"),
    # out of range, or OpenAI options this server does not implement: refused, not silently ignored
    ({"prompt": "x", "echo": "yes"}, "echo"),
    ({"prompt": "x", "suffix": "the end"}, "suffix"),
    ({"prompt": "x", "presence_penalty": 2.5}, "presence_penalty"),
    ({"prompt": "x", "frequency_penalty": -3}, "frequency_penalty"),
    ({"prompt": "x", "repetition_penalty": 0}, "repetition_penalty"),
    ({"prompt": "x", "min_p": 1.5}, "min_p"),
    ({"prompt": "x", "best_of": 2}, "best_of"),
    ({"prompt": "x", "use_beam_search": True}, "use_beam_search"),
    ({"prompt": "x", "bad_words": [""]}, "bad_words"),
    ({"prompt": "x", "spaces_between_special_tokens": False}, "spaces_between_special_tokens"),
    ({"prompt": "x", "length_penalty": 2.0}, "length_penalty"),
    ({"prompt": "x", "allowed_token_ids": []}, "allowed_token_ids"),
    ({"prompt": "x", "allowed_token_ids": [5000]}, "allowed_token_ids"),
    ({"prompt": "x", "stop_token_ids": [-1]}, "stop_token_ids"),
    ({"prompt": "x", "truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
])
def test_bad_requests_are_400_naming_the_field(server, payload, param):
    url, aeng, _, _ = server
    r = httpx.post(f"{url}/v1/completions", json=payload, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
    assert _all_free(aeng)


def test_max_tokens_past_the_context_is_400_and_chat_defaults_to_the_rest(tiny_model_dir):
    """As vLLM: an explicit max_tokens (or max_completion_tokens) beyond the context left after the
    prompt is a 400 naming it; a chat request without one runs to the end of the context; a
    completion without one gets 16 tokens."""
    model, tok = tiny_parts(tiny_model_dir)
    with serve_engine(EngineConfig(kv_cache_tokens=1024, max_model_len=48, policy="fcfs", packer="token"),
                      model, tok) as (url, aeng):
        msgs = [{"role": "user", "content": "hi"}]
        n_prompt = httpx.post(f"{url}/tokenize", json={"messages": msgs}, timeout=30).json()["count"]
        room = 48 - n_prompt
        for field in ("max_tokens", "max_completion_tokens"):
            r = httpx.post(f"{url}/v1/chat/completions", json={"messages": msgs, field: room + 1}, timeout=30)
            assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text
            ok = httpx.post(f"{url}/v1/chat/completions", timeout=30,
                            json={"messages": msgs, field: room, "ignore_eos": True}).json()
            assert ok["usage"]["completion_tokens"] == room
        whole = httpx.post(f"{url}/v1/chat/completions", json={"messages": msgs, "ignore_eos": True}, timeout=30).json()
        assert whole["usage"]["completion_tokens"] == room and whole["choices"][0]["finish_reason"] == "length"
        text = httpx.post(f"{url}/v1/completions", json={"prompt": [5, 6], "ignore_eos": True}, timeout=30).json()
        assert text["usage"]["completion_tokens"] == 16
        r = httpx.post(f"{url}/v1/completions", json={"prompt": [5, 6], "max_tokens": 47}, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
        assert _all_free(aeng)


def test_an_unknown_model_is_404(server):
    """As OpenAI and vLLM; leaving `model` out picks the first served name, and a response names
    the one its request gave (the server runs under two: vLLM's --served-model-name)."""
    url, aeng, _, _ = server
    for path, body in (("/v1/completions", {"prompt": "x", "max_tokens": 1}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 1}),
                       ("/tokenize", {"prompt": "x"}), ("/detokenize", {"tokens": [5]})):
        r = httpx.post(url + path, json={**body, "model": "gpt-4"}, timeout=30)
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found", r.text
        assert r.json()["error"]["param"] == "model" and "`tiny`, `tiny-alias`" in r.json()["error"]["message"]
        for model in (None, "tiny", "tiny-alias"):
            ok = httpx.post(url + path, json=body if model is None else {**body, "model": model}, timeout=30)
            assert ok.status_code == 200, ok.text
            if path.startswith("/v1/"):
                assert ok.json()["model"] == (model or "tiny")
    stream = httpx.post(url + "/v1/completions", timeout=30, json={"prompt": "x", "max_tokens": 2, "stream": True,
                                                                   "model": "tiny-alias"})
    chunks = [json.loads(line[6:]) for line in stream.text.splitlines()
              if line.startswith("data: ") and line != "data: [DONE]"]
    assert chunks and all(c["model"] == "tiny-alias" for c in chunks)
    assert _all_free(aeng)


def test_neutral_openai_options_and_text_parts_are_accepted(server):
    url, aeng, _, _ = server
    neutral = {"logprobs": None, "echo": False, "logit_bias": {}, "presence_penalty": 0, "frequency_penalty": 0,
               "best_of": 1, "n": 1}
    plain = {"prompt": "the river", "max_tokens": 4, "temperature": 0}
    a = httpx.post(f"{url}/v1/completions", json=plain, timeout=30).json()["choices"][0]["text"]
    b = httpx.post(f"{url}/v1/completions", json={**plain, **neutral}, timeout=30).json()["choices"][0]["text"]
    assert a == b
    msg = {"max_tokens": 4, "temperature": 0}
    a = httpx.post(f"{url}/v1/chat/completions", timeout=30,
                   json={**msg, "messages": [{"role": "user", "content": "hi there"}]}).json()
    b = httpx.post(f"{url}/v1/chat/completions", timeout=30, json={**msg, "messages": [
        {"role": "user", "content": [{"type": "text", "text": "hi "}, {"type": "text", "text": "there"}]}]}).json()
    assert a["choices"][0]["message"]["content"] == b["choices"][0]["message"]["content"]
    r = httpx.post(f"{url}/v1/chat/completions", timeout=30, json={**msg, "messages": [
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x"}}]}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages.0.content", r.text
    r = httpx.post(f"{url}/v1/completions", content=b"{bad", headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["param"] is None, r.text
    assert _all_free(aeng)


def test_client_disconnect_aborts_and_frees_kv(server):
    url, aeng, _, _ = server
    with httpx.stream("POST", f"{url}/v1/completions", timeout=30,
                      json={"prompt": [5] * 300, "max_tokens": 2000, "ignore_eos": True, "stream": True}) as r:
        for i, line in enumerate(r.iter_lines()):
            if i >= 6:
                break           # hang up mid-stream
    assert _all_free(aeng, timeout=10)


def test_openai_client_works(server):
    openai = pytest.importorskip("openai")
    url, aeng, _, _ = server
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=30)
    out = client.completions.create(model="tiny", prompt="hello", max_tokens=4, temperature=0, logprobs=2)
    assert out.usage.completion_tokens <= 4 and out.choices[0].finish_reason in ("length", "stop")
    assert len(out.choices[0].logprobs.token_logprobs) == out.usage.completion_tokens
    chat = dict(model="tiny", messages=[{"role": "user", "content": "hey"}], max_tokens=4, temperature=0)
    whole = client.chat.completions.create(**chat).choices[0].message
    chunks = list(client.chat.completions.create(**chat, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == whole.content
    assert _all_free(aeng)


def test_chat_stream_opens_each_choice_with_its_role(server):
    """As OpenAI and vLLM: before any token, one chunk per choice with the role and empty content;
    completions (text) streams have no such chunk."""
    url, aeng, _, _ = server
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "n": 2, "stream": True}
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=30) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert [e["choices"] for e in events[:2]] == [
        [{"index": i, "delta": {"role": "assistant", "content": ""}, "finish_reason": None, "logprobs": None}]
        for i in (0, 1)]
    assert all("role" not in e["choices"][0]["delta"] for e in events[2:])
    assert sorted(e["choices"][0]["index"] for e in events[2:]) == [0, 0, 0, 1, 1, 1]
    with httpx.stream("POST", f"{url}/v1/completions", json={"prompt": "hi", "max_tokens": 2, "stream": True},
                      timeout=30) as r:
        first = json.loads(next(line for line in r.iter_lines() if line.startswith("data: {"))[6:])
    assert "text" in first["choices"][0] and "delta" not in first["choices"][0]
    assert _all_free(aeng)


def test_penalties_reach_the_sampler(server):
    url, aeng, tok, ref = server
    prompt = [7, 300, 9, 11]
    for fields in ({"repetition_penalty": 0.2}, {"frequency_penalty": -2.0}, {"presence_penalty": -2.0}):
        want = ref.generate([prompt], SamplingParams(max_tokens=8, ignore_eos=True, **fields))[0]
        plain = ref.generate([prompt], SamplingParams(max_tokens=8, ignore_eos=True))[0]
        assert want != plain
        r = httpx.post(f"{url}/v1/completions", timeout=30, json={"prompt": prompt, "max_tokens": 8, "temperature": 0,
                                                                 "ignore_eos": True, **fields})
        assert r.json()["choices"][0]["text"] == tok.decode(want), fields
    # logit_bias: +100 forces a token at every step, -100 bans the greedy one
    body = {"prompt": prompt, "max_tokens": 5, "temperature": 0, "ignore_eos": True, "logprobs": 0}
    forced = httpx.post(f"{url}/v1/completions", timeout=30, json={**body, "logit_bias": {"42": 100}}).json()
    assert forced["choices"][0]["logprobs"]["tokens"] == [tok.decode([42])] * 5
    plain = ref.generate([prompt], SamplingParams(max_tokens=5, ignore_eos=True))[0]
    banned = httpx.post(f"{url}/v1/completions", timeout=30,
                        json={**body, "logit_bias": {str(plain[0]): -100}}).json()["choices"][0]["text"]
    assert banned == tok.decode(ref.generate([prompt], SamplingParams(max_tokens=5, ignore_eos=True,
                                                                      logit_bias={plain[0]: -100.0}))[0])
    assert not banned.startswith(tok.decode([plain[0]]))
    for bias in ({"99999": 1}, {"5": 200}, {"x": 1}):
        r = httpx.post(f"{url}/v1/completions", timeout=30, json={**body, "logit_bias": bias})
        assert r.status_code == 400 and r.json()["error"]["param"].startswith("logit_bias"), r.text
    assert _all_free(aeng)


def test_echo_returns_the_prompt_and_its_logprobs(server):
    """`echo` (lm-eval's loglikelihood request: echo + logprobs): the prompt text before the
    completion, and logprobs over prompt + completion tokens, the first prompt token's null and
    the rest the engine's `prompt_logprobs`; streamed, the first chunk carries the prompt. On
    chat, `echo` is a 400 naming it."""
    url, aeng, tok, ref = server
    prompt = "the quiet river and the light"
    ids = tok.encode(prompt)
    ref.add_request("echo", ids, SamplingParams(max_tokens=3, logprobs=2, prompt_logprobs=2, ignore_eos=True))
    want_prompt, gen = None, []
    while ref.has_unfinished():
        for o in ref.step().outputs:
            want_prompt = o.prompt_logprobs if o.prompt_logprobs is not None else want_prompt
            gen += [(t, lp) for t, lp in zip(o.new_token_ids, o.logprobs or [])]
    body = {"prompt": prompt, "max_tokens": 3, "temperature": 0, "ignore_eos": True}
    plain = httpx.post(f"{url}/v1/completions", json=body, timeout=30).json()["choices"][0]
    echoed = httpx.post(f"{url}/v1/completions", json={**body, "echo": True}, timeout=30).json()["choices"][0]
    assert echoed["text"] == prompt + plain["text"] and echoed["logprobs"] is None
    r = httpx.post(f"{url}/v1/completions", json={**body, "echo": True, "logprobs": 2}, timeout=30).json()
    lp, usage = r["choices"][0]["logprobs"], r["usage"]
    assert usage["prompt_tokens"] == len(ids) and usage["completion_tokens"] == 3
    assert lp["tokens"] == [tok.decode([t]) for t in ids + [t for t, _ in gen]]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert lp["token_logprobs"][1:] == pytest.approx([e.logprob for e in want_prompt[1:]] +
                                                     [e.logprob for _, e in gen], abs=1e-5)
    assert [list(d) for d in lp["top_logprobs"][1:len(ids)]] == \
        [[tok.decode([a]) for a, _ in e.top] for e in want_prompt[1:]]
    assert lp["text_offset"][0] == 0 and "".join(lp["tokens"]) == r["choices"][0]["text"]
    assert len(r["choices"][0]["prompt_logprobs"]) == len(ids)     # vLLM's: echo + logprobs computes them
    chunks = []
    with httpx.stream("POST", f"{url}/v1/completions", json={**body, "echo": True, "logprobs": 2, "stream": True},
                      timeout=30) as s:
        for line in s.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks += json.loads(line[6:])["choices"]
    assert chunks[0]["text"].startswith(prompt) and "".join(c["text"] for c in chunks) == r["choices"][0]["text"]
    assert sum((c["logprobs"]["token_logprobs"] for c in chunks if c["logprobs"]), []) == \
        pytest.approx(lp["token_logprobs"], abs=1e-5)
    ids_prompt = httpx.post(f"{url}/v1/completions", json={**body, "prompt": ids, "echo": True}, timeout=30).json()
    assert ids_prompt["choices"][0]["text"] == tok.decode(ids) + plain["text"]
    bad = httpx.post(f"{url}/v1/chat/completions", timeout=30, json={
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "echo": True})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "echo", bad.text
    assert _all_free(aeng)


def test_prompt_logprobs_in_vllms_shape(server):
    """vLLM's `prompt_logprobs` (k), per completion choice and once per chat response: per prompt
    token null (the first) or {token id: {logprob, rank, decoded_token}}, the prompt token with its
    vocabulary rank then the top k ranked 1..k, all the engine's; also with echo + logprobs (each
    cut to its own k). A bad k, or k > 0 with `stream` (as vLLM), is a 400 naming the field."""
    url, aeng, tok, ref = server
    prompt = "the quiet river and the light"
    ids = tok.encode(prompt)
    ref.add_request("plp", ids, SamplingParams(max_tokens=2, prompt_logprobs=3, ignore_eos=True))
    outs = [o for _ in range(100) if ref.has_unfinished() for o in ref.step().outputs]
    want = next(o.prompt_logprobs for o in outs if o.prompt_logprobs)
    body = {"prompt": prompt, "max_tokens": 2, "temperature": 0, "ignore_eos": True}
    r = httpx.post(f"{url}/v1/completions", json={**body, "prompt_logprobs": 3, "n": 2}, timeout=30).json()
    plain = httpx.post(f"{url}/v1/completions", json=body, timeout=30).json()["choices"][0]
    assert plain["prompt_logprobs"] is None and [c["text"] for c in r["choices"]] == [plain["text"]] * 2
    got = r["choices"][0]["prompt_logprobs"]
    assert r["choices"][1]["prompt_logprobs"] == got and r["choices"][0]["logprobs"] is None
    assert len(got) == len(ids) and got[0] is None and all(d is not None for d in got[1:])
    for t, d, w in zip(ids[1:], got[1:], want[1:]):
        assert list(d)[0] == str(t) and d[str(t)]["rank"] == w.rank >= 1
        assert d[str(t)]["logprob"] == pytest.approx(w.logprob, abs=1e-5)
        assert all(v.keys() == {"logprob", "rank", "decoded_token"} and v["decoded_token"] == tok.decode([int(a)])
                   for a, v in d.items())
        top = {str(a): (i, v) for i, (a, v) in enumerate(w.top, 1)}
        assert set(d) == top.keys() | {str(t)} and len(d) == 3 + (w.rank > 3)
        assert all(d[a]["rank"] == i and d[a]["logprob"] == pytest.approx(v, abs=1e-5) for a, (i, v) in top.items())
    assert max(w.rank for w in want[1:]) > 3           # some prompt token outside the top 3
    zero = httpx.post(f"{url}/v1/completions", json={**body, "prompt_logprobs": 0}, timeout=30).json()
    assert [list(d) for d in zero["choices"][0]["prompt_logprobs"][1:]] == [[str(t)] for t in ids[1:]]
    echo = httpx.post(f"{url}/v1/completions", json={**body, "echo": True, "logprobs": 1, "prompt_logprobs": 3},
                      timeout=30).json()["choices"][0]
    assert echo["prompt_logprobs"] == got and all(len(t) == 1 for t in echo["logprobs"]["top_logprobs"][1:])
    msgs = [{"role": "user", "content": prompt}]
    chat_ids = httpx.post(f"{url}/tokenize", json={"messages": msgs}, timeout=10).json()["tokens"]
    chat = httpx.post(f"{url}/v1/chat/completions", json={"messages": msgs, "max_tokens": 2, "prompt_logprobs": 1},
                      timeout=30).json()
    assert len(chat["prompt_logprobs"]) == len(chat_ids) and chat["prompt_logprobs"][0] is None
    assert "prompt_logprobs" not in chat["choices"][0]          # vLLM's chat: once, beside the choices
    assert all(str(t) in d and 1 <= len(d) <= 2 for t, d in zip(chat_ids[1:], chat["prompt_logprobs"][1:]))
    for path, req in (("/v1/completions", body), ("/v1/chat/completions", {"messages": msgs, "max_tokens": 2})):
        for bad in (-1, 21, 1.5, "2", True, {"prompt_logprobs": 2, "stream": True}):
            extra = bad if isinstance(bad, dict) else {"prompt_logprobs": bad}
            e = httpx.post(f"{url}{path}", json={**req, **extra}, timeout=30)
            assert e.status_code == 400 and e.json()["error"]["param"] == "prompt_logprobs", (path, bad, e.text)
    with httpx.stream("POST", f"{url}/v1/completions", json={**body, "prompt_logprobs": 0, "stream": True},
                      timeout=30) as s:
        chunks = [json.loads(x[6:]) for x in s.iter_lines() if x.startswith("data: {")]
    assert "".join(c["choices"][0]["text"] for c in chunks) == plain["text"] and \
        not any("prompt_logprobs" in c["choices"][0] for c in chunks)
    assert _all_free(aeng)


def test_a_batch_of_prompts_gives_n_choices_per_prompt_in_order(server):
    """OpenAI's batched completions (a list of strings or of token-id lists): choice p * n + i is
    prompt p's i-th, each the prompt's own greedy completion; usage adds the prompts up; echo
    returns each its own prompt; streamed, every choice index arrives; a bad element is a 400
    naming its index."""
    url, aeng, tok, ref = server
    texts = ["the river", "a small boat on the sea", "light"]
    ids = [tok.encode(t) for t in texts]
    want = [tok.decode(o) for o in ref.generate(ids, SamplingParams(max_tokens=4, ignore_eos=True))]
    body = {"max_tokens": 4, "temperature": 0, "ignore_eos": True, "n": 2}
    r = httpx.post(f"{url}/v1/completions", json={**body, "prompt": texts}, timeout=60).json()
    assert [c["index"] for c in r["choices"]] == list(range(6))
    assert [c["text"] for c in r["choices"]] == [w for w in want for _ in range(2)]
    assert r["usage"]["prompt_tokens"] == sum(map(len, ids)) and r["usage"]["completion_tokens"] == 24
    r = httpx.post(f"{url}/v1/completions", json={**body, "n": 1, "prompt": ids, "echo": True}, timeout=60).json()
    assert [c["text"] for c in r["choices"]] == [tok.decode(i) + w for i, w in zip(ids, want)]
    got: dict[int, str] = {}
    with httpx.stream("POST", f"{url}/v1/completions", json={**body, "prompt": texts, "stream": True},
                      timeout=60) as s:
        for line in s.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                for c in json.loads(line[6:])["choices"]:
                    got[c["index"]] = got.get(c["index"], "") + c["text"]
    assert [got[i] for i in range(6)] == [w for w in want for _ in range(2)]
    bad = httpx.post(f"{url}/v1/completions", json={**body, "prompt": ["fine", ""]}, timeout=30)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "prompt.1", bad.text
    bad = httpx.post(f"{url}/v1/completions", json={**body, "n": 2, "prompt": ["x"] * 129}, timeout=30)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "prompt" and "258" in bad.text, bad.text
    assert _all_free(aeng)


def test_logprobs_in_openai_shapes_equal_the_engines(server):
    url, aeng, tok, ref = server
    prompt = "the quiet river and the light"
    ids = tok.encode(prompt)
    ref.add_request("lp", ids, SamplingParams(max_tokens=6, logprobs=3, ignore_eos=True))
    want = []
    while ref.has_unfinished():
        for o in ref.step().outputs:
            want += [(t, lp) for t, lp in zip(o.new_token_ids, o.logprobs or [])]
    body = {"prompt": prompt, "max_tokens": 6, "temperature": 0, "ignore_eos": True, "logprobs": 3}
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=30).json()
    lp = r["choices"][0]["logprobs"]
    assert lp["tokens"] == [tok.decode([t]) for t, _ in want]
    assert lp["token_logprobs"] == pytest.approx([e.logprob for _, e in want], abs=1e-5)
    assert [list(d) for d in lp["top_logprobs"]] == [[tok.decode([a]) for a, _ in e.top] for _, e in want]
    assert lp["text_offset"][0] == 0 and "".join(lp["tokens"]) == r["choices"][0]["text"]
    # streamed: the chunks' logprobs add up to the same
    chunks = []
    with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}, timeout=30) as s:
        for line in s.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks += [c["logprobs"] for c in json.loads(line[6:])["choices"]]
    assert sum((c["token_logprobs"] for c in chunks), []) == pytest.approx(lp["token_logprobs"], abs=1e-5)
    assert sum((c["text_offset"] for c in chunks), []) == lp["text_offset"]
    # chat: a bool plus top_logprobs; without logprobs: null
    msg = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "temperature": 0}
    c = httpx.post(f"{url}/v1/chat/completions", json={**msg, "logprobs": True, "top_logprobs": 2}, timeout=30).json()
    content = c["choices"][0]["logprobs"]["content"]
    assert len(content) == c["usage"]["completion_tokens"] and all(len(e["top_logprobs"]) == 2 for e in content)
    assert all(e["logprob"] == pytest.approx(e["top_logprobs"][0]["logprob"]) for e in content)    # greedy
    assert httpx.post(f"{url}/v1/chat/completions", json=msg, timeout=30).json()["choices"][0]["logprobs"] is None
    bad = httpx.post(f"{url}/v1/chat/completions", json={**msg, "top_logprobs": 2}, timeout=30)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "top_logprobs"
    bad = httpx.post(f"{url}/v1/completions", json={**body, "logprobs": 21}, timeout=30)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "logprobs"
    assert _all_free(aeng)


def test_n_choices_are_separate_requests_merged(server):
    url, aeng, tok, ref = server
    prompt = [7, 300, 9, 11, 42]
    sampled = {"prompt": prompt, "max_tokens": 6, "temperature": 0.9, "seed": 7, "ignore_eos": True}
    r = httpx.post(f"{url}/v1/completions", json={**sampled, "n": 3}, timeout=30).json()
    want = [tok.decode(ref.generate([prompt], SamplingParams(max_tokens=6, temperature=0.9, seed=7 + i,
                                                             ignore_eos=True))[0]) for i in range(3)]
    assert [c["text"] for c in sorted(r["choices"], key=lambda c: c["index"])] == want
    assert len(set(want)) > 1 and r["usage"]["completion_tokens"] == 18
    # streamed: chunks carry their choice index; per index they add up to the same texts
    texts = ["", "", ""]
    with httpx.stream("POST", f"{url}/v1/completions", json={**sampled, "n": 3, "stream": True}, timeout=30) as s:
        for line in s.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                for c in json.loads(line[6:])["choices"]:
                    texts[c["index"]] += c["text"]
    assert texts == want
    chat = httpx.post(f"{url}/v1/chat/completions", timeout=30, json={
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "temperature": 0, "n": 2}).json()
    assert [c["index"] for c in chat["choices"]] == [0, 1]
    assert chat["choices"][0]["message"] == chat["choices"][1]["message"]      # greedy: the same
    bad = httpx.post(f"{url}/v1/completions", json={"prompt": [10 ** 6], "n": 2}, timeout=30)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "prompt"
    # a client that hangs up mid-stream aborts every choice
    with httpx.stream("POST", f"{url}/v1/completions", timeout=30,
                      json={"prompt": [5] * 200, "max_tokens": 2000, "ignore_eos": True, "stream": True, "n": 3}) as s:
        for i, _ in enumerate(s.iter_lines()):
            if i >= 6:
                break
    assert _all_free(aeng, timeout=10)


def test_min_tokens_holds_eos_back(server):
    url, aeng, tok, _ = server
    eos = aeng.engine.eos_token_ids[0]
    body = {"prompt": [7, 300, 9], "max_tokens": 12, "temperature": 0, "logit_bias": {str(eos): 100}}
    early = httpx.post(f"{url}/v1/completions", json=body, timeout=30).json()
    assert early["usage"]["completion_tokens"] == 1 and early["choices"][0]["finish_reason"] == "stop"
    held = httpx.post(f"{url}/v1/completions", json={**body, "min_tokens": 5}, timeout=30).json()
    assert held["usage"]["completion_tokens"] == 6 and held["choices"][0]["finish_reason"] == "stop"
    bad = httpx.post(f"{url}/v1/completions", json={**body, "min_tokens": 13}, timeout=30)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "min_tokens"
    assert _all_free(aeng)


def test_a_repeated_prompt_reports_its_cached_tokens(server):
    url, aeng, tok, ref = server
    ids = [7 + (i * 37) % 400 for i in range(70)]       # 70 tokens: 4 full blocks of 16 reusable
    expected = ref.generate([ids], SamplingParams(max_tokens=6, ignore_eos=True))[0]
    cached = []
    for stream in (False, True):
        body = {"prompt": ids, "max_tokens": 6, "temperature": 0, "ignore_eos": True, "stream": stream}
        if stream:
            body["stream_options"] = {"include_usage": True}
            with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=30) as r:
                chunks = [json.loads(line[6:]) for line in r.iter_lines()
                          if line.startswith("data: ") and line != "data: [DONE]"]
            text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
            usage = chunks[-1]["usage"]
        else:
            r = httpx.post(f"{url}/v1/completions", json=body, timeout=30)
            assert r.status_code == 200, r.text
            text, usage = r.json()["choices"][0]["text"], r.json()["usage"]
        assert text == tok.decode(expected)
        cached.append(usage["prompt_tokens_details"]["cached_tokens"])
    assert cached == [0, 64]
    assert _all_free(aeng)


def test_chat_continues_the_final_message_as_vllm(server):
    """`continue_final_message` with `add_generation_prompt: false` (vLLM's, HF's rule): the
    prompt ends right after the last message's content, so the reply continues it; the text
    equals a completion of that prompt. Asking for both, or continuing a message the template
    drops, is a 400 naming the field."""
    url, aeng, tok, ref = server
    msgs = [{"role": "user", "content": "name a river"}, {"role": "assistant", "content": "The river "}]
    flags = {"add_generation_prompt": False, "continue_final_message": True}
    ids = httpx.post(f"{url}/tokenize", json={"messages": msgs, **flags}, timeout=10).json()["tokens"]
    text = tok.apply_chat_template(msgs, add_generation_prompt=False)
    assert ids == tok.encode(text[:text.rindex("The river") + len("The river")], add_special_tokens=False)
    chat = httpx.post(f"{url}/v1/chat/completions", timeout=30,
                      json={"messages": msgs, "max_tokens": 5, "temperature": 0, "ignore_eos": True, **flags}).json()
    assert chat["usage"]["prompt_tokens"] == len(ids)
    assert chat["choices"][0]["message"]["content"] == tok.decode(ref.generate([ids], SamplingParams(
        max_tokens=5, ignore_eos=True))[0])
    for payload in ({"messages": msgs, "continue_final_message": True},
                    {"messages": msgs[:1] + [{"role": "assistant", "content": "   "}], **flags}):
        for path in ("/v1/chat/completions", "/tokenize"):
            r = httpx.post(f"{url}{path}", json=payload, timeout=10)
            assert r.status_code == 400 and r.json()["error"]["param"] == "continue_final_message", (path, r.text)
    assert _all_free(aeng)


def test_tokenize_and_detokenize_as_vllm(server):
    url, aeng, tok, ref = server
    r = httpx.post(f"{url}/tokenize", json={"prompt": "Once upon a time"}, timeout=10)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["tokens"] == tok.encode("Once upon a time") and body["count"] == len(body["tokens"])
    assert body["max_model_len"] == aeng.max_model_len
    assert httpx.post(f"{url}/tokenize", json={"prompt": [5, 9, 11]}, timeout=10).json()["tokens"] == [5, 9, 11]
    # Chat messages go through the same template as /v1/chat/completions: the usage of a chat
    # request counts exactly these tokens.
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello river"}]
    ids = httpx.post(f"{url}/tokenize", json={"messages": msgs}, timeout=10).json()["tokens"]
    chat = httpx.post(f"{url}/v1/chat/completions", json={"messages": msgs, "max_tokens": 2}, timeout=30).json()
    assert chat["usage"]["prompt_tokens"] == len(ids)
    no_gen = httpx.post(f"{url}/tokenize", json={"messages": msgs, "add_generation_prompt": False}, timeout=10)
    assert len(no_gen.json()["tokens"]) <= len(ids)
    # add_special_tokens, vLLM's defaults: on for a prompt, off for messages (the template writes
    # BOS itself: the chat prompt starts with exactly one).
    bos = tok.bos_token_id
    assert body["tokens"][0] == bos and ids[0] == bos and ids[1] != bos
    bare = httpx.post(f"{url}/tokenize", json={"prompt": "Once upon a time", "add_special_tokens": False}, timeout=10)
    assert bare.json()["tokens"] == body["tokens"][1:]
    doubled = httpx.post(f"{url}/tokenize", json={"messages": msgs, "add_special_tokens": True}, timeout=10)
    assert doubled.json()["tokens"] == [bos] + ids
    plain = httpx.post(f"{url}/v1/completions", timeout=30, json={"prompt": "Once upon a time", "max_tokens": 1,
                                                                  "add_special_tokens": False}).json()
    assert plain["usage"]["prompt_tokens"] == len(body["tokens"]) - 1
    r = httpx.post(f"{url}/detokenize", json={"tokens": body["tokens"]}, timeout=10)
    assert r.status_code == 200 and r.json()["prompt"] == tok.decode(body["tokens"])
    for path, payload, param in [("/tokenize", {}, None), ("/tokenize", {"prompt": "a", "messages": msgs}, None),
                                 ("/tokenize", {"prompt": ""}, "prompt"),
                                 ("/detokenize", {"tokens": [1, 10 ** 9]}, "tokens")]:
        r = httpx.post(f"{url}{path}", json=payload, timeout=10)
        assert r.status_code == 400, (path, payload, r.text)
        assert r.json()["error"]["param"] == param, r.json()


def test_vllms_extra_sampling_parameters(server):
    """vLLM's stop_token_ids, include_stop_str_in_output, allowed_token_ids, skip_special_tokens
    and truncate_prompt_tokens do what vLLM's do, checked against the greedy output of the
    reference engine."""
    url, aeng, tok, ref = server
    prompt = "Once upon a time, a small robot"
    ids = tok.encode(prompt)
    greedy = ref.generate([ids], SamplingParams(max_tokens=12, ignore_eos=True))[0]
    k = next(i for i in range(2, len(greedy)) if greedy[i] not in greedy[:i])    # first made at k

    def post(**extra):
        r = httpx.post(f"{url}/v1/completions", timeout=30,
                       json={"prompt": prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": True, **extra})
        assert r.status_code == 200, r.text
        return r.json()

    # stop_token_ids: ends at that token, finish "stop"; as in vLLM v1 the token counts but its
    # text is left out unless include_stop_str_in_output.
    body = post(stop_token_ids=[greedy[k]])
    assert body["choices"][0]["finish_reason"] == "stop" and body["usage"]["completion_tokens"] == k + 1
    assert body["choices"][0]["text"] == tok.decode(greedy[:k])
    body = post(stop_token_ids=[greedy[k]], include_stop_str_in_output=True)
    assert body["choices"][0]["text"] == tok.decode(greedy[:k + 1])
    # include_stop_str_in_output: the stop string ends the text instead of being cut off.
    whole = tok.decode(greedy)
    stop = whole[len(tok.decode(greedy[:3])):][:3]
    assert stop and stop in whole
    cut = post(stop=[stop])["choices"][0]["text"]
    kept = post(stop=[stop], include_stop_str_in_output=True)["choices"][0]["text"]
    assert kept == cut + stop and whole.startswith(kept)
    # allowed_token_ids: only those ids come out; skip_special_tokens=false shows special tokens' text.
    eos = 1
    only_eos = post(allowed_token_ids=[eos], max_tokens=3)["choices"][0]["text"]
    shown = post(allowed_token_ids=[eos], max_tokens=3, skip_special_tokens=False)["choices"][0]["text"]
    assert only_eos == "" and shown == tok.decode([eos] * 3, skip_special_tokens=False) != ""
    two = [greedy[0], greedy[1]]
    lp = post(allowed_token_ids=two, logprobs=0)["choices"][0]["logprobs"]["tokens"]
    assert len(lp) == 12 and set(lp) <= {tok.decode([t]) for t in two}
    # bad_words: the greedy output's word at k never comes out again, and the text differs from k on.
    word = tok.decode([greedy[k]]).strip()
    assert word and word in whole
    banned = post(bad_words=[word])["choices"][0]["text"]
    assert word not in banned and banned.startswith(tok.decode(greedy[:k]))
    # truncate_prompt_tokens: the last k prompt tokens only, as if sent alone.
    tail = ids[-4:]
    body = post(truncate_prompt_tokens=4)
    assert body["usage"]["prompt_tokens"] == 4
    assert body["choices"][0]["text"] == tok.decode(ref.generate([tail], SamplingParams(max_tokens=12,
                                                                                        ignore_eos=True))[0])
    assert post(truncate_prompt_tokens=len(ids) + 5)["choices"][0]["text"] == whole    # longer: no change
    assert _all_free(aeng)


def test_chat_prompt_ids_equal_transformers_apply_chat_template(server, tiny_model_dir):
    """The token ids a chat request runs are HF's `apply_chat_template(..., tokenize=True)`: the
    template's own BOS, no second one from the tokenizer (a double BOS changes every reply)."""
    transformers = pytest.importorskip("transformers")
    url, _, _, _ = server
    hf = transformers.AutoTokenizer.from_pretrained(tiny_model_dir)
    for msgs in ([{"role": "user", "content": "hello"}],
                 [{"role": "system", "content": "be brief"}, {"role": "user", "content": "name a river"},
                  {"role": "assistant", "content": "The Nile."}, {"role": "user", "content": "another"}]):
        ids = httpx.post(f"{url}/tokenize", json={"messages": msgs}, timeout=10).json()["tokens"]
        want = hf.apply_chat_template(msgs, tokenize=True, add_generation_prompt=True)
        assert ids == list(want if isinstance(want, list) else want["input_ids"])     # newer HF: an encoding


def test_chat_template_kwargs_reach_the_template(server):
    """vLLM's chat_template_kwargs: variables the template reads (this one ignores them, so the ids
    are unchanged); one naming a variable the server sets is a 400 naming the field."""
    url, _, _, _ = server
    msgs = [{"role": "user", "content": "hello"}]
    plain = httpx.post(f"{url}/tokenize", json={"messages": msgs}, timeout=10).json()["tokens"]
    extra = httpx.post(f"{url}/tokenize", json={"messages": msgs, "chat_template_kwargs": {"enable_thinking": False}},
                       timeout=10).json()["tokens"]
    assert extra == plain
    for path in ("/tokenize", "/v1/chat/completions"):
        r = httpx.post(f"{url}{path}", json={"messages": msgs, "max_tokens": 1,
                                             "chat_template_kwargs": {"add_generation_prompt": False}}, timeout=10)
        assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template_kwargs", r.text


def test_a_checkpoints_generation_config_sets_eos_ids_and_default_sampling(tiny_model_dir, tmp_path):
    """As vLLM's --generation-config auto: the file's eos_token_id ends generation (unless
    ignore_eos) and its sampling parameters fill the fields a request leaves out (here top_k 1:
    greedy despite the API's temperature default; max_new_tokens: the default max_tokens)."""
    import json
    import shutil

    from raycluster.model.generation_config import load_generation_config

    ckpt = tmp_path / "ckpt"
    shutil.copytree(tiny_model_dir, ckpt)
    model, tok = tiny_parts(ckpt)
    prompt = "Once upon a time, a small robot"
    greedy = LLMEngine(EngineConfig(kv_cache_tokens=4096, policy="fcfs", packer="token"), model, tok).generate(
        [tok.encode(prompt)], SamplingParams(max_tokens=12, ignore_eos=True))[0]
    k = next(i for i in range(2, len(greedy)) if greedy[i] not in greedy[:i])
    (ckpt / "generation_config.json").write_text(json.dumps(
        {"eos_token_id": [1, greedy[k]], "top_k": 1, "temperature": 0.9, "max_new_tokens": 5}))
    model, tok = tiny_parts(ckpt)
    assert greedy[k] in tok.eos_token_ids
    cfg = EngineConfig(kv_cache_tokens=4096, policy="fcfs", packer="token")
    with serve_engine(cfg, model, tok, sampling_defaults=load_generation_config(ckpt).sampling) as (url, aeng):
        def complete(**extra):
            r = httpx.post(f"{url}/v1/completions", json={"prompt": prompt, **extra}, timeout=30)
            assert r.status_code == 200, r.text
            return r.json()

        short = complete(ignore_eos=True)                    # max_tokens from the file; greedy by top_k
        assert short["usage"]["completion_tokens"] == 5 and short["choices"][0]["text"] == tok.decode(greedy[:5])
        stopped = complete(max_tokens=12)                    # the file's EOS id ends it
        assert stopped["choices"][0]["finish_reason"] == "stop" and stopped["usage"]["completion_tokens"] == k + 1
        assert stopped["choices"][0]["text"] == tok.decode(greedy[:k])
        sampled = {complete(max_tokens=8, ignore_eos=True, top_k=0, seed=s)["choices"][0]["text"] for s in range(4)}
        assert len(sampled) > 1                              # top_k given: the file's no longer applies
        assert _all_free(aeng)


def test_x_request_id_names_the_response_and_requests_are_logged(tiny_model_dir, caplog):
    """vLLM's X-Request-Id: the response's id is built from it and the header comes back (a
    generated id when none was sent); two requests may send the same one. With log_requests
    every request gets a "received" line (no prompt text) and a line per choice that ends."""
    import logging

    model, tok = tiny_parts(tiny_model_dir)
    cfg = EngineConfig(kv_cache_tokens=4096, policy="fcfs", packer="token")
    with serve_engine(cfg, model, tok, log_requests=True) as (url, aeng), \
            caplog.at_level(logging.INFO, logger="raycluster.requests"):
        logging.getLogger("raycluster.requests").propagate = True     # to caplog
        body = {"prompt": "secret words here", "max_tokens": 3, "temperature": 0}
        a = httpx.post(f"{url}/v1/completions", json=body, headers={"X-Request-Id": "trace-7"}, timeout=30)
        b = httpx.post(f"{url}/v1/completions", json=body, headers={"X-Request-Id": "trace-7"}, timeout=30)
        assert a.status_code == b.status_code == 200
        assert a.json()["id"] == b.json()["id"] == "cmpl-trace-7" and a.headers["x-request-id"] == "trace-7"
        plain = httpx.post(f"{url}/v1/completions", json=body, timeout=30)
        assert plain.headers["x-request-id"] == plain.json()["id"] != "cmpl-trace-7"
        with httpx.stream("POST", f"{url}/v1/chat/completions", timeout=30, headers={"X-Request-Id": "s1"},
                          json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "stream": True}) as r:
            assert r.headers["x-request-id"] == "s1"
            ids = {json.loads(line[6:])["id"] for line in r.iter_lines()
                   if line.startswith("data: ") and line != "data: [DONE]"}
        assert ids == {"chatcmpl-s1"}
        bad = httpx.post(f"{url}/v1/completions", json=body, headers={"X-Request-Id": "x" * 300}, timeout=30)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "X-Request-Id"
        deadline = time.monotonic() + 5
        while sum("finished" in m for m in caplog.messages) < 4 and time.monotonic() < deadline:
            time.sleep(0.05)
        logging.getLogger("raycluster.requests").propagate = False
        assert _all_free(aeng)
    lines = caplog.messages
    assert sum(m.startswith("received cmpl-trace-7") for m in lines) == 2
    assert any(m.startswith("finished chatcmpl-s1 choice 0: ") for m in lines)
    assert sum(m.startswith("finished cmpl-trace-7 choice 0: length, 3 tokens") for m in lines) == 2
    assert not any("secret" in m for m in lines)


@pytest.mark.parametrize("parser", ["deepseek_r1", "qwen3"])
def test_reasoning_parser_splits_thinking_from_the_answer(tiny_model_dir, parser):
    """vLLM's --reasoning-parser: the model's output (forced here by a regex to think, then
    answer) comes back as reasoning_content and content, the same streamed and not; the
    completions endpoint and the plain chat reply are untouched."""
    model, tok = tiny_parts(tiny_model_dir)
    cfg = EngineConfig(kv_cache_tokens=4096, policy="fcfs", packer="token")
    regex = "<think>[a-z]{3,6}</think>[a-z]{2,5}"
    with serve_engine(cfg, model, tok, reasoning_parser=parser) as (url, aeng):
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 40, "temperature": 0,
                "structured_outputs": {"regex": regex}}
        whole = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60).json()["choices"][0]
        msg = whole["message"]
        raw = httpx.post(f"{url}/v1/completions", timeout=60, json={
            "prompt": tok.apply_chat_template(body["messages"], tokenize=True), "max_tokens": 40,
            "temperature": 0, "structured_outputs": {"regex": regex}}).json()
        text = raw["choices"][0]["text"]
        assert text.startswith("<think>") and "</think>" in text        # the completion is untouched
        thought, answer = text[len("<think>"):].split("</think>")
        assert (msg["reasoning_content"], msg["content"]) == (thought, answer)
        with httpx.stream("POST", f"{url}/v1/chat/completions", json={**body, "stream": True}, timeout=60) as r:
            deltas = [json.loads(line[6:])["choices"][0]["delta"] for line in r.iter_lines()
                      if line.startswith("data: ") and line != "data: [DONE]"]
        assert "".join(d.get("reasoning_content") or "" for d in deltas) == thought
        assert "".join(d.get("content") or "" for d in deltas) == answer
        plain = httpx.post(f"{url}/v1/chat/completions", timeout=60, json={**body, "structured_outputs": {
            "regex": "[a-z]{2,5}"}}).json()["choices"][0]["message"]
        got = (plain["reasoning_content"], plain["content"])      # no tags: qwen3 answers, r1 still thinks
        said = got[0] or got[1]
        assert said and got == ((None, said) if parser == "qwen3" else (said, None))
        assert _all_free(aeng)
