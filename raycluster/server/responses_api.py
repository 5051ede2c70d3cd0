"""OpenAI's Responses API (`POST /v1/responses`, as vLLM serves it) over the chat route.

A request enters as a `ResponsesRequest`; `to_chat` turns it into the chat completion request it
means (instructions as the system message; input items as messages: text messages, earlier
`function_call`s as an assistant's tool calls, `function_call_output`s as tool messages;
function tools and tool_choice in chat's nested shape; `text.format` as `response_format`;
`max_output_tokens` as `max_tokens`; vLLM's sampling extras passed on). The chat handler runs it
(tokenizing, tools, reasoning parser, structured outputs, SLO fields, the cluster's router:
everything chat has), and its answer leaves reshaped: a JSON chat completion as one `response`
object (`response_from_chat`: reasoning, message and function_call output items), an SSE chat
stream as Responses' typed events (`ResponseEvents`: response.created, output_item.added,
output_text.delta, function_call_arguments.delta, ..., response.completed).

The routes (raycluster.server.responses_routes) store responses and continue them
(`previous_response_id`: `to_chat` takes the earlier turns' items as `context`) and run background
responses. Tools other than functions and file input are refused; `input_image` parts become the
chat's image_url parts.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any, AsyncIterator, Awaitable, Callable, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from raycluster.server.protocol import ChatCompletionRequest

# The chat request's names for the fields a Responses request spells differently.
_CHAT_TO_RESPONSES = {"max_tokens": "max_output_tokens", "messages": "input", "response_format": "text.format",
                      "reasoning_effort": "reasoning.effort"}
# Chat fields a Responses request may not set through vLLM's extra sampling parameters (its own
# fields, e.g. `tools`, reach chat translated instead).
_NOT_PASSED = {"messages", "n", "stream_options", "max_tokens", "max_completion_tokens", "response_format",
               "logprobs", "echo"}


class ResponsesInputError(ValueError):
    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


class TextFormat(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)
    type: Literal["text", "json_object", "json_schema"] = "text"
    name: str | None = None
    description: str | None = None
    schema_: dict | None = Field(None, alias="schema")
    strict: bool | None = None


class TextConfig(BaseModel):
    model_config = ConfigDict(extra="ignore")
    format: TextFormat = TextFormat()


class ResponsesRequest(BaseModel):
    # extra="allow": vLLM's sampling extras (top_k, min_p, seed, stop, priority, ...) pass to chat.
    model_config = ConfigDict(extra="allow")
    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = None
    top_p: float | None = None
    tools: list[dict[str, Any]] | None = Field(None, max_length=128)
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)
    include: list[str] | None = None
    stream: bool = False
    store: bool | None = None
    metadata: dict[str, str] | None = None
    reasoning: dict[str, Any] | None = None
    previous_response_id: str | None = None
    background: bool | None = None
    truncation: Literal["auto", "disabled"] | None = None
    user: str | None = None


def input_items(req: ResponsesRequest) -> list[dict[str, Any]]:
    """The request's input as items (a string is one user message)."""
    if isinstance(req.input, str):
        return [{"type": "message", "role": "user", "content": req.input}]
    return list(req.input)


# The id prefix of each kind of item an input may hold.
_ITEM_PREFIX = {"message": "msg", "function_call": "fc", "function_call_output": "fco", "reasoning": "rs"}


