"""OpenAI-compatible HTTP API over a generation backend: one in-process engine (`AsyncEngine`)
or the cluster (`ClusterClient`, used by the Serve gateway).

Routes: POST /v1/completions, POST /v1/chat/completions (both with `stream` over SSE), POST
/v1/responses (OpenAI's Responses API over the chat route, responses stored when given a store:
raycluster.server.responses_routes),
POST /v1/embeddings (raycluster.server.embeddings), POST /score and /rerank (also under /v1, and
/v2/rerank: raycluster.server.scoring), POST /classify (also /v1/classify: raycluster.server.classify),
GET /v1/models, GET /health, GET /metrics (Prometheus text); with API keys, a bearer token
(raycluster.server.auth) on all but /health, /metrics and the docs. Prompts are tokenized once here;
token ids go to the backend, text deltas come back. A backend provides `admit()` (raises
`OverloadedError` before any tokenization), `next_id`, `generate` (async iterator of
`RequestOutput`; `InvalidRequestError` before the first one), `stats()`, `max_model_len` and
`prometheus_text()` for extra metrics lines; one that serves LoRA adapters also provides
`lora_adapters()` (name -> path of those it knows now), `refresh_lora_adapters()` (async: the
same as they are, asked of the router in the cluster) and, for runtime updating (raycluster.server.lora_routes),
`load_lora` / `unload_lora`. Errors a client causes are 400 in
OpenAI's error shape with `param` naming the field. `n` > 1 runs n backend requests (a seeded
one with seed + i for choice i) and merges them into the choices, streamed as they come; a
completion request with a batch of prompts runs n per prompt (choice p * n + i).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import replace
from typing import Sequence

from fastapi import FastAPI, Request as HTTPRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from jinja2 import TemplateError

from raycluster.engine.engine import InvalidRequestError
from raycluster.model.config import ModelConfig
from raycluster.request import SLO
from raycluster.model.tokenizer import bad_words_token_ids
from raycluster.server.auth import ApiKeyMiddleware
from raycluster.server.openai_logprobs import prompt_logprobs
from raycluster.server.responses_routes import add_responses_routes
from raycluster.server.protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                                       OverloadedError, TokenizeRequest, error_body, now_s,
                                       overloaded_response)
from raycluster.server.embeddings import add_embedding_routes
from raycluster.server.images import (MAX_IMAGES_PER_PROMPT, ImageSpec, load_images, place_images, takes_parts,
                                      template_content)
from raycluster.server.videos import MAX_VIDEOS_PER_PROMPT
from raycluster.server.scoring import add_scoring_routes
from raycluster.server.classify import add_classify_routes
from raycluster.server.pooling_api import add_pooling_routes
from raycluster.server.lora_resolver import RESOLVER_DIR_ENV, LoRAResolver, resolver_dir
from raycluster.server.lora_routes import RUNTIME_LORA_ENV, add_lora_routes, runtime_lora_allowed
from raycluster.server.reasoning import REASONING_PARSERS, reasoning_stream, split_reasoning
from raycluster.server.request_metrics import RequestMetrics, RequestMetricsSink
from raycluster.server.streams import ClosingStreamingResponse, Stream, sse, usage_of
from raycluster.engine.guided import Grammar, Regex
from raycluster.server.structured import PatternCheck, pattern_of
from raycluster.server.tool_parsers import tool_parser
from raycluster.server.tools import ToolCallOutput, template_message, template_tools, tool_mode, tool_parameters


def request_logger() -> logging.Logger:
    """The `raycluster.requests` logger at INFO, to stderr unless something configured it (in a
    Serve replica stderr is the replica's log, which the Ray dashboard shows)."""
    log = logging.getLogger("raycluster.requests")
    if not log.handlers and log.level == logging.NOTSET:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)
        log.propagate = False
    return log


def _bad_request(message: str, param: str | None, status: int = 400) -> JSONResponse:
    return JSONResponse(error_body(message, param), status_code=status)




def template_kwargs(body) -> dict | None:
    """A chat (or tokenize) request's extra variables for the chat template: its
    chat_template_kwargs, and its reasoning_effort unless they set one themselves."""
    effort = getattr(body, "reasoning_effort", None)
    if effort is None:
        return body.chat_template_kwargs
    return {"reasoning_effort": effort, **(body.chat_template_kwargs or {})}


