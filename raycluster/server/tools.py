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
model's own tool-call syntax, which this server does not have: it is a 400 naming `tool_choice`,
as vLLM answers without --enable-auto-tool-choice.

Messages may carry earlier calls and their results: an assistant message's `tool_calls` (its
content may then be null) and `tool` messages with `tool_call_id`. For the template, each call's
`arguments` string is parsed into an object (what HF chat templates expect, as vLLM does).

`ToolCallOutput` turns one choice's generated text into the response's message / stream deltas.
"""

from __future__ import annotations

import json
import uuid
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from raycluster.engine.engine import InvalidRequestError


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


def tool_mode(body) -> str | None:
    """"named" | "required" | None (text: "none", or no tools); InvalidRequestError for a choice
    this server cannot serve or one that names no tool of the request."""
    choice, tools = body.tool_choice, body.tools or []
    if choice is None:
        choice = "auto" if tools else "none"
    if choice == "none":
        return None
    if not tools:
        raise InvalidRequestError("tool_choice", f"{_label(choice)} needs `tools`")
    if choice == "auto":
        raise InvalidRequestError("tool_choice", "\"auto\" needs a parser of the model's own tool-call syntax, which "
                                  "this server does not have; use \"required\", a named function, or \"none\"")
    if choice == "required":
        return "required"
    if all(t.function.name != choice.function.name for t in tools):
        raise InvalidRequestError("tool_choice.function.name",
                                  f"{choice.function.name!r} is not one of the request's tools")
    return "named"


def _label(choice) -> str:
    return f"function {choice.function.name!r}" if isinstance(choice, NamedToolChoice) else json.dumps(choice)


def tool_schema(body) -> tuple[str, dict] | None:
    """(field, JSON schema) the output must match for a forced tool call, or None."""
    mode = tool_mode(body)
    if mode is None:
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


def new_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


class ToolCallOutput:
    """One choice's text as tool calls. `mode` "named" (the text is the function's arguments)
    or "required" (a JSON array of {name, parameters})."""

    def __init__(self, mode: str, function_name: str | None = None) -> None:
        self.mode, self.function_name = mode, function_name
        self._parts: list[str] = []
        self._id = new_call_id()
        self._started = False

    def calls(self, text: str) -> list[dict] | None:
        """The tool calls in the complete text; None when it is not (a length cut, for "required")."""
        if self.mode == "named":
            return [self._call(self._id, self.function_name, text)]
        try:
            items = json.loads(text)
        except json.JSONDecodeError:
            return None
        return [self._call(new_call_id(), it["name"], json.dumps(it["parameters"], ensure_ascii=False))
                for it in items]

    @staticmethod
    def _call(call_id: str, name: str, arguments: str) -> dict:
        return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}

    def finish_reason(self, reason: str | None) -> str | None:
        return "tool_calls" if self.mode == "required" and reason == "stop" else reason

    def message(self, text: str, reason: str | None) -> tuple[dict, str | None]:
        """The response's message and finish_reason for the whole text."""
        calls = self.calls(text)
        if calls is None:       # cut short: what was written, as text
            return {"role": "assistant", "content": text, "tool_calls": []}, reason
        return {"role": "assistant", "content": None, "tool_calls": calls}, self.finish_reason(reason)

    def delta(self, text: str, finished: bool, reason: str | None) -> tuple[dict, str | None]:
        """A stream chunk's delta and finish_reason for the next piece of text. A named call
        streams its arguments as they come (the first delta names the function); "required"
        calls are sent whole once the array is complete."""
        if self.mode == "named":
            call = {"index": 0, "function": {"arguments": text}}
            if not self._started:
                self._started = True
                call = {"index": 0, "id": self._id, "type": "function",
                        "function": {"name": self.function_name, "arguments": text}}
            return {"tool_calls": [call]}, self.finish_reason(reason)
        self._parts.append(text)
        if not finished:
            return {}, None
        whole = "".join(self._parts)
        calls = self.calls(whole)
        if calls is None:
            return {"content": whole}, reason
        return {"tool_calls": [{"index": i, **c} for i, c in enumerate(calls)]}, self.finish_reason(reason)
