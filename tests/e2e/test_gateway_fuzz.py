"""Nothing a client sends may crash the server: seeded random malformed requests over real HTTP.

The single-engine OpenAI server (the gateway's FastAPI app on one engine, whose request checks
the cluster's gateway shares) gets 160 requests per engine built by mutating valid bodies: wrong
types, extreme numbers, huge or nested arrays, out-of-vocabulary ids, lone surrogates, unknown
fields, absurd SLOs and priorities, and raw bodies that are not JSON objects at all. Four engines
order requests by fcfs, lars (Medha packer), kairos and justitia, the policy families the
router runs too. Every answer
must be a 2xx or a 4xx in OpenAI's error shape (never a 5xx, never a dropped connection); a
stream that starts must end; afterwards the engine still answers a valid request exactly and
holds no KV.
"""

from __future__ import annotations

import json
import random
import time

import httpx
import pytest
from engine_http import serve_engine

from raycluster.engine.config import EngineConfig
from raycluster.engine.engine import LLMEngine
from raycluster.model.loader import load_model
from raycluster.model.tokenizer import Tokenizer
from raycluster.request import SamplingParams
from raycluster.server.response_store import LocalResponses, ResponseStore

pytestmark = pytest.mark.e2e

COMPLETION = {"model": "tiny", "prompt": "Once upon a time", "max_tokens": 4, "temperature": 0}
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "Hi there"}], "max_tokens": 4}
TOKENIZE = {"prompt": "Hello world"}
DETOKENIZE = {"tokens": [5, 6, 7]}
RESPONSES = {"model": "tiny", "input": "Hi there", "max_output_tokens": 4}
ROUTES = [("/v1/completions", COMPLETION), ("/v1/chat/completions", CHAT), ("/tokenize", TOKENIZE),
          ("/detokenize", DETOKENIZE), ("/v1/responses", RESPONSES)]
FIELDS = ["prompt", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "min_p",
          "n", "stream", "stream_options", "stop", "stop_token_ids", "seed", "logprobs", "top_logprobs", "echo",
          "ignore_eos", "min_tokens", "prompt_logprobs", "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias",
          "ttft_slo_ms", "tpot_slo_ms", "priority", "tenant", "app_id", "tokens", "add_generation_prompt",
          "continue_final_message", "model", "user", "no_such_field", "response_format", "structured_outputs",
          "guided_json", "guided_regex", "guided_choice", "guided_whitespace_pattern", "tools", "tool_choice",
          "parallel_tool_calls", "input", "instructions", "max_output_tokens", "text", "include",
          "previous_response_id", "metadata", "store", "reasoning_effort"]
