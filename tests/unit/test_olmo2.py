"""OLMo 2 (`Olmo2ForCausalLM`): norms after each block's output (no input norms), q/k RMSNorm
over the whole projection; the engine's greedy tokens equal to transformers' `generate`; a
pipeline (spp 2) equal to one process; tp refused by name (a rank holding some heads cannot norm
across all of them). Logits against transformers, chunked and decoded: test_model_hf.py."""

from __future__ import annotations

import random

import pytest
import torch
from test_spp import BS, NUM_BLOCKS, _plans, spp_group

from raycluster.engine.config import EngineConfig
from raycluster.engine.engine import LLMEngine
from raycluster.engine.kv_manager import KVCacheManager
from raycluster.engine.model_runner import ModelRunner
from raycluster.model.loader import load_model
from raycluster.model.tiny import write_tiny_model
from raycluster.parallel.factory import build_runner
from raycluster.request import SamplingParams


@pytest.fixture(scope="module")
def olmo2(tmp_path_factory):
    path = write_tiny_model(tmp_path_factory.mktemp("olmo2"), seed=5, architectures=["Olmo2ForCausalLM"],
                            num_hidden_layers=2)
    return path, load_model(path)[0]


def test_the_layers_hold_only_output_norms_and_whole_width_qk_norms(olmo2):
    _, model = olmo2
    cfg = model.config
    assert cfg.block_norms == "post" and cfg.qk_norm_across_heads and not cfg.qk_norm
    layer = model.model.layers[0]
    assert not hasattr(layer, "input_layernorm") and not hasattr(layer, "pre_feedforward_layernorm")
    assert layer.self_attn.q_norm.weight.shape == (cfg.num_attention_heads * cfg.head_dim,)
    assert layer.self_attn.k_norm.weight.shape == (cfg.num_key_value_heads * cfg.head_dim,)


def test_engine_greedy_tokens_equal_transformers_generate(olmo2):
    transformers = pytest.importorskip("transformers")
    path, model = olmo2
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                           attn_implementation="eager").eval()
    rng = random.Random(8)
    work = [([rng.randrange(6, 4000) for _ in range(n)], m) for n, m in ((3, 12), (33, 8), (70, 10))]
    want = []
    for prompt, m in work:
        with torch.no_grad():
            seq = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                              max_new_tokens=m, min_new_tokens=m, do_sample=False, pad_token_id=2)
        want.append(seq[0, len(prompt):].tolist())
    eng = LLMEngine(EngineConfig(kv_cache_tokens=4096, policy="fcfs", packer="token", chunk_size=16), model)
    assert eng.generate([p for p, _ in work], [SamplingParams(max_tokens=m, ignore_eos=True) for _, m in work]) == want
    assert len({t for out in want for t in out}) > 6         # not one token repeated


def test_a_pipeline_gives_the_single_runners_hidden_rows(olmo2, monkeypatch):
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    _, model = olmo2
    ref = ModelRunner(model, KVCacheManager(NUM_BLOCKS, BS))
    plans = _plans()[:3]
    want = [ref.run_plan(p) for p in plans]
    with spp_group(model, KVCacheManager(NUM_BLOCKS, BS), 2, 128) as runner:
        for plan, w in zip(plans, want):
            torch.testing.assert_close(runner.run_plan(plan), w, atol=1e-4, rtol=1e-4)


def test_tensor_parallelism_is_refused_by_name(olmo2):
    _, model = olmo2
    with pytest.raises(ValueError, match="q/k norms span every head"):
        build_runner(EngineConfig(kv_cache_tokens=1024, tp=2, policy="fcfs", packer="token"), model, torch.float32)
