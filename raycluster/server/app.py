"""OpenAI-compatible HTTP API over a generation backend: one in-process engine (`AsyncEngine`)
or the cluster (`ClusterClient`, used by the Serve gateway).

Routes: POST /v1/completions, POST /v1/chat/completions (both with `stream` over SSE),
GET /v1/models, GET /health, GET /metrics (Prometheus text); with API keys, a bearer token
(raycluster.server.auth) on all but /health, /metrics and the docs. Prompts are tokenized once here;
token ids go to the backend, text deltas come back. A backend provides `admit()` (raises
`OverloadedError` before any tokenization), `next_id`, `generate` (async iterator of
`RequestOutput`; `InvalidRequestError` before the first one), `stats()`, `max_model_len` and
`prometheus_text()` for extra metrics lines. Errors a client causes are 400 in
OpenAI's error shape with `param` naming the field. `n` > 1 runs n backend requests (a seeded
one with seed + i for choice i) and merges them into the choices, streamed as they come; a
completion request with a batch of prompts runs n per prompt (choice p * n + i).
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import replace
from typing import AsyncIterator, Sequence

from fastapi import FastAPI, Request as HTTPRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from jinja2 import TemplateError

from raycluster.engine.engine import InvalidRequestError
from raycluster.request import SLO
from raycluster.model.tokenizer import bad_words_token_ids
from raycluster.server.auth import ApiKeyMiddleware
from raycluster.server.openai_logprobs import chat_logprobs, completion_logprobs, prompt_logprobs
from raycluster.server.protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                                       OverloadedError, TokenizeRequest, error_body, now_s)
from raycluster.server.request_metrics import RequestMetrics, RequestMetricsSink
from raycluster.engine.guided import Grammar, Regex
from raycluster.server.structured import PatternCheck, pattern_of
from raycluster.server.tool_parsers import tool_parser
from raycluster.server.tools import ToolCallOutput, template_message, template_tools, tool_mode, tool_parameters


def _bad_request(message: str, param: str | None, status: int = 400) -> JSONResponse:
    return JSONResponse(error_body(message, param), status_code=status)


def _overloaded(e: OverloadedError) -> JSONResponse:
    return JSONResponse(error_body(str(e), None, "overloaded_error", e.code), status_code=e.status,
                        headers={"Retry-After": str(max(1, round(e.retry_after_s)))})


def build_app(engine, tokenizer, model_names: str | Sequence[str], api_keys: Sequence[str] = (),
              tool_call_parser: str | None = None, metrics_sinks: Sequence[RequestMetricsSink] = (),
              sampling_defaults: dict | None = None) -> FastAPI:
    """`model_names`: the names a request's `model` may give (vLLM's --served-model-name); a
    response names the one its request gave, else the first. `sampling_defaults`: the model's
    default sampling parameters (its generation_config.json: raycluster.model.generation_config)
    for fields a request leaves out, `max_tokens` included. `api_keys`: if any, every route but /health, /metrics and the docs wants one of them as
    a bearer token (raycluster.server.auth). `tool_call_parser`: the model's tool-call syntax
    (raycluster.server.tool_parsers), which `tool_choice: "auto"` needs. `metrics_sinks`: where
    each request's metrics go besides /metrics (raycluster.server.request_metrics)."""
    names = [model_names] if isinstance(model_names, str) else list(model_names)
    if not names:
        raise ValueError("model_names: at least one name to serve under")
    parser = tool_parser(tool_call_parser)
    app = FastAPI(title="raycluster", version="0.1.0")
    if api_keys:
        app.add_middleware(ApiKeyMiddleware, keys=api_keys)
    metrics = RequestMetrics(metrics_sinks)

    @app.exception_handler(RequestValidationError)
    async def _validation(_, exc: RequestValidationError):
        err = exc.errors()[0] if exc.errors() else {"loc": (), "msg": "invalid request"}
        if err.get("type") == "json_invalid":
            return _bad_request(f"the body is not valid JSON: {err.get('ctx', {}).get('error', '')}", None)
        loc = [str(p) for p in err.get("loc", ()) if p != "body"]
        param = ".".join(loc) or None
        msg = str(err.get("msg")).removeprefix("Value error, ")
        return _bad_request(f"{param}: {msg}" if param else msg, param)

    @app.get("/health")
    async def health():
        ok, info = await engine.health()
        return JSONResponse({"status": "ok" if ok else "unavailable", **info}, status_code=200 if ok else 503)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": name, "object": "model", "created": now_s(),
                                            "owned_by": "raycluster", "root": names[0],
                                            "max_model_len": engine.max_model_len} for name in names]}

    @app.get("/metrics")
    async def prom():
        s = engine.stats()
        body = metrics.render(s) + engine.prometheus_text().encode()
        return Response(body, media_type=metrics.content_type)

    def _encode_prompt(prompt, field: str = "prompt", special: bool = True) -> list[int]:
        if isinstance(prompt, str) and not prompt:
            raise InvalidRequestError(field, "must not be empty")
        if isinstance(prompt, str):
            try:
                return tokenizer.encode(prompt, add_special_tokens=special)
            except ValueError as e:
                raise InvalidRequestError(field, str(e)) from None
        if prompt and all(isinstance(t, int) for t in prompt):
            return list(prompt)
        raise InvalidRequestError(field, "must be a string or a list of token ids")

    def _encode_prompts(prompt, echo: bool, special: bool = True) -> list[tuple[list[int], str]]:
        """(token ids, text) of each prompt of a completion request: one string or token-id list,
        or a batch of them (OpenAI's list of strings / of token-id lists). The text is the
        prompt as sent, or with `echo` its ids decoded (what `echo` returns)."""
        if isinstance(prompt, list) and prompt and not all(isinstance(t, int) for t in prompt):
            batch = [(p, f"prompt.{i}") for i, p in enumerate(prompt)]
        else:
            batch = [(prompt, "prompt")]
        out = []
        for p, field in batch:
            ids = _encode_prompt(p, field, special)
            out.append((ids, p if isinstance(p, str) else tokenizer.decode(ids) if echo else ""))
        return out

    patterns = PatternCheck(tokenizer)

    async def _structured(body, tool: str | None = None) -> Regex | Grammar | None:
        """The regex or grammar the output must match (checked to compile), or None. `tool`: the
        resolved tool choice of a chat request."""
        asked = pattern_of(body, tool)
        if asked is None:
            return None
        await patterns.check(*asked)
        return asked[1]

    async def _run(body, prompts: list[tuple[list[int], str]], kind: str, http: HTTPRequest, echo: bool = False,
                   guided: Regex | Grammar | None = None, tool: tuple | None = None):
        """Serve `prompts` ((ids, text) each) with `body.n` choices each: choice p * n + i is
        prompt p's i-th. `echo`: put each prompt's text before its choices' completions.
        `guided`: the regex or grammar every choice's output must match. `tool`: (mode, function name,
        parser) of a chat request's tool choice (raycluster.server.tools): the outputs are
        returned as tool calls."""
        max_tokens = getattr(body, "max_completion_tokens", None) or body.max_tokens
        default_max = (sampling_defaults or {}).get("max_tokens")
        model_name = body.model or names[0]
        if (k := body.truncate_prompt_tokens) is not None:      # vLLM's: keep the last k tokens
            prompts = [(ids[-k:], tokenizer.decode(ids[-k:]) if echo and len(ids) > k else text)
                       for ids, text in prompts]
        sampling = body.to_sampling(defaults=sampling_defaults)
        if body.bad_words:
            sampling.bad_words_token_ids = bad_words_token_ids(tokenizer, body.bad_words)
        if guided is not None:
            guided.into(sampling)
        room = engine.max_model_len - max(len(ids) for ids, _ in prompts)
        if max_tokens is not None and 0 < room < max_tokens:     # room <= 0: the prompt's own error
            field = "max_completion_tokens" if getattr(body, "max_completion_tokens", None) else "max_tokens"
            return _bad_request(f"{field}: {max_tokens} is too large: the context is {engine.max_model_len} tokens "
                                f"and the prompt takes {engine.max_model_len - room}", field)
        if max_tokens is None and default_max is not None:     # the model's default, within the context
            max_tokens = max(min(default_max, room), 1)
        if max_tokens is None and kind != "text_completion":
            max_tokens = max(room, 1)   # as vLLM's chat: up to the end of the context (or of the KV)
        if max_tokens is not None:
            sampling.max_tokens = max_tokens
        slo = SLO(ttft_s=body.ttft_slo_ms / 1e3 if body.ttft_slo_ms else None,
                  tpot_s=body.tpot_slo_ms / 1e3 if body.tpot_slo_ms else None)
        rid = engine.next_id("cmpl" if kind == "text_completion" else "chatcmpl")
        # Each choice is a request (the i-th of a prompt seeded seed + i, so seeded choices differ).
        slots = [(ids, text, i) for ids, text in prompts for i in range(body.n)]
        gens = [engine.generate(rid if len(slots) == 1 else f"{rid}-{k}", ids,
                                sampling if sampling.seed is None else replace(sampling, seed=sampling.seed + i),
                                slo=slo, priority=body.priority, tenant=body.tenant or "default", app_id=body.app_id)
                for k, (ids, _, i) in enumerate(slots)]
        t0 = time.perf_counter()
        # The first output surfaces validation errors before any byte is sent.
        try:
            firsts = [await gens[0].__anext__()] if len(gens) == 1 else \
                await asyncio.gather(*(g.__anext__() for g in gens), return_exceptions=True)
        except (InvalidRequestError, OverloadedError) as e:
            firsts = [e]
        err = next((e for e in firsts if isinstance(e, BaseException)), None)
        if err is not None:
            for g in gens:
                await g.aclose()
            if isinstance(err, InvalidRequestError):
                return _bad_request(str(err), err.field)
            if isinstance(err, OverloadedError):
                return _overloaded(err)
            raise err
        decode = tokenizer.decode if sampling.logprobs is not None else None
        streams = [_Stream(g, f, t0, metrics, decode, (text, ids) if echo else None, sampling.logprobs)
                   for g, f, (ids, text, _) in zip(gens, firsts, slots)]
        n_prompt = sum(len(ids) for ids, _ in prompts)
        metrics.admitted(sum(len(ids) for ids, _, _ in slots))
        if body.stream:
            opts = body.stream_options
            usage_mode = "each" if opts and opts.include_usage and opts.continuous_usage_stats else \
                "end" if opts and opts.include_usage else None
            calls = [ToolCallOutput(*tool) for _ in streams] if tool else None
            return _ClosingStreamingResponse(_sse(streams, rid, kind, model_name, n_prompt, body.n, usage_mode, calls),
                                             media_type="text/event-stream", requests=[s.gen for s in streams])
        results = await asyncio.gather(*(s.collect(kind) for s in streams))
        usage = _usage(n_prompt, streams, body.n)
        shown = body.shown_prompt_logprobs()
        plps = [None if shown is None or s.prompt_lps is None else
                prompt_logprobs(tokenizer.decode, ids, s.prompt_lps, shown) for s, (ids, _, _) in zip(streams, slots)]
        choices = []
        for i, (text, _, reason, logprobs) in enumerate(results):
            if kind == "text_completion":
                choices.append({"index": i, "text": text, "logprobs": logprobs, "finish_reason": reason,
                                "prompt_logprobs": plps[i]})
            else:
                message = {"role": "assistant", "content": text}
                if tool:
                    message, reason = ToolCallOutput(*tool).message(text, reason)
                choices.append({"index": i, "message": message, "logprobs": logprobs, "finish_reason": reason})
        out = {"id": rid, "object": kind, "created": now_s(), "model": model_name, "choices": choices, "usage": usage}
        if kind != "text_completion":       # vLLM's chat has them once per response (one prompt)
            out["prompt_logprobs"] = plps[0]
        return out

    def _unknown_model(body) -> JSONResponse | None:
        if body.model is None or body.model in names:
            return None
        served = ", ".join(f"`{n}`" for n in names)
        return JSONResponse(error_body(f"model: `{body.model}` does not exist (this server has {served})",
                                       "model", code="model_not_found"), status_code=404)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, http: HTTPRequest):
        if (missing := _unknown_model(body)) is not None:
            return missing
        try:
            engine.admit()
            prompts = _encode_prompts(body.prompt, body.echo, body.add_special_tokens)
            guided = await _structured(body)
        except OverloadedError as e:
            return _overloaded(e)
        except InvalidRequestError as e:
            return _bad_request(str(e), e.field)
        return await _run(body, prompts, "text_completion", http, body.echo, guided)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, http: HTTPRequest):
        if (missing := _unknown_model(body)) is not None:
            return missing
        try:
            engine.admit()
            ids = _chat_ids(body)
            mode = tool_mode(body, parser)
            guided = await _structured(body, mode)
        except OverloadedError as e:
            return _overloaded(e)
        except InvalidRequestError as e:
            return _bad_request(str(e), e.field)
        tool = None if mode is None else (mode, body.tool_choice.function.name if mode == "named" else None,
                                          parser.for_tools(tool_parameters(body)) if mode == "auto" else parser)
        return await _run(body, [(ids, "")], "chat.completion", http, guided=guided, tool=tool)

    def _chat_ids(body) -> list[int]:
        """The chat template over `body.messages` (a chat or tokenize request), tokenized. A
        template that refuses the messages (e.g. roles that do not alternate) is the client's
        error."""
        try:
            prompt = tokenizer.apply_chat_template([template_message(m) for m in body.messages],
                                                   add_generation_prompt=body.add_generation_prompt,
                                                   continue_final_message=body.continue_final_message,
                                                   tools=template_tools(body),
                                                   template_kwargs=body.chat_template_kwargs)
        except ValueError as e:
            field = "chat_template_kwargs" if str(e).startswith("chat_template_kwargs") else \
                "continue_final_message" if body.continue_final_message else "messages"
            raise InvalidRequestError(field, str(e).removeprefix("chat_template_kwargs: ")) from e
        except (TemplateError, TypeError) as e:       # a template that cannot render these messages
            raise InvalidRequestError("messages", f"the chat template cannot render them: {e}") from e
        try:        # the template writes BOS itself: none added on top unless asked (vLLM's rule)
            return tokenizer.encode(prompt, add_special_tokens=bool(body.add_special_tokens))
        except ValueError as e:
            raise InvalidRequestError("messages", str(e)) from None

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest):
        """vLLM's: the token ids a completion (or chat) request with this input would run."""
        if (missing := _unknown_model(body)) is not None:
            return missing
        try:
            ids = _encode_prompt(body.prompt, special=body.add_special_tokens is not False) \
                if body.messages is None else _chat_ids(body)
        except InvalidRequestError as e:
            return _bad_request(str(e), e.field)
        return {"count": len(ids), "max_model_len": engine.max_model_len, "tokens": ids}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        if (missing := _unknown_model(body)) is not None:
            return missing
        vocab = tokenizer.vocab_size
        bad = next((t for t in body.tokens if not 0 <= t < vocab), None)
        if bad is not None:
            return _bad_request(f"tokens: {bad} is not a token id of this model (0 to {vocab - 1})", "tokens")
        return {"prompt": tokenizer.decode(body.tokens)}

    return app


