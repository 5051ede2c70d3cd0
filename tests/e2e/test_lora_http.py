"""LoRA adapters over real HTTP on one engine, as vLLM serves them: /v1/models lists each
adapter with the base model as its parent, a request whose `model` names an adapter gets the
text of the base model with that adapter merged into its weights (streamed and not, chat too),
the base name still gets the base, and an unknown name is a 404 listing what is served."""

from __future__ import annotations

import json

import httpx
import pytest
import torch
from engine_http import serve_engine, tiny_parts

from raycluster.engine.config import EngineConfig
from raycluster.engine.engine import LLMEngine
from raycluster.model.loader import load_model
from raycluster.model.lora import TARGETS, load_adapter
from raycluster.model.tiny import write_tiny_lora
from raycluster.request import SamplingParams

pytestmark = pytest.mark.e2e

CFG = dict(kv_cache_tokens=8192, policy="fcfs", packer="token", predictor="none")


@pytest.fixture(scope="module")
def served(tiny_model_dir, tmp_path_factory):
    adapter = write_tiny_lora(tmp_path_factory.mktemp("lora") / "sql", tiny_model_dir, seed=1)
    model, tok = tiny_parts(tiny_model_dir)
    merged, cfg = load_model(tiny_model_dir)
    for (layer, module), (a, b) in load_adapter(adapter, cfg, "sql").weights.items():
        with torch.no_grad():
            getattr(getattr(merged.model.layers[layer], TARGETS[module]), module).weight += b @ a
    refs = {"tiny": LLMEngine(EngineConfig(**CFG), model, tok), "sql": LLMEngine(EngineConfig(**CFG), merged, tok)}
    with serve_engine(EngineConfig(**CFG, enable_prefix_caching=True, lora_modules=[f"sql={adapter}"]),
                      model, tok) as (url, aeng):
        yield url, aeng, tok, refs


def test_models_lists_the_adapter_under_the_base(served):
    url, *_ = served
    data = httpx.get(url + "/v1/models", timeout=10).json()["data"]
    assert [(m["id"], m.get("parent")) for m in data] == [("tiny", None), ("sql", "tiny")]


def test_a_request_on_the_adapter_gets_the_merged_models_text(served):
    url, aeng, tok, refs = served
    prompt = "the river ran past the old mill"
    ids = tok.encode(prompt)
    for name in ("sql", "tiny", "sql"):         # base and adapter interleaved: no cache crosses over
        want = tok.decode(refs[name].generate([ids], SamplingParams(max_tokens=16, ignore_eos=True))[0])
        body = {"model": name, "prompt": prompt, "max_tokens": 16, "temperature": 0, "ignore_eos": True}
        r = httpx.post(url + "/v1/completions", json=body, timeout=60).json()
        assert r["model"] == name and r["choices"][0]["text"] == want
        text = ""
        with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True}, timeout=60) as s:
            for line in s.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    text += json.loads(line[6:])["choices"][0]["text"]
        assert text == want
    chat = {"model": "sql", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "temperature": 0}
    ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True),
                     add_special_tokens=False)
    want = tok.decode(refs["sql"].generate([ids], SamplingParams(max_tokens=8))[0], skip_special_tokens=True)
    assert httpx.post(url + "/v1/chat/completions", json=chat, timeout=60).json()["choices"][0]["message"][
        "content"] == want
    kv = aeng.engine.kv
    assert kv.num_free_blocks == kv.num_blocks


def test_an_unknown_model_lists_the_adapters_too(served):
    url, *_ = served
    r = httpx.post(url + "/v1/completions", json={"model": "nope", "prompt": "x", "max_tokens": 2}, timeout=10)
    assert r.status_code == 404 and "`tiny`, `sql`" in r.json()["error"]["message"]
