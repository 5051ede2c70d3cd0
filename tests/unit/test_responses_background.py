"""Background responses without an engine: the chat request is a coroutine the test controls. A
response is stored queued, then in progress, then as the chat answer ended it (completed, or failed
with the chat route's error or the exception); a cancel aborts the task at once when it runs here,
and within a poll when the store was told by another replica; a cancelled response stays so. A
streamed one runs on when its client hangs up, its events logged and stored in order, and its
stream resumes from the store (giving up when nothing comes)."""

import asyncio
import json

from fastapi.responses import JSONResponse

from raycluster.server.response_store import LocalResponses, ResponseStore
from raycluster.server.responses_background import BackgroundResponses

COMPLETION = {"model": "tiny", "choices": [{"message": {"role": "assistant", "content": "hi"},
                                            "finish_reason": "stop"}],
              "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}}


def _queued(rid):
    return {"id": rid, "object": "response", "status": "queued", "background": True, "output": [], "model": "x",
            "error": None, "incomplete_details": None, "usage": None}


async def _settle(runner, rounds=200):
    for _ in range(rounds):         # bounded: each round yields to the tasks once
        if not len(runner):
            return
        await asyncio.sleep(0.01)
    raise AssertionError("background tasks did not end")


def test_a_background_response_goes_from_queued_to_completed():
    store = LocalResponses(ResponseStore(10))
    runner = BackgroundResponses(store, poll_s=0.01)

    async def scenario():
        go = asyncio.Event()
        seen = []

        async def chat():
            seen.append((await store.get("r1"))["response"]["status"])
            await go.wait()
            return JSONResponse(COMPLETION)
        await runner.start(_queued("r1"), [{"id": "msg_1", "type": "message"}], chat)
        await asyncio.sleep(0.02)
        mid = (await store.get("r1"))["response"]["status"]
        go.set()
        await _settle(runner)
        return seen, mid, await store.get("r1")
    seen, mid, record = asyncio.run(scenario())
    assert seen == ["in_progress"] and mid == "in_progress"
    response = record["response"]
    assert response["status"] == "completed" and response["model"] == "tiny"
    assert response["output"][0]["content"][0]["text"] == "hi" and response["usage"]["output_tokens"] == 1
    assert record["context"] == [{"id": "msg_1", "type": "message"}]


def test_chat_errors_and_exceptions_end_the_response_failed():
    store = LocalResponses(ResponseStore(10))
    runner = BackgroundResponses(store, poll_s=0.01)

    async def refused():
        return JSONResponse({"error": {"message": "max_tokens: too large", "code": "invalid_value",
                                       "param": "max_tokens"}}, status_code=400)

    async def broken():
        raise RuntimeError("engine gone")

    async def scenario():
        await runner.start(_queued("a"), [], refused)
        await runner.start(_queued("b"), [], broken)
        await _settle(runner)
        return (await store.get("a"))["response"], (await store.get("b"))["response"]
    a, b = asyncio.run(scenario())
    assert a["status"] == "failed" and a["error"] == {"code": "invalid_value", "message": "max_tokens: too large"}
    assert b["status"] == "failed" and b["error"] == {"code": "server_error", "message": "RuntimeError: engine gone"}


def test_cancel_here_aborts_at_once_and_cancel_elsewhere_within_a_poll():
    store = LocalResponses(ResponseStore(10))
    runner = BackgroundResponses(store, poll_s=0.05)
    closed = []

    async def forever(name):
        try:
            await asyncio.Event().wait()
        finally:
            closed.append(name)         # the request's generators close here: the abort

    async def scenario():
        await runner.start(_queued("here"), [], lambda: forever("here"))
        await runner.start(_queued("elsewhere"), [], lambda: forever("elsewhere"))
        await asyncio.sleep(0.01)
        record = await runner.cancel("here")
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        first = list(closed)
        store.store.cancel("elsewhere")      # another replica told the store, not this runner
        await _settle(runner)
        return record, first, await store.statuses(["here", "elsewhere"])
    record, first, statuses = asyncio.run(scenario())
    assert record["response"]["status"] == "cancelled" and first == ["here"]
    assert sorted(closed) == ["elsewhere", "here"]
    assert statuses == {"here": "cancelled", "elsewhere": "cancelled"}
    assert json.dumps(record)      # plain data, as the router actor would carry it


def _chat_chunks(words, finish="stop"):
    """A streamed chat completion's SSE chunks: one delta per word, then the finish and usage."""
    for w in words:
        yield f'data: {json.dumps({"model": "tiny", "choices": [{"index": 0, "delta": {"content": w}, "finish_reason": None}]})}\n\n'
    last = {"model": "tiny", "choices": [{"index": 0, "delta": {}, "finish_reason": finish}],
            "usage": {"prompt_tokens": 3, "completion_tokens": len(words), "total_tokens": 3 + len(words)}}
    yield f"data: {json.dumps(last)}\n\n"
    yield "data: [DONE]\n\n"


def test_a_streamed_background_response_is_logged_stored_and_resumable():
    from raycluster.server.streams import ClosingStreamingResponse

    store = LocalResponses(ResponseStore(10))
    runner = BackgroundResponses(store, poll_s=0.01)
    closed = []

    async def scenario():
        go = asyncio.Event()

        async def body():
            for i, chunk in enumerate(_chat_chunks(["a", "b", "c"])):
                if i == 2:
                    await go.wait()         # the client hears the first events before the rest exist
                yield chunk

        async def request():
            try:
                yield None
            finally:
                closed.append("r")

        async def chat():           # the chat route awaits each request's first output before answering
            started = request()
            await started.__anext__()
            return ClosingStreamingResponse(body(), requests=[started], media_type="text/event-stream")
        events = await runner.start_streamed(_queued("s"), [], chat)
        first = []
        async for e in events.follow():
            first.append(e)
            if len(first) == 3:
                break                       # the client hangs up: the response runs on
        go.set()
        await _settle(runner)
        resumed = [e async for e in runner.follow_stored("s", 2)]
        return first, resumed, await store.get("s")
    first, resumed, record = asyncio.run(scenario())
    seqs = [json.loads(e.split("data: ", 1)[1])["sequence_number"] for e in first + resumed]
    assert seqs == list(range(len(seqs))) and len(first) == 3
    assert record["events"] == first + resumed and record["stream_done"] is True
    assert record["response"]["status"] == "completed" and record["response"]["output"][0]["content"][0]["text"] == "abc"
    assert '"type": "response.completed"' in resumed[-1] and closed == ["r"]


def test_following_the_store_gives_up_when_nothing_comes():
    """A streamed response whose replica went away (its events stop, never marked done)."""
    store = LocalResponses(ResponseStore(10))
    runner = BackgroundResponses(store, poll_s=0.01, idle_s=0.05)

    async def scenario():
        await store.put("x", {"response": _queued("x"), "context": [], "events": []})
        await store.append_events("x", ["e0"])
        return [e async for e in runner.follow_stored("x", -1)], [e async for e in runner.follow_stored("nope", -1)]
    assert asyncio.run(scenario()) == (["e0"], [])
