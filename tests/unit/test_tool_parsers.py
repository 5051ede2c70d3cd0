"""The tool-call parsers of tool_choice "auto" (hermes, llama3_json, mistral, pythonic, llama4_pythonic,
qwen3_coder, deepseek_v3) on the syntax each model family writes, and how a choice's text becomes tool calls,
whole and streamed: a stream sends the text before the calls as content as it comes (holding back
what may begin a call marker), then the calls at the end, and the pieces add up to the
non-streamed message; a stream cut inside a call is text. Llama 4's list bare or in
<|python_start|> ... <|python_end|>, and qwen3_coder's <function=...> blocks without <tool_call>
(the first starting a line: mid-line it is prose), streamed equal to the whole message at every cut."""

from __future__ import annotations

import pytest

from raycluster.server.protocol import ChatCompletionRequest
from raycluster.server.tool_parsers import (TOOL_PARSERS, DeepSeekV3Parser, HermesParser, Llama3JsonParser,
                                            Llama4PythonicParser, MistralParser, ParsedCall, PythonicParser,
                                            Qwen3CoderParser, tool_parser)
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
# Llama 4: the pythonic list wrapped in <|python_start|> ... <|python_end|>, or bare.
LLAMA4 = 'Let me check.<|python_start|>[get_weather(city="Paris"), search(q="a b", n=2)]<|python_end|>'
LLAMA4_BARE = 'Checking.\n[get_weather(city="Paris")]'
# Qwen3-Coder's <function=...> blocks without <tool_call> around them.
QWEN3_BARE = ('Let me check.\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n3\n'
              '</parameter>\n</function>\n<function=search>\n<parameter=opts>\n{"depth": 2}\n</parameter>\n'
              '<parameter=q>\n3\n</parameter>\n</function>\n')
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
         ("pythonic", '\n[get_weather(city="Paris")]'), ("llama4_pythonic", LLAMA4), ("llama4_pythonic", LLAMA4_BARE),
         ("llama4_pythonic", ' <|python_start|>[search(q="x")]'), ("qwen3_coder", QWEN3_CODER),
         ("qwen3_coder", QWEN3_BARE),
         ("qwen3_coder", '<function=search>\n<parameter=q>\n"x"\n</parameter>\n</function>'),
         ("deepseek_v3", DEEPSEEK)]
STEPS = [1, 3, 4, 0.75, 1000]       # a float: pieces of that share of the text
PROSE = "Qwen3-Coder wraps <function=NAME> in <tool_call>, e.g. <function=f></function>."   # mid-line: text


