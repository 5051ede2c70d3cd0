"""The tool-call parsers of tool_choice "auto" (hermes, llama3_json, mistral, pythonic, qwen3_coder,
deepseek_v3) on the syntax each model family writes, and how a choice's text becomes tool calls,
whole and streamed: a stream sends the text before the calls as content as it comes (holding back
what may begin a call marker), then the calls at the end, and the pieces add up to the
non-streamed message; a stream cut inside a call is text."""

from __future__ import annotations

import pytest

from raycluster.server.protocol import ChatCompletionRequest
from raycluster.server.tool_parsers import (DeepSeekV3Parser, HermesParser, Llama3JsonParser, MistralParser,
                                            ParsedCall, PythonicParser, Qwen3CoderParser, tool_parser)
from raycluster.server.tools import NO_PARAMETERS, ToolCallOutput, array_items, tool_parameters

HERMES = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
          '<tool_call>\n{"name": "search", "arguments": {"q": "Paris"}}\n</tool_call>')
LLAMA = '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "search", "parameters": {"q": "x"}}'
MISTRAL = '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}]'
PYTHONIC = 'Checking.\n[get_weather(city="Paris", unit="c"), search(q=\'a "b"\', n=-2, exact=True, tags=["x", None], ' \
    'opts={"depth": 1.5, "k": (1, 2)})]'
QWEN3_CODER = ('Let me check.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n'
               '<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=search>\n'
               '<parameter=q>\nline one\nline two\n</parameter>\n<parameter=exact>\ntrue\n</parameter>\n'
               '<parameter=opts>\n{"depth": 2, "tags": ["a"]}\n</parameter>\n<parameter=n>\nmany\n</parameter>\n'
               '</function>\n</tool_call>')
DEEPSEEK = ('Let me check.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n'
            '{"city": "Paris"}\n```<｜tool▁call▁end｜>\n<｜tool▁call▁begin｜>function<｜tool▁sep｜>search\n```json\n'
            '{"q": "Paris", "n": 2}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>')
# The request's tools' parameters, by which qwen3_coder types its values (the others ignore them).
PARAMETERS = {"get_weather": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}},
              "search": {"type": "object", "properties": {"q": {"type": "string"}, "exact": {"type": "boolean"},
                                                          "opts": {"type": "object"}, "n": {"type": ["integer", "null"]}}}}


def test_each_parser_reads_its_models_calls():
    assert HermesParser().parse(HERMES) == ("Let me check.\n", [ParsedCall("get_weather", '{"city": "Paris"}'),
                                                               ParsedCall("search", '{"q": "Paris"}')])
    assert Llama3JsonParser().parse(LLAMA) == (None, [ParsedCall("get_weather", '{"city": "Paris"}'),
                                                      ParsedCall("search", '{"q": "x"}')])
    assert Llama3JsonParser().parse(' {"name": "f", "parameters": {}} ') == (None, [ParsedCall("f", "{}")])
    assert MistralParser().parse(MISTRAL) == (None, [ParsedCall("get_weather", '{"city": "Paris"}')])
    assert PythonicParser().parse(PYTHONIC) == ("Checking.\n", [
        ParsedCall("get_weather", '{"city": "Paris", "unit": "c"}'),
        ParsedCall("search", '{"q": "a \\"b\\"", "n": -2, "exact": true, "tags": ["x", null], '
                             '"opts": {"depth": 1.5, "k": [1, 2]}}')])
    assert PythonicParser().parse(' [f()]\n') == (None, [ParsedCall("f", "{}")])          # the whole message
    assert Qwen3CoderParser().for_tools(PARAMETERS).parse(QWEN3_CODER) == ("Let me check.\n", [
        ParsedCall("get_weather", '{"city": "Paris", "days": 3}'),
        ParsedCall("search", '{"q": "line one\\nline two", "exact": true, "opts": {"depth": 2, "tags": ["a"]}, '
                             '"n": "many"}')])       # "many" is no integer: it stays a string
    # Without the tools' schemas every value is a string.
    assert Qwen3CoderParser().parse(QWEN3_CODER)[1][0] == ParsedCall("get_weather", '{"city": "Paris", "days": "3"}')
    assert DeepSeekV3Parser().parse(DEEPSEEK) == ("Let me check.", [ParsedCall("get_weather", '{"city": "Paris"}'),
                                                                    ParsedCall("search", '{"q": "Paris", "n": 2}')])
    # Arguments already written as a JSON string stay as they are.
    assert HermesParser().parse('<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>')[1] == \
        [ParsedCall("f", '{"a": 1}')]