def build_app(engine, tokenizer, model_names: str | Sequence[str], api_keys: Sequence[str] = (),
              tool_call_parser: str | None = None, metrics_sinks: Sequence[RequestMetricsSink] = (),
              sampling_defaults: dict | None = None, log_requests: bool = False,
              reasoning_parser: str | None = None, request_id_header: bool = True,
              allow_runtime_lora: bool | None = None, lora_resolver_dir: str | None = None,
              lora_resolver_max_loaded: int | None = None, model_config: ModelConfig | None = None,
              response_store=None, images: ImageSpec | None = None,
              max_images: int = MAX_IMAGES_PER_PROMPT, allowed_local_media_path: str | None = None,
              max_videos: int = MAX_VIDEOS_PER_PROMPT, mm_embeds: bool = False) -> FastAPI:
    """`model_names`: the names a request's `model` may give (vLLM's --served-model-name); a
    response names the one its request gave, else the first. `sampling_defaults`: the model's
    default sampling parameters (its generation_config.json: raycluster.model.generation_config)
    for fields a request leaves out, `max_tokens` included. `log_requests` (vLLM's
    --enable-log-requests): a log line (logger `raycluster.requests`, INFO) when a request is
    received, with its sampling parameters but not its prompt, and when each choice ends.
    `reasoning_parser` (vLLM's --reasoning-parser, raycluster.server.reasoning): chat replies
    carry the model's thinking as `reasoning_content`, apart from `content` (and tool calls).
    LoRA adapters (the backend's `lora_adapters()`, vLLM's --lora-modules): a request whose `model`
    is one runs with that adapter; /v1/models lists them with the base as `parent`.
    `allow_runtime_lora`: serve /v1/load_lora_adapter and /v1/unload_lora_adapter (default: vLLM's
    VLLM_ALLOW_RUNTIME_LORA_UPDATING environment variable). `lora_resolver_dir` (default: vLLM's
    VLLM_LORA_RESOLVER_CACHE_DIR; needs runtime updating allowed): a request naming an unknown
    model is served from the adapter in that directory's subdirectory of the name, loaded first,
    keeping at most `lora_resolver_max_loaded` of those (raycluster.server.lora_resolver).
    `request_id_header`: answer with an `X-Request-Id` header (off behind Ray Serve, which sets the
    header on the way in, a UUID when the client sent none, and returns it itself).
    `api_keys`: if any, every route but /health, /metrics and the docs wants one of them as
    a bearer token (raycluster.server.auth). `tool_call_parser`: the model's tool-call syntax
    (raycluster.server.tool_parsers), which `tool_choice: "auto"` needs. `metrics_sinks`: where
    each request's metrics go besides /metrics (raycluster.server.request_metrics).
    `model_config`: the served model's (how /v1/embeddings pools, normalises and shortens vectors:
    raycluster.server.embeddings). `response_store`: where the Responses API keeps responses
    (raycluster.server.response_store; None: nothing is stored). `images`: how the model takes
    images (raycluster.server.images; None: chat requests with image parts are refused);
    `max_images` / `max_videos`: the most a request may carry (vLLM's limit_mm_per_prompt);
    `allowed_local_media_path` (vLLM's): a directory file: image URLs may read (None: refused).
    `mm_embeds` (vLLM's --enable-mm-embeds): chat messages may give images as precomputed
    embeddings (image_embeds parts; for trusted clients)."""
    names = [model_names] if isinstance(model_names, str) else list(model_names)
    lora_names = getattr(engine, "lora_adapters", dict)      # a backend without adapters may omit it

    async def adapters_now() -> dict[str, str]:
        """The adapters (name -> path) as they are (the router's, in the cluster): they come and
        go at run time."""
        refresh = getattr(engine, "refresh_lora_adapters", None)
        return await refresh() if refresh is not None else {}
    if set(lora_names()) & set(names):
        raise ValueError(f"LoRA adapters {sorted(set(lora_names()) & set(names))} also name the served model")
    rlog = request_logger() if log_requests else None
    if reasoning_parser is not None and reasoning_parser not in REASONING_PARSERS:
        raise ValueError(f"reasoning_parser: unknown {reasoning_parser!r}; choose one of {sorted(REASONING_PARSERS)}")
    thinking = REASONING_PARSERS.get(reasoning_parser) if reasoning_parser else None
    if not names:
        raise ValueError("model_names: at least one name to serve under")
    parser = tool_parser(tool_call_parser)
    app = FastAPI(title="raycluster", version="0.1.0")
    if api_keys:
        app.add_middleware(ApiKeyMiddleware, keys=api_keys)
    metrics = RequestMetrics(metrics_sinks, model_name=names[0], max_model_len=engine.max_model_len)

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

    resolver = None
    if runtime_lora_allowed(allow_runtime_lora):
        add_lora_routes(app, engine, names)
        if (root := resolver_dir(lora_resolver_dir)) is not None:
            resolver = LoRAResolver(root, engine, adapters_now, max_loaded=lora_resolver_max_loaded)
    elif lora_resolver_dir:
        raise ValueError("lora_resolver_dir: loading adapters on first use needs runtime LoRA updating "
                         f"(allow_runtime_lora_updating, or {RUNTIME_LORA_ENV})")
    if lora_resolver_max_loaded is not None and resolver is None:
        raise ValueError("lora_resolver_max_loaded: there is no LoRA resolver (lora_resolver_dir or "
                         f"{RESOLVER_DIR_ENV}, with runtime LoRA updating)")

    @app.get("/v1/models")
    async def models():
        adapters = await adapters_now()
        now = now_s()
        return {"object": "list", "data": [
            *({"id": name, "object": "model", "created": now, "owned_by": "raycluster", "root": names[0],
               "max_model_len": engine.max_model_len} for name in names),
            *({"id": name, "object": "model", "created": now, "owned_by": "raycluster", "root": path,
               "parent": names[0], "max_model_len": engine.max_model_len} for name, path in adapters.items())]}

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

    def _encode_pair(first: str, second: str, field: str, special: bool = True) -> tuple[list[int], int]:
        """A cross-encoder's input: the two texts joined by the tokenizer's pair template, and
        where the second starts (`Tokenizer.pair_encoding`)."""
        for text in (first, second):
            if not text:
                raise InvalidRequestError(field, "must not be empty")
        try:
            return tokenizer.pair_encoding(first, second, add_special_tokens=special)
        except ValueError as e:
            raise InvalidRequestError(field, str(e)) from None

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
                   guided: Regex | Grammar | None = None, tool: tuple | None = None, prompt_images: list | None = None):
        """Serve `prompts` ((ids, text) each) with `body.n` choices each: choice p * n + i is
        prompt p's i-th. `echo`: put each prompt's text before its choices' completions.
        `guided`: the regex or grammar every choice's output must match. `tool`: (mode, function name,
        parser) of a chat request's tool choice (raycluster.server.tools): the outputs are
        returned as tool calls. `prompt_images`: the prompt's (`ImageInput`s; one prompt)."""
        max_tokens = getattr(body, "max_completion_tokens", None) or body.max_tokens
        default_max = (sampling_defaults or {}).get("max_tokens")
        model_name = body.model or names[0]
        if prompt_images and body.truncate_prompt_tokens is not None:
            return _bad_request("truncate_prompt_tokens: a prompt with images is not cut", "truncate_prompt_tokens")
        if (k := body.truncate_prompt_tokens) is not None:      # vLLM's: keep the last k tokens
            prompts = [(ids[-k:], tokenizer.decode(ids[-k:]) if echo and len(ids) > k else text)
                       for ids, text in prompts]
        sampling = body.to_sampling(defaults=sampling_defaults)
        if model_name not in names:            # an adapter (`_unknown_model` let it through)
            sampling.lora_adapter = model_name
        if body.bad_words:
            sampling.bad_words_token_ids = bad_words_token_ids(tokenizer, body.bad_words)
        if thinking is not None and thinking.keeps_special_tokens and kind != "text_completion":
            sampling.skip_special_tokens = False    # gpt-oss's channel markers are special tokens
        if guided is not None:
            guided.into(sampling)
        if prompt_images:
            sampling.images = prompt_images
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
        prefix = "cmpl" if kind == "text_completion" else "chatcmpl"
        rid = engine.next_id(prefix)
        # vLLM's: a client's X-Request-Id names the response (the backend keeps its own unique id).
        client_id = http.headers.get("x-request-id")
        if client_id is not None and not (0 < len(client_id) <= 256 and client_id.isprintable()):
            return _bad_request("X-Request-Id: must be 1 to 256 printable characters", "X-Request-Id")
        response_id = f"{prefix}-{client_id}" if client_id else rid
        headers = {"X-Request-Id": client_id or response_id} if request_id_header else None
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
                return overloaded_response(err)
            raise err
        decode = tokenizer.decode if sampling.logprobs is not None else None
        if rlog is not None:
            rlog.info("received %s (backend %s): prompt tokens %s, n %d, stream %s, max_tokens %d, temperature %g, "
                      "top_p %g, top_k %d, seed %s, priority %d, tenant %s, app_id %s", response_id, rid,
                      [len(ids) for ids, _ in prompts], body.n, body.stream, sampling.max_tokens,
                      sampling.temperature, sampling.top_p, sampling.top_k, sampling.seed, body.priority,
                      body.tenant or "default", body.app_id)

        def ended(k: int):
            if rlog is None:
                return None
            return lambda reason, n, ttft, e2e: rlog.info(
                "finished %s choice %d: %s, %d tokens, ttft %.3f s, e2e %.3f s", response_id, k, reason, n, ttft, e2e)
        streams = [Stream(g, f, t0, metrics, decode, (text, ids) if echo else None, sampling.logprobs, ended(k))
                   for k, (g, f, (ids, text, _)) in enumerate(zip(gens, firsts, slots))]
        n_prompt = sum(len(ids) for ids, _ in prompts)
        metrics.admitted(sum(len(ids) for ids, _, _ in slots), sampling.max_tokens, body.n)
        if body.stream:
            opts = body.stream_options
            usage_mode = "each" if opts and opts.include_usage and opts.continuous_usage_stats else \
                "end" if opts and opts.include_usage else None
            calls = [ToolCallOutput(*tool) for _ in streams] if tool else None
            reasoning = [reasoning_stream(thinking) for _ in streams] if thinking and kind != "text_completion" \
                else None
            body_iter = sse(streams, response_id, kind, model_name, n_prompt, body.n, usage_mode, calls, reasoning)
            return ClosingStreamingResponse(body_iter, media_type="text/event-stream",
                                            requests=[s.gen for s in streams], headers=headers)
        results = await asyncio.gather(*(s.collect(kind) for s in streams))
        usage = usage_of(n_prompt, streams, body.n)
        shown = body.shown_prompt_logprobs()
        plps = [None if shown is None or s.prompt_lps is None else
                prompt_logprobs(tokenizer.decode, ids, s.prompt_lps, shown) for s, (ids, _, _) in zip(streams, slots)]
        choices = []
        for i, (text, _, reason, logprobs) in enumerate(results):
            if kind == "text_completion":
                choices.append({"index": i, "text": text, "logprobs": logprobs, "finish_reason": reason,
                                "prompt_logprobs": plps[i]})
            else:
                thought, text = split_reasoning(thinking, text) if thinking else (None, text)
                message = {"role": "assistant", "content": text}
                if tool:
                    message, reason = ToolCallOutput(*tool).message(text or "", reason)
                if thinking:
                    message["reasoning_content"] = thought
                choices.append({"index": i, "message": message, "logprobs": logprobs, "finish_reason": reason})
        out = {"id": response_id, "object": kind, "created": now_s(), "model": model_name, "choices": choices,
               "usage": usage}
        if kind != "text_completion":       # vLLM's chat has them once per response (one prompt)
            out["prompt_logprobs"] = plps[0]
        return JSONResponse(out, headers=headers)

    async def _unknown_model(body) -> JSONResponse | None:
        if resolver is not None and body.model is not None:
            resolver.touch(body.model)
        if body.model is None or body.model in names or body.model in lora_names():
            return None
        adapters = await adapters_now()          # what this process knew may be behind
        if body.model in adapters:
            return None
        why = "" if resolver is None else await resolver.resolve(body.model)
        if why is None:
            return None                          # loaded from the resolver's directory just now
        served = ", ".join(f"`{n}`" for n in [*names, *adapters])
        return JSONResponse(error_body(f"model: `{body.model}` does not exist (this server has {served})"
                                       + (f"; {why}" if why else ""), "model", code="model_not_found"),
                            status_code=404)

    chat_ids = (lambda body: _chat_ids(body)) if tokenizer is not None else None
    add_embedding_routes(app, engine, names, _encode_prompt, _unknown_model, model_config, chat_ids, metrics)
    add_scoring_routes(app, engine, names, _encode_prompt, _encode_pair if tokenizer is not None else None,
                       _unknown_model, model_config, metrics)
    add_classify_routes(app, engine, names, _encode_prompt, _unknown_model, model_config, chat_ids, metrics)
    add_pooling_routes(app, engine, names, _encode_prompt, _unknown_model, model_config, chat_ids, metrics)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, http: HTTPRequest):
        if (missing := await _unknown_model(body)) is not None:
            return missing
        try:
            engine.admit()
            prompts = _encode_prompts(body.prompt, body.echo, body.add_special_tokens)
            guided = await _structured(body)
        except OverloadedError as e:
            return overloaded_response(e)
        except InvalidRequestError as e:
            return _bad_request(str(e), e.field)
        return await _run(body, prompts, "text_completion", http, body.echo, guided)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, http: HTTPRequest):
        if (missing := await _unknown_model(body)) is not None:
            return missing
        try:
            engine.admit()
            ids, image_inputs = await _chat_prompt(body)
            mode = tool_mode(body, parser)
            guided = await _structured(body, mode)
        except OverloadedError as e:
            return overloaded_response(e)
        except InvalidRequestError as e:
            return _bad_request(str(e), e.field)
        tool = None if mode is None else (mode, body.tool_choice.function.name if mode == "named" else None,
                                          parser.for_tools(tool_parameters(body)) if mode == "auto" else parser)
        return await _run(body, [(ids, "")], "chat.completion", http, guided=guided, tool=tool, prompt_images=image_inputs)

    add_responses_routes(app, chat, names, response_store)

    async def _chat_prompt(body) -> tuple[list[int], list]:
        """The chat request's prompt ids, its image tokens expanded, and its images on them."""
        loaded = await load_images(body.messages, images, max_images, local_root=allowed_local_media_path,
                                   video_limit=max_videos, embeds=mm_embeds)
        ids = _chat_ids(body, with_images=True, loaded=loaded)
        return place_images(ids, loaded, images) if loaded else (ids, [])

    def _chat_ids(body, with_images: bool = False, loaded=()) -> list[int]:
        """The chat template over `body.messages` (a chat or tokenize request), tokenized; image
        parts as the image token, once each (`_chat_prompt` expands them), or on Gemma 3 as its
        marker, expanded in the text for the `loaded` images before tokenizing. A template that
        refuses the messages (e.g. roles that do not alternate) is the client's error."""
        if not with_images and any(m.media() for m in body.messages):
            raise InvalidRequestError("messages", "image_url, video_url and image_embeds parts are taken by "
                                      "/v1/chat/completions and /tokenize only")
        parts = takes_parts(tokenizer.chat_template)
        image_text, video_text = (images.token_text, images.video_text) if images is not None else (None, None)
        try:
            prompt = tokenizer.apply_chat_template([template_message(m) | {"content": template_content(m, parts, image_text, video_text)}
                                                    for m in body.messages],
                                                   add_generation_prompt=body.add_generation_prompt,
                                                   continue_final_message=body.continue_final_message,
                                                   tools=template_tools(body),
                                                   template_kwargs=template_kwargs(body))
        except ValueError as e:
            field = "chat_template_kwargs" if str(e).startswith("chat_template_kwargs") else \
                "continue_final_message" if body.continue_final_message else "messages"
            raise InvalidRequestError(field, str(e).removeprefix("chat_template_kwargs: ")) from e
        except (TemplateError, TypeError) as e:       # a template that cannot render these messages
            raise InvalidRequestError("messages", f"the chat template cannot render them: {e}") from e
        if loaded:
            prompt = images.expand_text(prompt, loaded)
        try:        # the template writes BOS itself: none added on top unless asked (vLLM's rule)
            return tokenizer.encode(prompt, add_special_tokens=bool(body.add_special_tokens))
        except ValueError as e:
            raise InvalidRequestError("messages", str(e)) from None

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest):
        """vLLM's: the token ids a completion (or chat) request with this input would run."""
        if (missing := await _unknown_model(body)) is not None:
            return missing
        try:
            ids = _encode_prompt(body.prompt, special=body.add_special_tokens is not False) \
                if body.messages is None else (await _chat_prompt(body))[0]
        except InvalidRequestError as e:
            return _bad_request(str(e), e.field)
        return {"count": len(ids), "max_model_len": engine.max_model_len, "tokens": ids}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        if (missing := await _unknown_model(body)) is not None:
            return missing
        vocab = tokenizer.vocab_size
        bad = next((t for t in body.tokens if not 0 <= t < vocab), None)
        if bad is not None:
            return _bad_request(f"tokens: {bad} is not a token id of this model (0 to {vocab - 1})", "tokens")
        return {"prompt": tokenizer.decode(body.tokens)}

    return app
