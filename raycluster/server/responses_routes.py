"""The Responses API's routes: POST /v1/responses through the chat route's handler, and the stored
responses (GET / DELETE /v1/responses/{id}, GET /v1/responses/{id}/input_items,
`previous_response_id`, background responses and POST /v1/responses/{id}/cancel).

A request is translated (raycluster.server.responses_api.to_chat), run by the chat handler, and its
answer reshaped into a response object or Responses events. With a store (`store`, an async facade
of raycluster.server.response_store; None or disabled: nothing is kept) a response whose request
did not say `store: false` is kept once it has ended, with the context its input continued, so a
later request naming it in `previous_response_id` continues the whole conversation: the stored
context, its output items, then the new input (its instructions are the new request's alone).
An unknown `previous_response_id` is a 404 naming the field, as OpenAI answers. A `background`
request (stored) is answered `queued` at once, or with `stream` its events as they come, and runs
in this process (raycluster.server.responses_background) while clients poll it or resume its stream
(GET with `stream=true&starting_after=N`, from any gateway replica); a client hanging up stops
nothing; `cancel` stops a running one, from any gateway replica. A response's input items (the context it continued, then its own input, each
with an id) list newest first by default, in pages of `limit` after / before an item id.
"""

from __future__ import annotations

import json
from typing import Any

from fastapi import Request as HTTPRequest
from fastapi.responses import JSONResponse, StreamingResponse

from raycluster.server.protocol import error_body
from raycluster.server.response_store import RUNNING
from raycluster.server.responses_api import (_CHAT_TO_RESPONSES, ResponsesInputError, ResponsesRequest, _new_id,
                                             created_now, input_items, response_events, response_from_chat,
                                             response_shell, to_chat, with_ids)
from raycluster.server.responses_background import BackgroundResponses
from raycluster.server.streams import ClosingStreamingResponse


def _not_found(field: str, message: str) -> JSONResponse:
    return JSONResponse(error_body(message, field, code="not_found"), status_code=404)


def _bad(field: str, message: str) -> JSONResponse:
    return JSONResponse(error_body(f"{field}: {message}", field), status_code=400)


def _background_refusal(body: ResponsesRequest, storing: bool) -> JSONResponse | None:
    if not body.background:
        return None
    if not storing:
        return _bad("background", "this server stores no responses (max_stored_responses is 0), and a background "
                    "response is one to poll")
    if body.store is False:
        return _bad("store", "a background response must be stored (leave store out or set it true)")
    return None


