"""The Responses API's routes: POST /v1/responses through the chat route's handler, and the stored
responses (GET / DELETE /v1/responses/{id}, `previous_response_id`).

A request is translated (raycluster.server.responses_api.to_chat), run by the chat handler, and its
answer reshaped into a response object or Responses events. With a store (`store`, an async facade
of raycluster.server.response_store; None or disabled: nothing is kept) a response whose request
did not say `store: false` is kept once it has ended, with the context its input continued, so a
later request naming it in `previous_response_id` continues the whole conversation: the stored
context, its output items, then the new input (its instructions are the new request's alone).
An unknown `previous_response_id` is a 404 naming the field, as OpenAI answers.
"""

from __future__ import annotations

import json
from typing import Any

from fastapi import Request as HTTPRequest
from fastapi.responses import JSONResponse

from raycluster.server.protocol import error_body
from raycluster.server.responses_api import (_CHAT_TO_RESPONSES, ResponsesInputError, ResponsesRequest, _new_id,
                                             created_now, input_items, response_events, response_from_chat,
                                             response_shell, to_chat)
from raycluster.server.streams import ClosingStreamingResponse


def _not_found(field: str, message: str) -> JSONResponse:
    return JSONResponse(error_body(message, field, code="not_found"), status_code=404)


def add_responses_routes(app, chat_handler, names, store=None) -> None:
    """The routes on `app`; `chat_handler` is the chat route's handler ((ChatCompletionRequest,
    HTTP request) -> its response), `store` the stored responses' facade (None: none kept)."""
    storing = store is not None and store.enabled

    @app.post("/v1/responses")
    async def responses(body: ResponsesRequest, http: HTTPRequest):
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
        result = await chat_handler(chat_body, http)
        if result.status_code != 200:           # the chat route's error, its fields renamed
            return _renamed_error(result)
        keep = storing and body.store is not False
        shell = response_shell(body, chat_body.model or names[0], _new_id("resp"), created_now(), stored=keep)
        items = context + input_items(body)

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
    async def stored_response(response_id: str):
        record = await store.get(response_id) if storing else None
        if record is None:
            return _not_found("response_id", f"response_id: {response_id!r} not found" +
                              ("" if storing else ": this server stores no responses"))
        return record["response"]

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str):
        if not storing or not await store.delete(response_id):
            return _not_found("response_id", f"response_id: {response_id!r} not found")
        return {"id": response_id, "object": "response", "deleted": True}

    @app.post("/v1/responses/{response_id}/cancel")
    async def cancel_response(response_id: str):
        if storing and await store.get(response_id) is not None:
            return JSONResponse(error_body(f"response_id: {response_id!r} is not running in the background (this "
                                           "server runs no background responses): nothing to cancel", "response_id"),
                                status_code=400)
        return _not_found("response_id", f"response_id: {response_id!r} not found")


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
