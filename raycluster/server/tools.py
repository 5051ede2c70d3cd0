"""Tool calling on chat completions: OpenAI's `tools` / `tool_choice`, served as vLLM serves them
without a tool-call parser.

A request's `tools` go to the chat template (as `tools`, for templates that render them) and its
`tool_choice` decides what the model may write:
- "none" (the default without tools): text, as any chat request;
- a named function (`{"type": "function", "function": {"name": ...}}`): the output is forced to
  JSON matching that function's `parameters` schema and returned as one tool call to it
  (finish_reason "stop", as OpenAI answers a forced call);
- "required": the output is forced to a JSON array of `{"name": ..., "parameters": {...}}`
  objects, one of the tools each (at most one with `parallel_tool_calls: false`), returned as
  tool calls (finish_reason "tool_calls").
Both forced modes ride on structured outputs (raycluster.server.structured): the regex of the
schema is the request's guided pattern. "auto" (the default with tools) needs a parser of the
model's own tool-call syntax: without one configured it is a 400 naming `tool_choice`, as vLLM
answers without --enable-auto-tool-choice.

Messages may carry earlier calls and their results: an assistant message's `tool_calls` (its
content may then be null) and `tool` messages with `tool_call_id`. For the template, each call's
`arguments` string is parsed into an object (what HF chat templates expect, as vLLM does).

With a tool-call parser configured (`tool_call_parser`: raycluster.server.tool_parsers),
"auto" lets the model answer in text or call tools in its own syntax, which is parsed into the
response's tool calls; without one, "auto" is refused as above.

`ToolCallOutput` turns one choice's generated text into the response's message / stream deltas.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from raycluster.engine.engine import InvalidRequestError
from raycluster.server.tool_parsers import skip_space


class FunctionDef(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: str = Field(..., pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None


class ToolDef(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["function"]
    function: FunctionDef


class FunctionName(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    type: Literal["function"]
    function: FunctionName


class CalledFunction(BaseModel):
    name: str
    arguments: str


class ToolCall(BaseModel):
    """A call in an assistant message of the conversation so far."""
    model_config = ConfigDict(extra="ignore")
    id: str
    type: Literal["function"] = "function"
    function: CalledFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice

# What an absent `parameters` means (OpenAI: a function that takes no arguments).
NO_PARAMETERS = {"type": "object", "properties": {}}


def tool_mode(body, parser=None) -> str | None:
    """"named" | "required" | "auto" | None (text: "none", or no tools); InvalidRequestError for a
    choice this server cannot serve ("auto" without a `parser`, raycluster.server.tool_parsers) or
    one that names no tool of the request."""
    choice, tools = getattr(body, "tool_choice", None), getattr(body, "tools", None) or []
    if choice is None:
        choice = "auto" if tools else "none"
    if choice == "none":
        return None
    if not tools:
        raise InvalidRequestError("tool_choice", f"{_label(choice)} needs `tools`")
    if choice == "auto":
        if parser is None:
            raise InvalidRequestError("tool_choice", "\"auto\" needs a parser of the model's tool-call syntax, and "
                                      "this server has none (tool_call_parser); use \"required\", a named function "
                                      "or \"none\"")
        return "auto"
    if choice == "required":
        return "required"
    if all(t.function.name != choice.function.name for t in tools):
        raise InvalidRequestError("tool_choice.function.name",
                                  f"{choice.function.name!r} is not one of the request's tools")
    return "named"


def _label(choice) -> str:
    return f"function {choice.function.name!r}" if isinstance(choice, NamedToolChoice) else json.dumps(choice)


def tool_schema(body, mode: str | None) -> tuple[str, dict] | None:
    """(field, JSON schema) the output must match for a forced tool call (`mode` named or
    required), or None."""
    if mode not in ("named", "required"):
        return None
    tools = body.tools
    if mode == "named":
        i, tool = next((i, t) for i, t in enumerate(tools) if t.function.name == body.tool_choice.function.name)
        return f"tools.{i}.function.parameters", tool.function.parameters or NO_PARAMETERS
    calls = [{"type": "object", "properties": {"name": {"type": "string", "enum": [t.function.name]},
                                               "parameters": t.function.parameters or NO_PARAMETERS},
              "required": ["name", "parameters"]} for t in tools]
    schema = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
    if body.parallel_tool_calls is False:
        schema["maxItems"] = 1
    return "tools", schema


def tool_parameters(body) -> dict[str, dict]:
    """Each tool's `parameters` schema by function name (what a parser of untyped arguments,
    e.g. qwen3_coder's, converts values by: `ToolParser.for_tools`)."""
    return {t.function.name: t.function.parameters or NO_PARAMETERS for t in body.tools or []}


