"""`POST /v1/embeddings` (OpenAI's embeddings API, as vLLM serves it for a model run as a pooling
model): each input's vector pools the final hidden states (after the model's last norm) of its
prompt as the model's pooler says (raycluster.model.pooling: the last token, the mean over the
prompt or the first token; a sentence-transformers checkpoint's own Pooling module, else a
decoder's last token, vLLM's `--convert embed` for a causal LM), cut to `dimensions` and
L2-normalised (unless the checkpoint's modules or the request's `normalize` say not).

Input: `input` a string, a list of strings, a list of token ids or a list of token-id lists;
or vLLM's chat form, `messages` through the chat template (`add_generation_prompt` off by
default, `continue_final_message`, `chat_template_kwargs`); `encoding_format` "float" (lists of
floats) or "base64" (little-endian float32 bytes, as
OpenAI's client decodes them); `dimensions` (a Matryoshka model's shorter vectors: its config's
`is_matryoshka` / `matryoshka_dimensions`; otherwise only its hidden size); vLLM's
`truncate_prompt_tokens` (keep the last k tokens), `add_special_tokens` (default true) and
`normalize`. Each input runs as one request of the backend (`engine.generate` with
`SamplingParams(embed=True, max_tokens=1)`): prefill only, wherever the backend places it (one
engine, or any prefill or mixed instance of the cluster), ending with its prompt (no token); the
backend returns the raw pooled vector and this module finishes it (`finish_vector`). Errors are
OpenAI's shape naming the field; a full queue is 429 with Retry-After.
"""

from __future__ import annotations

import asyncio
import base64
import time
from typing import Any, Callable, Literal

import numpy as np
from fastapi import FastAPI
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from raycluster.engine.engine import InvalidRequestError
from raycluster.model.config import ModelConfig
from raycluster.model.pooling import PoolerConfig, check_dimensions, finish_vector
from raycluster.request import SamplingParams
from raycluster.server.request_metrics import RequestMetrics
from raycluster.server.protocol import (ChatMessage, OverloadedError, continue_needs_no_new_turn, error_body,
                                       now_s, overloaded_response)


class PoolingInput(BaseModel):
    """The input of a pooling request (/v1/embeddings, /classify): `input` as OpenAI's embeddings
    take it, or vLLM's chat form, `messages` through the chat template (without a generation
    prompt unless asked); exactly one of the two."""
    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    input: Any = None   # str | list[str] | list[int] | list[list[int]]: checked by `request_inputs`
    messages: list[ChatMessage] | None = None
    add_generation_prompt: bool = False
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: None = None              # what the chat template reads (no tools here)
    user: str | None = None
    truncate_prompt_tokens: int | None = Field(None, ge=1)
    # None: on for `input` (as OpenAI's), off for `messages` (the template writes BOS itself).
    add_special_tokens: bool | None = None

    @field_validator("continue_final_message")
    @classmethod
    def _continue_or_new_turn(cls, v, info: ValidationInfo):
        return continue_needs_no_new_turn(v, info)

    @model_validator(mode="after")
    def _one_input(self) -> "PoolingInput":
        if (self.input is None) == (self.messages is None):
            raise ValueError("give exactly one of input and messages")
        return self


class EmbeddingRequest(PoolingInput):
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, ge=1)
    normalize: bool | None = None       # vLLM's: None -> the model's pooler default


def request_inputs(body: PoolingInput, encode: Callable[..., list[int]],
                   chat_ids: Callable[[PoolingInput], list[int]] | None) -> list[list[int]]:
    """Each input's token ids, cut to `truncate_prompt_tokens` (InvalidRequestError naming
    `input` / `input.i` / `messages`). `encode(prompt, field, add_special_tokens)`: a prompt's
    ids; `chat_ids(body)`: the messages' ids through the chat template (None: no tokenizer)."""
    k = body.truncate_prompt_tokens
    if body.messages is not None:
        if chat_ids is None:
            raise InvalidRequestError("messages", "this server has no chat template to render them")
        ids = chat_ids(body)
        return [ids[-k:] if k is not None else ids]
    raw = body.input
    if not isinstance(raw, (str, list)):
        raise InvalidRequestError("input", "must be a string, a list of strings, a list of token ids or a list "
                                           "of token-id lists")
    if isinstance(raw, list) and not raw:
        raise InvalidRequestError("input", "must not be empty")
    batch = [(raw, "input")] if isinstance(raw, str) or all(isinstance(t, int) for t in raw) else \
        [(p, f"input.{i}") for i, p in enumerate(raw)]
    out = []
    for prompt, field in batch:
        if not isinstance(prompt, (str, list)):
            raise InvalidRequestError(field, "must be a string or a list of token ids")
        ids = encode(prompt, field, body.add_special_tokens is not False)
        out.append(ids[-k:] if k is not None else ids)
    return out


def _vector(values: list[float], encoding: str) -> list[float] | str:
    if encoding == "float":
        return values
    return base64.b64encode(np.asarray(values, dtype="<f4").tobytes()).decode()


def adapter_of(body, names: list[str]) -> str | None:
    """The LoRA adapter a pooling request's `model` names (None: a served base-model name, or none)."""
    return body.model if body.model is not None and body.model not in names else None


