"""The Responses API's translation layer (raycluster.server.responses_api), exactly: a request
into the chat request it means, a chat completion into the response object, and a chat SSE
stream (reasoning, text, parallel tool calls, usage) into the typed events, validated by the
`openai` client's own event and response models. Over real HTTP: tests/e2e/test_responses_http.py."""

from __future__ import annotations

import asyncio
import json

import pytest
from pydantic import TypeAdapter

from raycluster.server.responses_api import (ResponseEvents, ResponsesInputError, ResponsesRequest, response_events,
                                             response_from_chat, response_shell, to_chat)


def _req(**body) -> ResponsesRequest:
    return ResponsesRequest.model_validate({"model": "tiny", **body})


def test_input_items_become_the_chat_messages_they_mean():
    chat = to_chat(_req(instructions="Be brief.", max_output_tokens=20, temperature=0, top_k=5, seed=3, n=4, input=[
        {"role": "user", "content": "weather?"},
        {"type": "reasoning", "id": "rs_1", "summary": []},
        {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "{\"city\": \"Paris\"}"},
        {"type": "function_call", "call_id": "c2", "name": "get_weather", "arguments": "{\"city\": \"Rome\"}"},
        {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
        {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "rain"}]},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "and "},
                                                        {"type": "input_text", "text": "tomorrow?"}]}]))
    assert [m.model_dump(exclude_none=True) for m in chat.messages] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}},
            {"id": "c2", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Rome\"}"}}]},
        {"role": "tool", "content": "sunny", "tool_call_id": "c1"},
        {"role": "tool", "content": "rain", "tool_call_id": "c2"},
        {"role": "user", "content": "and tomorrow?"}]
    # vLLM's sampling extras pass; `n` does not (a response has one output).
    assert (chat.max_tokens, chat.temperature, chat.top_k, chat.seed, chat.n) == (20, 0.0, 5, 3, 1)
    assert not chat.stream and chat.stream_options is None


def test_tools_formats_and_logprobs_take_chats_shapes():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    chat = to_chat(_req(input="hi", stream=True, tool_choice={"type": "function", "name": "f"},
                        tools=[{"type": "function", "name": "f", "description": "d", "parameters": schema}],
                        text={"format": {"type": "json_schema", "name": "out", "schema": schema, "strict": True}},
                        top_logprobs=2))
    assert chat.tools[0].model_dump(exclude_none=True) == {"type": "function", "function": {
        "name": "f", "description": "d", "parameters": schema}}
    assert chat.tool_choice.function.name == "f"
    assert chat.response_format.type == "json_schema" and chat.response_format.json_schema.schema_ == schema
    assert (chat.logprobs, chat.top_logprobs) == (True, 2)
    assert chat.stream and chat.stream_options.include_usage          # usage for response.completed
    assert to_chat(_req(input="hi", include=["message.output_text.logprobs"])).top_logprobs == 0
    assert to_chat(_req(input="hi", text={"format": {"type": "json_object"}})).response_format.type == "json_object"
    assert to_chat(_req(input="hi", reasoning={"effort": "low"})).reasoning_effort == "low"
    assert to_chat(_req(input="hi", reasoning={"summary": "auto"})).reasoning_effort is None


@pytest.mark.parametrize("body, field", [
    (dict(input="hi", reasoning={"effort": "max"}), "reasoning.effort"),
    (dict(input="hi", tools=[{"type": "web_search"}]), "tools.0.type"),
    (dict(input=[{"role": "user", "content": [{"type": "input_file", "file_id": "x"}]}]), "input.0.content.0"),
    (dict(input=[{"role": "user", "content": [{"type": "input_image", "file_id": "x"}]}]), "input.0.content.0.image_url"),
    (dict(input=[{"role": "tool", "content": "x"}]), "input.0.role"),
    (dict(input=[{"type": "function_call_output", "output": "x"}]), "input.0.call_id"),
    (dict(input=[{"type": "file_search_call"}]), "input.0.type"),
    (dict(input=[]), "input"),
    (dict(input="hi", tool_choice={"type": "mcp"}), "tool_choice"),
    (dict(input="hi", text={"format": {"type": "json_schema", "name": "x"}}), "text.format.schema"),
    (dict(input="hi", temperature=-1), "temperature"),
    (dict(input="hi", tools=[{"type": "function", "name": "bad name!"}]), "tools.0.function.name"),
])
def test_what_cannot_be_served_is_refused_naming_the_field(body, field):
    with pytest.raises(ResponsesInputError) as e:
        to_chat(_req(**body))
    assert e.value.field == field and str(e.value).startswith(field + ":")


