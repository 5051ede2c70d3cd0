"""Checks every decoder family's test module runs on its tiny checkpoint: the engine's greedy
tokens against transformers' `generate` (each prompt alone, fp32, eager attention), and an spp
group of 2 against the single-process runner."""

from __future__ import annotations

import random

import pytest
import torch
from test_spp import BS, NUM_BLOCKS, _plans, spp_group

from raycluster.engine.config import EngineConfig
from raycluster.engine.engine import LLMEngine
from raycluster.engine.kv_manager import KVCacheManager
from raycluster.engine.model_runner import ModelRunner
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