def input_fields(n: int) -> list[str]:
    """The field names of `n` inputs of `input`, as errors name them."""
    return ["input"] if n == 1 else [f"input.{k}" for k in range(n)]


async def pool_prompts(engine, rid: str, prompts: list[list[int]], fields: list[str],
                       lora_adapter: str | None = None, metrics: RequestMetrics | None = None,
                       pair_starts: list[int] | None = None, pool_tokens: bool = False) -> list:
    """The raw pooled vector of each prompt (token ids), run as pooling requests of `engine`
    (request ids `rid`, or `rid-k` for several) side by side. Raises the first failure:
    `InvalidRequestError` naming the failing prompt's field from `fields`, or `OverloadedError`.
    `metrics`: each prompt counts as a request (its prompt tokens, and when it ends its latency,
    no output tokens), as vLLM counts pooling requests. `pair_starts`: each prompt's second text's
    first position, for a cross-encoder's pairs (`SamplingParams.pair_start`); `pool_tokens`:
    each prompt's rows, one list per token (`SamplingParams.pool_tokens`)."""
    starts = pair_starts or [0] * len(prompts)

    async def one(k: int, ids: list[int]) -> list[float]:
        t0 = time.perf_counter()
        sampling = SamplingParams(max_tokens=1, embed=True, lora_adapter=lora_adapter, pair_start=starts[k],
                                  pool_tokens=pool_tokens)
        gen = engine.generate(rid if len(prompts) == 1 else f"{rid}-{k}", ids, sampling)
        if metrics is not None:
            metrics.admitted(len(ids))
        try:
            async for out in gen:
                if out.finished:
                    if out.embedding is None:
                        raise InvalidRequestError("input", f"no embedding came back ({out.finish_reason})")
                    if metrics is not None:
                        metrics.finished(out.finish_reason, 0, time.perf_counter() - t0, None, len(ids))
                    return out.embedding
        finally:
            await gen.aclose()
        raise InvalidRequestError("input", "the request ended without an embedding")

    results = await asyncio.gather(*(one(k, ids) for k, ids in enumerate(prompts)), return_exceptions=True)
    for k, r in enumerate(results):
        if isinstance(r, InvalidRequestError) and r.field in ("prompt", "input"):
            # The backend names a prompt `prompt`: here it is this input.
            raise InvalidRequestError(fields[k], str(r).partition(": ")[2]) from None
        if isinstance(r, BaseException):
            raise r
    return results


def add_embedding_routes(app: FastAPI, engine, names: list[str], encode: Callable[..., list[int]],
                         unknown_model, model_config: ModelConfig | None = None,
                         chat_ids: Callable[[PoolingInput], list[int]] | None = None,
                         metrics: RequestMetrics | None = None) -> None:
    """Register /v1/embeddings over `engine` (`generate`, `next_id`, `admit`). `encode(prompt,
    field, add_special_tokens)`: a prompt's ids; `unknown_model(body)`: the 404 for a `model`
    not served, or None; `model_config`: the served model's (its pooler and hidden size; None:
    the default pooler, `dimensions` checked against the vectors that come back); `chat_ids`:
    a `messages` request's ids through the chat template (None: no tokenizer here); `metrics`:
    where each input is counted (`pool_prompts`)."""
    pooler = model_config.pooler if model_config is not None else PoolerConfig()

    @app.post("/v1/embeddings")
    async def embeddings(body: EmbeddingRequest):
        if (missing := await unknown_model(body)) is not None:
            return missing
        if model_config is not None and model_config.labels:
            return JSONResponse(error_body("model: this model is a sequence classifier: use /classify (or /score "
                                           "and /rerank for a one-label cross-encoder)", "model"), status_code=400)
        if model_config is not None and \
                (why := check_dimensions(pooler, body.dimensions, pooler.output_size(model_config.hidden_size))) \
                is not None:
            return JSONResponse(error_body(f"dimensions: {why}", "dimensions"), status_code=400)
        try:
            engine.admit()
            prompts = request_inputs(body, encode, chat_ids)
        except OverloadedError as e:
            return overloaded_response(e)
        except InvalidRequestError as e:
            return JSONResponse(error_body(str(e), e.field), status_code=400)
        rid = engine.next_id("embd")
        try:
            results = await pool_prompts(engine, rid, prompts, input_fields(len(prompts)), adapter_of(body, names),
                                         metrics)
        except InvalidRequestError as e:
            return JSONResponse(error_body(str(e), e.field), status_code=400)
        except OverloadedError as e:
            return overloaded_response(e)
        if model_config is None and (why := check_dimensions(pooler, body.dimensions, len(results[0]))) is not None:
            return JSONResponse(error_body(f"dimensions: {why}", "dimensions"), status_code=400)
        normalize = pooler.normalize if body.normalize is None else body.normalize
        results = [finish_vector(v, body.dimensions, normalize) for v in results]
        n = sum(len(ids) for ids in prompts)
        return JSONResponse({
            "id": rid, "object": "list", "created": now_s(), "model": body.model or names[0],
            "data": [{"index": k, "object": "embedding", "embedding": _vector(v, body.encoding_format)}
                     for k, v in enumerate(results)],
            "usage": {"prompt_tokens": n, "total_tokens": n}})

