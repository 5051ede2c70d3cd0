"""gpt-oss's output in OpenAI's harmony format, split as vLLM's `openai_gptoss` reasoning parser
splits it: the `analysis` channel is reasoning, the `final` channel (and `commentary` without a
recipient: a preamble the user sees) is content, and a message to a function (`to=functions.NAME`)
is a tool call, passed on in the content as `<|start|>assistant to=functions.NAME<|message|>ARGS
<|call|>` for the `openai` tool parser (raycluster.server.tool_parsers) to read. Messages to the
built-in tools (browser, python) belong to the reasoning.

The output (decoded with its special tokens) is a run of messages: a header (channel, recipient,
content type) up to `<|message|>`, the body up to `<|end|>`, `<|call|>` or `<|return|>`, then
`<|start|>` and the next header. The chat template opens the first message (`<|start|>assistant`),
so the output begins at its header; an output that does not begin with one (e.g. constrained to a
JSON schema) is all content. Text deltas enter `HarmonyStream.feed`; (reasoning, content) deltas
leave, a marker cut between deltas held back until it is whole.
"""

from __future__ import annotations

import re

START, MESSAGE = "<|start|>", "<|message|>"
ENDS = ("<|end|>", "<|call|>", "<|return|>")
_HEADER_OPENINGS = ("<|channel|>", " to=", "<|constrain|>")
_CHANNEL = re.compile(r"<\|channel\|>\s*([A-Za-z_]+)")
_RECIPIENT = re.compile(r"\bto=([^\s<]+)")


def _partial(text: str, marks: tuple[str, ...]) -> int:
    """How many trailing characters of `text` may begin one of `marks`."""
    return max((k for mark in marks for k in range(min(len(mark) - 1, len(text)), 0, -1)
                if text.endswith(mark[:k])), default=0)


class HarmonyStream:
    def __init__(self) -> None:
        self._state = "begin"       # begin | header | body | between | plain
        self._route = "content"     # where the current body goes: reasoning | content | call
        self._buf = ""

    def feed(self, text: str, final: bool = False) -> tuple[str, str]:
        """(reasoning, content) to emit for the next piece of text; `final`: the output ended."""
        self._buf += text
        out = {"reasoning": [], "content": []}
        while self._step(out, final):
            pass
        return "".join(out["reasoning"]), "".join(out["content"])

    def _step(self, out: dict, final: bool) -> bool:
        """Consume what the state can; True if it moved on and there may be more to do."""
        buf = self._buf
        if self._state == "begin":
            if not buf:
                return False
            if buf.startswith(_HEADER_OPENINGS):
                self._state = "header"
            elif not final and any(m.startswith(buf) for m in _HEADER_OPENINGS):
                return False            # may still open a header
            else:
                self._state = "plain"
            return True
        if self._state == "plain":
            out["content"].append(buf)
            self._buf = ""
            return False
        if self._state == "between":
            if buf.startswith(START):
                self._buf, self._state = buf[len(START):], "header"
                return True
            if not buf or (not final and START.startswith(buf)):
                return False
            self._state = "header"      # no <|start|>: read on as a header anyway
            return True
        if self._state == "header":
            at = buf.find(MESSAGE)
            if at < 0:
                if final:
                    self._buf = ""      # a header cut off by the end: nothing to say
                return False
            self._open(buf[:at], out)
            self._buf, self._state = buf[at + len(MESSAGE):], "body"
            return True
        # body
        ends = [(buf.find(m), m) for m in ENDS if m in buf]
        if ends:
            at, mark = min(ends)
            self._emit(buf[:at], out)
            if self._route == "call":
                out["content"].append("<|call|>")
            self._buf, self._state = buf[at + len(mark):], "between"
            return True
        keep = 0 if final else _partial(buf, ENDS)
        self._emit(buf[:len(buf) - keep], out)
        if final and self._route == "call":
            out["content"].append("<|call|>")
        self._buf = buf[len(buf) - keep:]
        return False

    def _open(self, header: str, out: dict) -> None:
        """Route the body of the message `header` describes."""
        channel = _CHANNEL.search(header)
        recipient = _RECIPIENT.search(header)
        if recipient is not None and recipient.group(1).startswith("functions."):
            self._route = "call"
            out["content"].append(f"<|start|>assistant to={recipient.group(1)}{MESSAGE}")
        elif recipient is not None or (channel is not None and channel.group(1) == "analysis"):
            self._route = "reasoning"
        else:
            self._route = "content"     # final, a preamble on commentary, or no channel at all

    def _emit(self, text: str, out: dict) -> None:
        if text:
            out["reasoning" if self._route == "reasoning" else "content"].append(text)
