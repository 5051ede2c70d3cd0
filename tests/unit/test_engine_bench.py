"""Smoke test of `raycluster bench engine`: a tiny workload through every part of the benchmark,
checking the JSON's shape and that its values are sane (no timing assertions)."""

from __future__ import annotations

import json
import math

import pytest

from raycluster.bench import engine_bench as eb

pytest.importorskip("transformers")


def _finite_pos(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


def test_workload_is_seeded_and_in_range():
    a = eb.make_workload(8, 3, 4096, (16, 1024), (16, 256))
    assert a == eb.make_workload(8, 3, 4096, (16, 1024), (16, 256))
    assert a != eb.make_workload(8, 4, 4096, (16, 1024), (16, 256))
    for p, m in a:
        assert 16 <= len(p) <= 1024 and 16 <= m <= 256
        assert all(eb.FIRST_NORMAL_TOKEN <= t < 4096 for t in p)


def test_prefill_flops_formula():
    facts = {"matmul_params_per_token": 100, "hidden_size": 4, "vocab_size": 10,
             "num_hidden_layers": 2, "num_attention_heads": 3, "head_dim": 5}
    f = eb.prefill_flops(facts, 8)
    assert f["linear"] == 2 * 100 * 8 + 2 * 4 * 10
    assert f["attention"] == 2 * 4 * 3 * 5 * 8 * 9 // 2
    assert f["total"] == f["linear"] + f["attention"]


def test_small_run_writes_sane_json(tmp_path, tiny_model_dir):
    opts = eb.BenchOptions(model=tiny_model_dir, num_requests=4, threads=1, seed=1, batch_sizes=[2, 4],
                           prompt_len=(4, 24), output_len=(2, 6), decode_batches=[1, 2], decode_kv_lens=[16],
                           decode_steps=2, prefill_tokens=[32], bandwidth_mb=8, matmul_n=128)
    report = eb.run(opts, log=lambda m: None)
    out = tmp_path / "bench.json"
    out.write_text(json.dumps(report))
    rep = json.loads(out.read_text())
    meta, r = rep["meta"], rep["results"]

    assert meta["threads"] == 1 and meta["torch"] and meta["model_config"]["num_hidden_layers"] >= 1
    assert "static_batching" in meta["notes"] and "mfu" in meta["notes"]
    for k in ("dram_bandwidth", "weights_sized_bandwidth"):
        assert _finite_pos(r["peaks"][k]["peak_GBps"])
    assert _finite_pos(r["peaks"]["matmul"]["peak_GFLOPs"])

    wl = r["workload"]
    assert wl["num_requests"] == 4
    eng = r["engine"]
    assert eng["exact_lengths"] and eng["output_tokens"] == wl["output_tokens"]
    assert _finite_pos(eng["output_tokens_per_s"]) and _finite_pos(eng["wall_s"])
    assert 0 < eng["time_in_model_forward_s"] <= eng["time_in_runner_execute_s"] <= eng["wall_s"]

    hf = r["hf"]
    assert [x["batch_size"] for x in hf["runs"]] == [2, 4]
    for x in hf["runs"]:
        assert x["output_tokens"] == wl["output_tokens"]
        assert x["generated_tokens_incl_padding"] >= x["output_tokens"]
        assert 0 < x["useful_fraction"] <= 1
        # Same greedy model on the same prompts: the very first token agrees.
        assert x["agreement_with_engine"]["first_token_equal"] == 1.0
    assert hf["best_batch_size"] in (2, 4)
    assert math.isclose(r["speedup_vs_hf"], eng["output_tokens_per_s"] / hf["output_tokens_per_s"])
    assert isinstance(r["meets_target"], bool)

    assert [(d["batch"], d["kv_len"]) for d in r["decode"]] == [(1, 16), (2, 16)]
    for d in r["decode"]:
        assert _finite_pos(d["step_ms"]) and _finite_pos(d["bound_ms"]) and _finite_pos(d["mbu"])
        assert d["forward_ms"] <= d["step_ms"] and d["kv_bytes"] > 0
    assert [(p["tokens"], p["chunk_size"]) for p in r["prefill"]] == [(32, 512), (32, None)]
    for p in r["prefill"]:
        assert p["steps"] >= 1 and _finite_pos(p["mfu"]) and p["flops"]["attention"] > 0
    assert _finite_pos(r["total_wall_s"])
    assert "speedup vs best HF" in eb.summary(rep)


def test_cli_parses_engine_subcommand():
    a = eb.build_parser().parse_args(["--batch-size", "8,32", "--out", "x.json"])
    assert a.batch_size == [8, 32] and a.num_requests == 64 and a.model == "tiny"


def test_a_moe_models_facts_count_its_active_experts(tmp_path):
    from raycluster.bench.model_facts import decode_weight_bytes, model_facts
    from raycluster.model.loader import load_model
    from raycluster.model.tiny import write_tiny_model

    model, cfg = load_model(write_tiny_model(tmp_path, architectures=["MixtralForCausalLM"], num_hidden_layers=2))
    facts = model_facts(model)
    expert = 3 * cfg.hidden_size * cfg.moe.intermediate_size          # one expert's matmul weights
    dense = model_facts(load_model(write_tiny_model(tmp_path / "d", num_hidden_layers=2, intermediate_size=384))[0])
    # Per token: the dense layers' attention, k = 2 of the 4 experts and the router.
    assert facts["matmul_params_per_token"] == dense["matmul_params_per_token"] + cfg.num_hidden_layers * (
        expert + cfg.hidden_size * 4)
    assert facts["expert_weight_bytes"] == 4 * cfg.num_hidden_layers * 4 * expert
    # One token touches half the experts (2 of 4); a large batch all of them.
    assert decode_weight_bytes(facts, 1) == facts["decode_weight_bytes"] - facts["expert_weight_bytes"] / 2
    assert decode_weight_bytes(facts, 10_000) == pytest.approx(facts["decode_weight_bytes"])
    assert decode_weight_bytes(dense, 3) == dense["decode_weight_bytes"]


def test_model_facts_of_a_quantized_model_count_its_packed_weights(tmp_path, tiny_model_dir):
    """W4A16 in groups of 64, bf16: each layer weight is 4 bits plus a bf16 scale and zero per 64
    (the int4 kernel's operands); embedding, head and norms stay bf16; parameters count alike."""
    import torch

    from raycluster.bench.model_facts import model_facts
    from raycluster.model.loader import load_model
    from raycluster.model.quant.write import quantize_checkpoint

    quantize_checkpoint(str(tiny_model_dir), str(tmp_path / "q"), "w4a16", 64)
    dense = model_facts(load_model(tiny_model_dir, dtype=torch.bfloat16)[0])
    model, cfg = load_model(tmp_path / "q", dtype=torch.bfloat16)
    facts = model_facts(model)
    assert facts["total_params"] == dense["total_params"]
    assert facts["matmul_params_per_token"] == dense["matmul_params_per_token"]
    linear = dense["matmul_params_per_token"]
    rest = dense["decode_weight_bytes"] - 2 * linear       # norms and the head, bf16 in both
    assert facts["decode_weight_bytes"] == rest + linear // 2 + linear // 64 * 2 * 2
    assert facts["quantization"] == "compressed-tensors/ct-packed/4-bit"
