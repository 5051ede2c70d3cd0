"""LoRA adapters on KVP / SPP / TP groups and their combinations: each rank holds its shard of
every adapter (B by its output rows on q/k/v/gate/up, A by its input columns on o/down, added to
the partial sum before the all-reduce; only its layers on an SPP stage; the rows of its SPP
micro-batch), and a group engine gives the single-process engine's greedy tokens on batches
mixing two adapters and the base, chunked, with prefix caching; adapters loaded and unloaded at
run time reach (and leave) every rank. Ranks run as threads here; the cluster tests run them as
Ray actors (`pd-groups`)."""

from __future__ import annotations

import random

import pytest
import torch

from raycluster.engine.config import EngineConfig
from raycluster.engine.engine import LLMEngine
from raycluster.model.loader import load_model
from raycluster.model.lora import TARGETS, load_adapter
from raycluster.model.tiny import write_tiny_lora, write_tiny_model
from raycluster.parallel.shard import layer_part, shard_adapter
from raycluster.parallel.spp import runs_within, split_plan
from raycluster.parallel.plan import StepPlan
from raycluster.request import SamplingParams

BASE = dict(policy="fcfs", packer="token", predictor="none", block_size=16, num_threads=1, group_timeout_s=30,
            kv_cache_tokens=4096, chunk_size=40)
# Fewer KV heads than TP ranks: each KV head (and its k/v adapter rows) on two of tp 4 ranks.
KV_REP = dict(architectures=["Qwen3ForCausalLM"], hidden_size=128, num_attention_heads=8, num_key_value_heads=2,
              head_dim=16, intermediate_size=256, num_hidden_layers=2, attention_bias=True,
              rope_parameters={"rope_type": "default", "rope_theta": 1e6})


@pytest.fixture(scope="module")
def setups(tiny_model_dir, tmp_path_factory):
    """Per model: (model dir, {adapter: dir}): plain LoRA on q/v/o/down, rsLoRA on k/gate/up."""
    root = tmp_path_factory.mktemp("lora_groups")
    out = {}
    for name, model_dir in (("tiny", tiny_model_dir), ("kv-rep", write_tiny_model(root / "kv-rep", seed=1, **KV_REP))):
        out[name] = (model_dir, {
            "one": write_tiny_lora(root / f"{name}-one", model_dir, seed=1),
            "two": write_tiny_lora(root / f"{name}-two", model_dir, seed=2, rank=4, alpha=8.0, use_rslora=True,
                                   targets=("k_proj", "gate_proj", "up_proj"))})
    return out


