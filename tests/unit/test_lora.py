"""LoRA adapters beside the base weights: PEFT files load (and bad ones are refused naming the
problem), and a request on an adapter gives what the base model with that adapter merged into
its weights (W + scaling * B A, the plain formula) gives, in batches mixing adapters and the
base, chunked, with speculative decoding, and without sharing prefix-cache blocks across
adapters; and the same greedy tokens as transformers with PEFT loading the adapter."""

from __future__ import annotations

import json
import random

import pytest
import torch
from pydantic import ValidationError
from safetensors.torch import load_file, save_file

from raycluster.cluster.config import ClusterConfig
from raycluster.engine.config import EngineConfig
from raycluster.engine.engine import InvalidRequestError, LLMEngine
from raycluster.engine.scheduler import SchedulerOutput
from raycluster.model.loader import load_model
from raycluster.model.lora import AdapterError, load_adapter, parse_modules
from raycluster.model.tiny import write_tiny_lora
from raycluster.parallel.plan import step_plan
from raycluster.request import Request, SamplingParams

BASE = dict(policy="fcfs", packer="token", predictor="none", kv_cache_tokens=8192)


@pytest.fixture(scope="module")
def adapters(tiny_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    return {"sql": write_tiny_lora(root / "sql", tiny_model_dir, seed=1),
            "chat": write_tiny_lora(root / "chat", tiny_model_dir, seed=2, rank=4, alpha=8.0, use_rslora=True,
                                    targets=("k_proj", "gate_proj", "up_proj"))}


def _prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(6, 4000) for _ in range(rng.choice([1, 5, 17, 40, 90]))] for _ in range(n)]


def test_adapter_config_and_scaling(adapters, tiny_model_dir):
    _, cfg = load_model(tiny_model_dir)
    sql, chat = load_adapter(adapters["sql"], cfg, "sql"), load_adapter(adapters["chat"], cfg, "chat")
    assert sql.rank == 8 and sql.modules == {"q_proj", "v_proj", "o_proj", "down_proj"}
    assert chat.modules == {"k_proj", "gate_proj", "up_proj"}
    raw = load_file(f"{adapters['chat']}/adapter_model.safetensors")
    key = "base_model.model.model.layers.2.mlp.up_proj.lora_B.weight"
    # rsLoRA: alpha / sqrt(r) = 8 / 2; plain LoRA: alpha / r = 16 / 8.
    torch.testing.assert_close(chat.weights[(2, "up_proj")][1], raw[key] * 4.0)
    key = "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"
    torch.testing.assert_close(sql.weights[(0, "q_proj")][1], load_file(f"{adapters['sql']}/adapter_model.safetensors")[key] * 2.0)


@pytest.mark.parametrize("edit, message", [
    (lambda cfg, t: cfg.update(use_dora=True), "use_dora is not supported"),
    (lambda cfg, t: cfg.update(bias="all"), "bias 'all'"),
    (lambda cfg, t: cfg.update(peft_type="IA3"), "not LORA"),
    (lambda cfg, t: cfg.update(r=4), "has shape"),
    (lambda cfg, t: t.update({"base_model.model.model.embed_tokens.lora_A.weight": torch.zeros(8, 4096)}),
     "is not a LoRA A/B of a q/k/v/o"),
    (lambda cfg, t: t.update({"base_model.model.model.layers.9.self_attn.q_proj.lora_A.weight": torch.zeros(8, 256)}),
     "targets no projection"),
    (lambda cfg, t: t.pop("base_model.model.model.layers.1.mlp.down_proj.lora_B.weight"), "has lora_A but no lora_B"),
])
def test_bad_adapters_are_refused_naming_the_problem(adapters, tiny_model_dir, tmp_path, edit, message):
    _, cfg = load_model(tiny_model_dir)
    with open(f"{adapters['sql']}/adapter_config.json") as f:
        acfg = json.load(f)
    tensors = load_file(f"{adapters['sql']}/adapter_model.safetensors")
    edit(acfg, tensors)
    (tmp_path / "adapter_config.json").write_text(json.dumps(acfg))
    save_file(tensors, str(tmp_path / "adapter_model.safetensors"))
    with pytest.raises(AdapterError, match=message):
        load_adapter(tmp_path, cfg, "bad")
    with pytest.raises(AdapterError, match="no adapter_config.json"):
        load_adapter(tmp_path / "missing", cfg, "gone")


def test_lora_modules_are_name_path():
    assert parse_modules(["a=/x", "b = /y"]) == {"a": "/x", "b": "/y"}
    for bad, msg in ((["a"], "not name=path"), (["a=/x", "a=/y"], "given twice"), (["=/x"], "not name=path")):
        with pytest.raises(ValueError, match=msg):
            parse_modules(bad)
    with pytest.raises(ValidationError, match="not name=path"):
        EngineConfig(lora_modules=["nope"])


def test_the_cluster_serves_one_set_of_adapters_everywhere():
    with pytest.raises(ValidationError, match="every pool serves the same LoRA adapters"):
        ClusterConfig(pools=[{"role": "mixed", "engine": {"lora_modules": ["a=/x"]}}, {"role": "mixed"}])
    with pytest.raises(ValidationError, match="named like the served model"):
        ClusterConfig(engine={"lora_modules": ["tiny=/x"]}, pools=[{"role": "mixed"}])
    assert ClusterConfig(engine={"lora_modules": ["a=/x", "b=/y"]}, pools=[{"role": "mixed"}]).lora_names() == ["a", "b"]


