"""BERT-style encoders over real HTTP, against sentence-transformers and transformers on the same
checkpoints: /v1/embeddings of a sentence-transformers BERT (mean pooling, Normalize) = its
`encode`, /score and /rerank of BERT and XLM-RoBERTa cross-encoders = `CrossEncoder.predict`
(each pair one sequence with its token types), /classify = transformers' softmax; generation is
a 400 naming `model`, a prompt over the context a 400 naming the input."""

from __future__ import annotations

import warnings

import httpx
import pytest
import torch
from engine_http import all_free, serve_engine, tiny_parts

from raycluster.engine.config import EngineConfig

pytestmark = pytest.mark.e2e
st = pytest.importorskip("sentence_transformers")

QUERY = "what is the capital of germany"
DOCS = ["berlin is the capital of germany", "a cat sat on the mat", "paris is the capital of france",
        "rivers run to the sea"]


def _served(path):
    model, tok = tiny_parts(path)
    return serve_engine(EngineConfig(kv_cache_tokens=4096, policy="fcfs", predictor="none"), model, tok,
                        names=("enc",))


def test_embeddings_equal_sentence_transformers(encoders):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref = st.SentenceTransformer(str(encoders["bert-st"]), device="cpu")
    texts = [QUERY] + DOCS
    with _served(encoders["bert-st"]) as (url, aeng):
        emb = httpx.post(f"{url}/v1/embeddings", json={"model": "enc", "input": texts}, timeout=60)
        score = httpx.post(f"{url}/v1/score", json={"text_1": QUERY, "text_2": DOCS}, timeout=60)
        gen = httpx.post(f"{url}/v1/completions", json={"prompt": "a cat", "max_tokens": 2}, timeout=60)
        long = httpx.post(f"{url}/v1/embeddings", json={"input": " ".join(["cat"] * 80)}, timeout=60)
        assert all_free(aeng)
    assert emb.status_code == 200, emb.text
    want = torch.tensor(ref.encode(texts))
    got = torch.tensor([d["embedding"] for d in emb.json()["data"]])
    assert got.shape == want.shape and torch.allclose(got, want, atol=1e-5), (got - want).abs().max()
    cos = st.util.cos_sim(want[:1], want[1:])[0]
    assert [d["score"] for d in score.json()["data"]] == pytest.approx(cos.tolist(), abs=1e-5)
    assert gen.status_code == 400 and gen.json()["error"]["param"] == "model", gen.text
    assert long.status_code == 400 and long.json()["error"]["param"] == "input", long.text


@pytest.mark.parametrize("name", ["bert-ce", "xlmr-ce", "modernbert-ce"])
def test_cross_encoder_scores_equal_sentence_transformers(encoders, name):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref = st.CrossEncoder(str(encoders[name]), device="cpu")
    want = ref.predict([(QUERY, d) for d in DOCS])          # sigmoid of the one logit
    with _served(encoders[name]) as (url, aeng):
        rerank = httpx.post(f"{url}/v1/rerank", json={"query": QUERY, "documents": DOCS, "top_n": 3}, timeout=60)
        score = httpx.post(f"{url}/score", json={"text_1": QUERY, "text_2": DOCS}, timeout=60)
        emb = httpx.post(f"{url}/v1/embeddings", json={"input": QUERY}, timeout=60)
        assert all_free(aeng)
    assert score.status_code == 200, score.text
    assert [d["score"] for d in score.json()["data"]] == pytest.approx(want.tolist(), abs=1e-5)
    results = rerank.json()["results"]
    order = sorted(range(len(DOCS)), key=lambda i: -want[i])[:3]
    assert [r["index"] for r in results] == order
    assert [r["relevance_score"] for r in results] == pytest.approx([float(want[i]) for i in order], abs=1e-5)
    assert emb.status_code == 400 and emb.json()["error"]["param"] == "model", emb.text


def test_classify_equals_transformers(encoders):
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoModelForSequenceClassification.from_pretrained(str(encoders["bert-3"])).eval()
    tok = transformers.AutoTokenizer.from_pretrained(str(encoders["bert-3"]))
    with _served(encoders["bert-3"]) as (url, aeng):
        r = httpx.post(f"{url}/classify", json={"input": DOCS}, timeout=60)
        assert all_free(aeng)
    assert r.status_code == 200, r.text
    for d, text in zip(r.json()["data"], DOCS):
        with torch.no_grad():
            probs = torch.softmax(hf(**tok(text, return_tensors="pt")).logits[0], -1)
        assert d["probs"] == pytest.approx(probs.tolist(), abs=1e-5)
        assert d["label"] == ("neg", "neutral", "pos")[int(probs.argmax())] and d["num_classes"] == 3
