"""Speculative decoding over real HTTP on one engine: completions streamed and not, stop strings
and seeded sampling give a plain engine's text token for token, the streamed deltas of drafted
runs concatenate to the same text, and /metrics counts what was drafted and accepted."""

from __future__ import annotations

import json

import httpx
import pytest
from engine_http import serve_engine, tiny_parts

from raycluster.engine.config import EngineConfig
from raycluster.engine.engine import LLMEngine
from raycluster.request import SamplingParams

pytestmark = pytest.mark.e2e

CFG = dict(kv_cache_tokens=16384, policy="fcfs", packer="token", predictor="none")
# Greedy outputs of these prompts fall into cycles within 300 tokens: drafts get accepted.
PROMPTS = [[11, 305, 2024, 77, 1500, 9, 3000], [40, 41, 42, 43, 44, 45], [700] * 5]


@pytest.fixture(scope="module")
def served(tiny_model_dir):
    model, tok = tiny_parts(tiny_model_dir)
    ref = LLMEngine(EngineConfig(**CFG), model, tok)
    with serve_engine(EngineConfig(**CFG, speculative_method="ngram", num_speculative_tokens=4), model, tok) \
            as (url, aeng):
        yield url, aeng, tok, ref


def _stream_text(url: str, body: dict) -> tuple[str, list[str], str]:
    deltas, reason = [], None
    with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True}, timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                choice = json.loads(line[6:])["choices"][0]
                deltas.append(choice["text"])
                reason = choice["finish_reason"] or reason
    return "".join(deltas), deltas, reason


def test_drafted_text_equals_plain_decoding_streamed_and_not(served):
    url, aeng, tok, ref = served
    for prompt in PROMPTS:
        want = tok.decode(ref.generate([prompt], SamplingParams(max_tokens=300, ignore_eos=True))[0])
        body = {"prompt": prompt, "max_tokens": 300, "temperature": 0, "ignore_eos": True}
        r = httpx.post(url + "/v1/completions", json=body, timeout=120).json()
        assert r["choices"][0]["text"] == want and r["usage"]["completion_tokens"] == 300
        text, _, reason = _stream_text(url, body)
        assert text == want and reason == "length"
    assert aeng.engine.spec.accepted_tokens > 0
    metrics = httpx.get(url + "/metrics", timeout=10).text
    assert f"raycluster_spec_decode_draft_tokens_total {aeng.engine.spec.draft_tokens}" in metrics
    assert f"raycluster_spec_decode_accepted_tokens_total {aeng.engine.spec.accepted_tokens}" in metrics
    spec = aeng.engine.spec
    assert f'vllm:spec_decode_num_drafts_total{{model_name="tiny"}} {spec.drafts}' in metrics
    assert f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{model_name="tiny",position="0"}} ' \
           f'{spec.accepted_per_pos[0]}' in metrics and spec.accepted_per_pos[0] > 0
    kv = aeng.engine.kv
    assert kv.num_free_blocks == kv.num_blocks


def test_stop_strings_and_seeds_hold_with_drafts(served):
    url, _, tok, ref = served
    prompt = PROMPTS[0]
    full = ref.generate([prompt], SamplingParams(max_tokens=300, ignore_eos=True))[0]
    text = tok.decode(full)
    stop = text[len(text) * 3 // 4:][:4]         # late in the output, where drafts are accepted
    body = {"prompt": prompt, "max_tokens": 300, "temperature": 0, "ignore_eos": True, "stop": [stop]}
    r = httpx.post(url + "/v1/completions", json=body, timeout=120).json()["choices"][0]
    assert r["text"] == text[:text.index(stop)] and r["finish_reason"] == "stop"
    assert _stream_text(url, body)[0] == r["text"]
    sp = SamplingParams(max_tokens=120, temperature=0.7, top_p=0.9, seed=5)
    want = tok.decode(ref.generate([prompt], sp)[0])
    body = {"prompt": prompt, "max_tokens": 120, "temperature": 0.7, "top_p": 0.9, "seed": 5}
    assert httpx.post(url + "/v1/completions", json=body, timeout=120).json()["choices"][0]["text"] == want