NUMBERS = [0, 1, -1, 2, 7, 2**31, -2**31, 2**63, 10**30, 0.5, -0.5, 1e308, -1e308, 1e-320]
STRINGS = ["", "a", "\ud800", "\x00", "x" * 5000, "日本語", "<|eot_id|>", "{{ raise }}"]
# Near misses per field: the right shape with a wrong value (out-of-vocab ids, empty lists, ...).
EDGES = {
    "prompt": [[-1], [10**9], [2**63], [1, 2, 512], [], [[]], [[1, 2], [-3]], [[1], "a"], [1.5], ["a", ""],
               [[5] * 3000], ["\ud800"], [True]],
    "tokens": [[-1], [10**9], [], [1.5], ["a"], [2**63]],
    "messages": [[], [{"role": "user"}], [{"content": "hi"}], [{"role": "user", "content": None}],
                 [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
                 [{"role": "user", "content": [{"type": "image_url"}]}], [{"role": "assistant", "content": "x"}],
                 [{"role": "assistant", "content": None, "tool_calls": [{"id": "c", "function": {"name": "f",
                                                                                    "arguments": "{"}}]}],
                 [{"role": "tool", "content": "r", "tool_call_id": None}],
                 [{"role": "user", "content": "x", "tool_calls": []}]],
    "input": [[], [{"role": "user"}], [{"role": "user", "content": [{"type": "input_text"}]}], [3],
              [{"type": "function_call", "call_id": 1}], [{"type": "function_call_output", "call_id": "c", "output": 5}],
              [{"type": "reasoning"}], [{"role": ["user"], "content": "x"}], [{"type": {"a": 1}}]],
    "text": [{"format": {"type": "json_schema"}}, {"format": {"type": "json_object"}}, {"format": 5}, {}],
    "logit_bias": [{"-1": 5}, {"999999": 5}, {"5": 1e308}, {"5": -100}, {"a": 1}, {}],
    "stop_token_ids": [[-1], [10**9], [2**63], [], ["a"]],
    "stop": ["", [""], ["a"] * 100, [None], "x" * 5000],
    "stream_options": [{"include_usage": True}, {"continuous_usage_stats": True}, {"include_usage": "yes"}],
    "n": [0, 1, 3, 300, -1],
    "logprobs": [0, 5, 20, 21, -1, True],
    "top_logprobs": [0, 5, 21, -1],
    "prompt_logprobs": [0, 3, 21, -1, True, 1.5, "2"],
    # The scheduling fields reach the policies (a kinetic tree, virtual-time tags, urgency scores).
    "priority": [2**63, -2**63, 10**30, -1],
    "ttft_slo_ms": [1e-320, 1e-9, 1e308, 0, -5],
    "tpot_slo_ms": [1e-320, 1e308, 0],
    "tenant": ["", "\ud800", "x" * 5000, None],
    "app_id": ["", "\ud800", None],
    # Structured outputs: patterns that do not compile, schemas that are not schemas, conflicts.
    "response_format": [{"type": "json_object"}, {"type": "json_schema"}, {"type": "bogus"}, {"type": "text"},
                        {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 5}}},
                        {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "integer"}}}],
    "structured_outputs": [{"regex": "("}, {"choice": []}, {"choice": ["a", ""]}, {"grammar": "x"}, {"json": "{"},
                           {"regex": "[0-9]+", "choice": ["a"]}, {}, {"json_object": True}, {"regex": "\ud800"}],
    "guided_regex": ["(", "", "\ud800", "[0-9]{1,3}", "x" * 40000, "a{2,1}", "\\p{Nonsense}"],
    "guided_choice": [[], [""], ["\ud800"], ["a"] * 50, [None]],
    "guided_json": ["{", {"type": "nonsense"}, {"type": "object", "properties": {"a": {"$ref": "#/nope"}}}, []],
    "guided_whitespace_pattern": ["(", "\ud800", ""],
    # Tool calling: forced calls become patterns too; messages may carry calls and results.
    "tools": [[], [{"type": "function"}], [{"type": "function", "function": {"name": "f"}}],
              [{"type": "function", "function": {"name": "f", "parameters": {"type": 5}}}],
              [{"type": "function", "function": {"name": "\ud800"}}], [{"type": "retrieval"}]],
    "tool_choice": ["none", "auto", "required", "sometimes", {"type": "function", "function": {"name": "f"}},
                    {"type": "function"}, {"type": "function", "function": {"name": "nope"}}],
    "parallel_tool_calls": [False, True, "no"],
}
# Engines ordering by each family of policy (fcfs, slack over work, urgency, virtual time).
SCHEDULING = {"fcfs": {"policy": "fcfs", "packer": "token"}, "lars": {"policy": "lars", "packer": "medha"},
              "kairos": {"policy": "kairos", "packer": "token"}, "justitia": {"policy": "justitia", "packer": "token"}}


def _value(rng: random.Random, depth: int = 0):
    kind = rng.randrange(9 if depth < 2 else 5)
    if kind == 0:
        return None
    if kind == 1:
        return rng.choice([True, False])
    if kind == 2:
        return rng.choice(NUMBERS)
    if kind == 3:
        return rng.choice(STRINGS)
    if kind == 4:
        return [rng.choice([-1, 0, 5, 2**31, 10**9])] * rng.choice([0, 1, 3, 3000])
    if kind == 5:
        return [_value(rng, depth + 1) for _ in range(rng.randrange(4))]
    if kind == 6:
        return {rng.choice(["role", "content", "include_usage", "1", "-5", "x"]): _value(rng, depth + 1)
                for _ in range(rng.randrange(3))}
    if kind == 7:
        return [{"role": rng.choice(["user", "system", "assistant", "tool", "nobody", 3]),
                 "content": _value(rng, depth + 1)} for _ in range(rng.randrange(3))]
    return {"-1": rng.choice(NUMBERS), "5": rng.choice(NUMBERS)}       # logit_bias-shaped