def _run(eng, n=9, seed=3):
    rng = random.Random(seed)
    which = [None, "one", "two"] * (n // 3)
    reqs = [eng.add_request(f"r{i}", [rng.randrange(6, 4000) for _ in range(rng.choice([5, 17, 40, 90]))],
                            SamplingParams(max_tokens=10, ignore_eos=True, lora_adapter=w)) for i, w in enumerate(which)]
    for _ in range(1000):
        if not eng.has_unfinished():
            break
        eng.step()
    assert not eng.has_unfinished() and eng.kv.num_free_blocks == eng.kv.num_blocks
    return [r.output_token_ids for r in reqs]


def test_rank_shards_of_an_adapter_sum_to_the_whole_update(setups):
    """Per projection, the ranks' updates put back together (stacked rows of the column-parallel
    ones, summed partials of the row-parallel ones) equal the whole adapter's x A^T B^T."""
    model_dir, adapters = setups["kv-rep"]
    model, cfg = load_model(model_dir)
    full = load_adapter(adapters["one"], cfg, "one")
    two = load_adapter(adapters["two"], cfg, "two")
    tp = 4
    parts = [shard_adapter(full, r, tp, cfg.num_key_value_heads) for r in range(tp)]
    parts2 = [shard_adapter(two, r, tp, cfg.num_key_value_heads) for r in range(tp)]
    x = torch.randn(5, cfg.hidden_size)
    for (layer, module), (a, b) in {**full.weights, **two.weights}.items():
        src = parts if (layer, module) in full.weights else parts2
        dim = layer_part(f"{TARGETS[module]}.{module}.weight", 0, tp, cfg.num_key_value_heads).dim
        want = (torch.randn(5, a.shape[1]) if dim == 1 else x)
        whole = (want @ a.t()) @ b.t()
        if dim == 0:            # rows of each rank (k/v: each replicated head's rows on two ranks)
            got = [(want @ p.weights[(layer, module)][0].t()) @ p.weights[(layer, module)][1].t() for p in src]
            if module in ("k_proj", "v_proj"):
                got = got[::tp // cfg.num_key_value_heads]
            torch.testing.assert_close(torch.cat(got, dim=1), whole)
        else:                   # partial sums over each rank's input columns
            cols = want.chunk(tp, dim=1)
            got = sum((c @ p.weights[(layer, module)][0].t()) @ p.weights[(layer, module)][1].t()
                      for c, p in zip(cols, src))
            torch.testing.assert_close(got, whole, rtol=1e-5, atol=1e-6)
    stage = shard_adapter(full, 0, 1, cfg.num_key_value_heads, layers=range(1, 2))
    assert {layer for layer, _ in stage.weights} == {1}


def test_micro_batches_carry_their_rows_of_the_lora_runs():
    # Prefills of 12 and 8 tokens (micro-batches of 5, 5, 2 and 5, 3), then two decodes.
    plan = StepPlan(list(range(22)), [0, 5], [12, 8], [[0], [1]], [7, 9], [[2], [3]], [11, 19, 20, 21],
                    [("a", 0, 12), ("b", 20, 1), ("a", 21, 1)])
    mbs = split_plan(plan, 5)
    assert [mb.lora_runs for mb in mbs] == [[("a", 0, 5)], [("a", 0, 5)], [("a", 0, 2)], [], [],
                                             [("b", 0, 1), ("a", 1, 1)]]
    assert runs_within([("a", 3, 4)], 5, 20) == [("a", 0, 2)]


@pytest.mark.parametrize("model_name, group, layout", [
    ("tiny", {"tp": 2}, "tp2"),
    ("kv-rep", {"tp": 4}, "tp4"),
    ("tiny", {"kvp": 2}, "kvp2"),
    ("tiny", {"spp": 2, "spp_micro_tokens": 24}, "spp2"),
    ("tiny", {"kvp": 2, "tp": 2}, "kvp2xtp2"),
    ("tiny", {"spp": 2, "tp": 2, "spp_micro_tokens": 24}, "spp2xtp2"),
    ("tiny", {"kvp": 2, "spp": 2, "spp_micro_tokens": 24}, "kvp2xspp2"),
])
def test_a_group_engine_serves_adapters_as_the_single_engine_does(setups, model_name, group, layout):
    model_dir, adapters = setups[model_name]
    model = load_model(model_dir)[0]
    mods = [f"{n}={p}" for n, p in adapters.items()]
    want = _run(LLMEngine(EngineConfig(**BASE, lora_modules=mods), model))
    eng = LLMEngine(EngineConfig(**BASE, **group, lora_modules=mods, enable_prefix_caching=True), model)
    try:
        assert eng.runner.layout.startswith(layout)
        assert _run(eng) == want
        assert len({tuple(w) for w in want[:3]}) == 3        # each adapter changes the output
    finally:
        eng.close()


def test_adapters_loaded_and_unloaded_at_run_time_reach_every_rank(setups):
    model_dir, adapters = setups["tiny"]
    model = load_model(model_dir)[0]
    want = _run(LLMEngine(EngineConfig(**BASE, lora_modules=[f"{n}={p}" for n, p in adapters.items()]), model))
    eng = LLMEngine(EngineConfig(**BASE, tp=2), model)
    try:
        for name, path in adapters.items():
            eng.lora.add(eng.read_lora(name, path))
        assert _run(eng) == want
        assert set(eng.runner.rank0.adapters.set.adapters) == {"one", "two"}
        eng.unload_lora("one")
        assert set(eng.runner.rank0.adapters.set.adapters) == {"two"}
        eng.lora.add(eng.read_lora("one", adapters["two"]))       # the name again, other weights
        r = eng.add_request("x", list(range(100, 140)), SamplingParams(max_tokens=6, ignore_eos=True,
                                                                       lora_adapter="one"))
        while eng.has_unfinished():
            eng.step()
        ref = LLMEngine(EngineConfig(**BASE, lora_modules=[f"one={adapters['two']}"]), model)
        assert r.output_token_ids == ref.generate([list(range(100, 140))], SamplingParams(
            max_tokens=6, ignore_eos=True, lora_adapter="one"))[0]
    finally:
        eng.close()
