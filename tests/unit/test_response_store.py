"""The Responses API's store: the least recently used response goes first past the capacity (a
read counts as a use), a smaller capacity drops at once, 0 keeps nothing, and the async facade
over it answers as the store does."""

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
                                get=lambda rid: later(store.get(rid)), delete=lambda rid: later(store.delete(rid)))

    async def run():
        await responses.put("a", {"response": {"id": "a"}, "context": []})
        return await responses.get("a"), await responses.delete("a"), await responses.get("a")
    assert asyncio.run(run()) == ({"response": {"id": "a"}, "context": []}, True, None)
