"""The tool-call parsers of tool_choice "auto" (hermes, llama3_json, mistral) on the syntax each
model family writes, and how a choice's text becomes tool calls, whole and streamed: a stream
sends the text before the calls as content as it comes (holding back what may begin a call
marker), then the calls at the end, and the pieces add up to the non-streamed message."""

from __future__ import annotations

import pytest

from raycluster.server.tool_parsers import (HermesParser, Llama3JsonParser, MistralParser, ParsedCall,
                                            tool_parser)
from raycluster.server.tools import ToolCallOutput, array_items

HERMES = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
          '<tool_call>\n{"name": "search", "arguments": {"q": "Paris"}}\n</tool_call>')
LLAMA = '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "search", "parameters": {"q": "x"}}'
MISTRAL = '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}]'


def test_each_parser_reads_its_models_calls():
    assert HermesParser().parse(HERMES) == ("Let me check.\n", [ParsedCall("get_weather", '{"city": "Paris"}'),
                                                               ParsedCall("search", '{"q": "Paris"}')])
    assert Llama3JsonParser().parse(LLAMA) == (None, [ParsedCall("get_weather", '{"city": "Paris"}'),
                                                      ParsedCall("search", '{"q": "x"}')])
    assert Llama3JsonParser().parse(' {"name": "f", "parameters": {}} ') == (None, [ParsedCall("f", "{}")])
    assert MistralParser().parse(MISTRAL) == (None, [ParsedCall("get_weather", '{"city": "Paris"}')])
    # Arguments already written as a JSON string stay as they are.
    assert HermesParser().parse('<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>')[1] == \
        [ParsedCall("f", '{"a": 1}')]


@pytest.mark.parametrize("parser,text", [
    (HermesParser(), "no calls here"), (HermesParser(), '<tool_call>{"name": "f", "argu'),
    (HermesParser(), '<tool_call>{"arguments": {}}</tool_call>'),
    (Llama3JsonParser(), 'Paris is {"name": "f"}'), (Llama3JsonParser(), '{"name": "f", "parameters": {}} and more'),
    (Llama3JsonParser(), '{"name": "f", "param'), (MistralParser(), "[TOOL_CALLS] [{"), (MistralParser(), "plain"),
])
def test_text_without_calls_that_parse_is_content(parser, text):
    assert parser.parse(text) == (text, [])


def test_where_a_stream_may_hold_back_text():
    h = HermesParser()
    assert h.start("abc") == (None, 0) and h.start("abc<tool") == (None, 5) and h.start("a<tool_call>{") == (1, 0)
    l3 = Llama3JsonParser()
    assert l3.start("  ") == (None, 2) and l3.start(" {") == (0, 0) and l3.start("<|pyth") == (None, 6)
    assert l3.start("Hello") == (None, 0)
    assert MistralParser().start("x[TOOL") == (None, 5)
    with pytest.raises(ValueError, match="unknown tool_call_parser"):
        tool_parser("granite")


def _streamed(out: ToolCallOutput, text: str, step: int, reason: str = "stop") -> tuple[str, list, str | None]:
    content, calls, last = "", [], None
    pieces = [text[i:i + step] for i in range(0, len(text), step)]
    for k, piece in enumerate(pieces):
        delta, last = out.delta(piece, k == len(pieces) - 1, reason if k == len(pieces) - 1 else None)
        content += delta.get("content", "")
        calls += delta.get("tool_calls", [])
    return content, calls, last


@pytest.mark.parametrize("name,text", [("hermes", HERMES), ("llama3_json", LLAMA), ("mistral", MISTRAL),
                                       ("hermes", "Just text, <tool and more text."), ("llama3_json", "Plain text.")])
