"""A pooling model served by the P/D cluster over real HTTP: sentence-transformers' own save of
an embedding model (a LlamaModel without an output head, mean pooling, two Dense modules,
Normalize), its short prompts pooled on a tp 2 group of Ray-actor ranks (each reads its slices
from the bare-named files; the leader reads the Dense modules), its long ones on a single-process
instance. /v1/embeddings equals sentence-transformers' encode, /v1/score the cosine of those,
generation is a 400 naming `model`; afterwards nothing is in flight and every instance's KV is
free."""

from __future__ import annotations

import httpx
import numpy as np
import pytest
from cluster_http import drained_status
from serve_app import deployed_app

pytestmark = [pytest.mark.ray, pytest.mark.e2e]

ROUTER = "router-pooling"


def test_an_embedding_model_through_pd_pools(ray_cluster, st_dense_dir):
    st = pytest.importorskip("sentence_transformers")
    model = st.SentenceTransformer(str(st_dense_dir), device="cpu")
    # Short (under l_m = 64 tokens) and long (the prefill-long pool) texts.
    texts = ["hello river", "the sea", "wind " * 40 + "over the quiet town", "a stone " * 60]
    cfg = {"model": str(st_dense_dir), "policy": "lars", "threads_per_instance": 1, "router_name": ROUTER,
           "connector": "torch_dist", "initial_l_m": 64, "engine": {"kv_cache_tokens": 8192, "chunk_size": 32},
           "pools": [{"role": "prefill-short", "instances": 1, "engine": {"tp": 2, "group_launch": "ray"}},
                     {"role": "prefill-long", "instances": 1},
                     {"role": "decode", "instances": 1, "engine": {"policy": "fcfs", "packer": "token"}}]}
    with deployed_app(cfg, ROUTER, 300, "pooling cluster") as url:
        emb = httpx.post(f"{url}/v1/embeddings", json={"input": texts}, timeout=120)
        score = httpx.post(f"{url}/v1/score", json={"text_1": texts[0], "text_2": texts[1:]}, timeout=120)
        gen = httpx.post(f"{url}/v1/completions", json={"prompt": "hello", "max_tokens": 3}, timeout=120)
        assert emb.status_code == 200 and score.status_code == 200, (emb.text, score.text)
        want = [model.encode(t) for t in texts]
        for d, w in zip(emb.json()["data"], want):
            np.testing.assert_allclose(d["embedding"], w, atol=1e-5)
        assert [d["score"] for d in score.json()["data"]] == pytest.approx(
            [float(want[0] @ w) for w in want[1:]], abs=1e-5)
        assert gen.status_code == 400 and gen.json()["error"]["param"] == "model", gen.text
        status = drained_status(url)
        assert {i["role"]: i["layout"] for i in status["instances"]}["prefill-short"] == "tp2"
        model_facts = status["model"]
        assert (model_facts["architecture"], model_facts["tasks"], model_facts["pooling"]["size"]) == \
            ("LlamaModel", ["embed"], 64)


def test_a_bert_cross_encoder_through_pd_pools(ray_cluster, encoders):
    """A BERT cross-encoder (token types per pair) on P/D pools whose instances keep no KV:
    /rerank equals sentence-transformers' CrossEncoder, /pooling's token_classify one row per token;
    nothing left over."""
    st = pytest.importorskip("sentence_transformers")
    ref = st.CrossEncoder(str(encoders["bert-ce"]), device="cpu")
    query, docs = "what is the capital of germany", ["berlin is the capital of germany", "a cat sat on the mat",
                                                     "paris is the capital " * 5 + "of france"]
    want = ref.predict([(query, d) for d in docs])
    cfg = {"model": str(encoders["bert-ce"]), "policy": "lars", "threads_per_instance": 1, "router_name": ROUTER,
           "connector": "torch_dist", "initial_l_m": 16, "engine": {"kv_cache_tokens": 2048},
           "pools": [{"role": "prefill-short", "instances": 1}, {"role": "prefill-long", "instances": 1},
                     {"role": "decode", "instances": 1, "engine": {"policy": "fcfs", "packer": "token"}}]}
    with deployed_app(cfg, ROUTER, 300, "encoder cluster") as url:
        rerank = httpx.post(f"{url}/v1/rerank", json={"query": query, "documents": docs}, timeout=120)
        gen = httpx.post(f"{url}/v1/completions", json={"prompt": "a cat", "max_tokens": 3}, timeout=120)
        # Token-level outputs travel the router as one row per prompt token.
        rows = httpx.post(f"{url}/pooling", json={"input": query, "task": "token_classify"}, timeout=120)
        ids = httpx.post(f"{url}/tokenize", json={"prompt": query}, timeout=60).json()["tokens"]
        assert rows.status_code == 200, rows.text
        per_token = rows.json()["data"][0]["data"]
        assert len(per_token) == len(ids) and all(len(r) == 1 and 0 < r[0] < 1 for r in per_token)
        assert rerank.status_code == 200, rerank.text
        got = {r["index"]: r["relevance_score"] for r in rerank.json()["results"]}
        assert [got[i] for i in range(len(docs))] == pytest.approx(want.tolist(), abs=1e-5)
        assert gen.status_code == 400 and gen.json()["error"]["param"] == "model", gen.text
        status = drained_status(url)
        assert (status["model"]["architecture"], status["model"]["tasks"]) == ("BertForSequenceClassification",
                                                                               ["classify"])
