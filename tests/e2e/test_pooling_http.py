"""vLLM's /pooling over real HTTP, per task, against sentence-transformers and transformers on
the same checkpoints: `embed` = /v1/embeddings, `token_embed` = sentence-transformers' token
embeddings normalised per token, `classify` = /classify, `token_classify` = a
BertForTokenClassification's per-token softmax (its only task) or a sequence classifier's head on
every token; base64 carries the same float32 values; tasks a model does not serve, and
`dimensions`, are 400s naming the field."""

from __future__ import annotations

import base64
import warnings

import httpx
import numpy as np
import pytest
import torch
from engine_http import all_free, serve_engine, tiny_parts

from raycluster.engine.config import EngineConfig

pytestmark = pytest.mark.e2e
transformers = pytest.importorskip("transformers")

TEXTS = ["berlin is the capital of germany", "a cat sat on the mat"]


def _served(path):
    model, tok = tiny_parts(path)
    return serve_engine(EngineConfig(kv_cache_tokens=4096, policy="fcfs", predictor="none"), model, tok,
                        names=("enc",))


def _post(url, **body):
    return httpx.post(f"{url}/pooling", json={"input": TEXTS, **body}, timeout=60)


def test_embed_and_token_embed_equal_sentence_transformers(encoders):
    st = pytest.importorskip("sentence_transformers")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref = st.SentenceTransformer(str(encoders["bert-st"]), device="cpu")
    with _served(encoders["bert-st"]) as (url, aeng):
        default, tokens = _post(url), _post(url, task="token_embed")
        raw_tokens = _post(url, task="token_embed", normalize=False, encoding_format="base64")
        emb = httpx.post(f"{url}/v1/embeddings", json={"input": TEXTS}, timeout=60)
        bad_task, dims = _post(url, task="classify"), _post(url, dimensions=8)
        assert all_free(aeng)
    assert default.status_code == 200, default.text
    assert [d["data"] for d in default.json()["data"]] == [d["embedding"] for d in emb.json()["data"]]
    want = ref.encode(TEXTS, output_value="token_embeddings")
    for d, raw, w in zip(tokens.json()["data"], raw_tokens.json()["data"], want):
        assert d["object"] == "pooling"
        np.testing.assert_allclose(d["data"], torch.nn.functional.normalize(w, dim=-1).numpy(), atol=1e-5)
        flat = np.frombuffer(base64.b64decode(raw["data"]), dtype="<f4")
        np.testing.assert_allclose(flat.reshape(w.shape), w.numpy(), atol=1e-5)
    n = tokens.json()["usage"]["prompt_tokens"]
    assert n == sum(len(w) for w in want)
    for bad, field in ((bad_task, "task"), (dims, "dimensions")):
        assert bad.status_code == 400 and bad.json()["error"]["param"] == field, bad.text


def test_token_classifier_tags_every_token(encoders):
    hf = transformers.AutoModelForTokenClassification.from_pretrained(str(encoders["bert-ner"])).eval()
    tok = transformers.AutoTokenizer.from_pretrained(str(encoders["bert-ner"]))
    with _served(encoders["bert-ner"]) as (url, aeng):
        tags, logits = _post(url), _post(url, task="token_classify", use_activation=False)
        classify = httpx.post(f"{url}/classify", json={"input": TEXTS[0]}, timeout=60)
        emb = httpx.post(f"{url}/v1/embeddings", json={"input": TEXTS[0]}, timeout=60)
        assert all_free(aeng)
    assert tags.status_code == 200, tags.text
    for d, raw, text in zip(tags.json()["data"], logits.json()["data"], TEXTS):
        with torch.no_grad():
            want = hf(**tok(text, return_tensors="pt")).logits[0]
        np.testing.assert_allclose(raw["data"], want.numpy(), atol=1e-5)
        np.testing.assert_allclose(d["data"], torch.softmax(want, -1).numpy(), atol=1e-5)
    for bad in (classify, emb):
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "model", bad.text


def test_sequence_classifier_classify_and_token_classify(encoders):
    hf = transformers.AutoModelForSequenceClassification.from_pretrained(str(encoders["bert-3"])).eval()
    tok = transformers.AutoTokenizer.from_pretrained(str(encoders["bert-3"]))
    with _served(encoders["bert-3"]) as (url, aeng):
        default, per_token = _post(url), _post(url, task="token_classify")
        classify = httpx.post(f"{url}/classify", json={"input": TEXTS}, timeout=60)
        assert all_free(aeng)
    assert [d["data"] for d in default.json()["data"]] == [d["probs"] for d in classify.json()["data"]]
    for d, text in zip(per_token.json()["data"], TEXTS):
        with torch.no_grad():
            h = hf.bert(**tok(text, return_tensors="pt")).last_hidden_state[0]
            want = torch.softmax(hf.classifier(torch.tanh(hf.bert.pooler.dense(h))), -1)
        np.testing.assert_allclose(d["data"], want.numpy(), atol=1e-5)
