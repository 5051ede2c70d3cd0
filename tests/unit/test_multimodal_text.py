"""Image-text checkpoints served on their text alone (Gemma 3, Mistral 3 and Ministral 3, LLaVA, LLaVA-NeXT, Qwen2-VL, Qwen2.5-VL,
Qwen3-VL, Qwen3-VL-MoE with its stacked experts): config.json's `text_config` (or Qwen2-VL's flat config) read as transformers reads it
(Gemma 3's sparse release configs filled with its defaults, multimodal RoPE as plain RoPE), the
text model's tensors found under any of the layouts and the vision tower's never taken
for the text model's, logits and greedy tokens equal to transformers' image-text model given the
same text, a tp rank's shard read from the file, and what is refused (errors naming the nested field)."""

from __future__ import annotations

import json

import pytest
import torch
from family_checks import greedy_equals_transformers
from test_model_hf import _prompt, run_chunks
from test_shard_load import _same_shard

from raycluster.model.config import ModelConfig, ModelConfigError, model_summary
from raycluster.model.loader import load_model
from raycluster.model.tiny import tiny_config
from raycluster.model.tiny_multimodal import write_tiny_multimodal
from raycluster.parallel.shard import Checkpoint, load_shard, shard_model

# Untied Gemma 3 (tied, the tiny checkpoint repeats its input token under greedy decoding).
CASES = [("Gemma3ForConditionalGeneration", "released", dict(num_hidden_layers=3, tie_word_embeddings=False)),
         ("Gemma3ForConditionalGeneration", "transformers5", dict(num_hidden_layers=3)),
         ("Mistral3ForConditionalGeneration", "released", dict(num_hidden_layers=2, sliding_window=None)),
         # Ministral 3: Mistral 3's wrapper over a `ministral3` text model (YaRN, scaled queries).
         ("Mistral3ForConditionalGeneration", "transformers5", dict(num_hidden_layers=2,
                                                                    text_architecture="Ministral3ForCausalLM")),
         ("LlavaForConditionalGeneration", "transformers5", dict(num_hidden_layers=2)),
         # LLaVA-NeXT over Mistral, as llava-v1.6-mistral's released files hold it.
         ("LlavaNextForConditionalGeneration", "released", dict(num_hidden_layers=2)),
         # Multimodal RoPE (mrope), which on text alone is plain RoPE: Qwen2-VL's and Qwen2.5-VL's
         # released files (a flat config, plain names beside `visual.`), Qwen3-VL's (over Qwen3).
         ("Qwen2VLForConditionalGeneration", "released", dict(num_hidden_layers=2)),
         ("Qwen2_5_VLForConditionalGeneration", "released", dict(num_hidden_layers=2, tie_word_embeddings=True)),
         ("Qwen2_5_VLForConditionalGeneration", "transformers5", dict(num_hidden_layers=2)),
         ("Qwen3VLForConditionalGeneration", "released", dict(num_hidden_layers=2)),
         # Qwen3-VL-MoE: Qwen3-MoE whose experts the checkpoint stores stacked, gate / up in halves.
         ("Qwen3VLMoeForConditionalGeneration", "released", dict(num_hidden_layers=2))]


@pytest.fixture(scope="module", params=CASES, ids=[f"{a}-{layout}" for a, layout, _ in CASES])
def checkpoint(request, tmp_path_factory):
    arch, layout, over = request.param
    path = write_tiny_multimodal(tmp_path_factory.mktemp(arch), arch, seed=2, layout=layout, **over)
    return path, *load_model(path)