def with_ids(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`items` as a stored response lists them (GET .../input_items): each with an id (its own, or
    a new one), a message's string content as one text part."""
    out = []
    for item in items:
        kind = item.get("type", "message")
        new = {"id": item.get("id") or _new_id(_ITEM_PREFIX.get(kind, "item")), **item, "type": kind}
        if kind == "message":
            if isinstance(new.get("content"), str):
                part = "output_text" if new.get("role") == "assistant" else "input_text"
                new["content"] = [{"type": part, "text": new["content"]}]
            new.setdefault("status", "completed")
        out.append(new)
    return out


def to_chat(req: ResponsesRequest, context: list[dict[str, Any]] = ()) -> ChatCompletionRequest:
    """The chat completion request `req` means, continuing `context` (the items of the turns
    before it: a stored response's input and output, for `previous_response_id`; its
    instructions are not carried over, as OpenAI's are not); ResponsesInputError names the
    Responses field."""
    messages = [{"role": "system", "content": req.instructions}] if req.instructions else []
    messages += _messages(list(context), "context") + _messages(input_items(req))
    if not messages:
        raise ResponsesInputError("input", "must hold at least one message")
    chat: dict[str, Any] = {k: v for k, v in (req.model_extra or {}).items() if k not in _NOT_PASSED}
    chat.update(model=req.model, messages=messages, stream=req.stream, max_tokens=req.max_output_tokens)
    if req.stream:
        chat["stream_options"] = {"include_usage": True}
    for field in ("temperature", "top_p", "parallel_tool_calls"):
        if getattr(req, field) is not None:
            chat[field] = getattr(req, field)
    if req.tools:
        chat["tools"] = [_tool(t, i) for i, t in enumerate(req.tools)]
    if req.tool_choice is not None:
        chat["tool_choice"] = _tool_choice(req.tool_choice)
    if req.reasoning and req.reasoning.get("effort") is not None:     # the chat's reasoning_effort
        chat["reasoning_effort"] = req.reasoning["effort"]
    fmt = req.text.format if req.text is not None else None
    if fmt is not None and fmt.type == "json_schema":
        if fmt.schema_ is None:
            raise ResponsesInputError("text.format.schema", "is required for type json_schema")
        chat["response_format"] = {"type": "json_schema", "json_schema": {
            "name": fmt.name, "description": fmt.description, "schema": fmt.schema_, "strict": fmt.strict}}
    elif fmt is not None and fmt.type == "json_object":
        chat["response_format"] = {"type": "json_object"}
    if req.top_logprobs is not None or "message.output_text.logprobs" in (req.include or ()):
        chat.update(logprobs=True, top_logprobs=req.top_logprobs or 0)
    try:
        return ChatCompletionRequest.model_validate(chat)
    except ValidationError as e:
        err = e.errors()[0]
        loc = [str(p) for p in err.get("loc", ())]
        if loc:
            loc[0] = _CHAT_TO_RESPONSES.get(loc[0], loc[0])
        field = ".".join(loc) or "input"
        raise ResponsesInputError(field, str(err.get("msg")).removeprefix("Value error, ")) from None


def _messages(items: list[dict[str, Any]], where: str = "input") -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise ResponsesInputError(f"{where}.{i}.role", f"must be user, system, developer or assistant, got {role!r}")
            out.append({"role": role, "content": _content(item.get("content"), f"{where}.{i}.content")})
        elif kind == "function_call":
            for key in ("call_id", "name", "arguments"):
                if not isinstance(item.get(key), str):
                    raise ResponsesInputError(f"{where}.{i}.{key}", "must be a string")
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}
            # Calls in a row are one assistant turn (as chat holds parallel calls).
            if out and out[-1]["role"] == "assistant" and out[-1].get("tool_calls") is not None:
                out[-1]["tool_calls"].append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            if not isinstance(item.get("call_id"), str):
                raise ResponsesInputError(f"{where}.{i}.call_id", "must be a string")
            if not isinstance(output, str):
                output = _text(output, f"{where}.{i}.output")
            out.append({"role": "tool", "tool_call_id": item["call_id"], "content": output})
        elif kind == "reasoning":
            continue        # a model's earlier thinking is not fed back (as chat templates drop it)
        else:
            raise ResponsesInputError(f"{where}.{i}.type", f"{kind!r} is not supported (message, function_call, "
                                      "function_call_output or reasoning)")
    return out


def _content(content: Any, field: str) -> str | list[dict[str, Any]]:
    """A message's content as the chat request takes it: its text, or with `input_image` parts
    (an image URL: data: or http(s)) a list of chat text and image_url parts in order."""
    if not isinstance(content, list) or not any(isinstance(p, dict) and p.get("type") == "input_image"
                                                for p in content):
        return _text(content, field)
    parts = []
    for j, part in enumerate(content):
        if isinstance(part, dict) and part.get("type") == "input_image":
            if not isinstance(part.get("image_url"), str):
                raise ResponsesInputError(f"{field}.{j}.image_url", "must be a data: or http(s) URL "
                                          "(file_id images are not supported)")
            parts.append({"type": "image_url", "image_url": {"url": part["image_url"]}})
        else:
            parts.append({"type": "text", "text": _text([part], f"{field}.{j}")})
    return parts


