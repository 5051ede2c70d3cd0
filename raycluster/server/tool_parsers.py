"""Parsers of the tool-call syntax models write on their own (`tool_choice: "auto"`), chosen by
name as vLLM's `--tool-call-parser`:
- `hermes` (Hermes, Qwen2 / Qwen2.5 / Qwen3): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`
  blocks, after optional text;
- `llama3_json` (Llama 3.1-3.3): the whole output is one or more JSON objects
  `{"name": ..., "parameters": {...}}` separated by `;`, optionally after `<|python_tag|>`;
- `mistral`: `[TOOL_CALLS]` then a JSON array of `{"name": ..., "arguments": {...}}`;
- `pythonic` (Llama 3.2, ToolACE, ...): a Python list of calls with keyword arguments,
  `[get_weather(city="Paris"), get_time(tz="UTC")]`, ending the output (after optional text without
  such a list); read with `ast` (never evaluated): arguments must be literals, a positional one is
  not a call;
- `llama4_pythonic` (Llama 4): `pythonic`'s list, bare or wrapped in `<|python_start|>` ...
  `<|python_end|>` (the end marker optional, only space after it);
- `qwen3_coder` (Qwen3-Coder): `<tool_call>` blocks of XML, `<function=NAME>` holding
  `<parameter=ARG>VALUE</parameter>` each; a value is a string unless the tool's schema types that
  parameter number / integer / boolean / object / array / null (then JSON, if it reads as JSON).
  Also bare `<function=NAME>...</function>` blocks without `<tool_call>`: the first begins a line
  (only spaces / tabs before it on the line) and they run, space between them, to the end;
- `deepseek_v3` (DeepSeek-V3 / R1): `<｜tool▁calls▁begin｜>`, then per call
  `<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME` and a ```json fenced arguments object before
  `<｜tool▁call▁end｜>`, then `<｜tool▁calls▁end｜>`;
- `openai` (gpt-oss, with the `openai_gptoss` reasoning parser, which passes each harmony message
  to a function on as `<|start|>assistant to=functions.NAME<|message|>ARGS<|call|>`): one call per
  such message, its arguments JSON.

A parser takes a choice's whole text and returns (content, calls): the text before the calls
(None when there is none) and each call's name and arguments (a JSON string). A text whose calls
do not parse is returned as content with no calls, as vLLM does. `start(text)` tells a stream
where tool calls begin (text before it can be sent as content), or that they may begin at the
end of the text so far (`held` characters must wait). `for_tools(parameters)` is the parser for a
request whose tools take those parameter schemas (only `qwen3_coder` reads them)."""

from __future__ import annotations

import ast
import json
import math
import re
from abc import ABC, abstractmethod
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


class ToolParser(ABC):
    """A syntax's parser: `_read(text)` finds the calls, `start` where a stream's calls begin."""
    name: str

    def parse(self, text: str) -> tuple[str | None, list[ParsedCall]]:
        try:
            found = self._read(text)
        except (ValueError, RecursionError):        # RecursionError: JSON nested too deep
            found = None
        if found is None or not found[1]:
            return text, []
        at, calls = found
        return text[:at] or None, calls

    @abstractmethod
    def _read(self, text: str) -> tuple[int, list[ParsedCall]] | None:
        """(where the calls begin, the calls), None when the text holds none; ValueError when
        what should be calls does not parse."""

    @abstractmethod
    def start(self, text: str) -> tuple[int | None, int]:
        """Where a stream's calls begin in `text` (None: not yet), and how many trailing
        characters to hold back because they may begin them."""

    def for_tools(self, parameters: dict[str, dict]) -> ToolParser:
        """This parser for a request whose tools take `parameters` (function name: its JSON
        schema); a syntax that writes typed arguments needs none of it."""
        return self


class MarkerParser(ToolParser):
    """A syntax whose calls begin at `MARK`, after optional text: `_calls(text, at)` reads those
    after the `MARK` at `at`."""
    MARK: str

    def _read(self, text: str) -> tuple[int, list[ParsedCall]] | None:
        at = text.find(self.MARK)
        return None if at < 0 else (at, self._calls(text, at))

    @abstractmethod
    def _calls(self, text: str, at: int) -> list[ParsedCall]:
        """The calls after the `MARK` at `at`; ValueError when they do not parse."""

    def start(self, text: str) -> tuple[int | None, int]:
        """Where `MARK` is, or how many trailing characters of `text` could be the start of it."""
        at = text.find(self.MARK)
        return (at, 0) if at >= 0 else (None, _partial(text, self.MARK))


def _partial(text: str, mark: str) -> int:
    """How many trailing characters of `text` could be the start of `mark` (a proper prefix)."""
    return next((k for k in range(min(len(mark) - 1, len(text)), 0, -1) if text.endswith(mark[:k])), 0)


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


