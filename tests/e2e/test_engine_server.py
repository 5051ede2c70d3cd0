"""The single-engine OpenAI server over real HTTP on 127.0.0.1 (uvicorn in a thread): the API's
routes, streaming, metrics, errors, chat templates and vLLM's options (sampling parameters and
log-probabilities: test_engine_server_sampling.py)."""

from __future__ import annotations

import json
import time

import httpx
import pytest
from engine_http import all_free, serve_engine, served_with_reference, tiny_parts

from raycluster.engine.config import EngineConfig
from raycluster.engine.engine import LLMEngine
from raycluster.request import SamplingParams

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    with served_with_reference(tiny_model_dir) as served:
        yield served


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
    assert all_free(aeng)


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
    assert all_free(aeng)


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
    vllm_before = _vllm_samples(url)
    r = httpx.post(f"{url}/v1/completions", json={"prompt": [5] * 37, "max_tokens": 3, "n": 2, "ignore_eos": True}, timeout=30)
    assert r.status_code == 200
    after = _samples(url)
    assert after["raycluster_prompt_tokens_total"] - before.get("raycluster_prompt_tokens_total", 0) == 74
    assert after["raycluster_e2e_request_latency_seconds_count"] - \
        before.get("raycluster_e2e_request_latency_seconds_count", 0) == 2
    assert after["raycluster_generated_tokens_total"] - before.get("raycluster_generated_tokens_total", 0) == 6
    assert all_free(aeng)
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
    # vLLM's per-request histograms: one request (n 2, max_tokens 3) of two 37-token choices
    # with 3 tokens each; every token after a choice's first is one inter-token sample.
    new = {k: v - vllm_before.get(k, 0) for k, v in _vllm_samples(url).items()}
    assert new["vllm:request_params_n_count"] == 1 and new["vllm:request_params_n_sum"] == 2
    assert new["vllm:request_params_max_tokens_sum"] == 3
    assert new["vllm:request_prompt_tokens_count"] == 2 and new["vllm:request_prompt_tokens_sum"] == 74
    assert new[("vllm:request_prompt_tokens_bucket", "50.0")] == 2 and new[("vllm:request_prompt_tokens_bucket",
                                                                            "20.0")] == 0
    assert new["vllm:request_generation_tokens_sum"] == 6
    assert new["vllm:inter_token_latency_seconds_count"] == 4
    for name in ("decode", "prefill", "queue", "inference"):
        assert new[f"vllm:request_{name}_time_seconds_count"] == 2, name
    assert 0 < new["vllm:request_prefill_time_seconds_sum"] < new["vllm:request_inference_time_seconds_sum"]