def _request(rng: random.Random) -> tuple[str, bytes]:
    """A route and a body: a valid one with 1-3 fields replaced or dropped, or raw bytes."""
    route, base = rng.choice(ROUTES)
    if rng.random() < 0.1:
        raw = rng.choice([b"", b"{", b"[]", b"3", b"null", b'"prompt"', b"{\"prompt\": NaN, \"max_tokens\": 1}",
                          b"\xff\xfe", json.dumps(base).encode()[:-3], b'{"prompt": "a", "prompt": 5}'])
        return route, raw
    body = dict(base)
    for _ in range(rng.randint(1, 3)):
        field = rng.choice(FIELDS + list(EDGES) * 2)
        if rng.random() < 0.15:
            body.pop(field, None)
        elif field in EDGES and rng.random() < 0.6:
            body[field] = rng.choice(EDGES[field])
        else:
            body[field] = _value(rng)
    if "max_tokens" in base and rng.random() < 0.7:
        body["max_tokens"] = 4                  # keep most runs short
    if "max_output_tokens" in base and rng.random() < 0.7:
        body["max_output_tokens"] = 4
    return route, json.dumps(body).encode()


@pytest.fixture(scope="module", params=list(SCHEDULING))
def fuzz_server(tiny_model_dir, request):
    model, mcfg = load_model(tiny_model_dir)
    tok = Tokenizer(tiny_model_dir, mcfg.eos_token_id)
    cfg = EngineConfig(kv_cache_tokens=8192, enable_prefix_caching=True, num_threads=1, **SCHEDULING[request.param])
    with serve_engine(cfg, model, tok, log_level="critical",
                      response_store=LocalResponses(ResponseStore(50))) as (url, aeng):
        yield url, aeng, tok


def _send(client: httpx.Client, url: str, route: str, raw: bytes) -> tuple[int, bytes]:
    """Status and whole body; a stream is read to its end."""
    with client.stream("POST", url + route, content=raw, headers={"content-type": "application/json"}) as r:
        return r.status_code, r.read()


def test_random_malformed_requests_get_answers_not_crashes(fuzz_server):
    url, aeng, tok = fuzz_server
    rng = random.Random(20261125 + sorted(SCHEDULING).index(aeng.engine.config.policy))
    seen: dict[int, int] = {}
    deadline = time.monotonic() + 240
    with httpx.Client(timeout=60) as client:
        for i in range(160):
            assert time.monotonic() < deadline, f"fuzzing took too long (stopped at request {i})"
            route, raw = _request(rng)
            status, body = _send(client, url, route, raw)
            seen[status] = seen.get(status, 0) + 1
            assert status < 500, (i, route, raw[:300], status, body[:500])
            if status >= 400:
                err = json.loads(body)["error"]
                assert err["message"] and err["type"], (route, raw[:300], err)
            elif b"data: " in body[:6]:
                assert body.rstrip().endswith(b"data: [DONE]"), (route, raw[:300], body[-300:])
            elif body.startswith(b"event: "):           # a Responses stream ends with its final status
                last = body.rstrip().rsplit(b"\n\n", 1)[-1]
                assert last.startswith((b"event: response.completed", b"event: response.incomplete")), \
                    (route, raw[:300], body[-300:])
    # Both outcomes occurred: the mutations reach the engine as well as the validators.
    assert seen.get(200, 0) >= 40 and sum(n for s, n in seen.items() if 400 <= s < 500) >= 40, seen
    # The engine still serves, exactly, and nothing is left holding KV.
    prompt = "Once upon a time"
    r = httpx.post(url + "/v1/completions", json={**COMPLETION, "max_tokens": 8, "ignore_eos": True}, timeout=30)
    assert r.status_code == 200, r.text
    ref = LLMEngine(EngineConfig(kv_cache_tokens=4096, policy="fcfs", packer="token", num_threads=1),
                    aeng.engine.model, tok)
    expected = ref.generate([tok.encode(prompt)], SamplingParams(max_tokens=8, ignore_eos=True))[0]
    assert r.json()["choices"][0]["text"] == tok.decode(expected)
    deadline = time.monotonic() + 10
    while (aeng.engine.has_unfinished() or aeng.engine.kv.num_free_blocks != aeng.engine.kv.num_blocks) \
            and time.monotonic() < deadline:
        time.sleep(0.05)
    aeng.engine.kv.check()
    assert aeng.engine.kv.num_free_blocks == aeng.engine.kv.num_blocks and not aeng.engine.has_unfinished()
