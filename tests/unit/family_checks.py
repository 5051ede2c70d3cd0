"""Checks every decoder family's test module runs on its tiny checkpoint: the engine's greedy
tokens against transformers' `generate` (each prompt alone, fp32, eager attention), an spp
group of 2 against the single-process runner, a kvp group of 2 against the single engine, a LoRA
adapter against transformers + PEFT, and a
stacked-experts model's expert-parallel shards and group (gpt-oss, Llama 4)."""

from __future__ import annotations

import random

import pytest
import torch
from test_shard_load import _same_shard
from test_spp import BS, NUM_BLOCKS, _plans, spp_group
from test_tp import BASE, _close, same_as_single_runner

from raycluster.engine.config import EngineConfig
from raycluster.engine.engine import LLMEngine
from raycluster.engine.kv_manager import KVCacheManager
from raycluster.engine.model_runner import ModelRunner
from raycluster.parallel.factory import build_runner
from raycluster.parallel.shard import Checkpoint, load_shard, shard_model
from raycluster.request import SamplingParams


def greedy_equals_transformers(path, model, shape: list[tuple[int, int]], seed: int, chunk_size: int = 32,
                               min_distinct: int = 6) -> None:
    """Prompts of (length, max_tokens) `shape` (random ids, `seed`): the engine, chunking by
    `chunk_size`, gives transformers' greedy tokens, which are not one token repeated
    (`min_distinct` different ones in all), and ends with all its KV free."""
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                           attn_implementation="eager").eval()
    rng = random.Random(seed)
    work = [([rng.randrange(6, 4000) for _ in range(n)], m) for n, m in shape]
    want = []
    for prompt, m in work:
        with torch.no_grad():
            seq = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                              max_new_tokens=m, min_new_tokens=m, do_sample=False, pad_token_id=2)
        want.append(seq[0, len(prompt):].tolist())
    eng = LLMEngine(EngineConfig(kv_cache_tokens=4096, policy="fcfs", packer="token", chunk_size=chunk_size), model)
    assert eng.generate([p for p, _ in work], [SamplingParams(max_tokens=m, ignore_eos=True) for _, m in work]) == want
    assert len({t for out in want for t in out}) > min_distinct
    eng.kv.check()
    assert eng.kv.num_free_blocks == eng.kv.num_blocks


def lora_equals_transformers_with_peft(path, model, adapter, seed: int, lengths=(5, 30)) -> None:
    """The engine's greedy tokens with LoRA adapter `adapter` (PEFT's layout) equal transformers +
    PEFT's on prompts of `lengths` (random ids, `seed`), and differ from the base model's."""
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    hf = peft.PeftModel.from_pretrained(hf, str(adapter)).eval()
    eng = LLMEngine(EngineConfig(kv_cache_tokens=4096, policy="fcfs", packer="token", lora_modules=[f"a={adapter}"]),
                    model)
    rng = random.Random(seed)
    prompts = [[rng.randrange(6, 4000) for _ in range(n)] for n in lengths]
    got = eng.generate(prompts, SamplingParams(max_tokens=8, ignore_eos=True, lora_adapter="a"))
    for prompt, out in zip(prompts, got):
        with torch.no_grad():
            seq = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                              max_new_tokens=8, min_new_tokens=8, do_sample=False, pad_token_id=2)
        assert out == seq[0, len(prompt):].tolist()
    assert got != eng.generate(prompts, SamplingParams(max_tokens=8, ignore_eos=True))


def pipeline_equals_single_runner(model, monkeypatch) -> None:
    """An spp group of 2 (stage 1 a thread over gloo) gives the single runner's hidden rows on
    test_spp's plans (chunked prefills, a mixed step, decodes)."""
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    ref = ModelRunner(model, KVCacheManager(NUM_BLOCKS, BS))
    plans = _plans()[:3]
    want = [ref.run_plan(p) for p in plans]
    with spp_group(model, KVCacheManager(NUM_BLOCKS, BS), 2, 128) as runner:
        for plan, w in zip(plans, want):
            torch.testing.assert_close(runner.run_plan(plan), w, atol=1e-4, rtol=1e-4)


def stacked_experts_shard_by_expert(path, model, layer: int) -> list:
    """Two expert-parallel ranks of a stacked-experts model: each holds half the experts whole
    (its first one `first`, its stacked gate_up the width of every column), read from the file as
    cut in memory, and their routed layer `layer` sums to the whole block's. Returns the shards."""
    cfg = model.config
    per = cfg.moe.num_experts // 2
    shards = [shard_model(model, r, 2, expert_parallel=True) for r in range(2)]
    for r, s in enumerate(shards):
        block = s.model.layers[layer].ffn
        assert block.first == per * r
        assert block.experts.gate_up_proj.shape == (per, cfg.hidden_size, 2 * cfg.moe.intermediate_size)
        _same_shard(load_shard(Checkpoint(path, cfg), r, 2, expert_parallel=True), s)
    x = torch.randn(31, cfg.hidden_size, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        whole = model.model.layers[layer].ffn(x)
        torch.testing.assert_close(sum(s.model.layers[layer].ffn(x) for s in shards), whole, atol=1e-5, rtol=1e-5)
    return shards


def expert_parallel_group_equals_single_runner(model) -> None:
    # One table for every layer, as the single runner's plans give (a hybrid cache's groups
    # would need a table each: tests/unit/test_hybrid_kv.py).
    runner = build_runner(EngineConfig(**{**BASE, "kv_cache_tokens": 64 * BS, "enable_expert_parallel": True,
                                          "tp": 2, "disable_hybrid_kv_cache_manager": True}), model, torch.float32)
    try:
        assert runner.layout == "tp2ep"
        same_as_single_runner(model, runner)
    finally:
        _close(runner)


def kvp_engine_equals_single_engine(model, monkeypatch) -> None:
    """A kvp 2 engine gives the single engine's greedy tokens on prompts of 20 to 130 tokens."""
    from test_model_hf import _prompt
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    prompts = [_prompt(n, 3000, seed=n) for n in (20, 70, 130)]
    sp = SamplingParams(max_tokens=8, ignore_eos=True)
    base = dict(kv_cache_tokens=2048, policy="fcfs", packer="token", block_size=16, num_threads=1, group_timeout_s=30)
    want = LLMEngine(EngineConfig(**base), model).generate(prompts, sp)
    eng = LLMEngine(EngineConfig(**base, kvp=2), model)
    try:
        assert eng.runner.layout == "kvp2"
        assert eng.generate(prompts, sp) == want
    finally:
        eng.close()