async def _close(agen) -> None:
    """Close an async generator even if this task is being cancelled: the close runs as its own
    task (shielded), so a request's abort does not depend on which await the cancel hits (a
    cancelled close would leave the generator to the garbage collector)."""
    await asyncio.shield(asyncio.ensure_future(agen.aclose()))


class _ClosingStreamingResponse(StreamingResponse):
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


class _Stream:
    """Consumes one request's outputs, recording TTFT/TPOT metrics."""

    def __init__(self, gen, first, t0: float, metrics: RequestMetrics, decode=None,
                 echo: tuple[str, list[int]] | None = None, num_top: int | None = None) -> None:
        self.gen, self.first, self.t0, self.metrics = gen, first, t0, metrics
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
        t_first = time.perf_counter()
        self.metrics.first_token(t_first - self.t0)
        out = self.first
        try:
            while True:
                self.n_out = out.num_output_tokens
                self.n_cached = max(self.n_cached, out.num_cached_tokens)
                if out.prompt_logprobs is not None:
                    self.prompt_lps = out.prompt_logprobs
                yield out
                if out.finished:
                    now, n = time.perf_counter(), out.num_output_tokens
                    self.metrics.finished(out.finish_reason, n, now - self.t0,
                                          (now - t_first) / (n - 1) if n > 1 else None)
                    return
                out = await self.gen.__anext__()
        finally:
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