def test_logits_equal_the_image_text_model_given_text(checkpoint):
    transformers = pytest.importorskip("transformers")
    path, model, cfg = checkpoint
    with open(f"{path}/config.json") as f:
        arch = json.load(f)["architectures"][0]
    assert cfg.multimodal == arch and cfg.text_prefix in ("language_model.", "model.language_model.", "")
    assert (cfg.rope_scaling is None) == (cfg.query_scaling is None)    # Ministral 3's YaRN, else plain
    summary = model_summary(cfg)
    assert summary["architecture"] == arch and summary["text_only"] and "generate" in summary["tasks"]
    from raycluster.cli_status import model_line
    assert model_line({"name": "m", **summary}).startswith(f"model m ({arch}, text only): generate")
    hf = transformers.AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32,
                                                                  attn_implementation="eager").eval()
    assert type(hf).__name__ == arch
    ids = _prompt(80, 2000)
    ours, _, _ = run_chunks(model, ids, [len(ids)])
    with torch.no_grad():
        ref = hf(input_ids=torch.tensor([ids])).logits[0]
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-4)


def test_greedy_tokens_equal_transformers_generate(checkpoint):
    path, model, cfg = checkpoint
    if cfg.multimodal != "Gemma3ForConditionalGeneration" or cfg.tie_word_embeddings:
        pytest.skip("transformers' AutoModelForCausalLM builds Gemma 3's image-text model only (here untied)")
    greedy_equals_transformers(path, model, [(5, 10), (40, 8)], seed=21)


def test_a_tp_rank_reads_its_shard_under_the_prefix(checkpoint):
    path, model, cfg = checkpoint
    for rank in range(2):
        _same_shard(load_shard(Checkpoint(path, cfg), rank, 2), shard_model(model, rank, 2))
        if cfg.moe is not None:         # stacked experts: an expert-parallel rank's whole share too
            _same_shard(load_shard(Checkpoint(path, cfg), rank, 2, expert_parallel=True),
                        shard_model(model, rank, 2, expert_parallel=True))


def test_raycluster_quantize_writes_its_text_model_quantized(checkpoint, tmp_path):
    """Every wrapper and layout: the text model's decoder layers come back quantized from
    wherever the layout stores them (the tower, if any, stays as it was)."""
    from raycluster.model.quant.write import quantize_checkpoint
    quantize_checkpoint(checkpoint[0], str(tmp_path / "q"), "w8a16", 32)
    model, cfg = load_model(str(tmp_path / "q"))
    assert cfg.quant is not None and cfg.multimodal is not None
    layer = model.model.layers[0]
    assert type(layer.self_attn.q_proj).__name__ == "QuantLinear"


def test_gemma3s_sparse_release_config_takes_transformers_defaults():
    # gemma-3-4b-it's text_config states only what differs from Gemma3TextConfig's defaults.
    cfg = ModelConfig.from_dict({
        "architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3", "eos_token_id": [1, 106],
        "text_config": {"hidden_size": 2560, "intermediate_size": 10240, "model_type": "gemma3_text",
                        "num_hidden_layers": 34, "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
                        "sliding_window": 1024},
        "vision_config": {"model_type": "siglip_vision_model"}})
    assert cfg.architecture == "Gemma3ForCausalLM" and cfg.multimodal == "Gemma3ForConditionalGeneration"
    assert (cfg.vocab_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (262208, 8, 4, 256)
    assert (cfg.rope_theta, cfg.sliding_rope_theta, cfg.rope_scaling) == (1e6, 10000.0, {"factor": 8.0, "rope_type": "linear"})
    assert cfg.sliding_window == 1024 and len(cfg.sliding_layers) == 34 - 34 // 6
    assert cfg.gemma.query_pre_attn_scalar == 256 and cfg.eos_token_id == (1, 106) and cfg.tie_word_embeddings


@pytest.mark.parametrize("over, field", [
    (dict(text_config=None), "text_config"),
    (dict(quantization_config={"quant_method": "bitsandbytes"}), "quantization_config"),
    (dict(text_config={"model_type": "phi3_v"}), "text_config.model_type"),
    (dict(text_config={**tiny_config(), "num_key_value_heads": 3}), "text_config.num_key_value_heads"),
])
def test_errors_name_the_nested_field(over, field):
    d = {"architectures": ["LlavaForConditionalGeneration"], "model_type": "llava",
         "text_config": {**tiny_config(), "model_type": "llama"}, **over}
    with pytest.raises(ModelConfigError, match=field.replace(".", r"\.")):
        ModelConfig.from_dict(d)
