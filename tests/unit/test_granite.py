"""Granite (`GraniteForCausalLM`): its four multipliers read from config.json (transformers'
defaults when absent, positive numbers or a 400-style error naming the field), and the engine's
greedy tokens equal to transformers' `generate`. Logits against transformers, chunked and
decoded: test_model_hf.py; a tp group's vocab-parallel head: test_tp.py."""

from __future__ import annotations

import pytest
from family_checks import greedy_equals_transformers

from raycluster.model.config import ModelConfig, ModelConfigError
from raycluster.model.loader import load_model
from raycluster.model.tiny import tiny_config, write_tiny_model


def test_multipliers_are_read_with_transformers_defaults():
    cfg = ModelConfig.from_dict(tiny_config(architectures=["GraniteForCausalLM"]))
    assert (cfg.embedding_multiplier, cfg.residual_multiplier, cfg.attention_multiplier, cfg.logits_scaling) == \
        (4.0, 0.5, 0.125, 2.0)
    bare = ModelConfig.from_dict(tiny_config(architectures=["GraniteForCausalLM"], embedding_multiplier=None,
                                             residual_multiplier=None, attention_multiplier=None,
                                             logits_scaling=None))
    # transformers' defaults: every multiplier 1, so the attention scale is 1 too (not head_dim ** -0.5).
    assert (bare.embedding_multiplier, bare.residual_multiplier, bare.attention_multiplier, bare.logits_scaling) == \
        (1.0, 1.0, 1.0, 1.0)
    llama = ModelConfig.from_dict(tiny_config())
    assert llama.attention_multiplier is None and llama.logits_scaling == 1.0


@pytest.mark.parametrize("field, value", [("logits_scaling", 0), ("residual_multiplier", "x"),
                                          ("attention_multiplier", True), ("embedding_multiplier", -2.0)])
def test_a_bad_multiplier_is_named(field, value):
    with pytest.raises(ModelConfigError, match=field):
        ModelConfig.from_dict(tiny_config(architectures=["GraniteForCausalLM"], **{field: value}))


def test_engine_greedy_tokens_equal_transformers_generate(tmp_path):
    path = write_tiny_model(tmp_path, seed=4, architectures=["GraniteForCausalLM"], num_hidden_layers=2)
    greedy_equals_transformers(path, load_model(path)[0], [(5, 12), (40, 8), (90, 10)], seed=7)
