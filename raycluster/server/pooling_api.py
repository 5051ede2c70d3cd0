"""`POST /pooling` (also `/v1/pooling`): vLLM's pooling API, the raw outputs of a pooling model
for one pooling task.

Tasks, as vLLM names them: `embed` (the pooled vector, as /v1/embeddings), `classify` (a
classifier's label probabilities, as /classify), `token_embed` (every prompt token's final hidden
state, through the checkpoint's Dense modules if any, each normalised unless `normalize` is false:
multi-vector retrieval) and `token_classify` (every token's label probabilities: a
*ForTokenClassification's NER tags, or a sequence classifier's head on each token, a reward
model's per-token scores). An embedding model serves embed and token_embed, a sequence classifier
classify and token_classify, a token classifier token_classify only; `task` left out is the
first of those. Input as /v1/embeddings takes it (`input` or chat `messages`,
`truncate_prompt_tokens`, `add_special_tokens`); `use_activation: false` gives raw logits;
`encoding_format` float or base64 (the output's float32 values, flattened, little-endian).
`data[i].data` is a list of floats, or for a token task one list per prompt token. Token-level
requests skip the prefix cache (a hit would skip the rows they return).
"""

from __future__ import annotations

import base64
from typing import Callable, Literal

import numpy as np
from fastapi import FastAPI
from fastapi.responses import JSONResponse
from pydantic import Field

from raycluster.engine.engine import InvalidRequestError
from raycluster.model.config import ModelConfig
from raycluster.model.pooling import finish_vector
from raycluster.server.classify import label_probs
from raycluster.server.embeddings import PoolingInput, adapter_of, input_fields, pool_prompts, request_inputs
from raycluster.server.protocol import OverloadedError, error_body, now_s, overloaded_response
from raycluster.server.request_metrics import RequestMetrics

TOKEN_TASKS = ("token_embed", "token_classify")


class PoolingRequest(PoolingInput):
    task: Literal["embed", "classify", "token_embed", "token_classify"] | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, ge=1)      # refused, as vLLM's /pooling does
    normalize: bool | None = None                   # embed / token_embed: None -> the model's pooler default
    use_activation: bool = True                     # classify / token_classify: false -> raw logits


def supported_tasks(model_config: ModelConfig | None) -> tuple[str, ...]:
    """The pooling tasks a model serves, its default first."""
    if model_config is not None and model_config.token_classifier:
        return ("token_classify",)
    if model_config is not None and model_config.labels:
        return ("classify", "token_classify")
    return ("embed", "token_embed")


def _finish(raw, task: str, body: PoolingRequest, default_normalize: bool):
    """One input's output for `task` from the engine's raw vector ([H]) or rows ([n, H])."""
    if task in ("classify", "token_classify"):
        rows = raw if task == "token_classify" else [raw]
        out = [label_probs(r, body.use_activation) for r in rows]
        return out if task == "token_classify" else out[0]
    normalize = default_normalize if body.normalize is None else body.normalize
    return [finish_vector(r, None, normalize) for r in raw] if task == "token_embed" else \
        finish_vector(raw, None, normalize)


def _encoded(values, fmt: str):
    if fmt == "float":
        return values
    return base64.b64encode(np.asarray(values, dtype="<f4").tobytes()).decode()


def add_pooling_routes(app: FastAPI, engine, names: list[str], encode: Callable[..., list[int]], unknown_model,
                       model_config: ModelConfig | None = None,
                       chat_ids: Callable[[PoolingInput], list[int]] | None = None,
                       metrics: RequestMetrics | None = None) -> None:
    """Register /pooling over `engine` (`admit`, `next_id`, `generate`); the other arguments as
    `add_embedding_routes`'s."""
    tasks = supported_tasks(model_config)
    default_normalize = model_config.pooler.normalize if model_config is not None else True

    async def pooling(body: PoolingRequest):
        if (missing := await unknown_model(body)) is not None:
            return missing
        task = body.task or tasks[0]
        if task not in tasks:
            return JSONResponse(error_body(f"task: {task!r} is not served by this model (it serves "
                                           f"{', '.join(tasks)})", "task"), status_code=400)
        if body.dimensions is not None:
            return JSONResponse(error_body("dimensions: not supported by /pooling (ask /v1/embeddings)",
                                           "dimensions"), status_code=400)
        try:
            engine.admit()
            prompts = request_inputs(body, encode, chat_ids)
            rid = engine.next_id("pooling")
            raw = await pool_prompts(engine, rid, prompts, input_fields(len(prompts)), adapter_of(body, names),
                                     metrics, pool_tokens=task in TOKEN_TASKS)
        except OverloadedError as e:
            return overloaded_response(e)
        except InvalidRequestError as e:
            return JSONResponse(error_body(str(e), e.field), status_code=400)
        data = [{"index": k, "object": "pooling",
                 "data": _encoded(_finish(r, task, body, default_normalize), body.encoding_format)}
                for k, r in enumerate(raw)]
        n = sum(map(len, prompts))
        return JSONResponse({"id": rid, "object": "list", "created": now_s(), "model": body.model or names[0],
                             "data": data, "usage": {"prompt_tokens": n, "total_tokens": n, "completion_tokens": 0}})

    for path in ("/pooling", "/v1/pooling"):
        app.post(path)(pooling)
