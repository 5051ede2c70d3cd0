"""Tool calling over real HTTP on one engine: a named function's arguments follow its
`parameters` schema and equal the in-process engine's output under the same pattern, streamed
(arguments in pieces after a delta naming the function) and not; "required" returns calls to the
request's tools (one with parallel_tool_calls false), streamed and not alike; the `openai` client
reads them; earlier calls and tool results in the messages reach the chat template (arguments as
objects); "auto" and other choices this server cannot serve are 400s naming the field; with a
tool-call parser (hermes, pythonic, llama4_pythonic, qwen3_coder, bare and wrapped) "auto" returns
the calls the model writes in that syntax."""

from __future__ import annotations

import contextlib
import json

import httpx
import jsonschema
import openai
import pytest
from engine_http import serve_engine, tiny_parts

from raycluster.engine.config import EngineConfig
from raycluster.engine.engine import LLMEngine
from raycluster.model.tokenizer import Tokenizer
from raycluster.request import SamplingParams
from raycluster.server.protocol import ChatCompletionRequest
from raycluster.server.structured import escape, schema_regex
from raycluster.server.tools import template_message, template_tools

pytestmark = pytest.mark.e2e

# Bounded strings, enums and booleans: a random-weight model must be able to finish the JSON.
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                            "unit": {"enum": ["c", "f"]}}, "required": ["city", "unit"]}
SEARCH = {"type": "object", "properties": {"q": {"type": "string", "maxLength": 6}, "exact": {"type": "boolean"}},
          "required": ["q", "exact"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "weather in a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "search", "parameters": SEARCH}}]
SCHEMAS = {"get_weather": WEATHER, "search": SEARCH}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}
CFG = dict(kv_cache_tokens=8192, policy="fcfs", packer="token", num_threads=1)


@pytest.fixture(scope="module")
def served(tiny_model_dir):
    model, tok = tiny_parts(tiny_model_dir)
    ref = LLMEngine(EngineConfig(**CFG), model, tok)
    with serve_engine(EngineConfig(**CFG), model, tok) as (url, _):
        yield url, ref, tok


def _chat(url: str, **body):
    return httpx.post(url + "/v1/chat/completions", json={"model": "tiny", "messages": MESSAGES,
                                                          "max_tokens": 120, "temperature": 0, **body}, timeout=120)


def _stream(url: str, **body) -> list[dict]:
    chunks = []
    with httpx.stream("POST", url + "/v1/chat/completions", timeout=120, json={
            "model": "tiny", "messages": MESSAGES, "max_tokens": 120, "temperature": 0, "stream": True, **body}) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[6:]))
    return chunks


def test_a_named_function_gets_arguments_matching_its_schema(served):
    url, ref, tok = served
    r = _chat(url, tools=TOOLS, tool_choice=NAMED)
    assert r.status_code == 200, r.text
    [choice] = r.json()["choices"]
    msg = choice["message"]
    assert msg["content"] is None and choice["finish_reason"] == "stop"
    [call] = msg["tool_calls"]
    assert call["type"] == "function" and call["id"].startswith("chatcmpl-tool-")
    assert call["function"]["name"] == "get_weather"
    jsonschema.validate(json.loads(call["function"]["arguments"]), WEATHER)
    # The same pattern on the in-process engine, same prompt: the same text, token for token.
    ids = tok.apply_chat_template(MESSAGES, tools=TOOLS, tokenize=True)
    want = ref.generate([ids], SamplingParams(max_tokens=120, temperature=0.0,
                                              guided_regex=schema_regex(WEATHER, "x")))[0]
    assert call["function"]["arguments"] == tok.decode(want)

    chunks = _stream(url, tools=TOOLS, tool_choice=NAMED)
    assert chunks[0]["choices"] == [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                     "finish_reason": None, "logprobs": None}]
    deltas = [c["choices"][0]["delta"]["tool_calls"][0] for c in chunks[1:] if c["choices"]]
    assert deltas[0]["id"].startswith("chatcmpl-tool-") and deltas[0]["function"]["name"] == "get_weather"
    assert all("name" not in d["function"] and d["index"] == 0 for d in deltas[1:])
    assert "".join(d["function"]["arguments"] for d in deltas) == call["function"]["arguments"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


@pytest.mark.parametrize("parallel", [None, False])
def test_required_calls_the_requests_tools(served, parallel):
    """One call at most (parallel_tool_calls false) always completes here; an open array may run
    to max_tokens on a random-weight model: a cut array keeps its whole calls (a stream has sent
    each as it completed)."""
    url, _, _ = served
    extra = {} if parallel is None else {"parallel_tool_calls": parallel}
    r = _chat(url, tools=TOOLS, tool_choice="required", max_tokens=200, **extra)
    assert r.status_code == 200, r.text
    [choice] = r.json()["choices"]
    msg, calls = choice["message"], choice["message"]["tool_calls"]
    if parallel is False:
        assert choice["finish_reason"] == "tool_calls" and len(calls) == 1
    if not calls:       # cut before the first call was whole
        assert choice["finish_reason"] == "length" and msg["content"].startswith("[")
    else:
        assert choice["finish_reason"] in ("tool_calls", "length") and msg["content"] is None
    for c in calls:
        jsonschema.validate(json.loads(c["function"]["arguments"]), SCHEMAS[c["function"]["name"]])
    assert len({c["id"] for c in calls}) == len(calls)

    chunks = _stream(url, tools=TOOLS, tool_choice="required", max_tokens=200, **extra)
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    sent = [t for d in deltas for t in d.get("tool_calls", [])]
    assert [(t["index"], t["function"]) for t in sent] == [(i, c["function"]) for i, c in enumerate(calls)]
    assert "".join(d.get("content", "") for d in deltas) == (msg["content"] or "")
    assert chunks[-1]["choices"][0]["finish_reason"] == choice["finish_reason"]


def test_openai_client_reads_the_calls(served):
    url, _, _ = served
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
    out = client.chat.completions.create(model="tiny", messages=MESSAGES, tools=TOOLS, tool_choice=NAMED,
                                         max_tokens=120, temperature=0)
    call = out.choices[0].message.tool_calls[0]
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER)


