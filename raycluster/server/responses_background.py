"""Background responses of the Responses API (`background: true`): the request is answered at once
with the response `queued`, and this process runs it on its own while clients poll
GET /v1/responses/{id} and may cancel it.

`BackgroundResponses(store)` owns the tasks this process runs. `start` stores the queued response
and starts a task that marks it `in_progress`, runs the chat request (`run`, the chat handler on
the translated body) and stores what it ended as: `completed` / `incomplete` with its output, or
`failed` with the error the chat route answered. Cancelling goes through the store: `cancel`
marks the record cancelled there (raycluster.server.response_store keeps it so) and aborts the
task at once if it runs here; a task another gateway replica runs is found by that replica's
watcher, which asks the store for the statuses of all its running responses in one call every
`poll_s` and cancels those marked cancelled. Cancelling a task closes its request's generators,
which aborts the request in the engine (or the cluster) and frees its KV.

A background request that also asks to `stream` (`start_streamed`) keeps its Responses events
in an `EventLog` here (event i has sequence_number i) as the task produces them, whoever listens:
the POST streams them from the log, and a client that hangs up leaves the task running. They
reach the store too, a batch every `FLUSH_S`, so `follow_stored` can resume the stream after
any sequence number from any gateway replica (polling the store every `poll_s`; it gives up after
`idle_s` without news, since the replica running it may be gone).

A background response lives in the process that started it: if that process (a gateway replica)
stops, the response stays `in_progress` in the store.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any, AsyncIterator, Awaitable, Callable

from raycluster.server.responses_api import response_events, response_from_chat

log = logging.getLogger(__name__)

FLUSH_S = 0.1       # how often a streamed background response's new events reach the store


class EventLog:
    """A streamed background response's events so far, in order (event i has sequence_number i),
    and whether its stream has ended; `follow` yields them as they come."""

    def __init__(self) -> None:
        self.events: list[str] = []
        self.done = False
        self._changed = asyncio.Event()

    def add(self, event: str) -> None:
        self.events.append(event)
        self._wake()

    def close(self) -> None:
        self.done = True
        self._wake()

    def _wake(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    async def follow(self, after: int = -1) -> AsyncIterator[str]:
        """The events with sequence_number > `after`, then each new one, until the stream ends."""
        i = after + 1
        while True:
            changed = self._changed         # taken before looking, so no wake-up is missed
            while i < len(self.events):
                yield self.events[i]
                i += 1
            if self.done:
                return
            await changed.wait()


def _failed_event(seq: int, response: dict[str, Any]) -> str:
    data = {"type": "response.failed", "sequence_number": seq, "response": response}
    return f"event: response.failed\ndata: {json.dumps(data)}\n\n"


def failed(shell: dict[str, Any], code: str, message: str) -> dict[str, Any]:
    return dict(shell, status="failed", error={"code": code, "message": message})


class BackgroundResponses:
    def __init__(self, store, poll_s: float = 0.5, idle_s: float = 300.0) -> None:
        self.store, self.poll_s, self.idle_s = store, poll_s, idle_s
        self._tasks: dict[str, asyncio.Task] = {}      # response id -> its task, while it runs here
        self._logs: dict[str, EventLog] = {}           # streamed ones' events, while they run here
        self._watcher: asyncio.Task | None = None

    def __len__(self) -> int:
        return len(self._tasks)

    async def start(self, queued: dict[str, Any], items: list[dict[str, Any]],
                    run: Callable[[], Awaitable[Any]]) -> None:
        """Store `queued` (status "queued", the items its input continued) and run it (`run`: the
        chat request, not streamed)."""
        await self.store.put(queued["id"], {"response": queued, "context": items})
        self._track(queued["id"], asyncio.create_task(self._complete(queued, items, run)))

    async def start_streamed(self, queued: dict[str, Any], items: list[dict[str, Any]],
                             run: Callable[[], Awaitable[Any]]) -> EventLog:
        """As `start`, with `run` the streamed chat request: returns the log its events go to."""
        rid = queued["id"]
        events = self._logs[rid] = EventLog()
        await self.store.put(rid, {"response": queued, "context": items, "events": []})
        self._track(rid, asyncio.create_task(self._stream(queued, items, run, events)))
        return events

    def running_log(self, response_id: str) -> EventLog | None:
        return self._logs.get(response_id)

    def _track(self, rid: str, task: asyncio.Task) -> None:
        self._tasks[rid] = task
        task.add_done_callback(lambda _: self._tasks.pop(rid, None))
        if self._watcher is None or self._watcher.done():
            self._watcher = asyncio.create_task(self._watch())

    async def cancel(self, response_id: str) -> dict[str, Any] | None:
        """The stored record after cancelling (see ResponseStore.cancel); the task is aborted now if
        it runs here."""
        record = await self.store.cancel(response_id)
        if record is not None and record["response"].get("status") == "cancelled":
            task = self._tasks.get(response_id)
            if task is not None:
                task.cancel()
        return record

    async def _complete(self, queued: dict[str, Any], items: list[dict[str, Any]],
                        run: Callable[[], Awaitable[Any]]) -> None:
        rid = queued["id"]
        running = dict(queued, status="in_progress")
        await self.store.put(rid, {"response": running, "context": items})
        try:
            result = await run()
            if result.status_code != 200:
                err = json.loads(result.body).get("error") or {}
                response = failed(running, str(err.get("code") or err.get("type") or "server_error"),
                                  str(err.get("message") or f"HTTP {result.status_code}"))
            else:
                completion = json.loads(result.body)
                response = response_from_chat(dict(running, model=completion["model"]), completion)
        except Exception as e:          # the request's own failure: the response says so, nothing crashes
            log.exception("background response %s failed", rid)
            response = failed(running, "server_error", f"{type(e).__name__}: {e}")
        await self.store.put(rid, {"response": response, "context": items})

    async def _stream(self, queued: dict[str, Any], items: list[dict[str, Any]], run: Callable[[], Awaitable[Any]],
                      events: EventLog) -> None:
        rid = queued["id"]
        running = dict(queued, status="in_progress")
        stored = 0          # events the store has

        async def flush(done: bool = False) -> None:
            nonlocal stored
            batch, stored = events.events[stored:], len(events.events)
            await self.store.append_events(rid, batch, done)

        async def kept(response: dict[str, Any]) -> None:       # the final object, before its last events
            nonlocal stored
            await self.store.put(rid, {"response": response, "context": items, "events": list(events.events)})
            stored = len(events.events)
        try:
            await self.store.put(rid, {"response": running, "context": items, "events": []})
            result = await run()
            if result.status_code != 200:
                err = json.loads(result.body).get("error") or {}
                response = failed(running, str(err.get("code") or err.get("type") or "server_error"),
                                  str(err.get("message") or f"HTTP {result.status_code}"))
                events.add(_failed_event(len(events.events), response))
                await kept(response)
                return
            loop, last = asyncio.get_running_loop(), 0.0
            try:
                async for event in response_events(result.body_iterator, running, kept):
                    events.add(event)
                    if loop.time() - last >= FLUSH_S:
                        await flush()
                        last = loop.time()
            finally:
                for gen in result.requests:         # aborted if the stream did not end (a cancel)
                    await gen.aclose()
        except Exception as e:          # the request's own failure: the response says so, nothing crashes
            log.exception("background response %s failed", rid)
            response = failed(running, "server_error", f"{type(e).__name__}: {e}")
            events.add(_failed_event(len(events.events), response))
            await kept(response)
        finally:
            events.close()
            self._logs.pop(rid, None)
            await asyncio.shield(flush(done=True))

    async def follow_stored(self, response_id: str, after: int) -> AsyncIterator[str]:
        """The stored events of a streamed background response after `after`, then new ones as they
        reach the store, until its stream ends (or nothing new comes for `idle_s`)."""
        loop = asyncio.get_running_loop()
        quiet_since = loop.time()
        while True:
            got = await self.store.events_after(response_id, after)
            if got is None:
                return
            new, done = got
            for event in new:
                yield event
            after += len(new)
            if done or (not new and loop.time() - quiet_since > self.idle_s):
                return
            if new:
                quiet_since = loop.time()
            await asyncio.sleep(self.poll_s)

    async def _watch(self) -> None:
        """While tasks run here, abort those cancelled elsewhere (through another replica)."""
        while self._tasks:
            await asyncio.sleep(self.poll_s)
            running = list(self._tasks)
            if not running:
                break
            try:
                statuses = await self.store.statuses(running)
            except Exception:           # the router restarting: ask again next round
                log.warning("could not read background responses' statuses", exc_info=True)
                continue
            for rid, status in statuses.items():
                if status == "cancelled" and (task := self._tasks.get(rid)) is not None:
                    task.cancel()
