"""vLLM's score and rerank APIs: `POST /score` (also `/v1/score`) and `POST /rerank` (also
`/v1/rerank` and `/v2/rerank`, the Jina / Cohere shape), over an embedding model (a bi-encoder)
or a one-label sequence classifier (a cross-encoder).

Bi-encoder: a pair's score is the cosine similarity of the two texts' pooled vectors, each pooled
as /v1/embeddings pools it (raycluster.server.embeddings.pool_prompts; the full vector, before any
Matryoshka cut); each distinct text is pooled once. Cross-encoder (a checkpoint whose config names
a *ForSequenceClassification with one label): the two texts are read as one sequence, joined by
the tokenizer's pair template (transformers' `tokenizer(text_1, text_2)`), and the score is the
sigmoid of the classifier's logit (the logit itself with vLLM's `use_activation: false`), as
vLLM scores with a cross-encoder. A classifier with more
labels does not score (400 naming `model`).

Score: `text_1` a string or a list, `text_2` a string or a list; one `text_1` scores against each
`text_2` (1:N), or equal-length lists pair up (N:N). Rerank: `query` against each of `documents`
(strings or `{"text": ...}`), results sorted by `relevance_score` descending, cut to `top_n`
(absent or 0: all), each with its `document` unless `return_documents` is false. Both take vLLM's
`truncate_prompt_tokens` (keep the last k tokens of each sequence pooled) and
`add_special_tokens`; `usage` counts the tokens pooled. Errors are OpenAI's shape naming the field
(`text_2.3`, `documents.1`); a full queue is 429 with Retry-After.
"""

from __future__ import annotations

from typing import Callable

import torch
from fastapi import FastAPI
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from raycluster.engine.engine import InvalidRequestError
from raycluster.model.config import ModelConfig
from raycluster.server.embeddings import adapter_of, pool_prompts
from raycluster.server.request_metrics import RequestMetrics
from raycluster.server.protocol import OverloadedError, error_body, now_s, overloaded_response


class ScoreRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    text_1: str | list[str]
    text_2: str | list[str]
    truncate_prompt_tokens: int | None = Field(None, ge=1)
    add_special_tokens: bool = True
    use_activation: bool = True     # vLLM's: false gives a cross-encoder's raw logit


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
    use_activation: bool = True


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


def sigmoid(x: float) -> float:
    return torch.sigmoid(torch.tensor(x, dtype=torch.float32)).item()


def add_scoring_routes(app: FastAPI, engine, names: list[str], encode: Callable[..., list[int]],
                       encode_pair: Callable[..., tuple[list[int], int]] | None, unknown_model,
                       model_config: ModelConfig | None = None, metrics: RequestMetrics | None = None) -> None:
    """Register the score and rerank routes over `engine` (as /v1/embeddings: `admit`,
    `next_id`, `generate`). `encode(text, field, add_special_tokens)`: a text's ids;
    `encode_pair(first, second, field, add_special_tokens)`: a pair's ids (a cross-encoder's
    input) and where its second text starts; `unknown_model(body)`: the 404 for a `model` not served, or None; `model_config`: the
    served model's (a classifier's labels make it a cross-encoder; None: a bi-encoder);
    `metrics`: where each pooled sequence is counted."""
    labels = model_config.labels if model_config is not None else ()

    async def pooled(body, prompts: list[list[int]], fields: list[str], kind: str,
                     pair_starts: list[int] | None = None) -> tuple[str, list[list[float]]]:
        k = body.truncate_prompt_tokens
        if k is not None:       # cut from the left: a pair's second text starts that much earlier
            if pair_starts is not None:
                pair_starts = [max(0, s - max(0, len(ids) - k)) if s else 0 for ids, s in zip(prompts, pair_starts)]
            prompts = [ids[-k:] for ids in prompts]
        rid = engine.next_id(kind)
        return rid, await pool_prompts(engine, rid, prompts, fields, adapter_of(body, names), metrics,
                                       pair_starts), sum(map(len, prompts))

    async def bi_encoder(body, texts: list[tuple[str, str]], pairs: list[tuple[int, int]], kind: str):
        """(request id, each pair's cosine similarity, tokens pooled)."""
        engine.admit()
        prompts = [encode(text, field, body.add_special_tokens) for text, field in texts]
        rid, vecs, n = await pooled(body, prompts, [f for _, f in texts], kind)
        return rid, [cosine(vecs[a], vecs[b]) for a, b in pairs], n

    async def cross_encoder(body, texts: list[tuple[str, str]], pairs: list[tuple[int, int]], kind: str):
        """(request id, each pair's sigmoid of the classifier's logit, tokens pooled)."""
        if len(labels) != 1:
            raise InvalidRequestError("model", f"this classifier has {len(labels)} labels: only a one-label "
                                               "classifier (a cross-encoder) scores pairs; use /classify")
        if encode_pair is None:
            raise InvalidRequestError("model", "this server has no tokenizer to join the pairs")
        engine.admit()
        encoded = [encode_pair(texts[a][0], texts[b][0], texts[b][1], body.add_special_tokens) for a, b in pairs]
        rid, logits, n = await pooled(body, [ids for ids, _ in encoded], [texts[b][1] for _, b in pairs], kind,
                                      [start for _, start in encoded])
        return rid, [sigmoid(v[0]) if body.use_activation else v[0] for v in logits], n

    scores_of = cross_encoder if labels else bi_encoder

    def failed(e: Exception) -> JSONResponse:
        if isinstance(e, OverloadedError):
            return overloaded_response(e)
        return JSONResponse(error_body(str(e), e.field), status_code=400)

    async def score(body: ScoreRequest):
        if (missing := await unknown_model(body)) is not None:
            return missing
        try:
            texts, pairs = score_pairs(body)
            rid, scores, n = await scores_of(body, texts, pairs, "score")
        except (InvalidRequestError, OverloadedError) as e:
            return failed(e)
        return JSONResponse({
            "id": rid, "object": "list", "created": now_s(), "model": body.model or names[0],
            "data": [{"index": k, "object": "score", "score": v} for k, v in enumerate(scores)],
            "usage": {"prompt_tokens": n, "total_tokens": n, "completion_tokens": 0}})

    async def rerank(body: RerankRequest):
        if (missing := await unknown_model(body)) is not None:
            return missing
        docs = [d if isinstance(d, str) else d.text for d in body.documents]
        try:
            if not docs:
                raise InvalidRequestError("documents", "must not be empty")
            texts = [(body.query, "query")] + [(d, f"documents.{i}") for i, d in enumerate(docs)]
            rid, scores, n = await scores_of(body, texts, [(0, 1 + i) for i in range(len(docs))], "rerank")
        except (InvalidRequestError, OverloadedError) as e:
            return failed(e)
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
