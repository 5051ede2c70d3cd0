"""Stored responses of the Responses API (`store`, `previous_response_id`, GET / DELETE of
/v1/responses/{id}, background responses and their cancelling).

`ResponseStore(capacity)` keeps each stored response with the context its input continued (the
earlier turns' input items, so a later `previous_response_id` sees the whole conversation), the
least recently used dropped past `capacity` (responses are kept in memory, as vLLM's store keeps
them). The routes reach it through an async facade: `LocalResponses` in the process that serves
HTTP (engine-server), `RemoteResponses` through the cluster's router actor (which owns the one
store every gateway replica shares; a router restart empties it).

A record is a plain dict: {"response": the response object, "context": [input items]}. A
background response is stored as soon as it is queued and again as it advances; `cancel` marks a
running one cancelled, and a cancelled record stays so whatever is put over it later (the task
that ran it may still be ending on another gateway replica, which learns of the cancel through
`statuses`). A background response streamed as it runs also keeps its events (`append_events`,
`events_after`), so a client may resume its stream from any gateway replica.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, Awaitable, Callable


# The statuses of a background response that has not ended.
RUNNING = ("queued", "in_progress")


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
        old = self._records.get(response_id)
        if old is None or old["response"].get("status") != "cancelled":
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

    def cancel(self, response_id: str) -> dict[str, Any] | None:
        """The record, marked cancelled first if it is a background response still queued or in
        progress (a finished or cancelled one is returned as it is; None: no such record)."""
        record = self.get(response_id)
        if record is not None and record["response"].get("background") and \
                record["response"].get("status") in RUNNING:
            record = {**record, "response": {**record["response"], "status": "cancelled"}}
            self._records[response_id] = record
        return record

    def append_events(self, response_id: str, events: list[str], done: bool = False) -> None:
        """More events of a streamed background response (event i has sequence_number i); `done`:
        its stream has ended. Appended even to a cancelled record (its stream ends there)."""
        record = self._records.get(response_id)
        if record is not None:
            record.setdefault("events", []).extend(events)
            record["stream_done"] = record.get("stream_done", False) or done

    def events_after(self, response_id: str, after: int) -> tuple[list[str], bool] | None:
        """(the stored events with sequence_number > `after`, whether the stream has ended), or
        None: no such response, or one not streamed in the background."""
        record = self._records.get(response_id)
        if record is None or "events" not in record:
            return None
        return record["events"][after + 1:], record.get("stream_done", False)

    def statuses(self, response_ids: list[str]) -> dict[str, str | None]:
        """Each response's status (None: not stored), without counting as a use."""
        return {rid: (r["response"].get("status") if (r := self._records.get(rid)) is not None else None)
                for rid in response_ids}

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

    async def cancel(self, response_id: str) -> dict[str, Any] | None:
        return self.store.cancel(response_id)

    async def statuses(self, response_ids: list[str]) -> dict[str, str | None]:
        return self.store.statuses(response_ids)

    async def append_events(self, response_id: str, events: list[str], done: bool = False) -> None:
        self.store.append_events(response_id, events, done)

    async def events_after(self, response_id: str, after: int) -> tuple[list[str], bool] | None:
        return self.store.events_after(response_id, after)


class RemoteResponses:
    """The async facade over the router actor's store: each argument makes the awaitable of one
    of the actor's calls (`put_response`, `get_response`, `delete_response`, `cancel_response`,
    `response_statuses`, `append_response_events`, `response_events_after`)."""

    def __init__(self, put: Callable[[str, dict], Awaitable[None]], get: Callable[[str], Awaitable[Any]],
                 delete: Callable[[str], Awaitable[bool]], cancel: Callable[[str], Awaitable[Any]],
                 statuses: Callable[[list[str]], Awaitable[dict]],
                 append_events: Callable[[str, list[str], bool], Awaitable[None]],
                 events_after: Callable[[str, int], Awaitable[Any]], enabled: bool = True) -> None:
        self._put, self._get, self._delete, self.enabled = put, get, delete, enabled
        self._cancel, self._statuses = cancel, statuses
        self._append_events, self._events_after = append_events, events_after

    async def put(self, response_id: str, record: dict[str, Any]) -> None:
        await self._put(response_id, record)

    async def get(self, response_id: str) -> dict[str, Any] | None:
        return await self._get(response_id)

    async def delete(self, response_id: str) -> bool:
        return await self._delete(response_id)

    async def cancel(self, response_id: str) -> dict[str, Any] | None:
        return await self._cancel(response_id)

    async def statuses(self, response_ids: list[str]) -> dict[str, str | None]:
        return await self._statuses(response_ids)

    async def append_events(self, response_id: str, events: list[str], done: bool = False) -> None:
        await self._append_events(response_id, events, done)

    async def events_after(self, response_id: str, after: int) -> tuple[list[str], bool] | None:
        got = await self._events_after(response_id, after)
        return None if got is None else (list(got[0]), bool(got[1]))
