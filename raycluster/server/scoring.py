"""vLLM's score and rerank APIs over an embedding model (a bi-encoder): `POST /score` (also
`/v1/score`) and `POST /rerank` (also `/v1/rerank` and `/v2/rerank`, the Jina / Cohere shape).

A pair's score is the cosine similarity of the two texts' pooled vectors, each pooled as
/v1/embeddings pools it (raycluster.server.embeddings.pool_prompts; the full vector, before any
Matryoshka cut), what vLLM computes for an embedding model. Cross-encoders (a classification head
reading both texts at once) are not served.

Score: `text_1` a string or a list, `text_2` a string or a list; one `text_1` scores against each
`text_2` (1:N), or equal-length lists pair up (N:N). Rerank: `query` against each of `documents`
(strings or `{"text": ...}`), results sorted by `relevance_score` descending, cut to `top_n`
(absent or 0: all), each with its `document` unless `return_documents` is false. Both take vLLM's
`truncate_prompt_tokens` (keep the last k tokens of each text) and `add_special_tokens`. Each
distinct text is pooled once; `usage` counts those texts' tokens. Errors are OpenAI's shape
naming the field (`text_2.3`, `documents.1`); a full queue is 429 with Retry-After.
"""

from __future__ import annotations

from typing import Callable

import torch
from fastapi import FastAPI
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from raycluster.engine.engine import InvalidRequestError
from raycluster.server.embeddings import pool_prompts
from raycluster.server.protocol import OverloadedError, error_body, now_s, overloaded_response


class ScoreRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    text_1: str | list[str]
    text_2: str | list[str]
    truncate_prompt_tokens: int | None = Field(None, ge=1)
    add_special_tokens: bool = True


class RerankDocument(BaseModel):
    model_config = ConfigDict(extra="ignore")
    text: str


class RerankRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    query: str
    documents: list[str | RerankDocument]
    top_n: int | None = Field(None, ge=0)
    return_documents: bool = True
    truncate_prompt_tokens: int | None = Field(None, ge=1)
    add_special_tokens: bool = True


def score_pairs(body: ScoreRequest) -> tuple[list[tuple[str, str]], list[tuple[int, int]]]:
    """(the distinct texts with their field names, each pair as indices into them)."""
    ones = [body.text_1] if isinstance(body.text_1, str) else body.text_1
    twos = [body.text_2] if isinstance(body.text_2, str) else body.text_2
    if not ones:
        raise InvalidRequestError("text_1", "must not be empty")
    if not twos:
        raise InvalidRequestError("text_2", "must not be empty")
    if len(ones) != 1 and len(ones) != len(twos):
        raise InvalidRequestError("text_1", f"must be one text or as many as text_2 ({len(twos)}), got {len(ones)}")

    def named(texts: list[str] | str, field: str) -> list[tuple[str, str]]:
        return [(texts, field)] if isinstance(texts, str) else [(t, f"{field}.{i}") for i, t in enumerate(texts)]
    texts = named(body.text_1, "text_1") + named(body.text_2, "text_2")
    first = len(ones)
    pairs = [(0 if len(ones) == 1 else i, first + i) for i in range(len(twos))]
    return texts, pairs


def cosine(a: list[float], b: list[float]) -> float:
    return torch.nn.functional.cosine_similarity(torch.tensor(a, dtype=torch.float32),
                                                 torch.tensor(b, dtype=torch.float32), dim=0).item()


def add_scoring_routes(app: FastAPI, engine, names: list[str], encode: Callable[..., list[int]], unknown_model) -> None:
    """Register the score and rerank routes over `engine` (as /v1/embeddings: `admit`,
    `next_id`, `generate`). `encode(text, field, add_special_tokens)`: a text's ids;
    `unknown_model(body)`: the 404 for a `model` not served, or None."""

    async def vectors(body, texts: list[tuple[str, str]], kind: str) -> tuple[str, list[list[float]], int]:
        """(request id, each text's raw pooled vector, tokens pooled): may raise
        InvalidRequestError or OverloadedError."""
        engine.admit()
        prompts = []
        for text, field in texts:
            ids = encode(text, field, body.add_special_tokens)
            k = body.truncate_prompt_tokens
            prompts.append(ids[-k:] if k is not None else ids)
        rid = engine.next_id(kind)
        lora = body.model if body.model is not None and body.model not in names else None
        return rid, await pool_prompts(engine, rid, prompts, [f for _, f in texts], lora), sum(map(len, prompts))

    def failed(e: Exception) -> JSONResponse:
        if isinstance(e, OverloadedError):
            return overloaded_response(e)
        return JSONResponse(error_body(str(e), e.field), status_code=400)

    async def score(body: ScoreRequest):
        if (missing := await unknown_model(body)) is not None:
            return missing
        try:
            texts, pairs = score_pairs(body)
            rid, vecs, n = await vectors(body, texts, "score")
        except (InvalidRequestError, OverloadedError) as e:
            return failed(e)
        return JSONResponse({
            "id": rid, "object": "list", "created": now_s(), "model": body.model or names[0],
            "data": [{"index": k, "object": "score", "score": cosine(vecs[a], vecs[b])}
                     for k, (a, b) in enumerate(pairs)],
            "usage": {"prompt_tokens": n, "total_tokens": n, "completion_tokens": 0}})

    async def rerank(body: RerankRequest):
        if (missing := await unknown_model(body)) is not None:
            return missing
        docs = [d if isinstance(d, str) else d.text for d in body.documents]
        try:
            if not docs:
                raise InvalidRequestError("documents", "must not be empty")
            texts = [(body.query, "query")] + [(d, f"documents.{i}") for i, d in enumerate(docs)]
            rid, vecs, n = await vectors(body, texts, "rerank")
        except (InvalidRequestError, OverloadedError) as e:
            return failed(e)
        scores = [cosine(vecs[0], v) for v in vecs[1:]]
        order = sorted(range(len(docs)), key=lambda i: (-scores[i], i))
        if body.top_n:
            order = order[:body.top_n]
        results = [{"index": i, "relevance_score": scores[i],
                    **({"document": {"text": docs[i]}} if body.return_documents else {})} for i in order]
        return JSONResponse({"id": rid, "model": body.model or names[0], "usage": {"total_tokens": n},
                             "results": results})

    for path in ("/score", "/v1/score"):
        app.post(path)(score)
    for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
        app.post(path)(rerank)