def template_tools(body) -> list[dict] | None:
    return [t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None


def template_message(message) -> dict:
    """One request message as the chat template sees it: content text ("" when null), and for an
    assistant's calls their arguments as objects; a tool result keeps its `tool_call_id`."""
    out = {"role": message.role, "content": message.text()}
    if message.tool_calls:
        out["tool_calls"] = [{"id": c.id, "type": c.type,
                              "function": {"name": c.function.name, "arguments": _arguments(c.function.arguments)}}
                             for c in message.tool_calls]
    if message.tool_call_id is not None:
        out["tool_call_id"] = message.tool_call_id
    if message.name is not None:
        out["name"] = message.name
    return out


def _arguments(text: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text       # a template may still show it as written


@dataclass
class ArrayScan:
    """How far `array_items` has read a JSON array being written: `pos`, the index after the
    last whole element (after `[` before the first; 0 before that), and the elements so far."""
    pos: int = 0
    items: list = field(default_factory=list)
    closed: bool = False


def array_items(text: str, scan: ArrayScan | None = None) -> ArrayScan:
    """The complete elements of the JSON array `text` begins (a `required` answer being
    written) and whether the array is closed; elements other than objects with a string
    `name` end the scan. `scan`: the result for a prefix of `text`, read on from there (a
    stream scans each character once)."""
    scan = ArrayScan() if scan is None else scan
    dec, i = json.JSONDecoder(), scan.pos
    if i == 0:
        i = skip_space(text, 0)
        if not text.startswith("[", i):
            return scan
        scan.pos = i = i + 1
    while not scan.closed:
        i = skip_space(text, scan.pos)
        if text.startswith("]", i):
            scan.closed = True
            break
        if scan.items:
            if not text.startswith(",", i):
                break
            i = skip_space(text, i + 1)
        try:
            item, i = dec.raw_decode(text, i)
        except json.JSONDecodeError:
            break
        if not (isinstance(item, dict) and isinstance(item.get("name"), str)):
            break
        scan.items.append({"name": item["name"], "parameters": item.get("parameters", {})})
        scan.pos = i
    return scan


def new_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


class ToolCallOutput:
    """One choice's text as tool calls. `mode` "named" (the text is the function's arguments),
    "required" (a JSON array of {name, parameters}) or "auto" (text in the model's own syntax,
    read by `parser`, raycluster.server.tool_parsers; it may hold no call at all)."""

    def __init__(self, mode: str, function_name: str | None = None, parser=None) -> None:
        self.mode, self.function_name, self.parser = mode, function_name, parser
        self._text = ""             # the text so far (not a named call's: it is sent as it comes)
        self._scan = ArrayScan()    # required: how far the array has been read
        self._id = new_call_id()
        self._started = False
        self._sent = 0              # auto: characters already streamed as content
        self._in_calls = False      # auto: the calls have begun (the rest waits for the end)
        self._emitted = 0           # calls already streamed

    def parse(self, text: str) -> tuple[str | None, list[dict] | None]:
        """(content, calls) of the complete text; calls None when it holds none that parse (no
        call, for "auto"; for "required", an array cut before its first call was complete:
        a cut later keeps the calls written whole)."""
        if self.mode == "named":
            return None, [self._call(self._id, self.function_name, text)]
        if self.mode == "auto":
            content, calls = self.parser.parse(text)
            return (content, [self._call(new_call_id(), c.name, c.arguments) for c in calls]) if calls else (text, None)
        items = array_items(text).items
        if not items:
            return text, None
        return None, [self._call(new_call_id(), it["name"], json.dumps(it["parameters"], ensure_ascii=False))
                      for it in items]

    @staticmethod
    def _call(call_id: str, name: str, arguments: str) -> dict:
        return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}

    def finish_reason(self, reason: str | None, calls: bool = True) -> str | None:
        return "tool_calls" if calls and self.mode != "named" and reason == "stop" else reason

    def message(self, text: str, reason: str | None) -> tuple[dict, str | None]:
        """The response's message and finish_reason for the whole text."""
        content, calls = self.parse(text)
        if calls is None:       # no calls (or cut short): what was written, as text
            return {"role": "assistant", "content": text, "tool_calls": []}, reason
        return {"role": "assistant", "content": content, "tool_calls": calls}, self.finish_reason(reason)

    def delta(self, text: str, finished: bool, reason: str | None) -> tuple[dict, str | None]:
        """A stream chunk's delta and finish_reason for the next piece of text. A named call
        streams its arguments as they come (the first delta names the function); "required"
        sends each call once the array holds it whole; "auto" streams text as content until the
        model's tool-call syntax begins, and the calls at the end."""
        if self.mode == "named":
            call = {"index": 0, "function": {"arguments": text}}
            if not self._started:
                self._started = True
                call = {"index": 0, "id": self._id, "type": "function",
                        "function": {"name": self.function_name, "arguments": text}}
            return {"tool_calls": [call]}, self.finish_reason(reason)
        self._text += text
        whole = self._text
        if not finished and self.mode == "required":
            items = array_items(whole, self._scan).items
            calls = [self._call(new_call_id(), it["name"], json.dumps(it["parameters"], ensure_ascii=False))
                     for it in items[self._emitted:]]
            return self._calls_delta(calls), None
        if not finished:
            if self._in_calls:
                return {}, None
            begin, held = self.parser.start(whole)
            self._in_calls = begin is not None
            upto = begin if begin is not None else len(whole) - held
            piece, self._sent = whole[self._sent:upto], max(self._sent, upto)
            return ({"content": piece} if piece else {}), None
        content, calls = self.parse(whole)
        if calls is None:
            return {"content": whole[self._sent:]}, reason
        delta = self._calls_delta(calls[self._emitted:])
        rest = (content or "")[self._sent:]
        if rest:
            delta["content"] = rest
        return delta, self.finish_reason(reason)

    def _calls_delta(self, calls: list[dict]) -> dict:
        """A delta sending `calls`, numbered after the ones already sent."""
        if not calls:
            return {}
        first, self._emitted = self._emitted, self._emitted + len(calls)
        return {"tool_calls": [{"index": first + i, **c} for i, c in enumerate(calls)]}
