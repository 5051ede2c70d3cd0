"""StarCoder2 (`Starcoder2ForCausalLM`): config.json read as transformers reads it (biases on
every projection, LayerNorm with bias, an ungated GELU-tanh MLP, tied by default, a window on every
layer when set), the engine's greedy tokens equal to transformers' `generate`, LoRA on its
attention projections and an adapter naming its MLP refused. Logits against transformers, chunked
and decoded: test_model_hf.py; a tp group: test_tp.py."""

from __future__ import annotations

import pytest
from family_checks import greedy_equals_transformers

from raycluster.model.config import ModelConfig, ModelConfigError
from raycluster.model.loader import load_model
from raycluster.model.lora import AdapterError, load_adapter
from raycluster.model.tiny import tiny_config, write_tiny_lora, write_tiny_model

ARCH = ["Starcoder2ForCausalLM"]


def test_config_reads_as_transformers_reads_it():
    cfg = ModelConfig.from_dict(tiny_config(architectures=ARCH, tie_word_embeddings=None, norm_epsilon=1e-6))
    assert (cfg.qkv_bias, cfg.o_bias, cfg.mlp_bias, cfg.layer_norm_bias, cfg.plain_mlp) == (True,) * 5
    assert cfg.tie_word_embeddings and cfg.rms_norm_eps == 1e-6 and cfg.sliding_layers == ()
    windowed = ModelConfig.from_dict(tiny_config(architectures=ARCH, sliding_window=4096))
    assert windowed.sliding_layers == (0, 1, 2, 3) and windowed.sliding_window == 4096
    assert not ModelConfig.from_dict(tiny_config(architectures=ARCH, use_bias=False)).qkv_bias
    for field, value in (("hidden_act", "relu"), ("norm_epsilon", 0)):
        with pytest.raises(ModelConfigError, match=field):
            ModelConfig.from_dict(tiny_config(architectures=ARCH, **{field: value}))


def test_engine_greedy_tokens_equal_transformers_generate(tmp_path):
    # Untied, and a window shorter than the prompts.
    path = write_tiny_model(tmp_path, seed=8, architectures=ARCH, num_hidden_layers=2, sliding_window=24,
                            tie_word_embeddings=False)
    greedy_equals_transformers(path, load_model(path)[0], [(5, 12), (30, 16), (75, 8)], seed=16)


def test_lora_targets_attention_and_refuses_the_mlp(tmp_path):
    path = write_tiny_model(tmp_path / "m", architectures=ARCH, num_hidden_layers=1)
    _, cfg = load_model(path)
    ok = load_adapter(write_tiny_lora(tmp_path / "a", path, targets=("q_proj", "v_proj", "o_proj")), cfg, "a")
    assert sorted({m for _, m in ok.weights}) == ["o_proj", "q_proj", "v_proj"]
    tiny = write_tiny_model(tmp_path / "llama", num_hidden_layers=1)
    with pytest.raises(AdapterError, match="down_proj"):
        load_adapter(write_tiny_lora(tmp_path / "b", tiny, targets=("down_proj",)), cfg, "b")
