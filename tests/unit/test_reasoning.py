"""Reasoning parsers: a whole output splits as vLLM's deepseek_r1 / qwen3 parsers split it, and
the same text fed in any pieces (tags cut anywhere) gives the same parts, with no piece of a tag
ever emitted."""

import random

import pytest

from raycluster.server.reasoning import REASONING_PARSERS, ReasoningStream, split_reasoning

R1, QWEN3 = REASONING_PARSERS["deepseek_r1"], REASONING_PARSERS["qwen3"]


@pytest.mark.parametrize("fmt, text, want", [
    (R1, "let me think</think>\n\nThe answer is 4.", ("let me think", "\n\nThe answer is 4.")),
    (R1, "<think>let me think</think>4", ("let me think", "4")),
    (R1, "still thinking", ("still thinking", None)),
    (R1, "done</think>", ("done", None)),
    (QWEN3, "<think>hmm</think>yes", ("hmm", "yes")),
    (QWEN3, "no thinking here", (None, "no thinking here")),
    (QWEN3, "a <think>b</think> c", (None, "a <think>b</think> c")),
    (QWEN3, "<thin", (None, "<thin")),
    (QWEN3, "", (None, None)),
])
def test_whole_outputs_split_as_vllm(fmt, text, want):
    assert split_reasoning(fmt, text) == want


@pytest.mark.parametrize("fmt", [R1, QWEN3])
@pytest.mark.parametrize("seed", range(20))
def test_any_pieces_give_the_same_split_and_no_tag_leaks(fmt, seed):
    rng = random.Random(seed)
    text = rng.choice(["<think>", ""]) + "x<y</thin>" * rng.randint(0, 2) + "</think>" * rng.randint(0, 2) + "<ans>"
    cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(0, 6)))) if len(text) > 1 else []
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
    stream = ReasoningStream(fmt)
    got = [stream.feed(p, final=k == len(pieces) - 1) for k, p in enumerate(pieces)] or [stream.feed("", True)]
    reasoning, content = "".join(r for r, _ in got), "".join(c for _, c in got)
    assert (reasoning or None, content or None) == split_reasoning(fmt, text)
    for r, _ in got[:-1]:      # before the end, a reasoning delta never ends in a cut closing tag
        assert not any(r.endswith("</think>"[:n]) for n in range(1, 8)), (pieces, got)
