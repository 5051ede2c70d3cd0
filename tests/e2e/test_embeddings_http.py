"""POST /v1/embeddings on the single-engine server over real HTTP: every input form, base64, the
usage counts, the OpenAI client, and the errors (each naming its field); the vectors equal the
engine's own pooling output (itself checked against transformers: tests/unit/test_embeddings.py)."""

from __future__ import annotations

import base64

import httpx
import numpy as np
import torch
import pytest
from engine_http import all_free, served_with_reference

from raycluster.request import SamplingParams

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    with served_with_reference(tiny_model_dir) as served:
        yield served


def _reference(ref, ids: list[int]) -> np.ndarray:
    """The reference engine's raw (last-token) vector, L2-normalised as the API returns it."""
    req = ref.add_request(f"ref-{len(ids)}-{ids[-1]}", ids, SamplingParams(max_tokens=1, embed=True))
    while ref.has_unfinished():
        ref.step()
    v = np.asarray(req.embedding)
    return v / np.linalg.norm(v)


def test_every_input_form_gives_the_engines_vectors(server):
    url, aeng, tok, ref = server
    texts = ["hello river", "the quiet town and the wind over a stone"]
    r = httpx.post(f"{url}/v1/embeddings", json={"model": "tiny", "input": texts}, timeout=60)
    assert r.status_code == 200, r.text
    body = r.json()
    ids = [tok.encode(t) for t in texts]
    assert body["object"] == "list" and body["model"] == "tiny" and body["id"].startswith("embd")
    assert body["usage"] == {"prompt_tokens": sum(map(len, ids)), "total_tokens": sum(map(len, ids))}
    assert [d["index"] for d in body["data"]] == [0, 1] and all(d["object"] == "embedding" for d in body["data"])
    for d, i in zip(body["data"], ids):
        np.testing.assert_allclose(d["embedding"], _reference(ref, i), atol=1e-6)
    # One string, token ids, token-id lists; base64 is the same vector as float32 bytes.
    one = httpx.post(f"{url}/v1/embeddings", json={"input": texts[0]}, timeout=60).json()["data"]
    as_ids = httpx.post(f"{url}/v1/embeddings", json={"input": ids[0]}, timeout=60).json()["data"]
    batch = httpx.post(f"{url}/v1/embeddings", json={"input": ids}, timeout=60).json()["data"]
    b64 = httpx.post(f"{url}/v1/embeddings", json={"input": ids, "encoding_format": "base64"}, timeout=60).json()
    assert len(one) == len(as_ids) == 1 and len(batch) == 2
    np.testing.assert_allclose(one[0]["embedding"], as_ids[0]["embedding"], atol=1e-6)
    for d, e in zip(batch, b64["data"]):
        np.testing.assert_allclose(np.frombuffer(base64.b64decode(e["embedding"]), dtype="<f4"), d["embedding"],
                                   atol=1e-6)
    # vLLM's truncate_prompt_tokens keeps the last k tokens.
    cut = httpx.post(f"{url}/v1/embeddings", json={"input": ids[1], "truncate_prompt_tokens": 3}, timeout=60).json()
    np.testing.assert_allclose(cut["data"][0]["embedding"], _reference(ref, ids[1][-3:]), atol=1e-6)
    assert cut["usage"]["prompt_tokens"] == 3
    assert all_free(aeng)


def test_the_openai_client_reads_them(server):
    openai = pytest.importorskip("openai")
    url, aeng, tok, ref = server
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=30)
    out = client.embeddings.create(model="tiny", input=["hello river", "the sea"])      # base64 by default
    assert len(out.data) == 2 and out.usage.prompt_tokens == len(tok.encode("hello river")) + len(tok.encode("the sea"))
    np.testing.assert_allclose(out.data[0].embedding, _reference(ref, tok.encode("hello river")), atol=1e-6)
    assert all_free(aeng)


@pytest.mark.parametrize("payload,param,status", [
    ({"input": ""}, "input", 400),
    ({"input": []}, "input", 400),
    ({"input": ["ok", ""]}, "input.1", 400),
    ({"input": [1, "a"]}, "input.0", 400),
    ({"input": {"text": "a"}}, "input", 400),
    ({"input": [[5, 6], []]}, "input.1", 400),
    ({"input": "x", "encoding_format": "hex"}, "encoding_format", 400),
    ({"input": "x", "dimensions": 8}, "dimensions", 400),
    ({"input": list(range(5, 40000))}, "input", 400),            # longer than the context
    ({"input": [5, 99999]}, "input", 400),                       # not a token id of this vocab
    ({"input": ["ok", list(range(5, 40000))]}, "input.1", 400),
    ({"input": "x", "model": "nope"}, "model", 404),
])
def test_bad_requests_name_the_field(server, payload, param, status):
    url, aeng, _, _ = server
    r = httpx.post(f"{url}/v1/embeddings", json=payload, timeout=60)
    assert r.status_code == status, r.text
    assert r.json()["error"]["param"] == param
    assert all_free(aeng)


