"""The Responses API's store: the least recently used response goes first past the capacity (a
read counts as a use), a smaller capacity drops at once, 0 keeps nothing, a running background
response is cancelled and stays so, and the async facades over it answer as the store does."""

import asyncio

import pytest

from raycluster.server.response_store import LocalResponses, RemoteResponses, ResponseStore


def test_least_recently_used_goes_first():
    store = ResponseStore(3)
    for rid in ("a", "b", "c"):
        store.put(rid, {"response": {"id": rid}, "context": []})
    assert store.get("a")["response"]["id"] == "a"        # a is now the most recent
    store.put("d", {"response": {"id": "d"}, "context": []})
    assert store.get("b") is None and [r for r in "acd" if store.get(r)] == ["a", "c", "d"]
    store.put("c", {"response": {"id": "c2"}, "context": []})     # a put replaces and refreshes
    assert store.get("c")["response"]["id"] == "c2" and len(store) == 3
    store.resize(1)
    assert len(store) == 1 and store.get("c") is not None
    assert store.delete("c") and not store.delete("c") and len(store) == 0
    nothing = ResponseStore(0)
    nothing.put("x", {})
    assert nothing.get("x") is None
    with pytest.raises(ValueError, match="max_stored_responses"):
        ResponseStore(-1)


def test_the_local_facade_answers_as_the_store():
    responses = LocalResponses(ResponseStore(2))
    assert responses.enabled and not LocalResponses(ResponseStore(0)).enabled

    async def run():
        await responses.put("a", {"response": {"id": "a"}, "context": [1]})
        return await responses.get("a"), await responses.delete("a"), await responses.get("a")
    assert asyncio.run(run()) == ({"response": {"id": "a"}, "context": [1]}, True, None)


def test_the_remote_facade_awaits_the_actors_calls():
    """RemoteResponses as the gateway builds it, over an object standing in for the router actor."""
    store = ResponseStore(4)

    async def later(value):
        return value
    responses = RemoteResponses(put=lambda rid, rec: later(store.put(rid, rec)),
                                get=lambda rid: later(store.get(rid)), delete=lambda rid: later(store.delete(rid)),
                                cancel=lambda rid: later(store.cancel(rid)),
                                statuses=lambda rids: later(store.statuses(rids)),
                                append_events=lambda rid, ev, done: later(store.append_events(rid, ev, done)),
                                events_after=lambda rid, after: later(store.events_after(rid, after)))

    async def run():
        await responses.put("a", {"response": {"id": "a"}, "context": []})
        await responses.put("b", {"response": {"id": "b", "background": True, "status": "queued"}, "context": []})
        await responses.put("s", {"response": {"id": "s", "background": True, "status": "queued"}, "context": [],
                                  "events": []})
        await responses.append_events("s", ["e0", "e1"])
        await responses.append_events("s", ["e2"], True)
        cancelled = await responses.cancel("b")
        return (await responses.get("a"), await responses.delete("a"), await responses.get("a"),
                cancelled["response"]["status"], await responses.statuses(["a", "b"]),
                await responses.events_after("s", 0), await responses.events_after("b", -1))
    assert asyncio.run(run()) == ({"response": {"id": "a"}, "context": []}, True, None, "cancelled",
                                  {"a": None, "b": "cancelled"}, (["e1", "e2"], True), None)


def _record(rid, status, background=True):
    return {"response": {"id": rid, "status": status, "background": background}, "context": []}


def test_a_cancelled_background_response_stays_cancelled():
    store = ResponseStore(4)
    store.put("bg", _record("bg", "queued"))
    store.put("done", _record("done", "completed"))
    store.put("sync", _record("sync", "completed", background=False))
    assert store.cancel("bg")["response"]["status"] == "cancelled"
    # What the task running it stores afterwards does not undo the cancel.
    store.put("bg", _record("bg", "completed"))
    assert store.get("bg")["response"]["status"] == "cancelled"
    # Ended (or never background) responses are returned as they are; unknown ones are None.
    assert store.cancel("done")["response"]["status"] == "completed"
    assert store.cancel("sync")["response"]["status"] == "completed"
    assert store.cancel("nope") is None
    assert store.statuses(["bg", "done", "nope"]) == {"bg": "cancelled", "done": "completed", "nope": None}
    store.put("ip", _record("ip", "in_progress"))
    assert store.cancel("ip")["response"]["status"] == "cancelled"