def _text(content: Any, field: str) -> str:
    """A message's content as one string: a string, or a list of text parts."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ResponsesInputError(field, "must be a string or a list of text parts")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in ("input_text", "output_text", "text") or not isinstance(part.get("text"), str):
            raise ResponsesInputError(f"{field}.{j}", f"only text parts are supported, got {kind!r}")
        texts.append(part["text"])
    return "".join(texts)


def _tool(tool: dict[str, Any], i: int) -> dict[str, Any]:
    if tool.get("type") != "function":
        raise ResponsesInputError(f"tools.{i}.type", f"only function tools are supported, got {tool.get('type')!r}")
    fn = {k: tool[k] for k in ("name", "description", "parameters", "strict") if tool.get(k) is not None}
    return {"type": "function", "function": fn}


def _tool_choice(choice: str | dict[str, Any]) -> str | dict[str, Any]:
    if isinstance(choice, str):
        return choice
    if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
        raise ResponsesInputError("tool_choice", "must be none, auto, required or {\"type\": \"function\", \"name\": ...}")
    return {"type": "function", "function": {"name": choice["name"]}}


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def response_shell(req: ResponsesRequest, model: str, response_id: str, created: int,
                   stored: bool = False) -> dict[str, Any]:
    """The response object without output, status or usage: what the request asked for, echoed
    (`stored`: whether it will be kept for GET and `previous_response_id`)."""
    fmt = req.text.format.model_dump(by_alias=True, exclude_none=True) if req.text else {"type": "text"}
    return {"id": response_id, "object": "response", "created_at": created, "model": model,
            "status": "in_progress", "error": None, "incomplete_details": None, "instructions": req.instructions,
            "max_output_tokens": req.max_output_tokens, "metadata": req.metadata or {}, "output": [],
            "parallel_tool_calls": req.parallel_tool_calls is not False,
            "previous_response_id": req.previous_response_id, "reasoning": req.reasoning, "store": stored,
            "background": bool(req.background),
            "temperature": 1.0 if req.temperature is None else req.temperature,
            "text": {"format": fmt}, "tool_choice": req.tool_choice or "auto", "tools": req.tools or [],
            "top_p": 1.0 if req.top_p is None else req.top_p, "truncation": req.truncation or "disabled",
            "usage": None, "user": req.user}


def finish(shell: dict[str, Any], output: list[dict], finish_reason: str | None, usage: dict | None) -> dict:
    """`shell` completed: its output items, status from the chat finish reason, usage."""
    out = dict(shell, output=output)
    if finish_reason in ("stop", "tool_calls", None):
        out["status"] = "completed"
    else:
        out["status"] = "incomplete"
        out["incomplete_details"] = {"reason": "max_output_tokens" if finish_reason == "length" else finish_reason}
    if usage is not None:
        # cache_write_tokens: not counted here (the prefix cache keeps every full prompt block).
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
        out["usage"] = {"input_tokens": usage["prompt_tokens"],
                        "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
                        "output_tokens": usage["completion_tokens"],
                        "output_tokens_details": {"reasoning_tokens": 0},
                        "total_tokens": usage["total_tokens"]}
    return out


def response_from_chat(shell: dict[str, Any], completion: dict[str, Any]) -> dict[str, Any]:
    """A JSON chat completion (one choice) as the response object."""
    choice = completion["choices"][0]
    message = choice["message"]
    output = []
    if message.get("reasoning_content"):
        output.append(_reasoning_item(_new_id("rs"), message["reasoning_content"]))
    calls = message.get("tool_calls") or []
    if message.get("content") or not calls:
        lps = (choice.get("logprobs") or {}).get("content")
        output.append(_message_item(_new_id("msg"), message.get("content") or "", "completed", lps))
    for call in calls:
        output.append(_call_item(_new_id("fc"), call["id"], call["function"]["name"],
                                 call["function"]["arguments"], "completed"))
    return finish(shell, output, choice.get("finish_reason"), completion.get("usage"))


def _reasoning_item(item_id: str, text: str, status: str = "completed") -> dict:
    return {"type": "reasoning", "id": item_id, "summary": [], "status": status,
            "content": [{"type": "reasoning_text", "text": text}]}


def _text_part(text: str, logprobs: list | None = None) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}


def _message_item(item_id: str, text: str, status: str, logprobs: list | None = None) -> dict:
    return {"type": "message", "id": item_id, "role": "assistant", "status": status,
            "content": [_text_part(text, logprobs)] if status != "in_progress" else []}


def _call_item(item_id: str, call_id: str, name: str, arguments: str, status: str) -> dict:
    return {"type": "function_call", "id": item_id, "call_id": call_id, "name": name, "arguments": arguments,
            "status": status}


class ResponseEvents:
    """Turns a chat completion's SSE chunks (one choice, usage in the last) into the Responses
    API's events. Items open as their first delta arrives (reasoning, then the message text or
    each tool call) and close, in order, when another opens or the stream ends."""

    def __init__(self, shell: dict[str, Any]) -> None:
        self.shell = shell
        self.seq = 0
        self.output: list[dict] = []
        self.open: dict | None = None      # the item receiving deltas
        self.text = ""                     # the open item's text (or arguments) so far
        self.logprobs: list = []
        self.calls: dict[int, dict] = {}   # chat tool-call index -> its item
        self.finish_reason: str | None = None
        self.usage: dict | None = None
        self.final: dict | None = None     # the completed response object, once `end` ran

    def _event(self, kind: str, **fields) -> str:
        data = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return f"event: {kind}\ndata: {json.dumps(data)}\n\n"

    def start(self) -> list[str]:
        return [self._event("response.created", response=self.shell),
                self._event("response.in_progress", response=self.shell)]

    def _open(self, item: dict) -> list[str]:
        events = self._close()
        self.open, self.text, self.logprobs = item, "", []
        self.output.append(item)
        index = len(self.output) - 1
        events.append(self._event("response.output_item.added", output_index=index, item=dict(item)))
        if item["type"] == "message":
            events.append(self._event("response.content_part.added", item_id=item["id"], output_index=index,
                                      content_index=0, part=_text_part("")))
        return events

    def _close(self) -> list[str]:
        item, index = self.open, len(self.output) - 1
        if item is None:
            return []
        self.open = None
        ids = {"item_id": item["id"], "output_index": index}
        if item["type"] == "reasoning":
            item.update(_reasoning_item(item["id"], self.text))
            events = [self._event("response.reasoning_text.done", content_index=0, text=self.text, **ids)]
        elif item["type"] == "message":
            item.update(_message_item(item["id"], self.text, "completed", self.logprobs))
            events = [self._event("response.output_text.done", content_index=0, text=self.text,
                                  logprobs=self.logprobs, **ids),
                      self._event("response.content_part.done", content_index=0, part=item["content"][0], **ids)]
        else:
            item.update(arguments=self.text, status="completed")
            events = [self._event("response.function_call_arguments.done", arguments=self.text, **ids)]
        events.append(self._event("response.output_item.done", output_index=index, item=item))
        return events

    def feed(self, chunk: dict[str, Any]) -> list[str]:
        """Events for one parsed chat chunk."""
        if chunk.get("usage"):
            self.usage = chunk["usage"]
        events: list[str] = []
        for choice in chunk.get("choices", ()):
            delta = choice.get("delta") or {}
            if delta.get("reasoning_content"):
                if self.open is None or self.open["type"] != "reasoning":
                    events += self._open(_reasoning_item(_new_id("rs"), "", "in_progress"))
                events += self._delta("response.reasoning_text.delta", delta["reasoning_content"], content_index=0)
            if delta.get("content"):
                if self.open is None or self.open["type"] != "message":
                    events += self._open(_message_item(_new_id("msg"), "", "in_progress"))
                lps = (choice.get("logprobs") or {}).get("content") or []
                self.logprobs += lps
                events += self._delta("response.output_text.delta", delta["content"], content_index=0, logprobs=lps)
            for call in delta.get("tool_calls") or ():
                item = self.calls.get(call.get("index", 0))
                fn = call.get("function") or {}
                if item is None:
                    item = _call_item(_new_id("fc"), call.get("id") or _new_id("call"), fn.get("name") or "", "",
                                      "in_progress")
                    self.calls[call.get("index", 0)] = item
                    events += self._open(item)
                if fn.get("arguments"):
                    events += self._delta("response.function_call_arguments.delta", fn["arguments"])
            if choice.get("finish_reason") is not None:
                self.finish_reason = choice["finish_reason"]
        return events

    def _delta(self, kind: str, text: str, **fields) -> list[str]:
        self.text += text
        return [self._event(kind, item_id=self.open["id"], output_index=len(self.output) - 1, delta=text, **fields)]

    def end(self) -> list[str]:
        events = self._close()
        if not self.output:             # nothing generated: still one (empty) message, as non-streamed
            events += self._open(_message_item(_new_id("msg"), "", "in_progress")) + self._close()
        self.final = finish(self.shell, self.output, self.finish_reason, self.usage)
        kind = "response.completed" if self.final["status"] == "completed" else "response.incomplete"
        return events + [self._event(kind, response=self.final)]


async def response_events(chat_sse: AsyncIterator, shell: dict[str, Any],
                          on_done: Callable[[dict], Awaitable[None]] | None = None) -> AsyncIterator[str]:
    """The Responses events of a chat completion's SSE stream (its `data:` lines); `on_done` gets
    the final response object once the chat stream has ended whole, before its last events go out."""
    events = ResponseEvents(shell)
    for e in events.start():
        yield e
    try:
        async for raw in chat_sse:
            text = raw.decode() if isinstance(raw, bytes) else raw
            for line in text.splitlines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                for e in events.feed(json.loads(line[len("data: "):])):
                    yield e
    finally:
        await chat_sse.aclose()
    last = events.end()
    if on_done is not None:         # before the client hears it ended (it may fetch it at once)
        await on_done(events.final)
    for e in last:
        yield e


def created_now() -> int:
    return int(time.time())