class PythonicParser(ToolParser):
    name = "pythonic"
    _LIST = re.compile(r"\[\s*[A-Za-z_]\w*\(")          # where a list of calls may begin
    _BEGUN = re.compile(r"\[\s*(?:[A-Za-z_]\w*)?\Z")     # ... or may be beginning, at the end

    def _first(self, text: str) -> int | None:
        """Where the first list of calls may begin: the calls must run from there to the end,
        one parse (a later list would make it quadratic)."""
        m = self._LIST.search(text)
        return None if m is None else m.start()

    def _begin(self, text: str) -> int | None:
        """`_first`, or 0 when only space is before it."""
        at = self._first(text)
        return None if at is None else at if text[:at].strip() else 0

    def _read(self, text: str) -> tuple[int, list[ParsedCall]] | None:
        at = self._begin(text)
        return None if at is None else (at, self._calls(text[at:]))

    def _calls(self, source: str) -> list[ParsedCall]:
        """The calls `source` (from where they begin to the end) holds; ValueError if not calls."""
        return _python_calls(source)

    def _may_begin(self, text: str) -> int:
        """Where calls may be beginning at the end of `text` (len(text): nowhere)."""
        m = self._BEGUN.search(text)
        return m.start() if m else len(text)

    def start(self, text: str) -> tuple[int | None, int]:
        at = self._begin(text)
        if at is not None:
            return at, 0
        at = self._may_begin(text)
        return None, (len(text) - at if text[:at].strip() else len(text))   # leading space waits too


class Llama4PythonicParser(PythonicParser):
    """Llama 4's pythonic calls: `pythonic`'s list, bare or wrapped in `<|python_start|>` ...
    `<|python_end|>` (the end optional: it may be cut, or dropped as a special token). Calls
    begin at the first list or start marker; after the end marker only space may follow."""
    name = "llama4_pythonic"
    START, END = "<|python_start|>", "<|python_end|>"

    def _first(self, text: str) -> int | None:
        listed, mark = super()._first(text), text.find(self.START)
        return listed if mark < 0 or (listed is not None and listed < mark) else mark

    def _calls(self, source: str) -> list[ParsedCall]:
        source = source.strip()
        if source.startswith(self.START):
            source = source[len(self.START):].rstrip().removesuffix(self.END)
        return _python_calls(source)

    def _may_begin(self, text: str) -> int:
        return min(super()._may_begin(text), len(text) - _partial(text, self.START))


def _python_calls(source: str) -> list[ParsedCall]:
    try:
        tree = ast.parse(source.strip(), mode="eval").body
    except SyntaxError as e:
        raise ValueError("not Python") from e
    if not isinstance(tree, ast.List) or not tree.elts:
        raise ValueError("not a list of calls")
    calls = []
    for node in tree.elts:
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)) or node.args:
            raise ValueError("not a call by keywords")
        if any(k.arg is None for k in node.keywords):
            raise ValueError("**kwargs")
        calls.append(ParsedCall(node.func.id, _json({k.arg: _literal(k.value) for k in node.keywords})))
    return calls


_CONSTANTS = (str, int, float, bool, type(None))


def _literal(node: ast.expr):
    """A JSON value written as a Python literal (strings, numbers, True / False / None, lists,
    tuples, dicts with string keys)."""
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)) \
            and isinstance(node.operand, ast.Constant) and type(node.operand.value) in (int, float):
        value = node.operand.value
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.Constant) and isinstance(node.value, _CONSTANTS):
        if isinstance(node.value, float) and not math.isfinite(node.value):
            raise ValueError("not a JSON number")
        return node.value
    if isinstance(node, (ast.List, ast.Tuple)):
        return [_literal(e) for e in node.elts]
    if isinstance(node, ast.Dict) and all(isinstance(k, ast.Constant) and isinstance(k.value, str) for k in node.keys):
        return {k.value: _literal(v) for k, v in zip(node.keys, node.values)}
    raise ValueError("not a literal")


