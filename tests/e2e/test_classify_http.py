"""Sequence classifiers over real HTTP: /classify's probabilities and labels equal
transformers' LlamaForSequenceClassification (softmax over three labels); a one-label classifier
is a cross-encoder for /score and /rerank, each pair read as one sequence joined by the
tokenizer's pair template (as transformers' `tokenizer(a, b)` joins it) and scored by the sigmoid
of its logit; the routes a model does not serve answer 400 naming `model`."""

from __future__ import annotations

import httpx
import pytest
import torch
from engine_http import all_free, served_with_reference

pytestmark = pytest.mark.e2e

TEXTS = ["the river runs to the sea", "a stone", "wind over the quiet town"]


@pytest.fixture(scope="module")
def hf(classifiers):
    transformers = pytest.importorskip("transformers")
    tok = transformers.AutoTokenizer.from_pretrained(classifiers["reranker"])
    models = {name: transformers.AutoModelForSequenceClassification.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager") for name, path in classifiers.items()}
    return tok, models


def _hf_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0]


def test_classify_gives_transformers_probabilities_and_labels(classifiers, hf):
    tok, models = hf
    with served_with_reference(classifiers["sentiment"]) as (url, aeng, ours, _):
        r = httpx.post(f"{url}/classify", json={"model": "tiny", "input": TEXTS}, timeout=60)
        one = httpx.post(f"{url}/v1/classify", json={"input": TEXTS[0]}, timeout=60)
        emb = httpx.post(f"{url}/v1/embeddings", json={"input": TEXTS[0]}, timeout=60)
        score = httpx.post(f"{url}/score", json={"text_1": "a", "text_2": "b"}, timeout=60)
        messages = [{"role": "user", "content": TEXTS[1]}]
        chat = httpx.post(f"{url}/classify", json={"messages": messages}, timeout=60)
        chat_ids = httpx.post(f"{url}/tokenize", json={"messages": messages, "add_generation_prompt": False},
                              timeout=60).json()["tokens"]
        as_ids = httpx.post(f"{url}/classify", json={"input": chat_ids}, timeout=60)
        assert all_free(aeng)
    assert chat.status_code == 200 and chat.json()["data"][0]["probs"] == as_ids.json()["data"][0]["probs"]
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "list" and body["id"].startswith("classify")
    for d, text in zip(body["data"], TEXTS):
        ids = ours.encode(text)
        assert ids == tok(text)["input_ids"]
        probs = torch.softmax(_hf_logits(models["sentiment"], ids), dim=-1)
        assert d["probs"] == pytest.approx(probs.tolist(), abs=1e-5)
        assert d["label"] == ("negative", "neutral", "positive")[int(probs.argmax())] and d["num_classes"] == 3
    n = sum(len(ours.encode(t)) for t in TEXTS)
    assert body["usage"] == {"prompt_tokens": n, "total_tokens": n, "completion_tokens": 0}
    assert one.json()["data"][0]["probs"] == pytest.approx(body["data"][0]["probs"], abs=1e-6)
    for bad in (emb, score):
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "model", bad.text


def test_a_one_label_classifier_is_a_cross_encoder(classifiers, hf):
    tok, models = hf
    query = "where does the river go"
    with served_with_reference(classifiers["reranker"]) as (url, aeng, ours, _):
        s = httpx.post(f"{url}/score", json={"text_1": query, "text_2": TEXTS}, timeout=60)
        rr = httpx.post(f"{url}/v1/rerank", json={"query": query, "documents": TEXTS, "top_n": 2}, timeout=60)
        cls = httpx.post(f"{url}/classify", json={"input": query}, timeout=60)
        raw = httpx.post(f"{url}/score", json={"text_1": query, "text_2": TEXTS, "use_activation": False}, timeout=60)
        raw_cls = httpx.post(f"{url}/classify", json={"input": query, "use_activation": False}, timeout=60)
        assert all_free(aeng)
    assert s.status_code == 200 and rr.status_code == 200, (s.text, rr.text)
    want = []
    for text in TEXTS:
        ids = tok(query, text)["input_ids"]
        assert ours.encode_pair(query, text) == ids
        want.append(torch.sigmoid(_hf_logits(models["reranker"], ids))[0].item())
    assert [d["score"] for d in s.json()["data"]] == pytest.approx(want, abs=1e-5)
    # use_activation false: the raw logits (a reward model's score).
    assert [torch.sigmoid(torch.tensor(d["score"])).item() for d in raw.json()["data"]] == pytest.approx(want, abs=1e-5)
    assert raw_cls.json()["data"][0]["probs"] == pytest.approx(
        _hf_logits(models["reranker"], tok(query)["input_ids"]).tolist(), abs=1e-5)
    assert s.json()["usage"]["prompt_tokens"] == sum(len(tok(query, t)["input_ids"]) for t in TEXTS)
    order = sorted(range(len(TEXTS)), key=lambda i: -want[i])[:2]
    assert [x["index"] for x in rr.json()["results"]] == order
    assert [x["relevance_score"] for x in rr.json()["results"]] == pytest.approx([want[i] for i in order], abs=1e-5)
    # One label: /classify gives its sigmoid.
    assert cls.json()["data"][0]["probs"] == pytest.approx(
        [torch.sigmoid(_hf_logits(models["reranker"], tok(query)["input_ids"]))[0].item()], abs=1e-5)


def test_classify_on_an_embedding_model_names_the_model(tiny_model_dir):
    with served_with_reference(tiny_model_dir) as (url, aeng, _, _):
        r = httpx.post(f"{url}/classify", json={"input": "hello"}, timeout=60)
        assert all_free(aeng)
    assert r.status_code == 400 and r.json()["error"]["param"] == "model"
