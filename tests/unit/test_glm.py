"""GLM-4 (`GlmForCausalLM`: glm-4-9b-chat-hf), GLM-4-0414 (`Glm4ForCausalLM`) and GLM-4.5
(`Glm4MoeForCausalLM`: DeepSeek-V3's routing, its multi-token-prediction layers skipped at load): config.json read
as transformers reads it (gate/up stored fused, q/k/v biases, RoPE on interleaved pairs of each
head's first half, GLM-4-0414's norms after attention and the MLP), the engine's greedy tokens
equal to transformers' `generate`, and a LoRA adapter on the fused gate_up_proj and the split
q_proj equal to transformers + PEFT. Logits against transformers: test_model_hf.py; tp groups and
shards read from the file: test_tp.py, test_shard_load.py."""

from __future__ import annotations

import json

import pytest
from family_checks import greedy_equals_transformers, lora_equals_transformers_with_peft
from safetensors.torch import load_file, save_file

from raycluster.model.config import ModelConfig
from raycluster.model.loader import CheckpointError, load_model
from raycluster.model.lora import load_adapter
from raycluster.model.tiny import tiny_config, write_tiny_lora, write_tiny_model


def test_config_reads_as_transformers_reads_it():
    glm = ModelConfig.from_dict(tiny_config(architectures=["GlmForCausalLM"]))
    assert glm.fused_projections == ("gate_up_proj",) and glm.rope_interleaved and glm.rotary_dim == 16
    assert (glm.qkv_bias, glm.o_bias, glm.mlp_bias, glm.block_norms) == (True, False, False, "pre")
    glm4 = ModelConfig.from_dict(tiny_config(architectures=["Glm4ForCausalLM"], attention_bias=False))
    assert glm4.block_norms == "glm4" and not glm4.qkv_bias


@pytest.fixture(scope="module", params=["GlmForCausalLM", "Glm4ForCausalLM", "Glm4MoeForCausalLM"])
def glm(request, tmp_path_factory):
    path = write_tiny_model(tmp_path_factory.mktemp(request.param), seed=3, architectures=[request.param],
                            num_hidden_layers=2)
    return path, load_model(path)[0]


def test_engine_greedy_tokens_equal_transformers_generate(glm):
    greedy_equals_transformers(*glm, [(4, 12), (37, 8), (80, 10)], seed=11)


def test_glm45_skips_its_multi_token_prediction_layer(tmp_path):
    """GLM-4.5 and DeepSeek-V3 checkpoints store their MTP layer after the decoder layers
    (`num_nextn_predict_layers`): loaded as if absent; without the field, it is an unknown tensor."""
    path = write_tiny_model(tmp_path, seed=3, architectures=["Glm4MoeForCausalLM"], num_hidden_layers=2)
    stored = load_file(f"{path}/model.safetensors")
    stored.update({k.replace("model.layers.1.", "model.layers.2."): v.clone() for k, v in stored.items()
                   if k.startswith("model.layers.1.")})
    save_file(stored, f"{path}/model.safetensors")
    with pytest.raises(CheckpointError, match="model.layers.2."):
        load_model(path)
    with open(f"{path}/config.json") as f:
        cfg = json.load(f)
    with open(f"{path}/config.json", "w") as f:
        json.dump({**cfg, "num_nextn_predict_layers": 1}, f)
    model, config = load_model(path)
    assert len(model.model.layers) == 2 and config.num_hidden_layers == 2


@pytest.mark.parametrize("arch", ["GlmForCausalLM", "Glm4ForCausalLM"])
def test_a_lora_on_fused_and_split_projections_equals_transformers_with_peft(arch, tmp_path):
    path = write_tiny_model(tmp_path / "glm", seed=3, architectures=[arch], num_hidden_layers=2)
    model, _ = load_model(path)
    adapter = write_tiny_lora(tmp_path / "lora", path, seed=4, targets=("q_proj", "v_proj", "gate_up_proj"), std=0.3)
    assert sorted({m for _, m in load_adapter(adapter, model.config, "a").weights}) == [
        "gate_proj", "q_proj", "up_proj", "v_proj"]
    lora_equals_transformers_with_peft(path, model, adapter, seed=12)
