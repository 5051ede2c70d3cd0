"""Quantized checkpoints on engines and groups: greedy tokens equal transformers' `generate` on
the same checkpoint; TP ranks read their slices of the packed tensors, scales and zero points
from the files (every layout, tp 2 and 4, replicated KV heads) and give the single runner's
logits step by step; SPP and KVP engines give the plain engine's tokens; LoRA adapters on a
quantized base; tp splits that would cut through a group or packed word are refused."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch
from engine_arrivals import run_arrivals
from test_tp import BASE, BS, _close, _prefix_arrivals, same_as_single_runner

from raycluster.clock import VirtualClock
from raycluster.engine.config import EngineConfig
from raycluster.engine.engine import LLMEngine
from raycluster.model.loader import load_config, load_model
from raycluster.model.quant.linear import QuantLinear
from raycluster.model.quant.write import quantize_checkpoint
from raycluster.parallel.factory import build_runner
from raycluster.parallel.shard import Checkpoint, check_tp
from raycluster.parallel.tp import TPRunner
from raycluster.request import SamplingParams

torch.set_num_threads(1)
GROUP = 32


@pytest.fixture(scope="module")
def quantized(tiny_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("quant-par")
    out = {}
    for scheme in ("w4a16", "w4a16-asym", "w8a16", "gptq", "awq", "fp8-block"):
        quantize_checkpoint(str(tiny_model_dir), str(root / scheme), scheme, GROUP)
        out[scheme] = str(root / scheme)
    return out


@pytest.mark.parametrize("scheme,tp", [("w4a16-asym", 2), ("gptq", 2), ("awq", 2), ("fp8-block", 2), ("w8a16", 2),
                                       ("w4a16", 4)])
def test_a_tp_group_reads_its_quantized_slices_and_gives_the_single_runners_logits(quantized, scheme, tp):
    """At tp 4 the tiny model's 2 KV heads are replicated: k/v_proj's packed rows are cut by head."""
    path = quantized[scheme]
    model, _ = load_model(path, quant_kernels="quantized")
    runner = build_runner(EngineConfig(**{**BASE, "kv_cache_tokens": 64 * BS, "tp": tp, "quant_kernels": "quantized"}),
                          Checkpoint(path, load_config(path), "quantized"), torch.float32)
    try:
        assert isinstance(runner, TPRunner)
        layer = runner.rank0.model.model.layers[0]
        assert isinstance(layer.mlp.down_proj, QuantLinear) and layer.mlp.down_proj.in_features == 768 // tp
        same_as_single_runner(model, runner)
    finally:
        _close(runner)


def _hf_greedy(hf, prompt: list[int], max_tokens: int) -> list[int]:
    with torch.no_grad():
        seq = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                          max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False, pad_token_id=0)
    return seq[0, len(prompt):].tolist()


@pytest.mark.parametrize("chunk", [7, None])
def test_an_engine_on_a_quantized_checkpoint_gives_transformers_greedy_tokens(quantized, chunk):
    from transformers import AutoModelForCausalLM

    path = quantized["w4a16"]
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    rng = random.Random(1)
    work = [([rng.randrange(6, 4000) for _ in range(n)], rng.randint(1, 10)) for n in (1, 5, 17, 64, 65, 130, 200)]
    want = [_hf_greedy(hf, p, m) for p, m in work]
    model, _ = load_model(path, quant_kernels="quantized")
    eng = LLMEngine(EngineConfig(kv_cache_tokens=4096, policy="fcfs", packer="token", chunk_size=chunk,
                                 max_num_batched_tokens=256 if chunk else 4096), model)
    got = eng.generate([p for p, _ in work], [SamplingParams(max_tokens=m, ignore_eos=True) for _, m in work])
    assert got == want
    assert eng.kv.num_free_blocks == eng.kv.num_blocks


@pytest.mark.parametrize("group", [{"tp": 2, "spp": 2}, {"kvp": 2}])
def test_spp_tp_and_kvp_engines_from_a_quantized_checkpoint_give_the_plain_engines_tokens(quantized, group):
    path = quantized["gptq"]
    arrivals = _prefix_arrivals(4000, 5)
    cfg = dict(BASE, model=path, kv_cache_tokens=4096, chunk_size=48, quant_kernels="quantized")
    plain = LLMEngine.from_config(EngineConfig(**cfg), clock=VirtualClock())
    try:
        want = run_arrivals(plain, arrivals, 500)
    finally:
        plain.close()
    eng = LLMEngine.from_config(EngineConfig(**cfg, **group), clock=VirtualClock())
    try:
        got = run_arrivals(eng, arrivals, 500)
    finally:
        _close(eng.runner)
    assert {r: q.output_token_ids for r, q in got.items()} == {r: q.output_token_ids for r, q in want.items()}


def test_lora_on_a_quantized_base_adds_its_update_to_the_quantized_layers(quantized, tiny_model_dir, tmp_path):
    """An adapter over packed int4 layers (row-parallel ones on a tp 2 group too) equals it
    merged into the same weights dequantized."""
    from raycluster.model.lora import TARGETS, load_adapter
    from raycluster.model.tiny import write_tiny_lora

    path = quantized["w4a16"]
    adapter = write_tiny_lora(tmp_path / "ad", tiny_model_dir, seed=3)
    merged, cfg = load_model(path, quant_kernels="dense")
    for (layer, module), (a, b) in load_adapter(adapter, cfg, "ref").weights.items():
        getattr(getattr(merged.model.layers[layer], TARGETS[module]), module).matmul.weight += b @ a
    rng = random.Random(2)
    prompts = [[rng.randrange(6, 4000) for _ in range(n)] for n in (3, 40, 90)]
    plain = SamplingParams(max_tokens=6, ignore_eos=True)
    want = LLMEngine(EngineConfig(**BASE, kv_cache_tokens=4096), merged).generate(prompts, plain)
    on = SamplingParams(max_tokens=6, ignore_eos=True, lora_adapter="ad")
    for group in ({}, {"tp": 2}):
        eng = LLMEngine.from_config(EngineConfig(**BASE, model=path, kv_cache_tokens=4096, quant_kernels="quantized",
                                                 lora_modules=[f"ad={adapter}"], **group))
        try:
            reqs = [eng.add_request(f"r{i}", p, on) for i, p in enumerate(prompts)]
            for _ in range(200):
                if not eng.has_unfinished():
                    break
                eng.step()
            assert [r.output_token_ids for r in reqs] == want
        finally:
            eng.close()


def test_tp_splits_that_cut_through_quantization_groups_are_refused(quantized):
    # Groups of 128 columns: tp 4 gives o_proj 64 input columns per rank.
    cfg = load_config(quantized["w4a16"])
    big = dataclasses.replace(cfg, quant=dataclasses.replace(cfg.quant, group_size=128))
    with pytest.raises(ValueError, match=r"tp: 4 ranks give each 64 input columns of o_proj, not a multiple of the "
                                         r"checkpoint's 128-column quantization groups"):
        check_tp(big, 4)
    check_tp(big, 2)            # 128 columns per rank: whole groups
    act = dataclasses.replace(cfg, quant=dataclasses.replace(cfg.quant, act_order=True))
    with pytest.raises(ValueError, match="act-order checkpoint"):
        check_tp(act, 2)
    fp8 = load_config(quantized["fp8-block"])
    check_tp(fp8, 4)            # blocks of 32: a replicated KV head's 32 rows hold one
    blocks = dataclasses.replace(fp8, quant=dataclasses.replace(fp8.quant, block=(64, 64)))
    with pytest.raises(ValueError, match="tp: 4 ranks give each 32 output rows of k_proj, not a multiple of the 64 rows"):
        check_tp(blocks, 4)
    # In-memory models cannot be cut: their layers hold kernel operands, not the checkpoint's tensors.
    model, _ = load_model(quantized["gptq"])
    with pytest.raises(ValueError, match="read from its checkpoint"):
        build_runner(EngineConfig(**{**BASE, "kv_cache_tokens": 64 * BS, "tp": 2}), model, torch.float32)
