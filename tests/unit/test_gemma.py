"""Gemma, Gemma 2 and Gemma 3 (raycluster.model.gemma_config): config.json read as transformers
reads it, the engine's greedy tokens equal to transformers' `generate`, a Gemma 3 pipeline
(its per-layer RoPE across stages) equal to one process, and what is refused. The logits
against transformers, chunked and decoded, are in test_model_hf.py; tp groups in test_tp.py."""

from __future__ import annotations

import pytest
import torch
from family_checks import greedy_equals_transformers, pipeline_equals_single_runner

from raycluster.engine.config import EngineConfig
from raycluster.model.config import ModelConfig, ModelConfigError
from raycluster.model.loader import load_model
from raycluster.model.tiny import tiny_config, write_tiny_model
from raycluster.parallel.factory import build_runner


def _config(arch: str, **over) -> ModelConfig:
    return ModelConfig.from_dict(tiny_config(architectures=[arch], **over))


# ---- config.json ----------------------------------------------------------------------------------
def test_gemma_reads_as_transformers_defaults_it():
    g1 = _config("GemmaForCausalLM", tie_word_embeddings=None, head_dim=32)
    assert g1.tie_word_embeddings and g1.has_lm_head          # transformers' Gemma default: tied
    assert g1.gemma.version == 1 and g1.gemma.attention_scale == 32 ** -0.5
    assert g1.sliding_layers == () and g1.sliding_window is None and not g1.qk_norm
    assert g1.block_norms == "pre" and g1.gemma.attn_softcap is None

    g2 = _config("Gemma2ForCausalLM", num_hidden_layers=5)
    assert g2.sliding_layers == (0, 2, 4) and g2.sliding_window == 24          # the even layers
    assert (g2.gemma.attn_softcap, g2.gemma.final_softcap) == (5.0, 100.0) and g2.block_norms == "sandwich"
    assert g2.gemma.attention_scale == 24 ** -0.5 and not g2.qk_norm

    # Gemma 3: five sliding layers of every six without layer_types; the legacy file's RoPE
    # fields (the local base, a linear factor on the global layers only, which
    # max_position_embeddings already counts).
    g3 = _config("Gemma3ForCausalLM", num_hidden_layers=13, sliding_window_pattern=None, rope_parameters=None,
                 rope_theta=1e6, rope_local_base_freq=10000.0, rope_scaling={"rope_type": "linear", "factor": 8.0})
    assert g3.sliding_layers == (0, 1, 2, 3, 4, 6, 7, 8, 9, 10, 12)
    assert g3.qk_norm and g3.sliding_rope_theta == 10000.0 and g3.rope_theta == 1e6
    assert g3.rope_scaling == {"rope_type": "linear", "factor": 8.0}
    assert g3.max_model_len == g3.max_position_embeddings == 32768
    # layer_types, when written, decide.
    g3 = _config("Gemma3ForCausalLM", num_hidden_layers=3,
                 layer_types=["full_attention", "sliding_attention", "full_attention"])
    assert g3.sliding_layers == (1,)
    # A Gemma 2 base model (an embedding model such as BGE-multilingual-Gemma2).
    base = _config("Gemma2Model", hidden_act=None)
    assert base.architecture == "Gemma2ForCausalLM" and base.gemma.version == 2


@pytest.mark.parametrize("arch, over, field", [
    ("GemmaForCausalLM", dict(hidden_activation="relu"), "hidden_activation"),
    ("Gemma2ForCausalLM", dict(query_pre_attn_scalar=-1), "query_pre_attn_scalar"),
    ("Gemma2ForCausalLM", dict(attn_logit_softcapping="big"), "attn_logit_softcapping"),
    ("Gemma2ForCausalLM", dict(layer_types=["full_attention"]), "layer_types"),
    ("Gemma3ForCausalLM", dict(use_bidirectional_attention=True), "use_bidirectional_attention"),
    ("Gemma3ForCausalLM", dict(rope_parameters={
        "full_attention": {"rope_type": "default", "rope_theta": 1e6},
        "sliding_attention": {"rope_type": "linear", "rope_theta": 1e4, "factor": 2.0}}), "sliding_attention"),
])
def test_gemma_config_errors_name_the_field(arch, over, field):
    with pytest.raises(ModelConfigError, match=field):
        _config(arch, **over)


# ---- the engine against transformers' generate -----------------------------------------------------
@pytest.fixture(scope="module", params=["Gemma2ForCausalLM", "Gemma3ForCausalLM"])
def gemma(request, tmp_path_factory):
    path = write_tiny_model(tmp_path_factory.mktemp(request.param), seed=7, architectures=[request.param],
                            hidden_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                            num_hidden_layers=3, intermediate_size=256, tie_word_embeddings=False,
                            layer_types=["sliding_attention", "sliding_attention", "full_attention"])
    return path, load_model(path)[0]


def test_engine_greedy_tokens_equal_transformers_generate(gemma):
    # Prompts shorter and longer than the 24-token window; generations crossing it.
    path, model = gemma
    greedy_equals_transformers(path, model, [(1, 12), (5, 30), (23, 8), (40, 16), (97, 10), (130, 6)], seed=3,
                               min_distinct=10)


def test_a_gemma3_pipeline_gives_the_single_runners_hidden_rows(gemma, monkeypatch):
    """Stage 1 holds layer 2 alone: it must take the RoPE of its own index (full attention, in
    Gemma 3 the global base), not of the stage's first local layer (0, sliding)."""
    pipeline_equals_single_runner(gemma[1], monkeypatch)


def test_kv_parallel_attention_refuses_soft_capped_scores(tmp_path):
    path = write_tiny_model(tmp_path, architectures=["Gemma2ForCausalLM"], num_hidden_layers=2,
                            layer_types=["full_attention", "full_attention"])
    model, cfg = load_model(path)
    assert cfg.sliding_layers == () and cfg.gemma.attn_softcap == 5.0
    assert cfg.torch_attention_only and not _config("GemmaForCausalLM").torch_attention_only
    with pytest.raises(ValueError, match="attn_logit_softcapping"):
        build_runner(EngineConfig(kv_cache_tokens=1024, kvp=2, policy="fcfs", packer="token"), model, torch.float32)
