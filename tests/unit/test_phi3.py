"""Phi-3 / Phi-3.5 / Phi-4-mini (`Phi3ForCausalLM`): config.json's LongRoPE and partial rotary
read as transformers reads them, with the factor set fixed by the served context as vLLM fixes
it; fused qkv_proj / gate_up_proj split at load (and refused when misshapen); a LoRA adapter on
the fused projections served as transformers + PEFT serve it; the engine's greedy tokens equal to
transformers' `generate`. Logits against transformers, chunked and decoded: test_model_hf.py;
tp groups and shards read from the file: test_tp.py, test_shard_load.py."""

from __future__ import annotations

import math
import random

import pytest
import torch
from family_checks import greedy_equals_transformers
from safetensors.torch import load_file, save_file

from raycluster.engine.config import EngineConfig
from raycluster.engine.engine import LLMEngine
from raycluster.model.config import ModelConfig, ModelConfigError
from raycluster.model.loader import CheckpointError, load_model
from raycluster.model.lora import load_adapter
from raycluster.model.tiny import tiny_config, write_tiny_lora, write_tiny_model
from raycluster.request import SamplingParams

SHORT = [1.0 + 0.05 * i for i in range(12)]
LONG = [1.0 + 0.8 * i for i in range(12)]
ROPE = {"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75, "short_factor": SHORT,
        "long_factor": LONG}


def _config(**over) -> ModelConfig:
    return ModelConfig.from_dict(tiny_config(architectures=["Phi3ForCausalLM"], **over))


def test_longrope_reads_as_transformers_and_fixes_its_factors_by_the_context():
    cfg = _config(max_position_embeddings=131072, original_max_position_embeddings=4096, rope_parameters=ROPE)
    assert cfg.rotary_dim == 24 and cfg.fused_projections == ("qkv_proj", "gate_up_proj")
    assert cfg.max_model_len == 131072
    s = cfg.rope_scaling
    assert s["ext_factors"] == LONG and s["factor"] == 32.0           # 131072 / 4096
    assert s["attention_factor"] == pytest.approx(math.sqrt(1 + math.log(32) / math.log(4096)))
    within = _config(max_position_embeddings=4096, original_max_position_embeddings=4096, rope_parameters=ROPE)
    assert within.rope_scaling["ext_factors"] == SHORT and within.rope_scaling["attention_factor"] == 1.0
    # The first Phi-3 configs: rope_scaling of type "su", partial_rotary_factor at the top level.
    legacy = _config(rope_parameters=None, rope_theta=10000.0, partial_rotary_factor=0.5,
                     max_position_embeddings=8192, original_max_position_embeddings=2048,
                     rope_scaling={"type": "su", "short_factor": SHORT[:8], "long_factor": LONG[:8]})
    assert legacy.rotary_dim == 16 and legacy.rope_scaling["ext_factors"] == LONG[:8]
    # Phi-3-mini-4k: no scaling, a window on every layer.
    mini = _config(sliding_window=2047)
    assert mini.rope_scaling is None and mini.sliding_layers == (0, 1, 2, 3) and mini.sliding_window == 2047


