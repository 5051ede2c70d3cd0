"""OLMo 2 (`Olmo2ForCausalLM`): norms after each block's output (no input norms), q/k RMSNorm
over the whole projection; the engine's greedy tokens equal to transformers' `generate`; a
pipeline (spp 2) equal to one process; tp refused by name (a rank holding some heads cannot norm
across all of them). Logits against transformers, chunked and decoded: test_model_hf.py."""

from __future__ import annotations

import pytest
import torch
from family_checks import greedy_equals_transformers, pipeline_equals_single_runner

from raycluster.engine.config import EngineConfig
from raycluster.model.loader import load_model
from raycluster.model.tiny import write_tiny_model
from raycluster.parallel.factory import build_runner


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
    greedy_equals_transformers(*olmo2, [(3, 12), (33, 8), (70, 10)], seed=8, chunk_size=16)


def test_a_pipeline_gives_the_single_runners_hidden_rows(olmo2, monkeypatch):
    pipeline_equals_single_runner(olmo2[1], monkeypatch)


def test_tensor_parallelism_is_refused_by_name(olmo2):
    _, model = olmo2
    with pytest.raises(ValueError, match="q/k norms span every head"):
        build_runner(EngineConfig(kv_cache_tokens=1024, tp=2, policy="fcfs", packer="token"), model, torch.float32)