@pytest.fixture(scope="module")
def st_dir(tiny_model_dir, tmp_path_factory, write_st_layout):
    """The tiny checkpoint as a sentence-transformers embedding model: mean pooling, a Normalize
    module, trained (says its config) for 16- and 32-dimension Matryoshka vectors."""
    import json
    import shutil

    root = tmp_path_factory.mktemp("st") / "tiny-st"
    shutil.copytree(tiny_model_dir, root)
    write_st_layout(root, {"embedding_dimension": 256, "pooling_mode": "mean", "include_prompt": True}, True)
    cfg = json.loads((root / "config.json").read_text())
    (root / "config.json").write_text(json.dumps({**cfg, "matryoshka_dimensions": [16, 32]}))
    return root


def test_a_sentence_transformers_checkpoint_gives_sentence_transformers_vectors(st_dir):
    st = pytest.importorskip("sentence_transformers")
    model = st.SentenceTransformer(str(st_dir), device="cpu")
    texts = ["hello river", "the quiet town and the wind over a stone", "a"]
    with served_with_reference(st_dir) as (url, aeng, tok, _):
        full = httpx.post(f"{url}/v1/embeddings", json={"input": texts}, timeout=60)
        short = httpx.post(f"{url}/v1/embeddings", json={"input": texts, "dimensions": 16}, timeout=60)
        raw = httpx.post(f"{url}/v1/embeddings", json={"input": texts[1], "normalize": False}, timeout=60)
        bad = httpx.post(f"{url}/v1/embeddings", json={"input": texts[0], "dimensions": 8}, timeout=60)
        assert all_free(aeng)
    assert full.status_code == short.status_code == raw.status_code == 200, (full.text, short.text, raw.text)
    for text, got, cut in zip(texts, full.json()["data"], short.json()["data"]):
        assert len(got["embedding"]) == 256 and len(cut["embedding"]) == 16
        # One text at a time: no padding in the reference's batch.
        np.testing.assert_allclose(got["embedding"], model.encode(text), atol=1e-5)
        np.testing.assert_allclose(cut["embedding"], model.encode(text, truncate_dim=16, normalize_embeddings=True),
                                   atol=1e-5)
    # Without normalising: the mean of the final hidden states (the Transformer and Pooling modules).
    with torch.no_grad():
        means = model[1](model[0](model.tokenize([texts[1]])))["sentence_embedding"][0].numpy()
    np.testing.assert_allclose(raw.json()["data"][0]["embedding"], means, atol=1e-5)
    assert abs(np.linalg.norm(raw.json()["data"][0]["embedding"]) - 1) > 1e-3
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "dimensions"
    assert "[16, 32]" in bad.json()["error"]["message"]


def test_a_checkpoint_without_an_output_head_serves_embeddings_only(st_dir, tmp_path):
    """sentence-transformers' own save of an embedding model (tensors without "model.", no
    lm_head): /v1/embeddings and /score serve, generation is a 400 naming `model`."""
    import shutil

    from safetensors.torch import load_file, save_file
    root = tmp_path / "bare"
    shutil.copytree(st_dir, root)
    sd = load_file(str(root / "model.safetensors"))
    save_file({k.removeprefix("model."): v for k, v in sd.items() if k != "lm_head.weight"},
              str(root / "model.safetensors"))
    with served_with_reference(st_dir) as (url, _, _, _):
        want = httpx.post(f"{url}/v1/embeddings", json={"input": ["hello river", "the sea"]}, timeout=60).json()
    with served_with_reference(root) as (url, aeng, _, _):
        got = httpx.post(f"{url}/v1/embeddings", json={"input": ["hello river", "the sea"]}, timeout=60)
        score = httpx.post(f"{url}/score", json={"text_1": "hello river", "text_2": "the sea"}, timeout=60)
        comp = httpx.post(f"{url}/v1/completions", json={"prompt": "hello", "max_tokens": 3}, timeout=60)
        chat = httpx.post(f"{url}/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]},
                          timeout=60)
        assert all_free(aeng)
    assert got.status_code == 200 and score.status_code == 200, (got.text, score.text)
    for g, w in zip(got.json()["data"], want["data"]):
        np.testing.assert_allclose(g["embedding"], w["embedding"], atol=1e-6)
    a, b = (np.asarray(d["embedding"]) for d in got.json()["data"])
    assert score.json()["data"][0]["score"] == pytest.approx(float(a @ b), abs=1e-5)
    for r in (comp, chat):
        assert r.status_code == 400 and r.json()["error"]["param"] == "model", r.text
        assert "no output head" in r.json()["error"]["message"]