@pytest.mark.parametrize("over, field", [
    (dict(rope_parameters={**ROPE, "short_factor": []}), "short_factor"),
    (dict(rope_parameters={**ROPE, "long_factor": LONG[:5]}), "long_factor"),
    (dict(rope_parameters={**ROPE, "partial_rotary_factor": 1.5}), "partial_rotary_factor"),
    (dict(rope_parameters=ROPE, original_max_position_embeddings=None), "original_max_position_embeddings"),
    (dict(quantization_config={"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}),
     "quantization_config"),
])
def test_phi3_config_errors_name_the_field(over, field):
    with pytest.raises(ModelConfigError, match=field):
        _config(**over)


def test_fused_tensors_split_at_load_and_a_misshapen_one_is_named(tmp_path):
    path = write_tiny_model(tmp_path / "ok", architectures=["Phi3ForCausalLM"], num_hidden_layers=2)
    stored = load_file(f"{path}/model.safetensors")
    assert "model.layers.0.self_attn.qkv_proj.weight" in stored and "model.layers.0.self_attn.q_proj.weight" not in stored
    model, cfg = load_model(path)
    q = cfg.num_attention_heads * cfg.head_dim
    fused = stored["model.layers.1.self_attn.qkv_proj.weight"]
    assert torch.equal(model.model.layers[1].self_attn.q_proj.weight, fused[:q])
    assert torch.equal(model.model.layers[1].self_attn.v_proj.weight, fused[-cfg.num_key_value_heads * cfg.head_dim:])
    assert torch.equal(model.model.layers[1].mlp.up_proj.weight,
                       stored["model.layers.1.mlp.gate_up_proj.weight"][cfg.intermediate_size:])
    stored["model.layers.1.mlp.gate_up_proj.weight"] = stored["model.layers.1.mlp.gate_up_proj.weight"][:-1]
    save_file(stored, f"{path}/model.safetensors")
    with pytest.raises(CheckpointError, match=r"model.layers.1.mlp.gate_up_proj.weight.*gate_proj \+ up_proj"):
        load_model(path)


def test_a_lora_on_the_fused_projections_equals_transformers_with_peft(tmp_path):
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    path = write_tiny_model(tmp_path / "phi3", seed=2, architectures=["Phi3ForCausalLM"], num_hidden_layers=2)
    adapter = write_tiny_lora(tmp_path / "lora", path, seed=3, targets=("qkv_proj", "o_proj", "gate_up_proj"),
                              std=0.3)
    model, cfg = load_model(path)
    loaded = load_adapter(adapter, cfg, "fused")
    assert sorted({m for _, m in loaded.weights}) == ["gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"]
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    hf = peft.PeftModel.from_pretrained(hf, str(adapter)).eval()
    eng = LLMEngine(EngineConfig(kv_cache_tokens=4096, policy="fcfs", packer="token", lora_modules=[f"fused={adapter}"]),
                    model)
    rng = random.Random(5)
    prompts = [[rng.randrange(6, 4000) for _ in range(n)] for n in (3, 20, 47)]
    got = eng.generate(prompts, SamplingParams(max_tokens=8, ignore_eos=True, lora_adapter="fused"))
    base = eng.generate(prompts, SamplingParams(max_tokens=8, ignore_eos=True))
    for prompt, out in zip(prompts, got):
        with torch.no_grad():
            ids = hf.generate(input_ids=torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                              max_new_tokens=8, min_new_tokens=8, do_sample=False, pad_token_id=2)
        assert out == ids[0, len(prompt):].tolist()
    assert all(len(set(out)) > 1 for out in got)     # not one token repeated
    assert got != base                  # the adapter changes the output


@pytest.mark.parametrize("over", [dict(sliding_window=24),
                                  dict(max_position_embeddings=512, original_max_position_embeddings=32,
                                       rope_parameters={**ROPE, "original_max_position_embeddings": 32})])
def test_engine_greedy_tokens_equal_transformers_generate(tmp_path, over):
    """A window shorter than the prompts; LongRoPE's long set (the context past the original)
    over prompts longer than the original context, so transformers takes the long set too."""
    path = write_tiny_model(tmp_path, seed=4, architectures=["Phi3ForCausalLM"], num_hidden_layers=2, **over)
    greedy_equals_transformers(path, load_model(path)[0], [(40, 12), (65, 8), (100, 10)], seed=6)


def test_raycluster_quantize_refuses_a_phi3_checkpoint(tmp_path):
    from raycluster.model.quant.write import quantize_checkpoint
    path = write_tiny_model(tmp_path / "phi3", architectures=["Phi3ForCausalLM"], num_hidden_layers=1)
    with pytest.raises(ValueError, match="Phi-3"):
        quantize_checkpoint(path, str(tmp_path / "q"), "w4a16", 32)