def _vllm_samples(url: str) -> dict:
    """vLLM-named samples: name -> value, and (name, le) -> value for histogram buckets."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{url}/metrics", timeout=10).text
    return {(s.name, s.labels["le"]) if "le" in s.labels else s.name: s.value
            for f in text_string_to_metric_families(text) for s in f.samples
            if s.name.startswith("vllm:") and "finished_reason" not in s.labels}


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
    assert all_free(aeng)


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
        assert all_free(aeng)


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
    assert all_free(aeng)


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
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages", r.text
    assert "takes no images" in r.json()["error"]["message"]
    r = httpx.post(f"{url}/v1/chat/completions", timeout=30, json={**msg, "messages": [
        {"role": "user", "content": [{"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}]}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages.0.content", r.text
    r = httpx.post(f"{url}/v1/completions", content=b"{bad", headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["param"] is None, r.text
    assert all_free(aeng)


def test_client_disconnect_aborts_and_frees_kv(server):
    url, aeng, _, _ = server
    with httpx.stream("POST", f"{url}/v1/completions", timeout=30,
                      json={"prompt": [5] * 300, "max_tokens": 2000, "ignore_eos": True, "stream": True}) as r:
        for i, line in enumerate(r.iter_lines()):
            if i >= 6:
                break           # hang up mid-stream
    assert all_free(aeng, timeout=10)


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
    assert all_free(aeng)


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
    assert all_free(aeng)


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
    assert all_free(aeng)


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
    assert all_free(aeng)


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
        assert all_free(aeng)


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
        assert all_free(aeng)
    lines = caplog.messages
    assert sum(m.startswith("received cmpl-trace-7") for m in lines) == 2
    assert any(m.startswith("finished chatcmpl-s1 choice 0: ") for m in lines)
    assert sum(m.startswith("finished cmpl-trace-7 choice 0: length, 3 tokens") for m in lines) == 2
    assert not any("secret" in m for m in lines)


def test_gpt_oss_harmony_channels_come_back_as_reasoning_content_and_tool_calls(tiny_model_dir):
    """--reasoning-parser openai_gptoss with --tool-call-parser openai: harmony output (forced by a
    regex) comes back as reasoning_content, content and tool_calls, the same streamed and not; chat
    requests are decoded with their special tokens (harmony's markers are special tokens), plain
    completions as asked."""
    model, tok = tiny_parts(tiny_model_dir)
    cfg = EngineConfig(kv_cache_tokens=4096, policy="fcfs", packer="token")
    think = r"<\|channel\|>analysis<\|message\|>[a-z]{3,6}<\|end\|><\|start\|>assistant"
    answer = think + r"<\|channel\|>final<\|message\|>[a-z]{2,5}"
    call = think + r' to=functions\.get_weather<\|channel\|>commentary json<\|message\|>\{"city": "[a-z]{3,6}"\}<\|call\|>'
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}}}}]
    with serve_engine(cfg, model, tok, reasoning_parser="openai_gptoss", tool_call_parser="openai") as (url, aeng):
        seen = []
        generate = aeng.generate

        def recording(rid, ids, sampling, **kw):
            seen.append(sampling.skip_special_tokens)
            return generate(rid, ids, sampling, **kw)
        aeng.generate = recording
        # The tiny tokenizer spells the markers out in pieces: room for them.
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 300, "temperature": 0,
                "structured_outputs": {"regex": answer}}
        msg = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60).json()["choices"][0]["message"]
        raw = httpx.post(f"{url}/v1/completions", timeout=60, json={
            "prompt": tok.apply_chat_template(body["messages"], tokenize=True), "max_tokens": 300,
            "temperature": 0, "structured_outputs": {"regex": answer}}).json()["choices"][0]["text"]
        assert seen == [False, True]
        thought = raw.split("<|message|>")[1].split("<|end|>")[0]
        assert (msg["reasoning_content"], msg["content"]) == (thought, raw.split("<|message|>")[2])
        with httpx.stream("POST", f"{url}/v1/chat/completions", json={**body, "stream": True}, timeout=60) as r:
            deltas = [json.loads(line[6:])["choices"][0]["delta"] for line in r.iter_lines()
                      if line.startswith("data: ") and line != "data: [DONE]"]
        assert "".join(d.get("reasoning_content") or "" for d in deltas) == thought
        assert "".join(d.get("content") or "" for d in deltas) == msg["content"]
        tool_body = {**body, "tools": tools, "tool_choice": "auto", "structured_outputs": {"regex": call}}
        choice = httpx.post(f"{url}/v1/chat/completions", json=tool_body, timeout=60).json()["choices"][0]
        assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
        assert choice["message"]["reasoning_content"]
        [tc] = choice["message"]["tool_calls"]
        assert tc["function"]["name"] == "get_weather" and set(json.loads(tc["function"]["arguments"])) == {"city"}
        with httpx.stream("POST", f"{url}/v1/chat/completions", json={**tool_body, "stream": True}, timeout=60) as r:
            chunks = [json.loads(line[6:])["choices"][0] for line in r.iter_lines()
                      if line.startswith("data: ") and line != "data: [DONE]"]
        streamed = [c for ch in chunks for c in ch["delta"].get("tool_calls") or []]
        assert streamed[0]["function"]["name"] == "get_weather"
        assert "".join(c["function"].get("arguments") or "" for c in streamed) == tc["function"]["arguments"]
        assert chunks[-1]["finish_reason"] == "tool_calls"
        assert all_free(aeng)


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
        assert all_free(aeng)
