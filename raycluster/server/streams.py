"""One HTTP request's outputs on their way to the client: the part of the OpenAI app that consumes
the backend's per-request generators (`RequestOutput`s in, OpenAI JSON pieces out).

`Stream` consumes one backend request, records its TTFT/TPOT/e2e in `RequestMetrics` and renders
each output's text and logprobs (the echoed prompt first, with `echo`); `collect` gathers a whole
choice (non-streamed responses). `sse` renders the choices of a streamed response as SSE `data:`
chunks (n choices merged as they come, usage as OpenAI's include_usage or vLLM's continuous
usage stats), and `ClosingStreamingResponse` makes sure every request is closed (aborted) however
the response ends, a client's hang-up included.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import AsyncIterator, Callable

from fastapi.responses import StreamingResponse

from raycluster.server.openai_logprobs import chat_logprobs, completion_logprobs
from raycluster.server.protocol import now_s
from raycluster.server.reasoning import ReasoningStream
from raycluster.server.request_metrics import RequestMetrics
from raycluster.server.tools import ToolCallOutput


async def _close(agen) -> None:
    """Close an async generator even if this task is being cancelled: the close runs as its own
    task (shielded), so a request's abort does not depend on which await the cancel hits (a
    cancelled close would leave the generator to the garbage collector)."""
    await asyncio.shield(asyncio.ensure_future(agen.aclose()))


class ClosingStreamingResponse(StreamingResponse):
    """Closes its body generator, then the requests' own generators (`requests`), however the
    response ends. A client that disconnects cancels the send loop while the body waits at a
    `yield`; nothing else closes it then, and the requests would run on until the garbage
    collector finalised them. A hang-up before the body's first step (while the response start
    is sent) leaves the body unstarted: closing it runs none of its code, so the requests, which
    the handler started already (their first output is awaited before responding), are closed
    here directly (a no-op for one the body closed)."""

    def __init__(self, content, *, requests=(), **kwargs) -> None:
        super().__init__(content, **kwargs)
        self.requests = list(requests)

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            # One shielded task for both steps: a cancel landing between them cannot skip the second.
            await asyncio.shield(asyncio.ensure_future(self._close_all()))

    async def _close_all(self) -> None:
        await self.body_iterator.aclose()       # the body closes the requests it has started
        for gen in self.requests:
            await gen.aclose()


class Stream:
    """Consumes one request's outputs, recording TTFT/TPOT metrics. `on_end(reason, tokens,
    ttft_s, e2e_s)`, if given, hears how it ended ("abort" when it was closed unfinished)."""

    def __init__(self, gen, first, t0: float, metrics: RequestMetrics, decode=None,
                 echo: tuple[str, list[int]] | None = None, num_top: int | None = None,
                 on_end: Callable[[str, int, float, float], None] | None = None) -> None:
        self.gen, self.first, self.t0, self.metrics, self.on_end = gen, first, t0, metrics, on_end
        self.decode = decode          # set when the request asked for logprobs
        self.echo = echo              # (prompt text, prompt ids) to put before the first output
        self.num_top = num_top        # alternatives per token asked for (the echoed prompt's may hold more)
        self.prompt_lps = None        # the engine's prompt logprobs, once the first output brought them
        self.n_out = 0
        self.n_cached = 0             # prompt tokens the engine took from its prefix cache
        self.chars = 0                # completion text so far (text_offset of the next token)

    def render(self, kind: str, out) -> tuple[str, dict | None]:
        """One output's text and logprobs object; the first output also carries the echoed
        prompt (and its tokens' logprobs, which the engine sends with the first token)."""
        text, ids, lps = out.new_text, out.new_token_ids, out.logprobs
        if self.echo is not None:
            prompt, prompt_ids = self.echo
            self.echo = None
            text = prompt + text
            if self.decode is not None:
                ids, lps = prompt_ids + ids, list(out.prompt_logprobs or [None] * len(prompt_ids)) + (lps or [])
        return text, self.logprobs(kind, ids, lps)

    def logprobs(self, kind: str, token_ids: list[int], lps) -> dict | None:
        if self.decode is None or lps is None:
            return None
        if kind == "text_completion":
            out = completion_logprobs(self.decode, token_ids, lps, self.chars, self.num_top)
            self.chars += sum(map(len, out["tokens"]))
            return out
        return chat_logprobs(self.decode, token_ids, lps)

    async def outputs(self):
        t_first = t_last = time.perf_counter()
        self.metrics.first_token(t_first - self.t0, self.first.prefill_s)
        out, reason = self.first, "abort"
        try:
            while True:
                if out is not self.first and out.num_output_tokens > self.n_out:
                    now = time.perf_counter()
                    self.metrics.tokens_after(now - t_last, out.num_output_tokens - self.n_out)
                    t_last = now
                self.n_out = out.num_output_tokens
                self.n_cached = max(self.n_cached, out.num_cached_tokens)
                if out.prompt_logprobs is not None:
                    self.prompt_lps = out.prompt_logprobs
                yield out
                if out.finished:
                    now, n, reason = time.perf_counter(), out.num_output_tokens, out.finish_reason
                    self.metrics.finished(out.finish_reason, n, now - self.t0,
                                          (now - t_first) / (n - 1) if n > 1 else None,
                                          out.num_prompt_tokens, now - t_first, self.first.prefill_s)
                    return
                out = await self.gen.__anext__()
        finally:
            if self.on_end is not None:
                self.on_end(reason, self.n_out, t_first - self.t0, time.perf_counter() - self.t0)
            await _close(self.gen)      # aborts the request if it has not finished

    async def collect(self, kind: str) -> tuple[str, int, str | None, dict | None]:
        parts, reason, merged = [], None, None
        async for out in self.outputs():
            text, lp = self.render(kind, out)
            parts.append(text)
            reason = out.finish_reason
            if lp is not None:      # both shapes are dicts of per-token lists: concatenate them
                merged = lp if merged is None else {k: merged[k] + v for k, v in lp.items()}
        return "".join(parts), self.n_out, reason, merged


async def _merged(streams: list[Stream]) -> AsyncIterator[tuple[int, object]]:
    """(choice index, output) from every stream as they come; closing this closes them all."""
    q: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, s: Stream) -> None:
        try:
            async for out in s.outputs():
                await q.put((i, out))
        finally:
            q.put_nowait((i, None))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        left = len(tasks)
        while left:
            i, out = await q.get()
            if out is None:
                left -= 1
            else:
                yield i, out
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def usage_of(n_prompt: int, streams: list[Stream], n: int) -> dict:
    """OpenAI's usage; `cached_tokens` as vLLM reports it (per prompt its first choice's: the n
    choices of a prompt share it, counted once)."""
    n_out = sum(s.n_out for s in streams)
    return {"prompt_tokens": n_prompt, "completion_tokens": n_out, "total_tokens": n_prompt + n_out,
            "prompt_tokens_details": {"cached_tokens": sum(s.n_cached for s in streams[::n])}}


def _chunk(rid: str, obj: str, created: int, model: str, choice: dict, usage: dict | None) -> str:
    chunk = {"id": rid, "object": obj, "created": created, "model": model, "choices": [choice]}
    if usage is not None:
        chunk["usage"] = usage
    return f"data: {json.dumps(chunk)}\n\n"


async def sse(streams: list[Stream], rid: str, kind: str, model: str, n_prompt: int, n: int,
              usage: str | None, calls: list[ToolCallOutput] | None = None,
              reasoning: list[ReasoningStream] | None = None) -> AsyncIterator[str]:
    """`usage`: None, "end" (OpenAI's include_usage: one last chunk with it) or "each" (also in
    every chunk, the counts so far: vLLM's continuous_usage_stats). `calls`: each choice's tool
    calls, made of its text (a forced tool call). `reasoning`: each choice's reasoning parser:
    its thinking goes out as `reasoning_content` deltas, the rest as content (or tool calls)."""
    obj = "text_completion" if kind == "text_completion" else "chat.completion.chunk"
    created = now_s()
    single = len(streams) == 1          # one request: its outputs directly, no merging layer
    outputs = streams[0].outputs() if single else _merged(streams)
    try:                # closing this generator must close the requests' (which aborts them)
        if kind != "text_completion":   # OpenAI's (and vLLM's) first chunk per choice: the role
            for i in range(len(streams)):
                yield _chunk(rid, obj, created, model, {"index": i, "delta": {"role": "assistant", "content": ""},
                                                        "finish_reason": None, "logprobs": None},
                             usage_of(n_prompt, streams, n) if usage == "each" else None)
        async for item in outputs:
            i, out = (0, item) if single else item
            text, lp = streams[i].render(kind, out)
            thought = None
            if reasoning is not None:
                thought, text = reasoning[i].feed(text, final=out.finished)
                if not thought and not text and not out.finished and lp is None:
                    continue                # all of it held back (a tag may be cut here)
            if kind == "text_completion":
                choice = {"index": i, "text": text, "finish_reason": out.finish_reason, "logprobs": lp}
            elif calls is not None:
                delta, reason = calls[i].delta(text, out.finished, out.finish_reason)
                choice = {"index": i, "delta": delta, "finish_reason": reason, "logprobs": lp}
            else:
                choice = {"index": i, "delta": {"content": text}, "finish_reason": out.finish_reason,
                          "logprobs": lp}
            if thought:
                choice["delta"] = {"reasoning_content": thought, **choice["delta"]}
                if not text and choice["delta"].get("content") == "":
                    del choice["delta"]["content"]
            yield _chunk(rid, obj, created, model, choice, usage_of(n_prompt, streams, n) if usage == "each" else None)
    finally:
        await _close(outputs)
    if usage is not None:
        final = {'id': rid, 'object': obj, 'created': created, 'model': model, 'choices': [],
                 'usage': usage_of(n_prompt, streams, n)}
        yield f"data: {json.dumps(final)}\n\n"
    yield "data: [DONE]\n\n"