def test_input_images_become_chat_image_parts_in_order():
    chat = to_chat(_req(input=[{"role": "user", "content": [
        {"type": "input_text", "text": "what is "}, {"type": "input_image", "image_url": "data:image/png;base64,AA=="},
        {"type": "input_text", "text": "this"}]}]))
    message = chat.messages[-1]
    assert message.text() == "what is this"
    assert [u.url for u in message.images()] == ["data:image/png;base64,AA=="]
    assert [p.type for p in message.content] == ["text", "image_url", "text"]


def test_a_continued_conversation_is_its_context_then_the_new_input():
    """`previous_response_id`: the stored turns' items (input and output: reasoning dropped, a
    call as the assistant's tool call), then the new input; only the new instructions."""
    context = [{"type": "message", "role": "user", "content": "Weather in Paris?"},
               {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "t"}]},
               {"type": "message", "id": "msg_1", "role": "assistant", "status": "completed",
                "content": [{"type": "output_text", "text": "Checking.", "annotations": [], "logprobs": []}]},
               {"type": "function_call", "id": "fc_1", "call_id": "call_1", "name": "get_weather",
                "arguments": '{"city": "Paris"}', "status": "completed"}]
    chat = to_chat(_req(instructions="Be brief.", input=[
        {"type": "function_call_output", "call_id": "call_1", "output": "22C"}]), context)
    assert [m.model_dump(exclude_none=True) for m in chat.messages] == [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "Checking."},
        {"role": "assistant", "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "content": "22C", "tool_call_id": "call_1"}]
    with pytest.raises(ResponsesInputError, match="context.0.role"):
        to_chat(_req(input="hi"), [{"type": "message", "role": "robot", "content": "x"}])


def _shell(**body):
    return response_shell(_req(input="hi", **body), "tiny", "resp_x", 1700000000)


def test_a_chat_completion_becomes_the_response_object():
    openai = pytest.importorskip("openai")
    completion = {"model": "tiny", "usage": {"prompt_tokens": 7, "completion_tokens": 5, "total_tokens": 12,
                                             "prompt_tokens_details": {"cached_tokens": 4}},
                  "choices": [{"index": 0, "finish_reason": "length", "logprobs": None, "message": {
                      "role": "assistant", "content": "Hello", "reasoning_content": "think",
                      "tool_calls": [{"id": "call_1", "type": "function",
                                      "function": {"name": "f", "arguments": "{}"}}]}}]}
    out = response_from_chat(_shell(max_output_tokens=5), completion)
    assert [i["type"] for i in out["output"]] == ["reasoning", "message", "function_call"]
    assert out["output"][0]["content"] == [{"type": "reasoning_text", "text": "think"}]
    assert out["output"][1]["content"][0]["text"] == "Hello"
    assert (out["output"][2]["call_id"], out["output"][2]["name"], out["output"][2]["arguments"]) == ("call_1", "f", "{}")
    assert out["status"] == "incomplete" and out["incomplete_details"] == {"reason": "max_output_tokens"}
    assert out["usage"] == {"input_tokens": 7, "input_tokens_details": {"cached_tokens": 4, "cache_write_tokens": 0},
                            "output_tokens": 5,
                            "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": 12}
    parsed = openai.types.responses.Response.model_validate(out)
    assert parsed.output_text == "Hello" and out["store"] is False


def _chunks(*deltas, finish="stop"):
    base = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": "tiny"}
    out = [dict(base, choices=[{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}])]
    for d in deltas:
        out.append(dict(base, choices=[{"index": 0, "delta": d, "finish_reason": None, "logprobs": None}]))
    out.append(dict(base, choices=[{"index": 0, "delta": {}, "finish_reason": finish}]))
    out.append(dict(base, choices=[], usage={"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}))
    return [f"data: {json.dumps(c)}\n\n" for c in out] + ["data: [DONE]\n\n"]


async def _collect(lines, shell):
    async def chat_sse():
        for line in lines:
            yield line
    return [e async for e in response_events(chat_sse(), shell)]


def test_a_chat_stream_becomes_the_responses_events():
    openai = pytest.importorskip("openai")
    lines = _chunks({"reasoning_content": "hm"}, {"reasoning_content": "m"}, {"content": "He"}, {"content": "llo"},
                    {"tool_calls": [{"index": 0, "id": "call_a", "type": "function",
                                     "function": {"name": "f", "arguments": ""}}]},
                    {"tool_calls": [{"index": 0, "function": {"arguments": "{\"a\":"}}]},
                    {"tool_calls": [{"index": 0, "function": {"arguments": " 1}"}}]},
                    {"tool_calls": [{"index": 1, "id": "call_b", "type": "function",
                                     "function": {"name": "g", "arguments": "{}"}}]}, finish="tool_calls")
    raw = asyncio.run(_collect(lines, _shell()))
    events = []
    for e in raw:
        kind, data = e.split("\n", 1)
        assert kind.startswith("event: ") and data.startswith("data: ") and e.endswith("\n\n")
        ev = json.loads(data[len("data: "):])
        assert ev["type"] == kind[len("event: "):]
        events.append(ev)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert [e["type"] for e in events] == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.reasoning_text.delta", "response.reasoning_text.delta",
        "response.reasoning_text.done", "response.output_item.done",
        "response.output_item.added", "response.content_part.added", "response.output_text.delta",
        "response.output_text.delta", "response.output_text.done", "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.delta", "response.function_call_arguments.done",
        "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done",
        "response.completed"]
    assert [e["output_index"] for e in events if e["type"] == "response.output_item.added"] == [0, 1, 2, 3]
    assert events[5]["text"] == "hm" + "m" and events[11]["text"] == "Hello"
    assert events[17]["arguments"] == "{\"a\": 1}" and events[21]["arguments"] == "{}"
    final = events[-1]["response"]
    assert final["status"] == "completed" and final["usage"]["total_tokens"] == 7
    assert [(i["type"], i.get("name")) for i in final["output"]] == [
        ("reasoning", None), ("message", None), ("function_call", "f"), ("function_call", "g")]
    assert final["output"][2]["call_id"] == "call_a" and final["output"][2]["arguments"] == "{\"a\": 1}"
    adapter = TypeAdapter(openai.types.responses.ResponseStreamEvent)
    for ev in events:                       # every event in the openai client's own shape
        adapter.validate_python(ev)


def test_an_empty_or_cut_stream_still_ends_with_one_message_and_its_status():
    events = [json.loads(e.split("data: ", 1)[1]) for e in asyncio.run(_collect(_chunks(finish="length"), _shell()))]
    kinds = [e["type"] for e in events]
    assert kinds[-1] == "response.incomplete" and kinds.count("response.output_item.added") == 1
    final = events[-1]["response"]
    assert final["incomplete_details"] == {"reason": "max_output_tokens"}
    assert final["output"][0]["content"][0]["text"] == ""


def test_events_for_one_chunk_at_a_time():
    """`ResponseEvents` alone: a text delta opens the message once; usage comes from the last chunk."""
    ev = ResponseEvents(_shell())
    assert len(ev.start()) == 2
    first = ev.feed({"choices": [{"delta": {"content": "a"}, "finish_reason": None}]})
    assert [json.loads(e.split("data: ", 1)[1])["type"] for e in first] == [
        "response.output_item.added", "response.content_part.added", "response.output_text.delta"]
    assert len(ev.feed({"choices": [{"delta": {"content": "b"}, "finish_reason": "stop"}]})) == 1
    ev.feed({"choices": [], "usage": {"prompt_tokens": 1, "completion_tokens": 2, "total_tokens": 3}})
    final = json.loads(ev.end()[-1].split("data: ", 1)[1])["response"]
    assert final["output"][0]["content"][0]["text"] == "ab" and final["usage"]["output_tokens"] == 2
