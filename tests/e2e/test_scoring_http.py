"""POST /score and /rerank (vLLM's score and rerank APIs over an embedding model) on the
single-engine server over real HTTP: the scores equal sentence-transformers' cosine similarity
of its own vectors for the same checkpoint (mean pooling, normalised), 1:N and N:N pairs, rerank's
order, top_n and documents, every path alias, and the errors naming their fields."""

from __future__ import annotations

import json
import shutil

import httpx
import pytest
from engine_http import all_free, served_with_reference

pytestmark = pytest.mark.e2e

QUERY = "where does the river go"
DOCS = ["the river runs to the sea", "a stone in the quiet town", "wind", "the sea is where rivers end"]


@pytest.fixture(scope="module")
def st_dir(tiny_model_dir, tmp_path_factory, write_st_layout):
    root = tmp_path_factory.mktemp("st") / "tiny-st"
    shutil.copytree(tiny_model_dir, root)
    write_st_layout(root, {"embedding_dimension": 256, "pooling_mode": "mean"}, True)
    return root


@pytest.fixture(scope="module")
def server(st_dir):
    with served_with_reference(st_dir) as (url, aeng, tok, _):
        yield url, aeng, tok


@pytest.fixture(scope="module")
def st_scores(st_dir):
    """sentence-transformers' cosine similarity of QUERY with each of DOCS (one text per encode
    call: no padding in the reference) and of DOCS[i] with DOCS[i + 1]."""
    st = pytest.importorskip("sentence_transformers")
    model = st.SentenceTransformer(str(st_dir), device="cpu")
    q, d = model.encode(QUERY), [model.encode(t) for t in DOCS]
    return ([float(st.util.cos_sim(q, v)) for v in d],
            [float(st.util.cos_sim(a, b)) for a, b in zip(d, d[1:])])


def test_scores_are_sentence_transformers_cosine_similarities(server, st_scores):
    url, aeng, tok = server
    one_to_n = httpx.post(f"{url}/score", json={"model": "tiny", "text_1": QUERY, "text_2": DOCS}, timeout=60)
    assert one_to_n.status_code == 200, one_to_n.text
    body = one_to_n.json()
    assert body["object"] == "list" and body["model"] == "tiny" and body["id"].startswith("score")
    assert [d["index"] for d in body["data"]] == [0, 1, 2, 3] and {d["object"] for d in body["data"]} == {"score"}
    assert [d["score"] for d in body["data"]] == pytest.approx(st_scores[0], abs=1e-5)
    # Each text pooled once: the query's tokens count once.
    n = len(tok.encode(QUERY)) + sum(len(tok.encode(t)) for t in DOCS)
    assert body["usage"] == {"prompt_tokens": n, "total_tokens": n, "completion_tokens": 0}
    pairs = httpx.post(f"{url}/v1/score", json={"text_1": DOCS[:-1], "text_2": DOCS[1:]}, timeout=60).json()
    assert [d["score"] for d in pairs["data"]] == pytest.approx(st_scores[1], abs=1e-5)
    single = httpx.post(f"{url}/score", json={"text_1": [QUERY], "text_2": DOCS[0]}, timeout=60).json()
    assert single["data"][0]["score"] == pytest.approx(st_scores[0][0], abs=1e-5)
    assert all_free(aeng)


def test_rerank_sorts_by_relevance_and_cuts_to_top_n(server, st_scores):
    url, aeng, tok = server
    want = sorted(range(len(DOCS)), key=lambda i: -st_scores[0][i])
    for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
        r = httpx.post(f"{url}{path}", json={"model": "tiny", "query": QUERY, "documents": DOCS}, timeout=60)
        assert r.status_code == 200, r.text
        body = r.json()
        assert [x["index"] for x in body["results"]] == want
        assert [x["relevance_score"] for x in body["results"]] == pytest.approx([st_scores[0][i] for i in want],
                                                                               abs=1e-5)
        assert [x["document"]["text"] for x in body["results"]] == [DOCS[i] for i in want]
        assert body["model"] == "tiny" and body["usage"]["total_tokens"] == \
            len(tok.encode(QUERY)) + sum(len(tok.encode(t)) for t in DOCS)
    top = httpx.post(f"{url}/rerank", json={"query": QUERY, "documents": [{"text": t} for t in DOCS], "top_n": 2,
                                            "return_documents": False}, timeout=60).json()
    assert [x["index"] for x in top["results"]] == want[:2] and all("document" not in x for x in top["results"])
    assert all_free(aeng)


@pytest.mark.parametrize("path,payload,param,status", [
    ("/score", {"text_1": ["a", "b"], "text_2": ["c", "d", "e"]}, "text_1", 400),
    ("/score", {"text_1": [], "text_2": "c"}, "text_1", 400),
    ("/score", {"text_1": "a", "text_2": []}, "text_2", 400),
    ("/score", {"text_1": "a", "text_2": ["ok", ""]}, "text_2.1", 400),
    ("/score", {"text_1": "a"}, "text_2", 400),
    ("/score", {"text_1": "a", "text_2": "b", "model": "nope"}, "model", 404),
    ("/rerank", {"query": "", "documents": ["a"]}, "query", 400),
    ("/rerank", {"query": "q", "documents": []}, "documents", 400),
    ("/rerank", {"query": "q", "documents": ["a", " word" * 40000]}, "documents.1", 400),
    ("/rerank", {"query": "q", "documents": ["a"], "top_n": -1}, "top_n", 400),
])
def test_bad_requests_name_the_field(server, path, payload, param, status):
    url, aeng, _ = server
    r = httpx.post(f"{url}{path}", content=json.dumps(payload), headers={"content-type": "application/json"},
                   timeout=60)
    assert r.status_code == status, r.text
    assert r.json()["error"]["param"] == param
    assert all_free(aeng)