async def _merged(streams: list[_Stream]) -> AsyncIterator[tuple[int, object]]:
    """(choice index, output) from every stream as they come; closing this closes them all."""
    q: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, s: _Stream) -> None:
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


def _usage(n_prompt: int, streams: list[_Stream], n: int) -> dict:
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


async def _sse(streams: list[_Stream], rid: str, kind: str, model: str, n_prompt: int, n: int,
               usage: str | None, calls: list[ToolCallOutput] | None = None) -> AsyncIterator[str]:
    """`usage`: None, "end" (OpenAI's include_usage: one last chunk with it) or "each" (also in
    every chunk, the counts so far: vLLM's continuous_usage_stats). `calls`: each choice's tool
    calls, made of its text (a forced tool call)."""
    obj = "text_completion" if kind == "text_completion" else "chat.completion.chunk"
    created = now_s()
    single = len(streams) == 1          # one request: its outputs directly, no merging layer
    outputs = streams[0].outputs() if single else _merged(streams)
    try:                # closing this generator must close the requests' (which aborts them)
        if kind != "text_completion":   # OpenAI's (and vLLM's) first chunk per choice: the role
            for i in range(len(streams)):
                yield _chunk(rid, obj, created, model, {"index": i, "delta": {"role": "assistant", "content": ""},
                                                        "finish_reason": None, "logprobs": None},
                             _usage(n_prompt, streams, n) if usage == "each" else None)
        async for item in outputs:
            i, out = (0, item) if single else item
            text, lp = streams[i].render(kind, out)
            if kind == "text_completion":
                choice = {"index": i, "text": text, "finish_reason": out.finish_reason, "logprobs": lp}
            elif calls is not None:
                delta, reason = calls[i].delta(text, out.finished, out.finish_reason)
                choice = {"index": i, "delta": delta, "finish_reason": reason, "logprobs": lp}
            else:
                choice = {"index": i, "delta": {"content": text}, "finish_reason": out.finish_reason,
                          "logprobs": lp}
            yield _chunk(rid, obj, created, model, choice, _usage(n_prompt, streams, n) if usage == "each" else None)
    finally:
        await _close(outputs)
    if usage is not None:
        final = {'id': rid, 'object': obj, 'created': created, 'model': model, 'choices': [],
                 'usage': _usage(n_prompt, streams, n)}
        yield f"data: {json.dumps(final)}\n\n"
    yield "data: [DONE]\n\n"