def test_earlier_calls_and_results_reach_the_template(served, tiny_model_dir):
    url, _, _ = served
    turn = [*MESSAGES,
            {"role": "assistant", "content": None, "tool_calls": [{"id": "call-1", "type": "function", "function": {
                "name": "get_weather", "arguments": "{\"city\": \"Paris\", \"unit\": \"c\"}"}}]},
            {"role": "tool", "tool_call_id": "call-1", "content": "21 degrees"}]
    r = httpx.post(url + "/v1/chat/completions", json={"model": "tiny", "messages": turn, "tools": TOOLS,
                                                       "tool_choice": "none", "max_tokens": 4}, timeout=60)
    assert r.status_code == 200, r.text
    assert isinstance(r.json()["choices"][0]["message"]["content"], str)
    # A template that renders tools and calls (as HF ones do) gets the definitions and the
    # arguments as an object.
    body = ChatCompletionRequest(model="tiny", messages=turn, tools=TOOLS)
    tok = Tokenizer(tiny_model_dir)
    tok.chat_template = ("{% for t in tools %}[{{ t.function.name }}]{% endfor %}"
                         "{% for m in messages %}{% for c in m.tool_calls or [] %}"
                         "<{{ c.function.name }}:{{ c.function.arguments.city }}>{% endfor %}"
                         "{% if m.tool_call_id %}({{ m.tool_call_id }}={{ m.content }}){% endif %}{% endfor %}")
    tok._compiled = None
    text = tok.apply_chat_template([template_message(m) for m in body.messages], tools=template_tools(body))
    assert text == "[get_weather][search]<get_weather:Paris>(call-1=21 degrees)"


