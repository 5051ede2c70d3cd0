"""OLMo 2 (`Olmo2ForCausalLM`) and OLMo 3 (`Olmo3ForCausalLM`): norms after each block's output
(no input norms), q/k RMSNorm over the whole projection; OLMo 3's sliding layers with their own
plain RoPE (its config read as transformers reads it, the legacy file's too); the engine's greedy
tokens equal to transformers' `generate`; a pipeline (spp 2) equal to one process; tp refused by
name (a rank holding some heads cannot norm across all of them). Logits against transformers,
chunked and decoded: test_model_hf.py."""

from __future__ import annotations

import pytest
from family_checks import greedy_equals_transformers, pipeline_equals_single_runner

from raycluster.engine.config import EngineConfig
from raycluster.engine.engine import LLMEngine
from raycluster.model.config import ModelConfig, ModelConfigError
from raycluster.model.loader import load_model
from raycluster.model.tiny import tiny_config, write_tiny_model
from raycluster.request import SamplingParams


@pytest.fixture(scope="module", params=["Olmo2ForCausalLM", "Olmo3ForCausalLM"])
def olmo2(request, tmp_path_factory):
    path = write_tiny_model(tmp_path_factory.mktemp(request.param), seed=5, architectures=[request.param],
                            num_hidden_layers=2 if request.param == "Olmo2ForCausalLM" else 4)
    return path, load_model(path)[0]


def test_olmo3_reads_its_sliding_layers_and_their_rope_as_transformers_does():
    cfg = ModelConfig.from_dict(tiny_config(architectures=["Olmo3ForCausalLM"], num_hidden_layers=8))
    assert (cfg.sliding_window, cfg.sliding_layers) == (24, (0, 1, 2, 4, 5, 6))
    assert cfg.rope_scaling["rope_type"] == "yarn" and (cfg.rope_theta, cfg.sliding_rope_theta) == (500000.0, 500000.0)
    assert cfg.max_model_len == 256 and cfg.qk_norm_across_heads and cfg.block_norms == "post"
    # The legacy file: RoPE at the top level, its scaling on the full layers only; layer_types decide.
    legacy = ModelConfig.from_dict(tiny_config(
        architectures=["Olmo3ForCausalLM"], num_hidden_layers=4, rope_parameters=None, rope_theta=1e6,
        rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
        layer_types=["full_attention", "sliding_attention", "full_attention", "sliding_attention"]))
    assert (legacy.rope_theta, legacy.sliding_rope_theta, legacy.sliding_layers) == (1e6, 1e6, (1, 3))
    assert ModelConfig.from_dict({**tiny_config(architectures=["Olmo3ForCausalLM"]), "sliding_window": None}).sliding_layers == ()
    with pytest.raises(ModelConfigError, match="sliding_attention"):
        ModelConfig.from_dict(tiny_config(architectures=["Olmo3ForCausalLM"], rope_parameters={
            "full_attention": {"rope_type": "default"}, "sliding_attention": {"rope_type": "linear", "factor": 2.0}}))


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


def test_a_tp_engine_gives_the_single_engines_tokens(olmo2):
    """Each rank norms its heads' part of q and k by the RMS of the whole projection (the ranks'
    sums of squares all-reduced): the engine's greedy tokens are one process's."""
    from test_model_hf import _prompt

    _, model = olmo2
    prompts = [_prompt(n, 3000, seed=n) for n in (9, 40, 75)]
    sp = SamplingParams(max_tokens=10, ignore_eos=True)
    cfg = dict(kv_cache_tokens=1024, policy="fcfs", packer="token", num_threads=1, group_timeout_s=30)
    want = LLMEngine(EngineConfig(**cfg), model).generate(prompts, sp)
    eng = LLMEngine(EngineConfig(**cfg, tp=2), model)
    try:
        assert eng.runner.layout == "tp2" and eng.generate(prompts, sp) == want
    finally:
        eng.runner.close()
