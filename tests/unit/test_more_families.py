"""Seed-OSS (`SeedOssForCausalLM`), Ernie 4.5 (`Ernie4_5ForCausalLM`), Arcee's AFM
(`ArceeForCausalLM`), Apertus (`ApertusForCausalLM`), Hunyuan dense (`HunYuanDenseV1ForCausalLM`) and
Ministral 3 (`Ministral3ForCausalLM`): config.json read as transformers reads it (Apertus' default
RoPE, Hunyuan's fixed-alpha RoPE, Ministral 3's default YaRN and query factor), the engine's greedy tokens equal to transformers' `generate`, and a LoRA
adapter on Arcee's ungated MLP equal to transformers + PEFT (a gate it has not, refused), Ministral 3
on an spp group equal to one runner. Logits
against transformers, chunked and decoded: test_model_hf.py; tp groups: test_tp.py."""

from __future__ import annotations


import pytest
from family_checks import greedy_equals_transformers, lora_equals_transformers_with_peft, pipeline_equals_single_runner

from raycluster.model.config import ModelConfig, ModelConfigError
from raycluster.model.loader import load_model
from raycluster.model.lora import AdapterError, load_adapter
from raycluster.model.tiny import tiny_config, write_tiny_lora, write_tiny_model

ARCHS = ["SeedOssForCausalLM", "Ernie4_5ForCausalLM", "ArceeForCausalLM", "ApertusForCausalLM",
         "HunYuanDenseV1ForCausalLM", "Ministral3ForCausalLM"]


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
    # Ministral 3: transformers' default RoPE (YaRN over 16K, factor 16) and query factor (beta 0.1).
    m3 = ModelConfig.from_dict(tiny_config(architectures=["Ministral3ForCausalLM"], rope_parameters=None,
                                           max_position_embeddings=262144))
    assert m3.query_scaling == (0.1, 16384) and m3.rope_theta == 1e6 and m3.max_model_len == 262144
    assert (m3.rope_scaling["rope_type"], m3.rope_scaling["factor"]) == ("yarn", 16.0)
    unscaled = tiny_config(architectures=["Ministral3ForCausalLM"])
    del unscaled["rope_parameters"]["llama_4_scaling_beta"]
    assert ModelConfig.from_dict(unscaled).query_scaling is None
    with pytest.raises(ModelConfigError, match="llama_4_scaling_beta"):
        bad = tiny_config(architectures=["Ministral3ForCausalLM"])
        bad["rope_parameters"]["llama_4_scaling_beta"] = "big"
        ModelConfig.from_dict(bad)
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


def test_ministral3s_query_factor_on_a_pipeline(tmp_path, monkeypatch):
    """Each spp stage scales its own layers' queries by the positions it is given."""
    path = write_tiny_model(tmp_path, seed=5, architectures=["Ministral3ForCausalLM"], num_hidden_layers=2)
    pipeline_equals_single_runner(load_model(path)[0], monkeypatch)
