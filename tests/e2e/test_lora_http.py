"""LoRA adapters over real HTTP on one engine, as vLLM serves them: /v1/models lists each
adapter with the base model as its parent, a request whose `model` names an adapter gets the
text of the base model with that adapter merged into its weights (streamed and not, chat too),
the base name still gets the base, and an unknown name is a 404 listing what is served; adapters
loaded and unloaded at run time, and loaded on first use from a resolver directory."""

from __future__ import annotations

import asyncio
import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from engine_http import serve_engine, tiny_parts

from raycluster.engine.config import EngineConfig
from raycluster.engine.engine import LLMEngine
from raycluster.model.tiny import write_tiny_lora
from raycluster.request import SamplingParams
from raycluster.server.app import build_app

pytestmark = pytest.mark.e2e

CFG = dict(kv_cache_tokens=8192, policy="fcfs", packer="token", predictor="none")


@pytest.fixture(scope="module")
def served(tiny_model_dir, tmp_path_factory, merged_lora):
    adapter = write_tiny_lora(tmp_path_factory.mktemp("lora") / "sql", tiny_model_dir, seed=1)
    model, tok = tiny_parts(tiny_model_dir)
    refs = {"tiny": LLMEngine(EngineConfig(**CFG), model, tok),
            "sql": LLMEngine(EngineConfig(**CFG), merged_lora(adapter), tok)}
    with serve_engine(EngineConfig(**CFG, enable_prefix_caching=True, lora_modules=[f"sql={adapter}"]),
                      model, tok, allow_runtime_lora=False) as (url, aeng):
        yield url, aeng, tok, refs


def test_models_lists_the_adapter_under_the_base(served):
    url, aeng, *_ = served
    data = httpx.get(url + "/v1/models", timeout=10).json()["data"]
    assert [(m["id"], m.get("parent")) for m in data] == [("tiny", None), ("sql", "tiny")]
    assert data[1]["root"] == str(aeng.engine.lora.adapters["sql"].path)        # vLLM's: the adapter's path


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


def test_runtime_lora_routes_exist_only_when_allowed(served):
    url, *_ = served
    r = httpx.post(url + "/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": "/x"}, timeout=10)
    assert r.status_code == 404


def test_adapters_load_and_unload_at_run_time_over_http(tiny_model_dir, tmp_path, monkeypatch, merged_lora):
    """vLLM's /v1/load_lora_adapter and /v1/unload_lora_adapter (VLLM_ALLOW_RUNTIME_LORA_UPDATING):
    plain-text success lines, 400 for a taken or base name and a bad adapter, 404 for a path
    with no adapter and an unknown unload; a loaded adapter is listed and serves the merged
    model's text, an unloaded one is a 404 model, and a name loaded again serves the new weights
    (prefix caching on: the old weights' KV is not reused)."""
    one = write_tiny_lora(tmp_path / "one", tiny_model_dir, seed=1)
    two = write_tiny_lora(tmp_path / "two", tiny_model_dir, seed=2)
    bad = write_tiny_lora(tmp_path / "bad", tiny_model_dir, seed=3)
    cfg_path = tmp_path / "bad" / "adapter_config.json"
    cfg_path.write_text(json.dumps({**json.loads(cfg_path.read_text()), "use_dora": True}))
    model, tok = tiny_parts(tiny_model_dir)
    prompt = "the river ran past the old mill and on to the sea below"

    def merged_text(adapter_dir):
        ref = LLMEngine(EngineConfig(**CFG), merged_lora(adapter_dir), tok)
        return tok.decode(ref.generate([tok.encode(prompt)], SamplingParams(max_tokens=12, ignore_eos=True))[0])

    monkeypatch.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "True")
    with serve_engine(EngineConfig(**CFG, enable_prefix_caching=True), model, tok) as (url, aeng):
        def load(name, path):
            return httpx.post(url + "/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(path)},
                              timeout=30)

        def unload(name):
            return httpx.post(url + "/v1/unload_lora_adapter", json={"lora_name": name}, timeout=30)

        def complete(name):
            return httpx.post(url + "/v1/completions", json={"model": name, "prompt": prompt, "max_tokens": 12,
                                                             "temperature": 0, "ignore_eos": True}, timeout=60)

        def models():
            return [m["id"] for m in httpx.get(url + "/v1/models", timeout=10).json()["data"]]

        assert complete("sql").status_code == 404
        r = load("sql", one)
        assert (r.status_code, r.text) == (200, "Success: LoRA adapter 'sql' added successfully.")
        assert models() == ["tiny", "sql"]
        assert complete("sql").json()["choices"][0]["text"] == merged_text(one)
        for name, path, status, words in (("sql", two, 400, "already been loaded"), ("tiny", two, 400, "base model"),
                                          ("new", tmp_path / "nowhere", 404, "no adapter found"),
                                          ("new", bad, 400, "use_dora is not supported"), ("", one, 400, "must be")):
            r = load(name, path)
            assert r.status_code == status and words in r.json()["error"]["message"], (name, r.text)
        assert models() == ["tiny", "sql"]
        r = unload("sql")
        assert (r.status_code, r.text) == (200, "Success: LoRA adapter 'sql' removed successfully.")
        assert models() == ["tiny"] and complete("sql").status_code == 404
        assert unload("sql").status_code == 404
        assert load("sql", two).status_code == 200
        assert complete("sql").json()["choices"][0]["text"] == merged_text(two)
        kv = aeng.engine.kv
        assert kv.num_free_blocks == kv.num_blocks


