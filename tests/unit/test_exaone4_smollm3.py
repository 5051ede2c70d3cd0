"""Two families with layers that use no position embedding: SmolLM3 (`no_rope_layers`, else every
`no_rope_layer_interval`-th layer) and EXAONE 4 (with a `sliding_window`, its full-attention layers;
norms after each block, q/k norms per head). config.json read as transformers reads it, errors
naming the field, the engine's greedy tokens equal to transformers' `generate`. Logits against
transformers, chunked and decoded: test_model_hf.py."""

from __future__ import annotations

import pytest
from family_checks import greedy_equals_transformers

from raycluster.model.config import ModelConfig, ModelConfigError
from raycluster.model.loader import load_model
from raycluster.model.tiny import tiny_config, write_tiny_model


def _config(arch: str, **over) -> ModelConfig:
    return ModelConfig.from_dict(tiny_config(architectures=[arch], **over))


def test_smollm3_reads_its_rope_free_layers():
    assert _config("SmolLM3ForCausalLM").nope_layers == (1, 3)                  # interval 2
    assert _config("SmolLM3ForCausalLM", no_rope_layer_interval=None).nope_layers == (3,)   # transformers' 4
    assert _config("SmolLM3ForCausalLM", no_rope_layers=[0, 1, 1, 0]).nope_layers == (0, 3)
    with pytest.raises(ModelConfigError, match="no_rope_layers"):
        _config("SmolLM3ForCausalLM", no_rope_layers=[1, 2, 1, 1])


def test_exaone4_reads_its_sliding_and_rope_free_layers():
    cfg = _config("Exaone4ForCausalLM", num_hidden_layers=8, sliding_window_pattern=None)
    assert cfg.sliding_layers == (0, 1, 2, 4, 5, 6) and cfg.nope_layers == (3, 7) and cfg.sliding_window == 24
    assert cfg.block_norms == "post" and cfg.qk_norm and not cfg.qkv_bias and not cfg.mlp_bias
    # No window in the file: transformers' default 4096; all-full layer types: no RoPE anywhere.
    assert _config("Exaone4ForCausalLM", sliding_window=None).sliding_window == 4096
    full = _config("Exaone4ForCausalLM", num_hidden_layers=2, layer_types=["full_attention"] * 2)
    assert full.sliding_layers == () and full.nope_layers == (0, 1)
    with pytest.raises(ModelConfigError, match="sliding_window_pattern"):
        _config("Exaone4ForCausalLM", sliding_window_pattern=0)


@pytest.mark.parametrize("arch", ["SmolLM3ForCausalLM", "Exaone4ForCausalLM"])
def test_engine_greedy_tokens_equal_transformers_generate(tmp_path, arch):
    path = write_tiny_model(tmp_path, seed=5, architectures=[arch], num_hidden_layers=4)
    greedy_equals_transformers(path, load_model(path)[0], [(6, 12), (30, 16), (70, 8)], seed=13)