def test_dense_modules_of_a_sentence_transformers_save(st_dense_dir):
    """A model as sentence-transformers saves it with Dense projections (a LlamaModel without a
    head, two Dense modules, Normalize): the vectors are sentence-transformers' own, 64 wide."""
    st = pytest.importorskip("sentence_transformers")
    model = st.SentenceTransformer(str(st_dense_dir), device="cpu")
    texts = ["hello river", "the quiet town and the wind over a stone"]
    with served_with_reference(st_dense_dir) as (url, aeng, _, _):
        r = httpx.post(f"{url}/v1/embeddings", json={"input": texts, "dimensions": 64}, timeout=60)
        wide = httpx.post(f"{url}/v1/embeddings", json={"input": texts[0], "dimensions": 256}, timeout=60)
        assert all_free(aeng)
    assert r.status_code == 200, r.text
    for d, text in zip(r.json()["data"], texts):
        assert len(d["embedding"]) == 64
        np.testing.assert_allclose(d["embedding"], model.encode(text), atol=1e-5)
    assert wide.status_code == 400 and wide.json()["error"]["param"] == "dimensions"
    assert "64 dimensions" in wide.json()["error"]["message"]


def test_chat_messages_pool_the_chat_templates_tokens(server):
    """vLLM's chat form: `messages` through the chat template (no generation prompt unless asked),
    the same vector as those ids sent as `input`; one of `input` and `messages` exactly."""
    url, aeng, _, ref = server
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "the river"}]
    ids = httpx.post(f"{url}/tokenize", json={"messages": messages, "add_generation_prompt": False}, timeout=60)
    chat = httpx.post(f"{url}/v1/embeddings", json={"messages": messages}, timeout=60)
    turn = httpx.post(f"{url}/v1/embeddings", json={"messages": messages, "add_generation_prompt": True}, timeout=60)
    assert chat.status_code == 200 and turn.status_code == 200, (chat.text, turn.text)
    tokens = ids.json()["tokens"]
    np.testing.assert_allclose(chat.json()["data"][0]["embedding"], _reference(ref, tokens), atol=1e-6)
    assert chat.json()["usage"]["prompt_tokens"] == len(tokens) < turn.json()["usage"]["prompt_tokens"]
    both = httpx.post(f"{url}/v1/embeddings", json={"messages": messages, "input": "x"}, timeout=60)
    neither = httpx.post(f"{url}/v1/embeddings", json={"model": "tiny"}, timeout=60)
    for r in (both, neither):
        assert r.status_code == 400 and "exactly one of input and messages" in r.json()["error"]["message"], r.text
    bad = httpx.post(f"{url}/v1/embeddings", json={"messages": [{"role": "user", "content": "a"}],
                                                   "continue_final_message": True, "add_generation_prompt": True},
                     timeout=60)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "continue_final_message"
    assert all_free(aeng)


def _counters(url: str) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families
    text = httpx.get(f"{url}/metrics", timeout=30).text
    return {s.name + "".join(f",{k}={v}" for k, v in sorted(s.labels.items()) if k != "model_name"): s.value
            for f in text_string_to_metric_families(text) for s in f.samples}


def test_pooling_requests_are_counted_in_the_metrics(server):
    """Each input is a request on /metrics, as vLLM counts pooling requests: its prompt tokens, a
    success with no generated tokens, its latency."""
    url, aeng, tok, _ = server
    before = _counters(url)
    texts = ["hello river", "the sea"]
    assert httpx.post(f"{url}/v1/embeddings", json={"input": texts}, timeout=60).status_code == 200
    assert httpx.post(f"{url}/score", json={"text_1": texts[0], "text_2": texts[1]}, timeout=60).status_code == 200
    after = _counters(url)
    n = 2 * sum(len(tok.encode(t)) for t in texts)

    def delta(name):
        return after.get(name, 0) - before.get(name, 0)
    assert delta("vllm:prompt_tokens_total") == n and delta("vllm:generation_tokens_total") == 0
    assert delta("vllm:request_success_total,finished_reason=stop") == 4
    assert delta("vllm:e2e_request_latency_seconds_count") == 4
    assert all_free(aeng)
