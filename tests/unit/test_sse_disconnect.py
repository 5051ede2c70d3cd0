"""A client that hangs up mid-stream aborts its request before the response call returns, even
when the hang-up lands while the send loop waits on the socket (the body generator then sits at
a `yield` that nothing resumes; without an explicit close, only the garbage collector would
finalise it and abort the request), and even when it lands while the response start is sent:
the body generator has not run a step then, so closing it reaches none of the requests, which
the handler had already started."""

from __future__ import annotations

import asyncio
import json

from raycluster.engine.engine import RequestOutput
from raycluster.server.app import build_app


class EndlessEngine:
    """Streams tokens forever; records the requests whose generator was closed early."""

    max_model_len = 4096

    def __init__(self) -> None:
        self.closed: list[str] = []
        # Hold every generator, as a reference cycle (a traceback's frames) would: then only an
        # explicit close, not refcounting, can end the request.
        self.live: list = []

    def admit(self) -> None:
        pass

    def next_id(self, prefix: str = "req") -> str:
        return f"{prefix}-1"          # n > 1: the choices are cmpl-1-0, cmpl-1-1, ...

    def generate(self, request_id, prompt_token_ids, sampling, **_):
        gen = self._tokens(request_id, prompt_token_ids)
        self.live.append(gen)
        return gen

    async def _tokens(self, request_id, prompt_token_ids):
        n = 0
        try:
            while True:
                n += 1
                yield RequestOutput(request_id, [7], "x", False, None, len(prompt_token_ids), n)
                await asyncio.sleep(0)
        finally:
            self.closed.append(request_id)


def _hang_up(engine, send_ok: int, **request) -> tuple[list[bytes], list[str]]:
    """POST a streaming completion; the client takes `send_ok` messages (the response start is
    the first), then hangs up while the next send waits on it, and stops reading. Returns the
    body chunks sent and the requests closed by the time the response call returned."""
    app = build_app(engine, None, "tiny")
    body = json.dumps({"prompt": [5, 6, 7], "max_tokens": 100, "stream": True, **request}).encode()
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
             "scheme": "http", "path": "/v1/completions", "raw_path": b"/v1/completions", "query_string": b"",
             "root_path": "", "headers": [(b"content-type", b"application/json")],
             "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 8000)}
    chunks: list[bytes] = []
    sent, requested = [], []

    async def main():
        blocked = asyncio.Event()

        async def receive():
            if not requested:
                requested.append(True)
                return {"type": "http.request", "body": body, "more_body": False}
            await blocked.wait()
            return {"type": "http.disconnect"}

        async def send(message):
            if len(sent) >= send_ok:
                blocked.set()                    # the hang-up arrives while this send waits
                await asyncio.Event().wait()     # a client that stopped reading: blocks until cancelled
            sent.append(message)
            if message["type"] == "http.response.body" and message.get("body"):
                chunks.append(message["body"])

        await asyncio.wait_for(app(scope, receive, send), timeout=10)
        return list(engine.closed)

    return chunks, asyncio.run(main())


def test_disconnect_while_sending_closes_the_request_generator():
    chunks, closed_when_returned = _hang_up(EndlessEngine(), send_ok=4)
    assert len(chunks) >= 3 and chunks[0].startswith(b"data: ")
    assert closed_when_returned == ["cmpl-1"]


def test_disconnect_while_the_response_starts_closes_the_request_generators():
    """The hang-up lands on the first send (the response start): no body chunk went out and the
    body generator never ran, yet every choice's request is closed (aborted)."""
    chunks, closed = _hang_up(EndlessEngine(), send_ok=0)
    assert chunks == [] and closed == ["cmpl-1"]
    chunks, closed = _hang_up(EndlessEngine(), send_ok=0, n=2)
    assert chunks == [] and sorted(closed) == ["cmpl-1-0", "cmpl-1-1"]
