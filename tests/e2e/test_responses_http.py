"""OpenAI's Responses API over real HTTP on one engine, read by the `openai` client: the output
text equals the chat route's (and the in-process engine's) for the same conversation, streamed
events add up to it, input items (content parts, earlier function calls and their outputs)
reach the chat template, a named function tool returns a `function_call` item whose arguments
follow its schema (streamed in argument deltas), `text.format` json_schema output follows its
schema, `top_logprobs` come per output token, and what this server cannot serve is a 4xx naming
the field. Every request leaves the engine's KV all free. (The translation itself, exactly:
tests/unit/test_responses_api.py.)"""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest
from engine_http import all_free, serve_engine, tiny_parts

from raycluster.engine.config import EngineConfig
from raycluster.engine.engine import LLMEngine
from raycluster.request import SamplingParams

pytestmark = pytest.mark.e2e

CFG = dict(kv_cache_tokens=8192, policy="fcfs", packer="token", num_threads=1)
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                            "unit": {"enum": ["c", "f"]}}, "required": ["city", "unit"]}
TOOL = {"type": "function", "name": "get_weather", "description": "weather in a city", "parameters": WEATHER}


@pytest.fixture(scope="module")
def served(tiny_model_dir):
    model, tok = tiny_parts(tiny_model_dir)
    ref = LLMEngine(EngineConfig(**CFG), model, tok)
    with serve_engine(EngineConfig(**CFG), model, tok) as (url, aeng):
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)
        yield url, client, aeng, ref, tok


def _chat_text(url: str, messages: list[dict], **body) -> dict:
    r = httpx.post(url + "/v1/chat/completions", timeout=120,
                   json={"model": "tiny", "messages": messages, "temperature": 0, **body})
    assert r.status_code == 200, r.text
    return r.json()


def test_text_equals_the_chat_routes_and_the_engines(served):
    url, client, aeng, ref, tok = served
    out = client.responses.create(model="tiny", instructions="Answer briefly.", input="Tell me about the sea.",
                                  max_output_tokens=24, temperature=0)
    messages = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Tell me about the sea."}]
    chat = _chat_text(url, messages, max_tokens=24)
    assert out.object == "response" and out.id.startswith("resp_") and out.model == "tiny"
    assert out.output_text == chat["choices"][0]["message"]["content"]
    want = ref.generate([tok.apply_chat_template(messages, tokenize=True)],
                        SamplingParams(max_tokens=24, temperature=0.0))[0]
    assert out.output_text == tok.decode(want)
    finished = chat["choices"][0]["finish_reason"]
    assert out.status == ("incomplete" if finished == "length" else "completed")
    if finished == "length":
        assert out.incomplete_details.reason == "max_output_tokens"
    assert (out.usage.input_tokens, out.usage.output_tokens) == (chat["usage"]["prompt_tokens"],
                                                                 chat["usage"]["completion_tokens"])
    assert out.store is False and out.instructions == "Answer briefly."
    assert all_free(aeng)


def test_streamed_events_add_up_to_the_response(served):
    url, client, aeng, _, _ = served
    body = dict(model="tiny", input="Tell me about the sea.", max_output_tokens=24, temperature=0)
    whole = client.responses.create(**body)
    events = list(client.responses.create(stream=True, **body))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete" if whole.status == "incomplete" else "response.completed"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == whole.output_text == events[-1].response.output_text
    assert events[-1].response.usage.output_tokens == whole.usage.output_tokens
    assert all_free(aeng)


