"""Parsers of the tool-call syntax models write on their own (`tool_choice: "auto"`), chosen by
name as vLLM's `--tool-call-parser`:
- `hermes` (Hermes, Qwen2 / Qwen2.5 / Qwen3): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`
  blocks, after optional text;
- `llama3_json` (Llama 3.1-3.3): the whole output is one or more JSON objects
  `{"name": ..., "parameters": {...}}` separated by `;`, optionally after `<|python_tag|>`;
- `mistral`: `[TOOL_CALLS]` then a JSON array of `{"name": ..., "arguments": {...}}`.

A parser takes a choice's whole text and returns (content, calls): the text before the calls
(None when there is none) and each call's name and arguments (a JSON string). A text whose calls
do not parse is returned as content with no calls, as vLLM does. `start(text)` tells a stream
where tool calls begin (text before it can be sent as content), or that they may begin at the
end of the text so far (`held` characters must wait)."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass


@dataclass
class ParsedCall:
    name: str
    arguments: str      # JSON text


def _json(value) -> str:
    return json.dumps(value, ensure_ascii=False)


def _call(obj, args_key: str) -> ParsedCall:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        raise ValueError("not a call")
    args = obj.get(args_key, obj.get("arguments", {}))
    return ParsedCall(obj["name"], args if isinstance(args, str) else _json(args))


def skip_space(text: str, i: int) -> int:
    while i < len(text) and text[i].isspace():
        i += 1
    return i


class ToolParser:
    """A syntax's parser: `_read(text)` finds the calls, `start` where a stream's calls begin."""
    name: str

    def parse(self, text: str) -> tuple[str | None, list[ParsedCall]]:
        try:
            found = self._read(text)
        except ValueError:
            found = None
        if found is None or not found[1]:
            return text, []
        at, calls = found
        return text[:at] or None, calls

    def _read(self, text: str) -> tuple[int, list[ParsedCall]] | None:
        """(where the calls begin, the calls), None when the text holds none; ValueError when
        what should be calls does not parse."""
        raise NotImplementedError

    def start(self, text: str) -> tuple[int | None, int]:
        raise NotImplementedError


class MarkerParser(ToolParser):
    """A syntax whose calls begin at `MARK`, after optional text: `_calls(text, at)` reads those
    after the `MARK` at `at`."""
    MARK: str

    def _read(self, text: str) -> tuple[int, list[ParsedCall]] | None:
        at = text.find(self.MARK)
        return None if at < 0 else (at, self._calls(text, at))

    def _calls(self, text: str, at: int) -> list[ParsedCall]:
        raise NotImplementedError

    def start(self, text: str) -> tuple[int | None, int]:
        """Where `MARK` is, or how many trailing characters of `text` could be the start of it."""
        at = text.find(self.MARK)
        if at >= 0:
            return at, 0
        mark = self.MARK
        return None, next((k for k in range(min(len(mark) - 1, len(text)), 0, -1) if text.endswith(mark[:k])), 0)


class HermesParser(MarkerParser):
    name = "hermes"
    MARK = "<tool_call>"
    _BLOCK = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.S)

    def _calls(self, text: str, at: int) -> list[ParsedCall]:
        return [self._block(m.group(1)) for m in self._BLOCK.finditer(text, at)]

    def _block(self, body: str) -> ParsedCall:
        """The call one `<tool_call>` block holds."""
        return _call(json.loads(body.strip()), "arguments")


class Llama3JsonParser(ToolParser):
    name = "llama3_json"
    TAG = "<|python_tag|>"

    def _read(self, text: str) -> tuple[int, list[ParsedCall]] | None:
        body = text.strip()
        body = body[len(self.TAG):].lstrip() if body.startswith(self.TAG) else body
        if not body.startswith("{"):
            return None
        calls, dec, i = [], json.JSONDecoder(), 0
        while True:
            obj, i = dec.raw_decode(body, i)
            calls.append(_call(obj, "parameters"))
            i = skip_space(body, i)
            if i == len(body):
                break
            if body[i] != ";":
                raise ValueError("text after a call")
            i = skip_space(body, i + 1)
            if i == len(body):
                break
        return 0, calls

    def start(self, text: str) -> tuple[int | None, int]:
        body = text.lstrip()
        if not body:
            return None, len(text)          # only whitespace so far: a call may still begin
        if body.startswith("{") or body.startswith(self.TAG):
            return 0, 0
        if self.TAG.startswith(body):
            return None, len(text)
        return None, 0                       # text: it stays text to the end


class MistralParser(MarkerParser):
    name = "mistral"
    MARK = "[TOOL_CALLS]"

    def _calls(self, text: str, at: int) -> list[ParsedCall]:
        items = json.loads(text[at + len(self.MARK):].strip())
        return [_call(obj, "arguments") for obj in (items if isinstance(items, list) else [items])]


TOOL_PARSERS = {p.name: p for p in (HermesParser, Llama3JsonParser, MistralParser)}


def tool_parser(name: str | None):
    """The parser called `name` (None: none configured)."""
    if name is None:
        return None
    if name not in TOOL_PARSERS:
        raise ValueError(f"unknown tool_call_parser {name!r}; choose from {', '.join(TOOL_PARSERS)}")
    return TOOL_PARSERS[name]()