def test_adapters_in_the_resolver_directory_load_on_first_use(tiny_model_dir, tmp_path, merged_lora):
    """vLLM's filesystem LoRA resolver: `model: sql` with <dir>/sql holding an adapter is served
    (four requests at once, one load), with the merged model's text; names outside the directory
    (a path, a symlink out, a dot name), with no adapter there, or with one this model cannot
    serve are 404s, and nothing of them is loaded."""
    root = tmp_path / "adapters"
    sql = write_tiny_lora(root / "sql", tiny_model_dir, seed=1)
    write_tiny_lora(root / "chat", tiny_model_dir, seed=2)
    write_tiny_lora(root / "bad", tiny_model_dir, seed=3)
    cfg_path = root / "bad" / "adapter_config.json"
    cfg_path.write_text(json.dumps({**json.loads(cfg_path.read_text()), "use_dora": True}))
    (root / "escape").symlink_to(write_tiny_lora(tmp_path / "outside", tiny_model_dir, seed=4))
    model, tok = tiny_parts(tiny_model_dir)
    prompt = "the river ran past the old mill and on to the sea below"
    ref = LLMEngine(EngineConfig(**CFG), merged_lora(sql), tok)
    want = tok.decode(ref.generate([tok.encode(prompt)], SamplingParams(max_tokens=12, ignore_eos=True))[0])
    with serve_engine(EngineConfig(**CFG), model, tok, allow_runtime_lora=True,
                      lora_resolver_dir=str(root)) as (url, aeng):
        loads = []
        real = aeng.load_lora

        async def counted(name, path):
            loads.append(name)
            await asyncio.sleep(0.3)        # a slow load: the other requests arrive meanwhile
            await real(name, path)
        aeng.load_lora = counted

        def complete(name):
            return httpx.post(url + "/v1/completions", json={"model": name, "prompt": prompt, "max_tokens": 12,
                                                             "temperature": 0, "ignore_eos": True}, timeout=60)

        def models():
            return [m["id"] for m in httpx.get(url + "/v1/models", timeout=10).json()["data"]]

        assert models() == ["tiny"]
        with ThreadPoolExecutor(4) as ex:
            replies = list(ex.map(complete, ["sql"] * 4))
        assert [r.status_code for r in replies] == [200] * 4, [r.text for r in replies]
        assert {r.json()["choices"][0]["text"] for r in replies} == {want}
        assert loads == ["sql"] and models() == ["tiny", "sql"]
        chat = {"model": "chat", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
        assert httpx.post(url + "/v1/chat/completions", json=chat, timeout=60).status_code == 200
        for name, words in (("nope", "no adapter directory 'nope'"), ("../outside", "no adapter directory"),
                            ("sql/", "no adapter directory"),
                            ("escape", "no adapter directory"), (".hidden", "no adapter directory"),
                            ("bad", "use_dora is not supported")):
            r = complete(name)
            assert r.status_code == 404 and words in r.json()["error"]["message"], (name, r.text)
        assert models() == ["tiny", "sql", "chat"] and loads == ["sql", "chat", "bad"]
        kv = aeng.engine.kv
        assert kv.num_free_blocks == kv.num_blocks
    with pytest.raises(ValueError, match="lora_resolver_dir: loading adapters on first use needs runtime"):
        build_app(aeng, tok, ["tiny"], allow_runtime_lora=False, lora_resolver_dir=str(root))
    with pytest.raises(ValueError, match="lora_resolver_max_loaded: there is no LoRA resolver"):
        build_app(aeng, tok, ["tiny"], allow_runtime_lora=True, lora_resolver_max_loaded=2)


def test_the_resolver_keeps_at_most_max_loaded_adapters_least_recently_used_out(tiny_model_dir, tmp_path,
                                                                                  merged_lora):
    """lora_resolver_max_loaded 2, adapters a, b, c in the directory and `sql` served from the
    start: a, b load; a is named again; c evicts b (named least recently), b comes back evicting
    a; `sql` is never evicted; each serves its merged model's text whenever it is loaded."""
    root = tmp_path / "adapters"
    paths = {n: write_tiny_lora(root / n, tiny_model_dir, seed=s) for n, s in (("a", 1), ("b", 2), ("c", 3))}
    static = write_tiny_lora(tmp_path / "sql", tiny_model_dir, seed=4)
    model, tok = tiny_parts(tiny_model_dir)
    prompt = "the river ran past the old mill"
    ids = tok.encode(prompt)
    want = {n: tok.decode(LLMEngine(EngineConfig(**CFG), merged_lora(p), tok).generate(
        [ids], SamplingParams(max_tokens=8, ignore_eos=True))[0]) for n, p in paths.items()}
    with serve_engine(EngineConfig(**CFG, lora_modules=[f"sql={static}"]), model, tok, allow_runtime_lora=True,
                      lora_resolver_dir=str(root), lora_resolver_max_loaded=2) as (url, aeng):
        def complete(name):
            r = httpx.post(url + "/v1/completions", json={"model": name, "prompt": prompt, "max_tokens": 8,
                                                          "temperature": 0, "ignore_eos": True}, timeout=60)
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]["text"]

        def models():
            return sorted(m["id"] for m in httpx.get(url + "/v1/models", timeout=10).json()["data"])

        for name, after in (("a", ["a", "sql", "tiny"]), ("b", ["a", "b", "sql", "tiny"]),
                            ("a", ["a", "b", "sql", "tiny"]), ("c", ["a", "c", "sql", "tiny"]),
                            ("b", ["b", "c", "sql", "tiny"]), ("sql", ["b", "c", "sql", "tiny"])):
            text = complete(name)
            assert name == "sql" or text == want[name], name
            assert models() == after, name
        kv = aeng.engine.kv
        assert kv.num_free_blocks == kv.num_blocks
