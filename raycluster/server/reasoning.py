"""Reasoning parsers (vLLM's `--reasoning-parser`): a reasoning model's chat output split into
`reasoning_content` (its thinking, between `<think>` and `</think>`) and `content` (the answer).

Text deltas enter `ReasoningStream.feed`; (reasoning, content) deltas leave. A tag split over
two deltas is held back until it is whole, so a client never sees part of one. Parsers by name:
- `deepseek_r1`: the chat template opens `<think>` in the prompt, so the output starts inside
  the reasoning (a `<think>` that still opens it is dropped); everything up to `</think>` is
  reasoning, the rest content. As vLLM's.
- `qwen3`: the output is reasoning only if it opens with `<think>`; otherwise (e.g. Qwen3 with
  `chat_template_kwargs: {"enable_thinking": false}`) all of it is content.
- `openai_gptoss` (gpt-oss): its harmony channels (raycluster.server.harmony): the output is read
  with its special tokens (`keeps_special_tokens`), analysis as reasoning, final as content, calls
  to functions passed on in the content for the `openai` tool parser.
A whole text splits as its deltas do (`split_reasoning`; `reasoning_stream` makes a parser's
stream), so streamed and non-streamed responses agree. (vLLM's qwen3 parser calls an output that opens `<think>` but never closes it content
when not streamed; here it is reasoning either way.)
"""

from __future__ import annotations

from dataclasses import dataclass

from raycluster.server.harmony import HarmonyStream

START, END = "<think>", "</think>"


@dataclass(frozen=True)
class ReasoningFormat:
    opened_by_prompt: bool      # the output starts inside the reasoning (the template opened it)
    harmony: bool = False       # gpt-oss's channels, not <think> tags

    @property
    def keeps_special_tokens(self) -> bool:
        """Whether the parser reads the output's special tokens (its markers are special tokens)."""
        return self.harmony


REASONING_PARSERS = {"deepseek_r1": ReasoningFormat(opened_by_prompt=True),
                     "qwen3": ReasoningFormat(opened_by_prompt=False),
                     "openai_gptoss": ReasoningFormat(opened_by_prompt=False, harmony=True)}


def reasoning_stream(fmt: ReasoningFormat) -> "ReasoningStream | HarmonyStream":
    """A fresh stream of the parser `fmt` for one choice's output."""
    return HarmonyStream() if fmt.harmony else ReasoningStream(fmt)


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of `text` that begins `tag` (a tag that may be cut)."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


class ReasoningStream:
    def __init__(self, fmt: ReasoningFormat) -> None:
        self._state = "reasoning" if fmt.opened_by_prompt else "undecided"
        self._at_start = True       # the output may open with START (dropped)
        self._buf = ""

    def feed(self, text: str, final: bool = False) -> tuple[str, str]:
        """(reasoning, content) to emit for the next piece of text; `final`: the output ended,
        release whatever was held back."""
        self._buf += text
        reasoning, content = [], []
        while True:
            if self._state == "content":
                content.append(self._buf)
                self._buf = ""
                break
            if self._at_start:
                if self._buf.startswith(START):
                    self._buf, self._at_start, self._state = self._buf[len(START):], False, "reasoning"
                    continue
                if START.startswith(self._buf) and not final:
                    break               # may still become START
                self._at_start = False
                if self._state == "undecided":
                    self._state = "content"
                    continue
            at = self._buf.find(END)
            if at >= 0:
                reasoning.append(self._buf[:at])
                self._buf, self._state = self._buf[at + len(END):], "content"
                continue
            keep = 0 if final else _partial_suffix(self._buf, END)
            reasoning.append(self._buf[:len(self._buf) - keep])
            self._buf = self._buf[len(self._buf) - keep:]
            break
        return "".join(reasoning), "".join(content)


def split_reasoning(fmt: ReasoningFormat, text: str) -> tuple[str | None, str | None]:
    """(reasoning_content, content) of a whole output; None for a part that is empty."""
    reasoning, content = reasoning_stream(fmt).feed(text, final=True)
    return reasoning or None, content or None
