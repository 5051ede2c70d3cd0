"""`POST /classify` (also `/v1/classify`): vLLM's classification API over a sequence classifier
(a checkpoint whose config names a *ForSequenceClassification: raycluster.model.config).

Each input (as /v1/embeddings takes them: a string, a list of strings, token ids or lists of
them, or chat `messages`; `truncate_prompt_tokens`, `add_special_tokens`) runs as one pooling request; the engine
returns the classifier's logits (its score head over the last token's final hidden state, as
transformers' *ForSequenceClassification computes them). The answer per input: `probs` (softmax
over the labels; with one label, its sigmoid), `label` (the most probable label's name from the
config's id2label) and `num_classes`; vLLM's `use_activation: false` returns the raw logits (a
reward model's score). A model that is not a classifier answers 400 naming `model`.
"""

from __future__ import annotations

from typing import Callable

import torch
from fastapi import FastAPI
from fastapi.responses import JSONResponse

from raycluster.engine.engine import InvalidRequestError
from raycluster.model.config import ModelConfig
from raycluster.server.embeddings import PoolingInput, adapter_of, input_fields, pool_prompts, request_inputs
from raycluster.server.request_metrics import RequestMetrics
from raycluster.server.protocol import OverloadedError, error_body, now_s, overloaded_response


class ClassificationRequest(PoolingInput):
    """vLLM's classification request: a pooling input (`input` or `messages`)."""
    use_activation: bool = True     # vLLM's: false returns the raw logits as `probs` (a reward model's score)


def label_probs(logits: list[float], activation: bool = True) -> list[float]:
    """A classifier's probabilities from its logits: softmax, or the sigmoid of a single one
    (`activation` false: the logits themselves)."""
    if not activation:
        return list(logits)
    x = torch.tensor(logits, dtype=torch.float32)
    return (torch.sigmoid(x) if len(logits) == 1 else torch.softmax(x, dim=-1)).tolist()


def add_classify_routes(app: FastAPI, engine, names: list[str], encode: Callable[..., list[int]], unknown_model,
                        model_config: ModelConfig | None = None,
                        chat_ids: Callable[[PoolingInput], list[int]] | None = None,
                        metrics: RequestMetrics | None = None) -> None:
    """Register /classify over `engine` (`admit`, `next_id`, `generate`); the other arguments as
    `add_embedding_routes`'s. `model_config` None or without labels: not a classifier."""
    labels = model_config.labels if model_config is not None else ()

    async def classify(body: ClassificationRequest):
        if (missing := await unknown_model(body)) is not None:
            return missing
        if not labels:
            return JSONResponse(error_body("model: this model is not a sequence classifier (its config names no "
                                           "*ForSequenceClassification architecture)", "model"), status_code=400)
        try:
            engine.admit()
            prompts = request_inputs(body, encode, chat_ids)
            rid = engine.next_id("classify")
            logits = await pool_prompts(engine, rid, prompts, input_fields(len(prompts)), adapter_of(body, names),
                                        metrics)
        except OverloadedError as e:
            return overloaded_response(e)
        except InvalidRequestError as e:
            return JSONResponse(error_body(str(e), e.field), status_code=400)
        data = []
        for k, row in enumerate(logits):
            probs = label_probs(row, body.use_activation)
            best = max(range(len(probs)), key=probs.__getitem__)
            data.append({"index": k, "label": labels[best], "probs": probs, "num_classes": len(probs)})
        n = sum(map(len, prompts))
        return JSONResponse({"id": rid, "object": "list", "created": now_s(), "model": body.model or names[0],
                             "data": data, "usage": {"prompt_tokens": n, "total_tokens": n, "completion_tokens": 0}})

    for path in ("/classify", "/v1/classify"):
        app.post(path)(classify)