@pytest.mark.parametrize("parser,text", [
    (HermesParser(), "no calls here"), (HermesParser(), '<tool_call>{"name": "f", "argu'),
    (HermesParser(), '<tool_call>{"arguments": {}}</tool_call>'),
    (Llama3JsonParser(), 'Paris is {"name": "f"}'), (Llama3JsonParser(), '{"name": "f", "parameters": {}} and more'),
    (Llama3JsonParser(), '{"name": "f", "param'), (MistralParser(), "[TOOL_CALLS] [{"), (MistralParser(), "plain"),
    (PythonicParser(), "plain"), (PythonicParser(), '[get_weather("Paris")]'),             # positional
    (PythonicParser(), '[get_weather(city=lookup("Paris"))]'), (PythonicParser(), "[f(a=x)]"),   # not literals
    (PythonicParser(), "[f(**kw)]"), (PythonicParser(), "[f(a={1: 2})]"), (PythonicParser(), "[os.system(a=1)]"),
    (PythonicParser(), "[f(a=1), 2]"), (PythonicParser(), '[f(a=1)] and then'), (PythonicParser(), '[f(a="x'),
    (PythonicParser(), "[1, 2]"), (PythonicParser(), "[f(a=1e999)]"),
    (PythonicParser(), "[f(1)] then [g(b=2)]"),        # calls begin at the first list: that one must be them
    (Qwen3CoderParser(), "no calls"), (Qwen3CoderParser(), "<tool_call>\n<function=f>\n<parameter=a>\n1\n"),
    (Qwen3CoderParser(), "<tool_call>\n<function=f>\n<parameter=a>\n1\n</function>\n</tool_call>"),   # unclosed
    (Qwen3CoderParser(), "<tool_call>\n<function=f>\n<parameter=a>1<parameter=b>2</parameter></function></tool_call>"),
    (Qwen3CoderParser(), '<tool_call>{"name": "f", "arguments": {}}</tool_call>'),          # hermes' JSON
    (Qwen3CoderParser(), "<tool_call>\n<function=f>\nloose text\n</function>\n</tool_call>"),
    (DeepSeekV3Parser(), "plain"), (DeepSeekV3Parser(), DEEPSEEK[:DEEPSEEK.index("```<")]),        # cut
    (DeepSeekV3Parser(), DEEPSEEK.replace('{"q": "Paris", "n": 2}', '["Paris"]')),                   # not an object
    (DeepSeekV3Parser(), DEEPSEEK.replace('{"city": "Paris"}', '{"city": Paris}')),
    (DeepSeekV3Parser(), "<｜tool▁calls▁begin｜><｜tool▁calls▁end｜>"),                               # no call
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
    py = PythonicParser()
    assert py.start("Sure [get_") == (None, 5) and py.start("Sure [") == (None, 1) and py.start(" [get") == (None, 5)
    assert py.start("\n ") == (None, 2) and py.start("a [b c") == (None, 0) and py.start("[1, 2]") == (None, 0)
    assert py.start("Sure [f(") == (5, 0) and py.start(" \n[f(") == (0, 0)      # space alone is no content
    assert Qwen3CoderParser().start("ok <tool_c") == (None, 7) and Qwen3CoderParser().start("<tool_call>") == (0, 0)
    assert DeepSeekV3Parser().start("ok<｜tool▁calls") == (None, 12)
    assert DeepSeekV3Parser().start("ok<｜tool▁calls▁begin｜>") == (2, 0)
    with pytest.raises(ValueError, match="unknown tool_call_parser"):
        tool_parser("granite")


def test_qwen3_coder_types_values_by_the_requests_tools():
    body = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}], tools=[
        {"type": "function", "function": {"name": "get_weather", "parameters": PARAMETERS["get_weather"]}},
        {"type": "function", "function": {"name": "now"}}])
    assert tool_parameters(body) == {"get_weather": PARAMETERS["get_weather"], "now": NO_PARAMETERS}
    parser = tool_parser("qwen3_coder")
    typed = parser.for_tools(tool_parameters(body))
    assert typed.parse(QWEN3_CODER)[1][0] == ParsedCall("get_weather", '{"city": "Paris", "days": 3}')
    assert parser.parameters == {}          # the configured parser stays untyped: each request gets its own
    hermes = tool_parser("hermes")
    assert hermes.for_tools(PARAMETERS) is hermes       # a syntax of typed JSON needs no schema


