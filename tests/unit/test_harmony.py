"""gpt-oss's harmony output split by the `openai_gptoss` reasoning parser (analysis as reasoning,
final and preambles as content, calls to functions passed on for the `openai` tool parser, calls
to built-in tools kept in the reasoning), whole and in any pieces (markers cut anywhere, never
leaking), and the `openai` tool parser reading the calls; reasoning_effort reaching the template."""

import json
import random

import pytest

from raycluster.server.app import template_kwargs
from raycluster.server.protocol import ChatCompletionRequest
from raycluster.server.reasoning import REASONING_PARSERS, reasoning_stream, split_reasoning
from raycluster.server.tool_parsers import tool_parser

GPTOSS = REASONING_PARSERS["openai_gptoss"]
CALL = "<|start|>assistant to=functions.get_weather<|message|>{\"city\": \"Paris\"}<|call|>"

CASES = [
    # Think, then answer (the template opened the first message with <|start|>assistant).
    ("<|channel|>analysis<|message|>User greets.<|end|><|start|>assistant<|channel|>final<|message|>Hello!<|return|>",
     ("User greets.", "Hello!")),
    # The end token is not in the text (the engine leaves a stop token out).
    ("<|channel|>analysis<|message|>hm<|end|><|start|>assistant<|channel|>final<|message|>Hi",
     ("hm", "Hi")),
    # A call, the recipient after the channel (with a content type), then in the role header.
    ("<|channel|>analysis<|message|>Need weather.<|end|><|start|>assistant<|channel|>commentary to=functions.get_weather"
     " <|constrain|>json<|message|>{\"city\": \"Paris\"}<|call|>", ("Need weather.", CALL)),
    ("<|channel|>analysis<|message|>Need weather.<|end|><|start|>assistant to=functions.get_weather<|channel|>commentary"
     " json<|message|>{\"city\": \"Paris\"}<|call|>", ("Need weather.", CALL)),
    # A preamble on commentary is content, before the call.
    ("<|channel|>commentary<|message|>Checking. <|end|><|start|>assistant to=functions.get_weather<|channel|>commentary"
     " json<|message|>{\"city\": \"Paris\"}<|call|>", (None, "Checking. " + CALL)),
    # A built-in tool's call belongs to the reasoning.
    ("<|channel|>analysis to=browser.search code<|message|>{\"query\": \"x\"}<|call|>", ("{\"query\": \"x\"}", None)),
    # Cut off while thinking; no header at all (a constrained output); nothing.
    ("<|channel|>analysis<|message|>still going", ("still going", None)),
    ("{\"a\": 1}", (None, "{\"a\": 1}")),
    ("", (None, None)),
    # A header cut off by the end says nothing.
    ("<|channel|>analysis<|message|>x<|end|><|start|>assistant<|channel|>fin", ("x", None)),
]


@pytest.mark.parametrize("text, want", CASES)
def test_whole_outputs_split_by_channel(text, want):
    assert split_reasoning(GPTOSS, text) == want


@pytest.mark.parametrize("seed", range(30))
def test_any_pieces_give_the_same_split_and_no_marker_leaks(seed):
    rng = random.Random(seed)
    text, _ = CASES[seed % len(CASES)]
    cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 12)))) if len(text) > 1 else []
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
    stream = reasoning_stream(GPTOSS)
    got = [stream.feed(p, final=k == len(pieces) - 1) for k, p in enumerate(pieces)] or [stream.feed("", True)]
    reasoning, content = "".join(r for r, _ in got), "".join(c for _, c in got)
    # The pieces add up to the whole split, so no piece of a marker went out as text and came back.
    assert (reasoning or None, content or None) == split_reasoning(GPTOSS, text)
    for r, _ in got:
        assert "<|" not in r and "|>" not in r, (pieces, got)


def test_the_openai_tool_parser_reads_the_calls_the_stream_passes_on():
    parser = tool_parser("openai")
    other = CALL.replace("get_weather", "get_time").replace('{"city": "Paris"}', '{"tz": "UTC"}')
    assert parser.parse("Checking. " + CALL + other) == ("Checking. ", [
        type(parser.parse(CALL)[1][0])("get_weather", json.dumps({"city": "Paris"})),
        type(parser.parse(CALL)[1][0])("get_time", json.dumps({"tz": "UTC"}))])
    bad = CALL.replace('{"city": "Paris"}', '{"city": ')
    assert parser.parse(bad) == (bad, [])                      # arguments that are not JSON: content
    assert parser.parse("no calls") == ("no calls", [])
    assert parser.start("text <|start|>assis") == (None, len("<|start|>assis"))
    assert parser.start("text " + CALL) == (5, 0)


def test_reasoning_effort_reaches_the_template_unless_chat_template_kwargs_set_it():
    body = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], reasoning_effort="high")
    assert template_kwargs(body) == {"reasoning_effort": "high"}
    body = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], reasoning_effort="low",
                                 chat_template_kwargs={"reasoning_effort": "medium", "x": 1})
    assert template_kwargs(body) == {"reasoning_effort": "medium", "x": 1}
    assert template_kwargs(ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}])) is None
    with pytest.raises(ValueError, match="reasoning_effort"):
        ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], reasoning_effort="max")


@pytest.mark.parametrize("seed", range(40))
def test_any_marker_soup_splits_alike_whole_and_in_pieces(seed):
    """Arbitrary runs of harmony's markers and text (malformed included): the stream never
    fails, splits in pieces as whole, and the openai tool parser reads its content without
    failing (calls or plain content)."""
    rng = random.Random(seed)
    atoms = ["<|start|>", "assistant", "<|channel|>", "analysis", "final", "commentary", " to=functions.f",
             " to=browser.search", "<|constrain|>", "json", "<|message|>", "<|end|>", "<|call|>", "<|return|>",
             "{\"a\": 1}", "hello", " ", "<|", "|>", "<"]
    text = "".join(rng.choice(atoms) for _ in range(rng.randint(0, 25)))
    cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(0, 10)))) if len(text) > 1 else []
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
    stream = reasoning_stream(GPTOSS)
    got = [stream.feed(p, final=k == len(pieces) - 1) for k, p in enumerate(pieces)] or [stream.feed("", True)]
    whole = split_reasoning(GPTOSS, text)
    assert ("".join(r for r, _ in got) or None, "".join(c for _, c in got) or None) == whole
    _, calls = tool_parser("openai").parse(whole[1] or "")
    for call in calls:          # whole calls only: a name, and arguments that are JSON
        assert call.name
        json.loads(call.arguments)