@pytest.mark.parametrize("name,text", [*CALLS, ("hermes", "Just text, <tool and more text."),
                                       ("llama3_json", "Plain text."), ("pythonic", "See [1] or [f(x)], [g"),
                                       ("pythonic", "[f(a=1)] is how one calls f."),
                                       ("qwen3_coder", "Text, <tool_c and <tool_call>\n<function=f>\n</tool_call>"),
                                       ("qwen3_coder", PROSE), ("qwen3_coder", "Tags:\n  <function=f> opens a call."),
                                       ("llama4_pythonic", "See <|python_st and [f(x)] or <|python_start|>print(1)"),
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


def test_llama4_pythonic_reads_the_list_wrapped_or_bare():
    parser = tool_parser("llama4_pythonic")
    assert isinstance(parser, Llama4PythonicParser) and TOOL_PARSERS["llama4_pythonic"] is Llama4PythonicParser
    assert parser.parse(LLAMA4) == ("Let me check.", [ParsedCall("get_weather", '{"city": "Paris"}'),
                                                      ParsedCall("search", '{"q": "a b", "n": 2}')])
    assert parser.parse(LLAMA4_BARE) == ("Checking.\n", [ParsedCall("get_weather", '{"city": "Paris"}')])
    # The whole message, the end marker left out (cut, or dropped as a special token), space around it.
    assert parser.parse('\n<|python_start|>[f(a=[1, {"b": None}])]') == \
        (None, [ParsedCall("f", '{"a": [1, {"b": null}]}')])
    assert parser.parse('<|python_start|> [f(), g(s="<|python_end|>")] <|python_end|>\n') == \
        (None, [ParsedCall("f", "{}"), ParsedCall("g", '{"s": "<|python_end|>"}')])
    assert PythonicParser().parse(LLAMA4_BARE) == parser.parse(LLAMA4_BARE)      # bare: pythonic's reading


@pytest.mark.parametrize("text", [
    "plain", "<|python_start|>", "<|python_start|><|python_end|>", "<|python_start|>[]<|python_end|>",
    '<|python_start|>[get_weather("Paris")]<|python_end|>', "<|python_start|>[f(a=lookup(1))]<|python_end|>",
    "<|python_start|>print(1)<|python_end|>",                                   # code, not calls
    "<|python_start|>[f(a=1)]<|python_end|> and then",                          # text after the end marker
    "[f(a=1)]<|python_end|>",                                                   # an end marker without a start
    "<|python_start|>[f(a=1)]<|python_end|><|python_start|>[g(b=2)]<|python_end|>",   # one list only
    "Sure [f(a=1)] <|python_start|>[g(b=2)]<|python_end|>",                     # calls begin at the first list
    '<|python_start|>[f(a="x', "<|python_start|>[f(a=1)", "<|python_start|>Sure [f(a=1)]<|python_end|>",
])
def test_llama4_pythonic_text_without_calls_that_parse_is_content(text):
    assert Llama4PythonicParser().parse(text) == (text, [])


def test_qwen3_coder_reads_bare_function_blocks():
    parser = Qwen3CoderParser().for_tools(PARAMETERS)
    assert parser.parse(QWEN3_BARE) == ("Let me check.\n", [
        ParsedCall("get_weather", '{"city": "Paris", "days": 3}'),
        ParsedCall("search", '{"opts": {"depth": 2}, "q": "3"}')])      # q is a string in the schema: "3"
    assert parser.parse('  <function=now>\n</function>') == ("  ", [ParsedCall("now", "{}")])
    assert parser.parse('<function=now></function>\n\n<function=now></function>') == \
        (None, [ParsedCall("now", "{}"), ParsedCall("now", "{}")])
    # A line's `<function=` begins the calls, one mid-line is text: the calls are the last line's.
    text = 'Use <function=x> tags.\n<function=search>\n<parameter=exact>\nfalse\n</parameter>\n</function>'
    assert parser.parse(text) == ('Use <function=x> tags.\n', [ParsedCall("search", '{"exact": false}')])
    # The wrapped form as before, also when a bare-looking line is inside (or after) its block.
    assert parser.parse(QWEN3_CODER) == Qwen3CoderParser().for_tools(PARAMETERS).parse(QWEN3_CODER)
    assert parser.parse("<tool_call>\n<function=now>\n</function>\n</tool_call>") == (None, [ParsedCall("now", "{}")])


@pytest.mark.parametrize("text", [
    PROSE, "Tags:\n<function=f> opens a call, </function> ends it.",       # a line's start, then prose
    "<function=f>\n<parameter=a>\n1\n</parameter>\n",                      # unfinished: no </function>
    "<function=f>\n<parameter=a>\n1\n</function>",                          # unclosed parameter
    "<function=f></function> and more", "<function=f></function>\n<tool_call>\n<function=g></function>\n</tool_call>",
    "<function=f></function>\n<function=g>", "<function=>\n</function>", "<function=f\n></function>",
    "<function=f>\nloose text\n</function>", "\t<function=f>\n<parameter=a>1<parameter=b>2</parameter></function>",
])
def test_qwen3_coder_bare_text_without_calls_that_parse_is_content(text):
    assert Qwen3CoderParser().for_tools(PARAMETERS).parse(text) == (text, [])


def test_where_a_stream_of_the_new_syntaxes_may_hold_back_text():
    l4 = Llama4PythonicParser()
    assert l4.start("Sure <|pyth") == (None, 6) and l4.start("Sure [get") == (None, 4) and l4.start(" <|") == (None, 3)
    assert l4.start("Sure.<|python_start|>") == (5, 0) and l4.start("\n<|python_start|>") == (0, 0)
    assert l4.start("Sure [f(") == (5, 0) and l4.start("a [f( <|python_start|>") == (2, 0)
    assert l4.start("Sure <|python_end|>") == (None, 0) and l4.start("a <b") == (None, 0)
    q = Qwen3CoderParser()
    assert q.start("ok\n  <func") == (None, 5) and q.start("ok <func") == (None, 0)      # mid-line: text
    assert q.start("ok\n<function=") == (3, 0) and q.start("ok\n\t<function=") == (4, 0)
    assert q.start("ok <function=f>") == (None, 0) and q.start("<") == (None, 1)
    assert q.start("<tool_call>\n<function=f>") == (0, 0) and q.start("a\n<function=f>\n<tool_call>") == (2, 0)


@pytest.mark.parametrize("name,text", [("llama4_pythonic", LLAMA4), ("llama4_pythonic", LLAMA4_BARE),
                                       ("qwen3_coder", QWEN3_BARE), ("qwen3_coder", "Hi.\n" + QWEN3_CODER)])
def test_every_cut_streams_what_the_message_holds(name, text):
    """Each prefix of the text (a stream cut there by max_tokens) streamed a character at a time
    and in two pieces split at each point gives the whole-message parse of that prefix."""
    for k in range(len(text) + 1):
        cut = text[:k]
        whole, reason = _auto(name).message(cut, "length")
        want = (whole["content"] or "", [(i, c["function"]) for i, c in enumerate(whole["tool_calls"])], reason)
        for pieces in ([cut[:j] for j in range(k + 1)], [cut[:k // 3], cut]):     # prefixes: what is whole so far
            out, content, calls, last = _auto(name), "", [], None
            for n, (a, b) in enumerate(zip([""] + pieces, pieces)):
                delta, last = out.delta(b[len(a):], n == len(pieces) - 1, "length" if n == len(pieces) - 1 else None)
                content += delta.get("content", "")
                calls += [(c["index"], c["function"]) for c in delta.get("tool_calls", [])]
            assert (content, calls, last) == want, (k, pieces[-1])