def _streamed(out: ToolCallOutput, text: str, step: float, reason: str = "stop") -> tuple[str, list, str | None]:
    """The content, calls and last finish_reason of `text` streamed in pieces of `step`
    characters (a float: that share of the text)."""
    content, calls, last = "", [], None
    step = max(1, int(len(text) * step)) if isinstance(step, float) else step
    pieces = [text[i:i + step] for i in range(0, len(text), step)]
    for k, piece in enumerate(pieces):
        delta, last = out.delta(piece, k == len(pieces) - 1, reason if k == len(pieces) - 1 else None)
        content += delta.get("content", "")
        calls += delta.get("tool_calls", [])
    return content, calls, last


def _auto(name: str) -> ToolCallOutput:
    return ToolCallOutput("auto", parser=tool_parser(name).for_tools(PARAMETERS))


CALLS = [("hermes", HERMES), ("llama3_json", LLAMA), ("mistral", MISTRAL), ("pythonic", PYTHONIC),
         ("pythonic", '\n[get_weather(city="Paris")]'), ("qwen3_coder", QWEN3_CODER), ("deepseek_v3", DEEPSEEK)]
STEPS = [1, 3, 4, 0.75, 1000]       # a float: pieces of that share of the text


@pytest.mark.parametrize("name,text", [*CALLS, ("hermes", "Just text, <tool and more text."),
                                       ("llama3_json", "Plain text."), ("pythonic", "See [1] or [f(x)], [g"),
                                       ("pythonic", "[f(a=1)] is how one calls f."),
                                       ("qwen3_coder", "Text, <tool_c and <tool_call>\n<function=f>\n</tool_call>"),
                                       ("deepseek_v3", "Text <｜tool▁calls and more.")])
@pytest.mark.parametrize("step", STEPS)
def test_auto_streams_what_the_message_holds(name, text, step):
    whole, reason = _auto(name).message(text, "stop")
    content, calls, last = _streamed(_auto(name), text, step)
    assert content == (whole["content"] or "") and last == reason
    assert [(c["index"], c["function"]) for c in calls] == [(i, c["function"]) for i, c in enumerate(whole["tool_calls"])]
    assert reason == ("tool_calls" if whole["tool_calls"] else "stop")
    assert bool(whole["tool_calls"]) == ((name, text) in CALLS)


@pytest.mark.parametrize("name,text", CALLS)
@pytest.mark.parametrize("step", STEPS)
@pytest.mark.parametrize("at", ["last string", "6 from the end"])
def test_a_stream_cut_mid_call_is_text(name, text, step, at):
    """Cut inside its last call (max_tokens: in its last string, or in its closing markup), the
    text is content, streamed and not, and the reason stays "length"."""
    cut = text[:text.rindex('"')] if at == "last string" else text[:-6]
    whole, reason = _auto(name).message(cut, "length")
    assert whole == {"role": "assistant", "content": cut, "tool_calls": []} and reason == "length"
    assert _streamed(_auto(name), cut, step, "length") == (cut, [], "length")


@pytest.mark.parametrize("name,text", CALLS)
def test_the_text_before_the_calls_streams_before_the_end(name, text):
    out, early = _auto(name), ""
    for ch in text[:-1]:
        delta, _ = out.delta(ch, False, None)
        assert "tool_calls" not in delta
        early += delta.get("content", "")
    assert early == (_auto(name).message(text, "stop")[0]["content"] or "")


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
