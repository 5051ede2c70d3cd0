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

A background response lives in the process that started it: if that process (a gateway replica)
stops, the response stays `in_progress` in the store.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any, Awaitable, Callable

from raycluster.server.responses_api import response_from_chat

log = logging.getLogger(__name__)


def failed(shell: dict[str, Any], code: str, message: str) -> dict[str, Any]:
    return dict(shell, status="failed", error={"code": code, "message": message})


class BackgroundResponses:
    def __init__(self, store, poll_s: float = 0.5) -> None:
        self.store, self.poll_s = store, poll_s
        self._tasks: dict[str, asyncio.Task] = {}      # response id -> its task, while it runs here
        self._watcher: asyncio.Task | None = None

    def __len__(self) -> int:
        return len(self._tasks)

    async def start(self, queued: dict[str, Any], items: list[dict[str, Any]],
                    run: Callable[[], Awaitable[Any]]) -> None:
        """Store `queued` (status "queued", the items its input continued) and run it."""
        rid = queued["id"]
        await self.store.put(rid, {"response": queued, "context": items})
        task = asyncio.create_task(self._complete(queued, items, run))
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
