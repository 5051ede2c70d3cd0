"""Stored responses of the Responses API (`store`, `previous_response_id`, GET / DELETE of
/v1/responses/{id}).

`ResponseStore(capacity)` keeps each stored response with the context its input continued (the
earlier turns' input items, so a later `previous_response_id` sees the whole conversation), the
least recently used dropped past `capacity` (responses are kept in memory, as vLLM's store keeps
them). The routes reach it through an async facade: `LocalResponses` in the process that serves
HTTP (engine-server), `RemoteResponses` through the cluster's router actor (which owns the one
store every gateway replica shares; a router restart empties it).

A record is a plain dict: {"response": the response object, "context": [input items]}.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, Awaitable, Callable


class ResponseStore:
    def __init__(self, capacity: int) -> None:
        if capacity < 0:
            raise ValueError(f"max_stored_responses: must be >= 0, got {capacity}")
        self.capacity = capacity
        self._records: OrderedDict[str, dict[str, Any]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._records)

    def resize(self, capacity: int) -> None:
        self.capacity = capacity
        self._trim()

    def put(self, response_id: str, record: dict[str, Any]) -> None:
        self._records[response_id] = record
        self._records.move_to_end(response_id)
        self._trim()

    def get(self, response_id: str) -> dict[str, Any] | None:
        record = self._records.get(response_id)
        if record is not None:
            self._records.move_to_end(response_id)
        return record

    def delete(self, response_id: str) -> bool:
        return self._records.pop(response_id, None) is not None

    def _trim(self) -> None:
        while len(self._records) > self.capacity:
            self._records.popitem(last=False)


class LocalResponses:
    """The async facade over a store in this process."""

    def __init__(self, store: ResponseStore) -> None:
        self.store = store

    @property
    def enabled(self) -> bool:
        return self.store.capacity > 0

    async def put(self, response_id: str, record: dict[str, Any]) -> None:
        self.store.put(response_id, record)

    async def get(self, response_id: str) -> dict[str, Any] | None:
        return self.store.get(response_id)

    async def delete(self, response_id: str) -> bool:
        return self.store.delete(response_id)


class RemoteResponses:
    """The async facade over the router actor's store: `put`, `get` and `delete` are awaitables'
    makers (the actor's `put_response`, `get_response`, `delete_response` calls)."""

    def __init__(self, put: Callable[[str, dict], Awaitable[None]], get: Callable[[str], Awaitable[Any]],
                 delete: Callable[[str], Awaitable[bool]], enabled: bool = True) -> None:
        self._put, self._get, self._delete, self.enabled = put, get, delete, enabled

    async def put(self, response_id: str, record: dict[str, Any]) -> None:
        await self._put(response_id, record)

    async def get(self, response_id: str) -> dict[str, Any] | None:
        return await self._get(response_id)

    async def delete(self, response_id: str) -> bool:
        return await self._delete(response_id)