class Qwen3CoderParser(HermesParser):
    name = "qwen3_coder"
    _FUNCTION = re.compile(r"\s*<function=([^>\n]+)>(.*)</function>\s*", re.S)
    _PARAMETER = re.compile(r"\s*<parameter=([^>\n]+)>(.*?)</parameter>", re.S)
    TYPED = frozenset({"number", "integer", "boolean", "object", "array", "null"})     # JSON values; else strings

    # A bare call (no `<tool_call>` around it) begins at `<function=` starting a line (only spaces
    # or tabs before it on its line): in prose, mid-line, it stays text. Bare calls run to the end.
    _BARE = re.compile(r"^[ \t]*(<function=)", re.M)
    _BARE_CALL = re.compile(r"<function=[^>\n]+>.*?</function>", re.S)
    BARE = "<function="

    def __init__(self, parameters: dict[str, dict] | None = None) -> None:
        self.parameters = parameters or {}

    def for_tools(self, parameters: dict[str, dict]) -> ToolParser:
        return type(self)(parameters)

    def _bare(self, text: str) -> int | None:
        """Where the first bare call begins (None: nowhere)."""
        m = self._BARE.search(text)
        return None if m is None else m.start(1)

    def _read(self, text: str) -> tuple[int, list[ParsedCall]] | None:
        bare, wrapped = self._bare(text), text.find(self.MARK)
        if bare is None or 0 <= wrapped < bare:
            return super()._read(text)
        return bare, self._bare_calls(text, bare)

    def _bare_calls(self, text: str, at: int) -> list[ParsedCall]:
        """The `<function=...>` blocks from `at`, space between them, to the end of `text`."""
        calls = []
        while at < len(text):
            m = self._BARE_CALL.match(text, at)
            if m is None:
                raise ValueError("not a function")
            calls.append(self._block(m.group()))
            at = skip_space(text, m.end())
        return calls

    def start(self, text: str) -> tuple[int | None, int]:
        begin, held = super().start(text)
        bare = self._bare(text)
        if bare is not None and (begin is None or bare < begin):
            return bare, 0
        if begin is not None:
            return begin, 0
        line = text[text.rfind("\n") + 1:].lstrip(" \t")      # a bare call's start may be coming
        return None, max(held, len(line) if line and self.BARE.startswith(line) else 0)

    def _block(self, body: str) -> ParsedCall:
        m = self._FUNCTION.fullmatch(body)
        if m is None:
            raise ValueError("not a function")
        name, rest = m.group(1).strip(), m.group(2)
        schema = self.parameters.get(name)
        props = schema.get("properties") if isinstance(schema, dict) else None
        props = props if isinstance(props, dict) else {}
        args, i = {}, skip_space(rest, 0)
        while i < len(rest):
            p = self._PARAMETER.match(rest, i)
            if p is None or "<parameter=" in p.group(2):
                raise ValueError("not a parameter")
            key = p.group(1).strip()
            args[key] = self._value(p.group(2), props.get(key))
            i = skip_space(rest, p.end())
        return ParsedCall(name, _json(args))

    def _value(self, text: str, schema):
        """A parameter's value: its text without the newline after `>` and before `</`, as JSON
        when the schema types it so and it reads as JSON."""
        text = text.removeprefix("\n").removesuffix("\n")
        kinds = schema.get("type") if isinstance(schema, dict) else None
        kinds = {kinds} if isinstance(kinds, str) else set(kinds) if isinstance(kinds, list) else set()
        if kinds & self.TYPED and "string" not in kinds:
            try:
                return json.loads(text)
            except ValueError:
                pass
        return text


class DeepSeekV3Parser(MarkerParser):
    name = "deepseek_v3"
    MARK, END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
    _CALL = re.compile(r"\s*<｜tool▁call▁begin｜>[^<\n]*<｜tool▁sep｜>([^\n]+)\n```(?:json)?\n(.*?)\n```\s*"
                       r"<｜tool▁call▁end｜>", re.S)

    def _calls(self, text: str, at: int) -> list[ParsedCall]:
        """The calls after the begin marker, up to the end marker (or the end of the text)."""
        calls, i = [], at + len(self.MARK)
        while m := self._CALL.match(text, i):
            args = json.loads(m.group(2))
            if not isinstance(args, dict):
                raise ValueError("arguments are not an object")
            calls.append(ParsedCall(m.group(1).strip(), _json(args)))
            i = m.end()
        i = skip_space(text, i)
        if i < len(text) and not text.startswith(self.END, i):
            raise ValueError("not a call")
        return calls


class OpenAIParser(MarkerParser):
    name = "openai"
    MARK = "<|start|>assistant to=functions."
    _CALL = re.compile(r"\s*<\|start\|>assistant to=functions\.([^\s<]+)<\|message\|>(.*?)<\|call\|>", re.S)

    def _calls(self, text: str, at: int) -> list[ParsedCall]:
        calls, i = [], at
        while m := self._CALL.match(text, i):
            calls.append(ParsedCall(m.group(1), _json(json.loads(m.group(2)))))
            i = m.end()
        if text[i:].strip():
            raise ValueError("not a call")
        return calls


TOOL_PARSERS = {p.name: p for p in (HermesParser, Llama3JsonParser, MistralParser, PythonicParser,
                                    Llama4PythonicParser, Qwen3CoderParser, DeepSeekV3Parser, OpenAIParser)}


def tool_parser(name: str | None):
    """The parser called `name` (None: none configured)."""
    if name is None:
        return None
    if name not in TOOL_PARSERS:
        raise ValueError(f"unknown tool_call_parser {name!r}; choose from {', '.join(TOOL_PARSERS)}")
    return TOOL_PARSERS[name]()
