"""Sampling parameters and log-probabilities through the single-engine OpenAI server over real
HTTP (uvicorn in a thread): penalties and logit_bias, echo, vLLM's prompt_logprobs, OpenAI's
logprobs shapes, n choices and batches of prompts, min_tokens, vLLM's extra sampling parameters;
each compared with the same engine called directly."""

from __future__ import annotations

import json

import httpx
import pytest
from engine_http import all_free, served_with_reference

from raycluster.request import SamplingParams

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    with served_with_reference(tiny_model_dir) as served:
        yield served


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
    assert all_free(aeng)


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
    assert all_free(aeng)


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
    assert all_free(aeng)


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
    assert all_free(aeng)


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
    assert all_free(aeng)


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
    assert all_free(aeng, timeout=10)


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
    assert all_free(aeng)


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
    assert all_free(aeng)
