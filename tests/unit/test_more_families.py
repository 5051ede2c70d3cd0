"""Seed-OSS (`SeedOssForCausalLM`), Ernie 4.5 (`Ernie4_5ForCausalLM`), Arcee's AFM
(`ArceeForCausalLM`), Apertus (`ApertusForCausalLM`) and Hunyuan dense (`HunYuanDenseV1ForCausalLM`):
config.json read as transformers reads it (Apertus' default RoPE, Hunyuan's fixed-alpha RoPE), the engine's greedy tokens equal to transformers' `generate`, and a LoRA
adapter on Arcee's ungated MLP equal to transformers + PEFT (a gate it has not, refused). Logits
against transformers, chunked and decoded: test_model_hf.py; tp groups: test_tp.py."""

from __future__ import annotations


import pytest
from family_checks import greedy_equals_transformers, lora_equals_transformers_with_peft

from raycluster.model.config import ModelConfig, ModelConfigError
from raycluster.model.loader import load_model
from raycluster.model.lora import AdapterError, load_adapter
from raycluster.model.tiny import tiny_config, write_tiny_lora, write_tiny_model

ARCHS = ["SeedOssForCausalLM", "Ernie4_5ForCausalLM", "ArceeForCausalLM", "ApertusForCausalLM",
         "HunYuanDenseV1ForCausalLM"]


def test_configs_read_as_transformers_reads_them():
    seed = ModelConfig.from_dict(tiny_config(architectures=["SeedOssForCausalLM"], attention_out_bias=False))
    assert (seed.qkv_bias, seed.o_bias, seed.mlp_bias) == (True, False, False)
    ernie = ModelConfig.from_dict(tiny_config(architectures=["Ernie4_5ForCausalLM"], tie_word_embeddings=None))
    assert (ernie.qkv_bias, ernie.o_bias, ernie.mlp_bias, ernie.rope_interleaved, ernie.tie_word_embeddings) == \
        (True, True, True, True, True)
    arcee = ModelConfig.from_dict(tiny_config(architectures=["ArceeForCausalLM"]))
    assert arcee.ungated_mlp == "relu2" and not arcee.plain_mlp
    apertus = ModelConfig.from_dict(tiny_config(architectures=["ApertusForCausalLM"], rope_parameters=None))
    assert (apertus.ungated_mlp, apertus.qk_norm, apertus.block_norms) == ("xielu", True, "apertus")
    assert apertus.rope_theta == 12e6 and apertus.rope_scaling["rope_type"] == "llama3"    # transformers' default
    # Hunyuan's "dynamic" RoPE of a fixed alpha: a plain RoPE at theta * alpha^(d / (d - 2)); q/k
    # norms after RoPE.
    hunyuan = ModelConfig.from_dict(tiny_config(architectures=["HunYuanDenseV1ForCausalLM"]))
    assert hunyuan.rope_scaling is None and hunyuan.rope_theta == pytest.approx(10000.0 * 1000.0 ** (32 / 30))
    assert hunyuan.qk_norm_after_rope and not hunyuan.qk_norm
    for arch in ("ArceeForCausalLM", "ApertusForCausalLM"):
        with pytest.raises(ModelConfigError, match="hidden_act"):
            ModelConfig.from_dict(tiny_config(architectures=[arch], hidden_act="silu"))


@pytest.mark.parametrize("arch", ARCHS)
def test_engine_greedy_tokens_equal_transformers_generate(tmp_path, arch):
    path = write_tiny_model(tmp_path, seed=5, architectures=[arch], num_hidden_layers=2)
    greedy_equals_transformers(path, load_model(path)[0], [(4, 12), (37, 8), (80, 10)], seed=19)


def test_a_lora_on_arcees_mlp_equals_transformers_with_peft(tmp_path):
    path = write_tiny_model(tmp_path / "arcee", seed=5, architectures=["ArceeForCausalLM"], num_hidden_layers=2)
    model, _ = load_model(path)
    adapter = write_tiny_lora(tmp_path / "lora", path, seed=6, targets=("q_proj", "up_proj", "down_proj"), std=0.3)
    lora_equals_transformers_with_peft(path, model, adapter, seed=20)
    llama = write_tiny_model(tmp_path / "llama", seed=5, num_hidden_layers=2)      # same shapes, with a gate
    gated = write_tiny_lora(tmp_path / "gate", llama, seed=6, targets=("gate_proj",))
    with pytest.raises(AdapterError, match="targets no projection"):
        load_adapter(gated, model.config, "g")