def add_responses_routes(app, chat_handler, names, store=None, poll_s: float = 0.5) -> None:
    """The routes on `app`; `chat_handler` is the chat route's handler ((ChatCompletionRequest,
    HTTP request) -> its response), `store` the stored responses' facade (None: none kept),
    `poll_s` how often background responses cancelled through another replica are looked for."""
    storing = store is not None and store.enabled
    background = BackgroundResponses(store, poll_s) if storing else None

    @app.post("/v1/responses")
    async def responses(body: ResponsesRequest, http: HTTPRequest):
        if (refusal := _background_refusal(body, storing)) is not None:
            return refusal
        context: list[dict[str, Any]] = []
        if body.previous_response_id is not None:
            if not storing:
                return JSONResponse(error_body("previous_response_id: this server stores no responses: send the "
                                               "whole conversation as input items", "previous_response_id"),
                                    status_code=400)
            record = await store.get(body.previous_response_id)
            if record is None:
                return _not_found("previous_response_id", f"previous_response_id: no stored response "
                                  f"{body.previous_response_id!r} (unknown, deleted, or past the store's capacity)")
            context = record["context"] + record["response"]["output"]
        try:
            chat_body = to_chat(body, context)
        except ResponsesInputError as e:
            return JSONResponse(error_body(str(e), e.field), status_code=400)
        keep = storing and body.store is not False
        shell = response_shell(body, chat_body.model or names[0], _new_id("resp"), created_now(), stored=keep)
        items = context + with_ids(input_items(body))
        if body.background:
            queued = dict(shell, status="queued")
            if body.stream:         # the client may hang up: the response runs on, its stream resumable
                events = await background.start_streamed(queued, items, lambda: chat_handler(chat_body, http))
                return StreamingResponse(events.follow(), media_type="text/event-stream")
            await background.start(queued, items, lambda: chat_handler(chat_body, http))
            return queued
        result = await chat_handler(chat_body, http)
        if result.status_code != 200:           # the chat route's error, its fields renamed
            return _renamed_error(result)

        async def kept(response: dict) -> None:
            if keep:
                await store.put(response["id"], {"response": response, "context": items})
        if isinstance(result, ClosingStreamingResponse):
            return ClosingStreamingResponse(response_events(result.body_iterator, shell, kept), requests=result.requests,
                                            media_type="text/event-stream", headers=_passed_headers(result))
        completion = json.loads(result.body)
        shell["model"] = completion["model"]
        response = response_from_chat(shell, completion)
        await kept(response)
        return JSONResponse(response, headers=_passed_headers(result))

    @app.get("/v1/responses/{response_id}")
    async def stored_response(response_id: str, stream: bool = False, starting_after: str | None = None):
        record = await store.get(response_id) if storing else None
        if record is None:
            return _not_found("response_id", f"response_id: {response_id!r} not found" +
                              ("" if storing else ": this server stores no responses"))
        if not stream:
            return record["response"]
        if "events" not in record:
            return _bad("stream", f"{response_id!r} was not created with background and stream true: it has no "
                        "stream to resume")
        if starting_after is not None and not starting_after.lstrip("-").isdigit():
            return _bad("starting_after", f"must be an event's sequence_number, got {starting_after!r}")
        after = -1 if starting_after is None else max(-1, int(starting_after))
        running = background.running_log(response_id)
        events = running.follow(after) if running is not None else background.follow_stored(response_id, after)
        return StreamingResponse(events, media_type="text/event-stream")

    @app.get("/v1/responses/{response_id}/input_items")
    async def listed_input_items(response_id: str, limit: str = "20", order: str = "desc",
                                 after: str | None = None, before: str | None = None):
        record = await store.get(response_id) if storing else None
        if record is None:
            return _not_found("response_id", f"response_id: {response_id!r} not found" +
                              ("" if storing else ": this server stores no responses"))
        if not limit.isdigit() or not 1 <= int(limit) <= 100:
            return _bad("limit", f"must be an integer from 1 to 100, got {limit!r}")
        if order not in ("asc", "desc"):
            return _bad("order", f"must be asc or desc, got {order!r}")
        items = record["context"] if order == "asc" else record["context"][::-1]
        ids = [item["id"] for item in items]
        lo, hi = 0, len(items)
        for field, cursor in (("after", after), ("before", before)):
            if cursor is not None and cursor not in ids:
                return _bad(field, f"{cursor!r} is not an input item of {response_id!r}")
        if after is not None:
            lo = ids.index(after) + 1
        if before is not None:
            hi = ids.index(before)
        window = items[lo:hi]
        # A page after a cursor (or none) starts there; a page before one ends at it.
        page = window[-int(limit):] if before is not None and after is None else window[:int(limit)]
        return {"object": "list", "data": page, "has_more": len(window) > len(page),
                "first_id": page[0]["id"] if page else None, "last_id": page[-1]["id"] if page else None}

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str):
        record = await store.get(response_id) if storing else None
        if record is not None and record["response"].get("status") in RUNNING:
            return _bad("response_id", f"{response_id!r} is still running in the background: cancel it first")
        if record is None or not await store.delete(response_id):
            return _not_found("response_id", f"response_id: {response_id!r} not found")
        return {"id": response_id, "object": "response", "deleted": True}

    @app.post("/v1/responses/{response_id}/cancel")
    async def cancel_response(response_id: str):
        record = await background.cancel(response_id) if storing else None
        if record is None:
            return _not_found("response_id", f"response_id: {response_id!r} not found")
        if not record["response"].get("background"):
            return _bad("response_id", f"{response_id!r} was not created with background: true: only background "
                        "responses can be cancelled")
        return record["response"]      # cancelled now, or as it ended (cancelling again changes nothing)


def _renamed_error(result) -> JSONResponse:
    """The chat route's error answer, its field named as the Responses request names it."""
    err = json.loads(result.body)
    param = (err.get("error") or {}).get("param")
    if param:
        head, _, rest = param.partition(".")
        renamed = _CHAT_TO_RESPONSES.get(head, head) + (f".{rest}" if rest else "")
        err["error"]["param"] = renamed
        err["error"]["message"] = err["error"]["message"].replace(param, renamed, 1)
    return JSONResponse(err, status_code=result.status_code, headers=_passed_headers(result))


def _passed_headers(result) -> dict[str, str]:
    rid = result.headers.get("x-request-id")
    retry = result.headers.get("retry-after")
    return {k: v for k, v in (("X-Request-Id", rid), ("Retry-After", retry)) if v is not None}
