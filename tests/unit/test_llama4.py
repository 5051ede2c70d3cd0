"""Llama 4 (`Llama4ForCausalLM`, and Scout / Maverick's `Llama4ForConditionalGeneration` on its text):
config.json read as transformers reads it, the engine's greedy tokens equal to transformers'
`generate` over prompts and decodes spanning several attention chunks, kvp refused,
the image-text wrapper's logits equal to its text model's, expert-parallel shards summing to the
block, an expert-parallel group and a pipeline equal to one process. Logits against transformers,
chunked and decoded: test_model_hf.py; tp groups (each expert's gate and up halves split alike)
and shards read from the file: test_tp.py, test_shard_load.py."""

from __future__ import annotations

import pytest
import torch
from family_checks import (expert_parallel_group_equals_single_runner, greedy_equals_transformers,
                           pipeline_equals_single_runner, stacked_experts_shard_by_expert)
from test_model_hf import _prompt, run_chunks

from raycluster.engine.config import EngineConfig
from raycluster.engine.engine import LLMEngine
from raycluster.model.config import ModelConfig, ModelConfigError
from raycluster.model.loader import load_model
from raycluster.model.tiny import tiny_config, write_tiny_model
from raycluster.model.tiny_multimodal import write_tiny_multimodal

ARCH = ["Llama4ForCausalLM"]


@pytest.fixture(scope="module")
def llama4(tmp_path_factory):
    path = write_tiny_model(tmp_path_factory.mktemp("llama4"), seed=6, architectures=ARCH, num_hidden_layers=4)
    return path, load_model(path)[0]


def test_config_reads_as_transformers_reads_it():
    cfg = ModelConfig.from_dict(tiny_config(architectures=ARCH, num_hidden_layers=4))
    assert cfg.nope_layers == (1, 3) and cfg.rope_interleaved and cfg.llama4.l2_qk_norm
    assert cfg.llama4.temperature == (16.0, 0.1) and cfg.moe.layers == (1, 3) and cfg.moe.llama4
    assert (cfg.intermediate_size, cfg.moe.intermediate_size, cfg.moe.shared_intermediate_size) == (256, 96, 96)
    assert cfg.attention_chunk == 24 and cfg.torch_attention_only and cfg.max_model_len == 32768
    # transformers' defaults: every 4th layer without RoPE, every layer routed (Scout).
    d = tiny_config(architectures=ARCH, num_hidden_layers=8)
    for k in ("no_rope_layer_interval", "interleave_moe_layer_step", "floor_scale", "attention_chunk_size"):
        del d[k]
    dflt = ModelConfig.from_dict(d)
    assert dflt.nope_layers == (3, 7) and dflt.moe.layers == tuple(range(8)) and dflt.llama4.temperature == (8192.0, 0.1)
    assert dflt.attention_chunk == 8192
    # Explicit lists win; without a chunk the RoPE layers attend causally.
    cfg = ModelConfig.from_dict({**tiny_config(architectures=ARCH, num_hidden_layers=3, no_rope_layers=[1, 0, 1],
                                               moe_layers=[2], attn_temperature_tuning=False),
                                 "attention_chunk_size": None})
    assert cfg.nope_layers == (1,) and cfg.moe.layers == (2,) and cfg.llama4.temperature is None
    assert cfg.attention_chunk is None and not cfg.torch_attention_only


@pytest.mark.parametrize("over, field", [
    (dict(no_rope_layers=[1, 0]), "no_rope_layers"),
    (dict(moe_layers=[9]), "moe_layers"),
    (dict(num_experts_per_tok=5), "num_experts_per_tok"),
    (dict(attention_chunk_size=0), "attention_chunk_size"),
    (dict(intermediate_size_mlp="x"), "intermediate_size_mlp"),
])
def test_config_errors_name_the_field(over, field):
    with pytest.raises(ModelConfigError, match=field):
        ModelConfig.from_dict(tiny_config(architectures=ARCH, **over))


def test_engine_greedy_tokens_equal_transformers_generate(llama4):
    # Prompts past the temperature's first step (position 15) and over several 24-token attention
    # chunks, decodes running across chunk boundaries.
    greedy_equals_transformers(*llama4, [(4, 14), (37, 8), (80, 10)], seed=18)


def test_kvp_is_refused_for_its_chunked_attention(llama4):
    with pytest.raises(ValueError, match="chunked attention"):
        LLMEngine(EngineConfig(kv_cache_tokens=2048, policy="fcfs", packer="token", kvp=2), llama4[1])


def test_the_image_text_wrapper_gives_its_text_models_logits(tmp_path):
    """transformers 5.24's Llama4ForConditionalGeneration cannot run without images; its text
    model (checked against transformers above) is the reference."""
    text = write_tiny_model(tmp_path / "text", seed=2, architectures=ARCH, num_hidden_layers=4)
    wrapped = write_tiny_multimodal(tmp_path / "mm", "Llama4ForConditionalGeneration", seed=2, num_hidden_layers=4)
    model, cfg = load_model(wrapped)
    assert cfg.multimodal == "Llama4ForConditionalGeneration" and cfg.text_prefix == "language_model."
    ids = _prompt(60, 2000)
    torch.testing.assert_close(run_chunks(model, ids, [60])[0], run_chunks(load_model(text)[0], ids, [60])[0],
                               atol=0, rtol=0)


def test_expert_parallel_ranks_hold_whole_experts_and_sum_to_the_block(llama4):
    path, model = llama4
    for s in stacked_experts_shard_by_expert(path, model, 1):      # the shared expert still split
        assert s.model.layers[1].ffn.shared_expert.down_proj.weight.shape == (model.config.hidden_size, 48)


def test_an_expert_parallel_group_gives_the_single_runners_logits(llama4):
    expert_parallel_group_equals_single_runner(llama4[1])


def test_a_pipeline_gives_the_single_runners_hidden_rows(llama4, monkeypatch):
    pipeline_equals_single_runner(llama4[1], monkeypatch)
