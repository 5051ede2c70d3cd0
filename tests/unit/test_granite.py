"""Granite (`GraniteForCausalLM`) and Granite MoE (`GraniteMoeForCausalLM`): the four multipliers
read from config.json (transformers' defaults when absent, positive numbers or a 400-style error
naming the field), Granite MoE's experts (stacked input_linear / output_linear, top k by router
logit) and their expert-parallel shares, and the engine's greedy tokens equal to transformers'
`generate`. Logits against transformers, chunked and decoded: test_model_hf.py; tp groups (every
expert's gate and up halves split alike) and shards read from the file: test_tp.py,
test_shard_load.py."""

from __future__ import annotations

import pytest
import torch
from family_checks import expert_parallel_group_equals_single_runner, greedy_equals_transformers
from test_shard_load import _same_shard

from raycluster.model.config import ModelConfig, ModelConfigError
from raycluster.model.loader import load_model
from raycluster.model.tiny import tiny_config, write_tiny_model
from raycluster.parallel.shard import Checkpoint, load_shard, shard_model


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


@pytest.mark.parametrize("arch", ["GraniteForCausalLM", "GraniteMoeForCausalLM"])
def test_engine_greedy_tokens_equal_transformers_generate(tmp_path, arch):
    path = write_tiny_model(tmp_path, seed=4, architectures=[arch], num_hidden_layers=2)
    greedy_equals_transformers(path, load_model(path)[0], [(5, 12), (40, 8), (90, 10)], seed=7)


def test_granite_moe_experts_and_their_expert_parallel_shares(tmp_path):
    path = write_tiny_model(tmp_path, seed=4, architectures=["GraniteMoeForCausalLM"], num_hidden_layers=2)
    model, cfg = load_model(path)
    moe = cfg.moe
    assert moe.granite and (moe.num_experts, moe.top_k, moe.intermediate_size, moe.layers) == (8, 2, 96, (0, 1))
    block = model.model.layers[0].block_sparse_moe
    assert block.input_linear.weight.shape == (8, 192, cfg.hidden_size)
    assert block.output_linear.weight.shape == (8, cfg.hidden_size, 96)
    x = torch.randn(23, cfg.hidden_size, generator=torch.Generator().manual_seed(0))
    shards = [shard_model(model, r, 2, expert_parallel=True) for r in range(2)]
    with torch.no_grad():
        torch.testing.assert_close(sum(s.model.layers[0].ffn(x) for s in shards), block(x), atol=1e-5, rtol=1e-5)
    for r, s in enumerate(shards):
        assert s.model.layers[0].ffn.first == 4 * r
        _same_shard(load_shard(Checkpoint(path, cfg), r, 2, expert_parallel=True), s)
    expert_parallel_group_equals_single_runner(model)