def test_plan_marks_each_requests_tokens_with_its_adapter():
    def req(rid, n, adapter, out=()):
        r = Request(rid, list(range(10, 10 + n)), SamplingParams(lora_adapter=adapter))
        r.output_token_ids = list(out)
        r.num_computed_tokens = n + len(out) - 1 if out else 0
        return r
    a, b, c = req("a", 5, "sql"), req("b", 3, "sql"), req("c", 4, None)
    d, e, f = req("d", 6, "chat", [7]), req("e", 6, "chat", [8]), req("f", 6, "sql", [9])
    tables = {r.request_id: [0, 1] for r in (a, b, c, d, e, f)}
    plan = step_plan(SchedulerOutput(prefills=[(a, 5), (b, 3), (c, 4)], decodes=[d, e, f],
                                     spec_tokens={"f": [1, 2]}), tables)[0]
    # a and b merge into one run; c is base; d and e decode a row each; f its row and 2 drafts.
    assert plan.lora_runs == [("sql", 0, 8), ("chat", 12, 2), ("sql", 14, 3)]


def _run(engine, prompts, sps):
    reqs = [engine.add_request(f"r{i}", p, sp) for i, (p, sp) in enumerate(zip(prompts, sps))]
    for _ in range(2000):
        if not engine.has_unfinished():
            break
        engine.step()
    engine.kv.check()
    assert engine.kv.num_free_blocks == engine.kv.num_blocks
    return [r.output_token_ids for r in reqs]


@pytest.mark.parametrize("extra", [{}, {"chunk_size": 7}, {"speculative_method": "ngram"},
                                   {"enable_prefix_caching": True, "block_size": 4}])
def test_a_batch_mixing_adapters_equals_each_merged_model(adapters, merged_lora, loaded, extra):
    model, tok = loaded
    prompts = _prompts(9, seed=3)
    which = [None, "sql", "chat"] * 3
    sps = [SamplingParams(max_tokens=12, ignore_eos=True, lora_adapter=w) for w in which]
    eng = LLMEngine(EngineConfig(**BASE, **extra, lora_modules=[f"{n}={p}" for n, p in adapters.items()]), model, tok)
    got = _run(eng, prompts, sps)
    plain = SamplingParams(max_tokens=12, ignore_eos=True)
    refs = {None: LLMEngine(EngineConfig(**BASE), model, tok),
            **{n: LLMEngine(EngineConfig(**BASE), merged_lora(p)) for n, p in adapters.items()}}
    want = [refs[w].generate([p], plain)[0] for p, w in zip(prompts, which)]
    assert got == want
    assert len({tuple(w) for w in want[:3]}) == 3       # each adapter changes the output


def test_prefix_cache_blocks_are_not_shared_across_adapters(adapters, merged_lora, loaded):
    model, tok = loaded
    eng = LLMEngine(EngineConfig(**BASE, enable_prefix_caching=True, block_size=4,
                                 lora_modules=[f"sql={adapters['sql']}"]), model, tok)
    prompt = _prompts(1, seed=5)[0] + list(range(100, 140))

    def run(adapter):
        r = eng.add_request(f"q{eng.kv.query_tokens}", prompt, SamplingParams(max_tokens=4, ignore_eos=True,
                                                                             lora_adapter=adapter))
        while eng.has_unfinished():
            eng.step()
        return r

    assert run(None).num_cached_tokens == 0
    on_sql = run("sql")
    assert on_sql.num_cached_tokens == 0        # the base's blocks hold other KV
    assert run("sql").num_cached_tokens > 0 and run(None).num_cached_tokens > 0
    ref = LLMEngine(EngineConfig(**BASE), merged_lora(adapters["sql"]))
    assert on_sql.output_token_ids == ref.generate([prompt], SamplingParams(max_tokens=4, ignore_eos=True))[0]


def test_an_adapter_the_engine_does_not_serve_is_a_model_error(adapters, loaded):
    model, tok = loaded
    plain = LLMEngine(EngineConfig(**BASE), model, tok)
    with pytest.raises(InvalidRequestError) as e:
        plain.add_request("a", [5, 6], SamplingParams(lora_adapter="sql"))
    assert e.value.field == "model"
    eng = LLMEngine(EngineConfig(**BASE, lora_modules=[f"sql={adapters['sql']}"]), model, tok)
    with pytest.raises(InvalidRequestError, match="'chat' is not served"):
        eng.add_request("b", [5, 6], SamplingParams(lora_adapter="chat"))
    assert not eng.has_unfinished()


@pytest.mark.parametrize("name", ["sql", "chat"])
def test_greedy_tokens_equal_transformers_with_peft(adapters, tiny_model_dir, loaded, name):
    """The reference implementation: transformers + PEFT loading the same adapter directory
    (plain LoRA on q/v/o/down, rsLoRA on k/gate/up)."""
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32,
                                                           attn_implementation="eager")
    hf = peft.PeftModel.from_pretrained(hf, str(adapters[name])).eval()
    model, tok = loaded
    eng = LLMEngine(EngineConfig(**BASE, lora_modules=[f"{n}={p}" for n, p in adapters.items()]), model, tok)
    prompts = _prompts(4, seed=11)
    got = _run(eng, prompts, [SamplingParams(max_tokens=8, ignore_eos=True, lora_adapter=name)] * 4)
    for prompt, out in zip(prompts, got):
        with torch.no_grad():
            ids = hf.generate(input_ids=torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                              max_new_tokens=8, min_new_tokens=8, do_sample=False, pad_token_id=2)
        assert out == ids[0, len(prompt):].tolist()