def test_input_items_reach_the_chat_template(served):
    url, client, _, _, _ = served
    call = {"city": "Paris", "unit": "c"}
    items = [{"role": "user", "content": [{"type": "input_text", "text": "Weather in "},
                                          {"type": "input_text", "text": "Paris?"}]},
             {"type": "function_call", "call_id": "call-1", "name": "get_weather", "arguments": json.dumps(call)},
             {"type": "function_call_output", "call_id": "call-1", "output": "sunny, 21 c"}]
    out = client.responses.create(model="tiny", input=items, tools=[TOOL], tool_choice="none", max_output_tokens=16,
                                  temperature=0)
    messages = [{"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": None, "tool_calls": [{"id": "call-1", "type": "function", "function": {
                    "name": "get_weather", "arguments": json.dumps(call)}}]},
                {"role": "tool", "tool_call_id": "call-1", "content": "sunny, 21 c"}]
    chat = _chat_text(url, messages, max_tokens=16, tool_choice="none",
                      tools=[{"type": "function", "function": {k: v for k, v in TOOL.items() if k != "type"}}])
    assert out.output_text == chat["choices"][0]["message"]["content"]
    assert out.tools[0].name == "get_weather"


def test_a_named_function_returns_a_call_item(served):
    _, client, aeng, _, _ = served
    body = dict(model="tiny", input="What is the weather in Paris?", tools=[TOOL], max_output_tokens=120,
                tool_choice={"type": "function", "name": "get_weather"}, temperature=0)
    out = client.responses.create(**body)
    [item] = [i for i in out.output if i.type == "function_call"]
    assert item.name == "get_weather" and item.call_id and out.status == "completed"
    jsonschema.validate(json.loads(item.arguments), WEATHER)
    events = list(client.responses.create(stream=True, **body))
    added = [e.item for e in events if e.type == "response.output_item.added"]
    assert [(i.type, i.name) for i in added if i.type == "function_call"] == [("function_call", "get_weather")]
    deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    [done] = [e.arguments for e in events if e.type == "response.function_call_arguments.done"]
    assert deltas == done == item.arguments
    assert all_free(aeng)


def test_json_schema_format_and_logprobs(served):
    _, client, _, _, _ = served
    out = client.responses.create(model="tiny", input="Weather in Paris?", max_output_tokens=120, temperature=0,
                                  text={"format": {"type": "json_schema", "name": "weather", "schema": WEATHER,
                                                   "strict": True}})
    assert out.status == "completed"
    jsonschema.validate(json.loads(out.output_text), WEATHER)
    assert out.text.format.type == "json_schema"
    out = client.responses.create(model="tiny", input="Hi", max_output_tokens=6, temperature=0, top_logprobs=2)
    part = out.output[0].content[0]
    assert len(part.logprobs) == out.usage.output_tokens
    assert all(len(lp.top_logprobs) == 2 and lp.logprob <= 0 for lp in part.logprobs)
    assert "".join(lp.token for lp in part.logprobs) == part.text


@pytest.mark.parametrize("body, status, field", [
    (dict(input="hi", previous_response_id="resp_1"), 400, "previous_response_id"),
    (dict(input="hi", tools=[{"type": "web_search"}]), 400, "tools.0.type"),
    (dict(input=[{"role": "user", "content": [{"type": "input_file", "file_id": "file_1"}]}]),
     400, "input.0.content.0"),
    # An image reaches the chat as an image_url part; this text-only model takes none.
    (dict(input=[{"role": "user", "content": [{"type": "input_image", "image_url": "http://127.0.0.1/x.png"}]}]),
     400, "input"),
    (dict(input="hi", max_output_tokens=10 ** 6), 400, "max_output_tokens"),
    (dict(input="hi", model="nope"), 404, "model"),
    (dict(input=7), 400, "input"),
])
def test_what_cannot_be_served_is_a_4xx_naming_the_field(served, body, status, field):
    url, _, aeng, _, _ = served
    r = httpx.post(url + "/v1/responses", json={"model": "tiny", **body}, timeout=60)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["param"] == field or err["param"].startswith(field + "."), err
    assert all_free(aeng)


def test_no_response_is_stored(served):
    url, _, _, _, _ = served
    for method, path in (("GET", "/v1/responses/resp_1"), ("POST", "/v1/responses/resp_1/cancel")):
        r = httpx.request(method, url + path, timeout=30)
        assert r.status_code == 404 and r.json()["error"]["param"] == "response_id"
