"""gpt-oss (`GptOssForCausalLM`): config.json read as transformers reads it (its defaults: YaRN,
alternating sliding layers, attention biases), the engine's greedy tokens equal to transformers'
`generate`, its released MXFP4 experts dequantized as transformers dequantizes them (whole and cut
for tp ranks, from one file or an index whose blocks and scales sit in different files), a LoRA
adapter on its attention equal to transformers + PEFT, expert-parallel shards
of its stacked experts, a KVP group (sinks applied after the ranks' states merge) and a pipeline
equal to one process. Logits against transformers, chunked and decoded: test_model_hf.py; tp
groups and shards read from the file: test_tp.py, test_shard_load.py; the sinks in the attention
backend against the plain formula: test_kernels.py."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from family_checks import (expert_parallel_group_equals_single_runner, greedy_equals_transformers,
                           kvp_engine_equals_single_engine, lora_equals_transformers_with_peft,
                           pipeline_equals_single_runner, stacked_experts_shard_by_expert)
from test_shard_load import _same_shard
from test_tp import BASE, BS, _close, same_as_single_runner

from raycluster.engine.config import EngineConfig
from raycluster.engine.engine import LLMEngine
from raycluster.model.config import ModelConfig, ModelConfigError, model_summary
from raycluster.model.loader import CheckpointError, load_model
from raycluster.model.quant.mxfp4 import dequantize, pack
from raycluster.model.tiny import tiny_config, write_tiny_lora, write_tiny_model
from raycluster.parallel.factory import build_runner
from raycluster.parallel.shard import Checkpoint, load_shard, shard_model

ARCH = ["GptOssForCausalLM"]


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory):
    path = write_tiny_model(tmp_path_factory.mktemp("gpt_oss"), seed=4, architectures=ARCH, num_hidden_layers=3)
    return path, load_model(path)[0]


@pytest.fixture(scope="module")
def full_attention(tmp_path_factory):
    """Every layer full: a KVP group serves it."""
    path = write_tiny_model(tmp_path_factory.mktemp("gpt_oss_full"), seed=4, architectures=ARCH, num_hidden_layers=2,
                            layer_types=["full_attention"] * 2)
    return path, load_model(path)[0]


def test_config_reads_as_transformers_reads_it():
    cfg = ModelConfig.from_dict(tiny_config(architectures=ARCH, num_hidden_layers=4))
    assert (cfg.sliding_window, cfg.sliding_layers) == (24, (0, 2))
    assert cfg.attention_sinks and cfg.qkv_bias and cfg.o_bias and cfg.torch_attention_only
    moe = cfg.moe
    assert moe.gpt_oss and (moe.num_experts, moe.top_k, moe.intermediate_size) == (8, 2, 96)
    assert moe.layers == (0, 1, 2, 3) and (moe.swiglu_alpha, moe.swiglu_limit) == (1.702, 0.3)
    # A file stating no RoPE gets transformers' default (YaRN x32 over 4096, base 150000): 131072 positions.
    bare = ModelConfig.from_dict(tiny_config(architectures=ARCH, rope_parameters=None, max_position_embeddings=131072))
    assert bare.rope_theta == 150000.0 and bare.rope_scaling["rope_type"] == "yarn" and bare.max_model_len == 131072
    assert bare.rope_scaling["truncate"] is False
    # attention_bias absent: biases (transformers' default); the window absent: 128.
    d = tiny_config(architectures=ARCH)
    del d["attention_bias"], d["sliding_window"]
    dflt = ModelConfig.from_dict(d)
    assert dflt.qkv_bias and dflt.sliding_window == 128


@pytest.mark.parametrize("over, field", [
    (dict(layer_types=["sliding_attention"]), "layer_types"),
    (dict(layer_types=["chunked_attention"] * 4), "layer_types"),
    (dict(sliding_window=0), "sliding_window"),
    (dict(num_experts_per_tok=9), "num_experts_per_tok"),
    (dict(swiglu_limit=-1.0), "swiglu_limit"),
    (dict(num_local_experts="8"), "num_local_experts"),
    # Quantized otherwise than its MXFP4 experts (whose blocks of 32 need sizes that are multiples of 32).
    (dict(quantization_config={"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}),
     "quantization_config"),
    (dict(quantization_config={"quant_method": "mxfp4"}, intermediate_size=100), "quantization_config"),
])
def test_config_errors_name_the_field(over, field):
    with pytest.raises(ModelConfigError, match=field):
        ModelConfig.from_dict(tiny_config(architectures=ARCH, **over))


def test_raycluster_quantize_refuses_it(gpt_oss, tmp_path):
    from raycluster.model.quant.write import quantize_checkpoint
    with pytest.raises(ValueError, match="GptOssForCausalLM checkpoint"):
        quantize_checkpoint(gpt_oss[0], str(tmp_path / "q"), "w4a16", 32)


def test_engine_greedy_tokens_equal_transformers_generate(gpt_oss):
    # Prompts past the 24-token window of the sliding layers, decodes running past it too.
    greedy_equals_transformers(*gpt_oss, [(4, 12), (37, 8), (80, 10)], seed=16)


def test_a_lora_on_attention_equals_transformers_with_peft(gpt_oss, tmp_path):
    path, model = gpt_oss
    adapter = write_tiny_lora(tmp_path / "lora", path, seed=5, targets=("q_proj", "v_proj", "o_proj"), std=0.3)
    lora_equals_transformers_with_peft(path, model, adapter, seed=13, lengths=(5, 40))


def test_expert_parallel_ranks_hold_whole_experts_and_sum_to_the_block(gpt_oss):
    path, model = gpt_oss
    whole = model.model.layers[1].ffn
    for r, s in enumerate(stacked_experts_shard_by_expert(path, model, 1)):
        torch.testing.assert_close(s.model.layers[1].ffn.experts.down_proj_bias,
                                   whole.experts.down_proj_bias[4 * r:4 * r + 4], atol=0, rtol=0)


def test_an_expert_parallel_group_gives_the_single_runners_logits(gpt_oss):
    expert_parallel_group_equals_single_runner(gpt_oss[1])


def test_a_pipeline_gives_the_single_runners_hidden_rows(gpt_oss, monkeypatch):
    pipeline_equals_single_runner(gpt_oss[1], monkeypatch)


def test_a_kvp_group_applies_the_sinks_after_the_merge(full_attention, monkeypatch):
    """Each rank's partial state carries no sink (a sink per rank would count it `kvp` times): the
    merged state is scaled once, by the merged LSE. Logits step by step, and the engine's tokens."""
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    _, model = full_attention
    runner = build_runner(EngineConfig(**{**BASE, "kv_cache_tokens": 64 * BS, "kvp": 2}), model, torch.float32)
    try:
        assert runner.layout == "kvp2"
        same_as_single_runner(model, runner)
    finally:
        _close(runner)
    kvp_engine_equals_single_engine(model, monkeypatch)