@pytest.mark.parametrize("step", [1, 3, 1000])
def test_auto_streams_what_the_message_holds(name, text, step):
    whole, reason = ToolCallOutput("auto", parser=tool_parser(name)).message(text, "stop")
    content, calls, last = _streamed(ToolCallOutput("auto", parser=tool_parser(name)), text, step)
    assert content == (whole["content"] or "") and last == reason
    assert [(c["index"], c["function"]) for c in calls] == [(i, c["function"]) for i, c in enumerate(whole["tool_calls"])]
    assert reason == ("tool_calls" if whole["tool_calls"] else "stop")


def test_text_before_a_call_streams_before_the_call_ends():
    out = ToolCallOutput("auto", parser=HermesParser())
    assert out.delta("Let me ", False, None) == ({"content": "Let me "}, None)
    assert out.delta("check.<tool", False, None) == ({"content": "check."}, None)      # "<tool" held
    assert out.delta('_call>{"name": "f", ', False, None) == ({}, None)
    delta, reason = out.delta('"arguments": {}}</tool_call>', True, "stop")
    assert reason == "tool_calls" and "content" not in delta
    assert [c["function"] for c in delta["tool_calls"]] == [{"name": "f", "arguments": "{}"}]


def test_a_length_cut_keeps_its_reason_and_what_was_whole():
    text = '<tool_call>{"name": "f", "argu'
    msg, reason = ToolCallOutput("auto", parser=HermesParser()).message(text, "length")
    assert msg == {"role": "assistant", "content": text, "tool_calls": []} and reason == "length"
    msg, reason = ToolCallOutput("required").message('[{"name": "f", "param', "length")
    assert msg["tool_calls"] == [] and msg["content"] == '[{"name": "f", "param' and reason == "length"
    # A cut after a whole call keeps that call (a stream has sent it already).
    msg, reason = ToolCallOutput("required").message('[{"name": "f", "parameters": {"a": 1}}, {"name": "g"', "length")
    assert [c["function"] for c in msg["tool_calls"]] == [{"name": "f", "arguments": '{"a": 1}'}]
    assert msg["content"] is None and reason == "length"


REQUIRED = '[ {"name": "f", "parameters": {"q": "a]b"}} , {"name": "g", "parameters": {}}]'


def _found(scan):
    return scan.items, scan.closed


def test_array_items_sees_whole_calls_only_and_reads_on_from_a_prefix():
    both = [{"name": "f", "parameters": {"q": "a]b"}}, {"name": "g", "parameters": {}}]
    assert _found(array_items(REQUIRED)) == (both, True)
    cut = REQUIRED.index("{\"name\": \"g\"")
    assert _found(array_items(REQUIRED[:cut])) == (both[:1], False)
    assert _found(array_items(REQUIRED[:20])) == ([], False) and _found(array_items("")) == ([], False)
    assert _found(array_items('[{"parameters": {}}]')) == ([], False)        # not a call: the scan stops
    # Read on, a character at a time, from each prefix's scan: the same as one scan of the whole.
    scan = None
    for k in range(len(REQUIRED) + 1):
        scan = array_items(REQUIRED[:k], scan)
        assert _found(scan) == _found(array_items(REQUIRED[:k])), k


@pytest.mark.parametrize("step", [1, 4, 1000])
@pytest.mark.parametrize("reason", ["stop", "length"])
def test_required_streams_each_call_once_it_is_whole(step, reason):
    text = REQUIRED if reason == "stop" else REQUIRED[:-12]
    whole, want_reason = ToolCallOutput("required").message(text, reason)
    content, calls, last = _streamed(ToolCallOutput("required"), text, step, reason)
    assert [(c["index"], c["function"]) for c in calls] == [(i, c["function"]) for i, c in enumerate(whole["tool_calls"])]
    assert content == (whole["content"] or "") and last == want_reason
    assert want_reason == ("tool_calls" if reason == "stop" else "length")
    out = ToolCallOutput("required")
    first, _ = out.delta(REQUIRED[:REQUIRED.index("} ,") + 2], False, None)     # the first call, before the end
    assert [c["function"]["name"] for c in first["tool_calls"]] == ["f"]
