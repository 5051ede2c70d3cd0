"""Structured outputs over real HTTP on one engine: OpenAI's `response_format` (through the
`openai` client too), vLLM's `structured_outputs` and `guided_*` fields (grammars included),
streamed and not; the text equals the in-process engine's for the same pattern; broken or
conflicting fields are a 400 naming the field."""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import pytest
from engine_http import serve_engine, tiny_parts

from raycluster.engine.config import EngineConfig
from raycluster.engine.engine import LLMEngine
from raycluster.request import SamplingParams
from raycluster.server.structured import choice_regex, schema_regex

pytestmark = pytest.mark.e2e

SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                           "visits": {"type": "integer"},
                                           "sunny": {"type": "boolean"}},
          "required": ["city", "visits", "sunny"]}
CFG = dict(kv_cache_tokens=8192, policy="fcfs", packer="token", num_threads=1)


@pytest.fixture(scope="module")
def served(tiny_model_dir):
    model, tok = tiny_parts(tiny_model_dir)
    ref = LLMEngine(EngineConfig(**CFG), model, tok)
    with serve_engine(EngineConfig(**CFG), model, tok) as (url, aeng):
        yield url, ref, tok, aeng


def _expected(ref, tok, prompt_ids, regex, max_tokens=100) -> str:
    out = ref.generate([prompt_ids], SamplingParams(max_tokens=max_tokens, guided_regex=regex))[0]
    return tok.decode(out)


def test_json_schema_through_the_openai_client(served):
    openai = pytest.importorskip("openai")
    url, ref, tok, _ = served
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", timeout=60)
    msgs = [{"role": "user", "content": "Where did you go?"}]
    r = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=100, temperature=0,
                                       response_format={"type": "json_schema",
                                                        "json_schema": {"name": "trip", "schema": SCHEMA}})
    text = r.choices[0].message.content
    jsonschema.validate(json.loads(text), SCHEMA)
    assert r.choices[0].finish_reason == "stop"
    ids = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
    assert text == _expected(ref, tok, ids, schema_regex(SCHEMA, "f"))


def test_vllm_fields_streamed_and_not(served):
    url, ref, tok, _ = served
    prompt = "My favourite colour is"
    ids = tok.encode(prompt)
    colours = ["teal", "crimson red", "off-white"]
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 20, "temperature": 0,
            "structured_outputs": {"choice": colours}}
    r = httpx.post(url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    text = r.json()["choices"][0]["text"]
    assert text in colours and text == _expected(ref, tok, ids, choice_regex(colours, "f"))
    parts = []
    with httpx.stream("POST", url + "/v1/completions", timeout=60,
                      json={**body, "structured_outputs": None, "guided_regex": r"[A-Z][a-z]{2,6} [0-9]{2}",
                            "stream": True}) as s:
        for line in s.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                parts.extend(c["text"] for c in json.loads(line[6:])["choices"])
    assert re.fullmatch(r"[A-Z][a-z]{2,6} [0-9]{2}", "".join(parts)), parts
    # n sampled choices, each its own guide
    r = httpx.post(url + "/v1/completions", timeout=60,
                   json={"model": "tiny", "prompt": prompt, "max_tokens": 300, "temperature": 1.0, "seed": 5, "n": 3,
                         "guided_json": SCHEMA})
    for c in r.json()["choices"]:
        assert c["finish_reason"] == "stop", c
        jsonschema.validate(json.loads(c["text"]), SCHEMA)


@pytest.mark.parametrize("fields, param", [
    ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice"),
    ({"guided_regex": "(unclosed"}, "guided_regex"),
    ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs.regex"),
    ({"structured_outputs": {"grammar": "root ::= [a"}}, "structured_outputs.grammar"),
    ({"structured_outputs": {"grammar": "start: no_such_rule"}}, "structured_outputs.grammar"),
    ({"guided_grammar": "start: ("}, "guided_grammar"),
    ({"structured_outputs": {"jsn": {}}}, "structured_outputs.jsn"),
    ({"response_format": {"type": "json_schema"}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": {"type": 5}}}},
     "response_format.json_schema.schema"),
])
def test_broken_fields_are_a_400_naming_the_field(served, fields, param):
    url, _, _, aeng = served
    r = httpx.post(url + "/v1/completions", timeout=60,
                   json={"model": "tiny", "prompt": "hi", "max_tokens": 5, **fields})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()
    assert not aeng.engine.has_unfinished()


def test_a_grammar_streamed_and_not(served):
    """vLLM's `structured_outputs.grammar` (Lark) and `guided_grammar` (GBNF): sentences of a
    language no regex holds (balanced parentheses around x), equal to the in-process engine's."""
    url, ref, tok, _ = served
    lark, gbnf = 'start: "(" start ")" | "x"', 'root ::= "(" root ")" | "x"'
    ids = tok.encode("{")
    want = tok.decode(ref.generate([ids], SamplingParams(max_tokens=30, guided_grammar=lark))[0])
    body = {"model": "tiny", "prompt": "{", "max_tokens": 30, "temperature": 0}
    r = httpx.post(url + "/v1/completions", json={**body, "structured_outputs": {"grammar": lark}}, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == want == "(x)"
    assert r.json()["choices"][0]["finish_reason"] == "stop"
    parts = []
    with httpx.stream("POST", url + "/v1/completions", timeout=60,
                      json={**body, "guided_grammar": gbnf, "stream": True}) as s:
        for line in s.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                parts.extend(c["text"] for c in json.loads(line[6:])["choices"])
    assert "".join(parts) == want
    r = httpx.post(url + "/v1/completions", timeout=60,       # sampled choices, each its own parser
                   json={**body, "temperature": 1.0, "seed": 2, "n": 4, "guided_grammar": gbnf})
    for c in r.json()["choices"]:
        k = len(c["text"]) - len(c["text"].lstrip("("))
        assert c["text"] == "(" * k + "x" + ")" * k and c["finish_reason"] == "stop", c