def test_kvp_is_refused_for_its_sliding_layers(gpt_oss):
    with pytest.raises(ValueError, match="kvp: 2 KVP ranks for a sliding-window model"):
        LLMEngine(EngineConfig(kv_cache_tokens=2048, policy="fcfs", packer="token", kvp=2), gpt_oss[1])


MXFP4_CONFIG = {"quant_method": "mxfp4", "modules_to_not_convert": [
    "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}


def _mxfp4_copy(src: str, dst: str, split: bool = False) -> str:
    """`src` as gpt-oss's released files store it: every expert weight as MXFP4 blocks and scales
    (`pack`), `quantization_config` saying so. `split`: an index over two files, each pair's blocks
    in one and its scales in the other."""
    shutil.copytree(src, dst)
    tensors = load_file(f"{dst}/model.safetensors")
    out = {}
    for k, v in tensors.items():
        if k.endswith(("experts.gate_up_proj", "experts.down_proj")):
            out[k + "_blocks"], out[k + "_scales"] = pack(v)
        else:
            out[k] = v
    os.remove(f"{dst}/model.safetensors")
    if split:
        files = ({k: v for k, v in out.items() if not k.endswith("_scales")},
                 {k: v for k, v in out.items() if k.endswith("_scales")})
        weight_map = {}
        for i, part in enumerate(files):
            save_file(part, f"{dst}/model-0000{i + 1}-of-00002.safetensors", metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(part, f"model-0000{i + 1}-of-00002.safetensors"))
        with open(f"{dst}/model.safetensors.index.json", "w") as f:
            json.dump({"metadata": {}, "weight_map": weight_map}, f)
    else:
        save_file(out, f"{dst}/model.safetensors", metadata={"format": "pt"})
    with open(f"{dst}/config.json") as f:
        cfg = json.load(f)
    with open(f"{dst}/config.json", "w") as f:
        json.dump({**cfg, "quantization_config": MXFP4_CONFIG}, f)
    return dst


@pytest.mark.parametrize("split", [False, True], ids=["one-file", "blocks-and-scales-apart"])
def test_mxfp4_experts_load_as_transformers_dequantizes_them(gpt_oss, tmp_path, split):
    transformers = pytest.importorskip("transformers")
    path, dense = gpt_oss
    packed = _mxfp4_copy(path, str(tmp_path / "mxfp4"), split)
    model, cfg = load_model(packed)
    assert cfg.moe.mxfp4 and cfg.quant is None
    assert model_summary(cfg)["weights"] == "mxfp4 experts, dequantized at load"
    w = dense.model.layers[0].ffn.experts.gate_up_proj
    got = model.model.layers[0].ffn.experts.gate_up_proj
    assert torch.equal(got, dequantize(*pack(w), torch.float32)) and not torch.equal(got, w)
    assert (got - w).abs().max() < 0.2 * w.abs().max()          # rounded to FP4, not scrambled
    hf = transformers.AutoModelForCausalLM.from_pretrained(packed, dtype=torch.float32,
                                                           attn_implementation="eager").eval()
    for ours, theirs in ((model.model.layers[1].ffn.experts.down_proj, hf.model.layers[1].mlp.experts.down_proj),
                         (got, hf.model.layers[0].mlp.experts.gate_up_proj)):
        assert torch.equal(ours, theirs.float())
    greedy_equals_transformers(packed, model, [(30, 8), (60, 6)], seed=17)
    # A tp rank reads its part of every dequantized expert, as cut from the loaded model.
    for r in range(2):
        _same_shard(load_shard(Checkpoint(packed, cfg), r, 2), shard_model(model, r, 2))


def test_mxfp4_errors_name_the_tensor(gpt_oss, tmp_path):
    path, _ = gpt_oss
    packed = _mxfp4_copy(path, str(tmp_path / "base"))
    tensors = load_file(f"{packed}/model.safetensors")
    name = "model.layers.1.mlp.experts.down_proj"
    cases = {"missing": {k: v for k, v in tensors.items() if k != name + "_scales"},
             "misshapen": {**tensors, name + "_blocks": tensors[name + "_blocks"][:, :, :1].contiguous()},
             "unexpected": {**tensors, "model.layers.7.mlp.experts.down_proj_blocks": tensors[name + "_blocks"].clone()}}
    messages = {"missing": f"missing tensors in checkpoint: {name}_scales",
                "misshapen": f"shape mismatch for tensor '{name}_blocks'",
                "unexpected": "unexpected tensor 'model.layers.7.mlp.experts.down_proj_blocks'"}
    for case, stored in cases.items():
        bad = str(tmp_path / case)
        shutil.copytree(packed, bad)
        save_file(stored, f"{bad}/model.safetensors")
        with pytest.raises(CheckpointError, match=messages[case]):
            load_model(bad)
