"""Cohere's Command models (raycluster.model.cohere_config): config.json read as transformers
reads it, the engine's greedy tokens equal to transformers' `generate` (Command R's layout, and
Cohere 2's sliding layers with full layers that use no RoPE), a pipeline equal to one process,
and tp refused for Command R+'s per-head q/k norm weights. Logits against transformers, chunked
and decoded: test_model_hf.py; a Cohere 2 tp group: test_tp.py."""

from __future__ import annotations

import pytest
import torch
from family_checks import greedy_equals_transformers, pipeline_equals_single_runner

from raycluster.model.config import ModelConfig, ModelConfigError
from raycluster.model.loader import load_model
from raycluster.model.tiny import tiny_config, write_tiny_model


def _config(arch: str, **over) -> ModelConfig:
    return ModelConfig.from_dict(tiny_config(architectures=[arch], **over))


def test_config_reads_as_transformers_defaults_it():
    r = _config("CohereForCausalLM", tie_word_embeddings=None, logit_scale=None)
    assert r.tie_word_embeddings and r.logit_scale == 0.0625              # transformers' defaults
    assert (r.layer_norm, r.block_norms, r.rope_interleaved, r.qk_norm) == (True, "parallel", True, False)
    assert r.rms_norm_eps == 1e-5 and r.sliding_layers == () and r.nope_layers == ()
    plus = _config("CohereForCausalLM", use_qk_norm=True)
    assert plus.qk_norm and plus.qk_norm_per_head_weights
    # Cohere 2: three sliding layers of every four; the fourth attends in full without RoPE.
    r7b = _config("Cohere2ForCausalLM", num_hidden_layers=8)
    assert r7b.sliding_layers == (0, 1, 2, 4, 5, 6) and r7b.nope_layers == (3, 7) and r7b.sliding_window == 24
    typed = _config("Cohere2ForCausalLM", num_hidden_layers=2, layer_types=["full_attention", "sliding_attention"])
    assert typed.sliding_layers == (1,) and typed.nope_layers == (0,)


@pytest.mark.parametrize("arch, over, field", [
    ("CohereForCausalLM", dict(logit_scale=0), "logit_scale"),
    ("CohereForCausalLM", dict(layer_norm_eps="x"), "layer_norm_eps"),
    ("Cohere2ForCausalLM", dict(sliding_window=None), "sliding_window"),
    ("Cohere2ForCausalLM", dict(layer_types=["full_attention"]), "layer_types"),
])
def test_config_errors_name_the_field(arch, over, field):
    with pytest.raises(ModelConfigError, match=field):
        _config(arch, **over)


@pytest.fixture(scope="module", params=["CohereForCausalLM", "Cohere2ForCausalLM"])
def command(request, tmp_path_factory):
    # Untied: a tied tiny model's greedy output repeats its input token.
    path = write_tiny_model(tmp_path_factory.mktemp(request.param), seed=6, architectures=[request.param],
                            num_hidden_layers=4, tie_word_embeddings=False)
    return path, load_model(path)[0]


def test_engine_greedy_tokens_equal_transformers_generate(command):
    # Prompts and generations crossing Cohere 2's 24-token window.
    greedy_equals_transformers(*command, [(3, 12), (20, 16), (45, 8), (90, 10)], seed=9)


def test_a_pipeline_gives_the_single_runners_hidden_rows(command, monkeypatch):
    pipeline_equals_single_runner(command[1], monkeypatch)


def test_per_head_qk_norm_weights_split_with_their_heads(tmp_path):
    """Command R+: a tp rank holds the q/k norm rows of its heads (its KV head's when replicated)."""
    from raycluster.parallel.shard import shard_model

    path = write_tiny_model(tmp_path, architectures=["CohereForCausalLM"], num_hidden_layers=1, use_qk_norm=True)
    model, _ = load_model(path)
    attn = model.model.layers[0].self_attn
    assert attn.q_norm.weight.shape == (8, 32)
    for tp in (2, 4):
        for rank in range(tp):
            shard = shard_model(model, rank, tp).model.layers[0].self_attn
            assert torch.equal(shard.q_norm.weight, attn.q_norm.weight[rank * 8 // tp:(rank + 1) * 8 // tp])
            kv = rank * 2 // tp
            assert torch.equal(shard.k_norm.weight, attn.k_norm.weight[kv:kv + max(1, 2 // tp)])
