"""API keys over real HTTP on one engine: with keys set, every API route wants one of them as a
bearer token (401 in OpenAI's error shape otherwise, streamed routes included), /health and
/metrics stay open, the `openai` client and loadgen work with the key; the keys come from
RAYCLUSTER_API_KEY (comma-separated)."""

from __future__ import annotations

import httpx
import openai
import pytest
from engine_http import serve_engine, tiny_parts

from loadgen.client import ClientConfig, run
from loadgen.workloads import make_workload
from raycluster.engine.config import EngineConfig
from raycluster.server.auth import bearer_headers, keys_from_env

pytestmark = pytest.mark.e2e

KEYS = ("sk-old", "sk-new")
CFG = dict(kv_cache_tokens=4096, policy="fcfs", packer="token", num_threads=1)


@pytest.fixture(scope="module")
def url(tiny_model_dir):
    model, tok = tiny_parts(tiny_model_dir)
    with serve_engine(EngineConfig(**CFG), model, tok, api_keys=KEYS) as (base, _):
        yield base


def test_keys_from_the_environment():
    assert keys_from_env({"RAYCLUSTER_API_KEY": " sk-old, sk-new ,"}) == KEYS
    assert keys_from_env({}) == () and bearer_headers({}) == {}
    assert bearer_headers({"RAYCLUSTER_API_KEY": "sk-old,sk-new"}) == {"Authorization": "Bearer sk-old"}


@pytest.mark.parametrize("method,path,body", [
    ("GET", "/v1/models", None),
    ("POST", "/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": 2}),
    ("POST", "/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": 2, "stream": True}),
    ("POST", "/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
                                      "max_tokens": 2}),
    ("POST", "/tokenize", {"model": "tiny", "prompt": "hi"}),
])
def test_api_routes_want_a_key(url, method, path, body):
    with httpx.Client(base_url=url, timeout=30) as c:
        for headers in ({}, {"Authorization": "Bearer sk-wrong"}, {"Authorization": "sk-old"},
                        {"Authorization": "Bearer sk-old2"}):
            r = c.request(method, path, json=body, headers=headers)
            assert r.status_code == 401, (headers, r.text)
            assert r.json()["error"]["code"] == "invalid_api_key"
            assert r.headers["www-authenticate"] == "Bearer"
        for key in KEYS:
            r = c.request(method, path, json=body, headers={"Authorization": f"Bearer {key}"})
            assert r.status_code == 200, r.text


def test_health_and_metrics_stay_open(url):
    with httpx.Client(base_url=url, timeout=30) as c:
        assert c.get("/health").status_code == 200
        assert c.get("/metrics").status_code == 200
        assert c.get("/openapi.json").status_code == 200


def test_openai_client_and_loadgen_with_the_key(url):
    client = openai.OpenAI(base_url=url + "/v1", api_key="sk-new", max_retries=0)
    out = client.completions.create(model="tiny", prompt="hello", max_tokens=3, temperature=0)
    assert out.usage.completion_tokens == 3
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=url + "/v1", api_key="nope", max_retries=0).models.list()

    wl = make_workload("chat", qps=20.0, num_requests=4, seed=0, max_output_tokens=4)
    ok = run(wl, ClientConfig(url=url, model="tiny", progress=False, timeout_s=60, api_key="sk-old"))
    assert [r.status for r in ok] == ["ok"] * 4, [r.error for r in ok]
    refused = run(wl, ClientConfig(url=url, model="tiny", progress=False, timeout_s=60))
    assert all(r.status == "http_error" and "HTTP 401" in r.error for r in refused)