@pytest.mark.parametrize("body,param", [
    ({"tools": TOOLS}, "tool_choice"),                                   # default with tools: auto
    ({"tools": TOOLS, "tool_choice": "auto"}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice.function.name"),
    ({"tools": TOOLS, "tool_choice": NAMED, "response_format": {"type": "json_object"}}, "response_format"),
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}], "tool_choice": "none"},
     "tools.0.function.name"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"messages": [{"role": "user", "content": None}]}, "messages.0"),
])
def test_what_it_cannot_serve_is_a_400_naming_the_field(served, body, param):
    url, _, _ = served
    r = _chat(url, **body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"].startswith(param), r.json()


@contextlib.contextmanager
def _served_with(tiny_model_dir, parser: str):
    model, tok = tiny_parts(tiny_model_dir)
    with serve_engine(EngineConfig(**CFG), model, tok, tool_call_parser=parser) as (url, _):
        yield url


@pytest.fixture(scope="module")
def served_hermes(tiny_model_dir):
    with _served_with(tiny_model_dir, "hermes") as url:
        yield url


@pytest.fixture(scope="module")
def served_pythonic(tiny_model_dir):
    with _served_with(tiny_model_dir, "pythonic") as url:
        yield url


@pytest.fixture(scope="module")
def served_llama4_pythonic(tiny_model_dir):
    with _served_with(tiny_model_dir, "llama4_pythonic") as url:
        yield url


@pytest.fixture(scope="module")
def served_qwen3_coder(tiny_model_dir):
    with _served_with(tiny_model_dir, "qwen3_coder") as url:
        yield url


def test_auto_with_a_parser_returns_text_when_the_model_calls_nothing(served_hermes):
    plain = _chat(served_hermes, max_tokens=12)
    auto = _chat(served_hermes, max_tokens=12, tools=TOOLS)           # tool_choice defaults to auto
    assert auto.status_code == 200, auto.text
    [choice] = auto.json()["choices"]
    assert choice["message"]["tool_calls"] == []
    assert choice["message"]["content"] == plain.json()["choices"][0]["message"]["content"]
    assert choice["finish_reason"] == plain.json()["choices"][0]["finish_reason"]


def _steered(url: str, regex: str, max_tokens: int = 80) -> dict:
    """The message of an "auto" answer steered by `regex` (a random-weight model would not write
    a tool-call syntax on its own), after checking that it ends in tool calls and that the stream
    sends the same content and calls."""
    body = dict(tools=TOOLS, tool_choice="auto", guided_regex=regex, max_tokens=max_tokens)
    r = _chat(url, **body)
    assert r.status_code == 200, r.text
    [choice] = r.json()["choices"]
    assert choice["finish_reason"] == "tool_calls"
    msg = choice["message"]
    assert all(c["id"].startswith("chatcmpl-tool-") for c in msg["tool_calls"])
    assert len({c["id"] for c in msg["tool_calls"]}) == len(msg["tool_calls"])
    chunks = _stream(url, **body)
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    assert "".join(d.get("content") or "" for d in deltas) == (msg["content"] or "")
    assert [t["function"] for d in deltas for t in d.get("tool_calls", [])] == [c["function"] for c in msg["tool_calls"]]
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
    return msg


def test_auto_with_a_parser_reads_the_models_calls(served_hermes):
    """Hermes syntax: text, then a call whose arguments the parser reads."""
    regex = escape('Sure.<tool_call>{"name": "get_weather", "arguments": {"city": "') + "[a-z]{1,6}" + \
        escape('"}}</tool_call>')
    msg = _steered(served_hermes, regex)
    assert msg["content"] == "Sure."
    [call] = msg["tool_calls"]
    assert call["function"]["name"] == "get_weather"
    assert set(json.loads(call["function"]["arguments"])) == {"city"}


def test_auto_with_the_pythonic_parser_reads_a_list_of_calls(served_pythonic):
    """A Python list of calls (the whole message, as Llama 3.2 writes it): no content, and the
    keyword arguments as a JSON object."""
    regex = escape('[get_weather(city="') + "[a-z]{1,6}" + escape('", unit="c"), search(q="x", exact=True)]')
    msg = _steered(served_pythonic, regex)
    assert msg["content"] is None
    weather, search = msg["tool_calls"]
    assert weather["function"]["name"] == "get_weather"
    jsonschema.validate(json.loads(weather["function"]["arguments"]), WEATHER)
    assert search["function"] == {"name": "search", "arguments": '{"q": "x", "exact": true}'}


def _assert_one_search(msg: dict, content: str, exact: bool) -> None:
    """`msg` is `content` then one call of `search` whose arguments fit its schema, `exact` typed as a JSON bool."""
    assert msg["content"] == content
    [call] = msg["tool_calls"]
    assert call["function"]["name"] == "search"
    args = json.loads(call["function"]["arguments"])
    assert args["exact"] is exact
    jsonschema.validate(args, SEARCH)


def test_auto_with_the_qwen3_coder_parser_types_values_by_the_tools_schema(served_qwen3_coder):
    """Qwen3-Coder's XML carries every value as text: `exact`, a boolean in the request's schema
    for `search`, comes back as JSON true, `q` as a string."""
    regex = escape("On it.<tool_call>\n<function=search>\n<parameter=q>\n") + "[a-z]{1,6}" + \
        escape("\n</parameter>\n<parameter=exact>\ntrue\n</parameter>\n</function>\n</tool_call>")
    msg = _steered(served_qwen3_coder, regex, max_tokens=160)
    _assert_one_search(msg, "On it.", exact=True)


def test_auto_with_the_llama4_pythonic_parser_reads_the_wrapped_list(served_llama4_pythonic):
    """Llama 4's list of calls inside <|python_start|> ... <|python_end|>, after text: the text
    is the content, the wrapper no part of the calls."""
    regex = escape('Sure.<|python_start|>[search(q="') + "[a-z]{1,6}" + escape('", exact=False)]<|python_end|>')
    msg = _steered(served_llama4_pythonic, regex)
    _assert_one_search(msg, "Sure.", exact=False)


def test_auto_with_the_qwen3_coder_parser_reads_a_bare_function_block(served_qwen3_coder):
    """A `<function=...>` block without `<tool_call>` around it, on its own line after text."""
    regex = escape("On it.\n<function=search>\n<parameter=q>\n") + "[a-z]{1,6}" + \
        escape("\n</parameter>\n<parameter=exact>\nfalse\n</parameter>\n</function>")
    msg = _steered(served_qwen3_coder, regex, max_tokens=160)
    _assert_one_search(msg, "On it.\n", exact=False)
