"""A client that hangs up mid-stream aborts its request before the response call returns, even
when the hang-up lands while the send loop waits on the socket (the body generator then sits at
a `yield` that nothing resumes; without an explicit close, only the garbage collector would
finalise it and abort the request), and even when it lands while the response start is sent:
the body generator has not run a step then, so closing it reaches none of the requests, which
the handler had already started.

With the cluster backend the abort is an actor call that suspends. A hang-up while the request
waits for its next token event closes its generator inside the cancelled task, where Starlette's
disconnect listener (an anyio cancel scope) cancels every await again: the abort must still reach
the router (the cause of the disconnect test that failed now and then on real clusters)."""

from __future__ import annotations

import asyncio
import json

from raycluster.cluster.client import ClusterClient
from raycluster.cluster.messages import GatewayReply, SubmitReply, TokenEvent
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


class SlowRouter:
    """A fake router for `ClusterClient`: one token per live request every 20 ms; an abort (and
    each pull) suspends, as a Ray actor call does."""

    def __init__(self) -> None:
        self.live: set[str] = set()
        self.aborted: list[str] = []

    async def submit(self, meta) -> SubmitReply:
        self.live.add(meta.request_id)
        return SubmitReply(True, router_id="r1")

    async def abort(self, request_id: str) -> None:
        await asyncio.sleep(0.01)
        self.aborted.append(request_id)
        self.live.discard(request_id)

    async def pull(self, gateway_id: str, timeout_s: float) -> GatewayReply:
        await asyncio.sleep(0.02)
        return GatewayReply([TokenEvent(r, [7]) for r in sorted(self.live)], router_id="r1")

    async def status(self) -> dict:
        return {}

    def client(self) -> ClusterClient:
        return ClusterClient(self.submit, self.abort, self.pull, self.status, tokenizer=None,
                             max_model_len=4096, vocab_size=1000, eos_token_ids=(2,), pull_timeout_s=0.02)


def _scope(spec_version: str | None = None) -> dict:
    asgi = {"version": "3.0"} if spec_version is None else {"version": "3.0", "spec_version": spec_version}
    return {"type": "http", "asgi": asgi, "http_version": "1.1", "method": "POST",
            "scheme": "http", "path": "/v1/completions", "raw_path": b"/v1/completions", "query_string": b"",
            "root_path": "", "headers": [(b"content-type", b"application/json")],
            "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 8000)}


def _hang_up(engine, send_ok: int, **request) -> tuple[list[bytes], list[str]]:
    """POST a streaming completion; the client takes `send_ok` messages (the response start is
    the first), then hangs up while the next send waits on it, and stops reading. Returns the
    body chunks sent and the requests closed by the time the response call returned."""
    app = build_app(engine, None, "tiny")
    body = json.dumps({"prompt": [5, 6, 7], "max_tokens": 100, "stream": True, **request}).encode()
    scope = _scope()
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


def test_a_hang_up_while_waiting_for_a_token_aborts_on_the_router():
    """uvicorn's scopes say ASGI spec 2.3, so Starlette runs its disconnect listener beside the
    body; the hang-up arrives while the request's generator waits for its next token event."""
    router = SlowRouter()
    client = router.client()
    app = build_app(client, None, "tiny")
    body = json.dumps({"prompt": [5, 6, 7], "max_tokens": 1000, "stream": True}).encode()

    async def main():
        gone, sent, requested = asyncio.Event(), [], []

        async def receive():
            if not requested:
                requested.append(True)
                return {"type": "http.request", "body": body, "more_body": False}
            await gone.wait()
            return {"type": "http.disconnect"}

        async def send(message):
            sent.append(message)
            if len(sent) == 4:      # mid-wait for the next event, 20 ms apart
                asyncio.get_running_loop().call_later(0.005, gone.set)

        await asyncio.wait_for(app(_scope("2.3"), receive, send), timeout=10)
        for _ in range(100):        # the abort runs on its own task: allow it its actor call
            if router.aborted:
                break
            await asyncio.sleep(0.01)
        client._pull_task.cancel()
        return sent

    sent = asyncio.run(main())
    assert len(sent) >= 4
    assert len(router.aborted) == 1 and router.aborted[0].startswith("cmpl-") and not router.live


def test_a_token_event_for_a_request_nobody_listens_to_aborts_it():
    """The backstop for an abort lost on the way: events keep coming for a request whose
    generator is gone, so the pull loop aborts it (once, while that abort is in flight)."""
    router = SlowRouter()
    client = router.client()

    async def main():
        router.live.add("orphan")
        client._ensure_pulling()
        for _ in range(100):
            if router.aborted:
                break
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.05)
        client._pull_task.cancel()

    asyncio.run(main())
    assert router.aborted == ["orphan"] and not router.live
