"""Weight quantization in the analytic roofline and the simulator's memory model.

Expected values are the module docstring's formulas (raycluster/sched/roofline.py) worked out here
by hand: W = w L P_layer + b V h read per step, M = W + b V h resident, w the scheme's bytes per
decoder-layer parameter (w4a16: 1/2 + 2/128; the 8-bit schemes: 1), the decoder-layer GEMMs at
the int8 / fp8 peak for w8a8 / fp8 where the GPU has those tensor cores. `quantization: none` must
leave every time and capacity as it was (the golden digests in test_sim_golden.py check the runs).
"""

from __future__ import annotations

import math
import random
from pathlib import Path
from typing import get_args

import pytest
from pydantic import ValidationError

from loadgen.workloads import make_workload
from raycluster.sched.roofline import (A100, GPUS, H100, H200, LLAMA3_70B, LLAMA3_8B, MIXTRAL_8X7B, MODELS,
                                       QUANTIZATIONS, RooflinePredictor)
from raycluster.sim.cluster import kv_tokens, make_predictor
from raycluster.sim.run import simulate
from raycluster.sim.spec import Quant, SimSpec, load_spec

W4 = 0.5 + 2 / 128          # int4 + one 2-byte scale per 128 input columns


def capacity(spec: SimSpec) -> int:
    pool = spec.pools[0]
    return kv_tokens(spec, pool, spec.engine_config(pool))


def test_the_spec_offers_the_roofline_schemes():
    assert get_args(Quant) == tuple(QUANTIZATIONS)
    assert SimSpec().quantization == "none" and RooflinePredictor().quantization == "none"


def test_gpu_peaks_per_scheme():
    # A100: int8 2x bf16, no fp8 tensor cores (vLLM runs fp8 weight-only there: bf16 GEMMs).
    assert A100.gemm_flops(QUANTIZATIONS["w8a8"]) == 624e12
    assert A100.gemm_flops(QUANTIZATIONS["fp8"]) == A100.peak_flops == 312e12
    for g in (H100, H200):
        assert g.gemm_flops(QUANTIZATIONS["fp8"]) == g.gemm_flops(QUANTIZATIONS["w8a8"]) == 1979e12
    for g in GPUS.values():
        for name in ("none", "w4a16", "w8a16"):            # weight-only: the bf16 peak
            assert g.gemm_flops(QUANTIZATIONS[name]) == g.peak_flops


def test_weight_bytes_by_scheme():
    m = LLAMA3_8B
    lm_head = m.vocab * m.hidden * 2
    layers = m.layers * m.layer_params
    w4 = QUANTIZATIONS["w4a16"]
    assert m.read_bytes(w4) == layers * W4 + lm_head                  # ~4.65 GB
    assert m.resident_bytes(w4) == layers * W4 + 2 * lm_head          # + the input embedding
    for name in ("w8a16", "w8a8", "fp8"):
        assert m.read_bytes(QUANTIZATIONS[name]) == layers * 1 + lm_head
    assert m.read_bytes(QUANTIZATIONS["none"]) == m.weight_bytes == 2 * (layers + m.vocab * m.hidden)
    assert m.resident_bytes() == m.params * m.dtype_bytes
    assert 4.6e9 < m.read_bytes(w4) < 4.7e9
    # A MoE model stores (and a big step reads) every expert in the scheme's format.
    x = MIXTRAL_8X7B
    experts = x.layers * 3 * x.hidden * x.intermediate * x.experts
    stored = x.layers * x.layer_params + x.layers * 3 * x.hidden * x.intermediate * (x.experts - x.experts_per_token)
    assert x.read_bytes(w4) == stored * W4 + x.vocab * x.hidden * 2
    idle = (1 - 2 / 8) ** 1
    assert x.step_weight_bytes(1, w4) == pytest.approx(x.read_bytes(w4) - W4 * experts * idle, rel=1e-12)


def test_decode_batch1_is_faster_by_the_weight_bytes():
    """Memory-bound: the step reads W; w4a16 reads ~0.31 of bf16's bytes, the 8-bit schemes ~0.53."""
    kvb = LLAMA3_8B.kv_bytes_per_token()
    times = {}
    for name, q in QUANTIZATIONS.items():
        r = RooflinePredictor(A100, LLAMA3_8B, mbu=0.8, quantization=name)
        c = r.cost([], [1000])
        assert not c.compute_bound
        expected = (LLAMA3_8B.read_bytes(q) + kvb * 1001) / (A100.hbm_bw * 0.8)
        times[name] = r.batch_time([], [1000])
        assert times[name] == pytest.approx(expected, rel=1e-12)
    ratio = times["w4a16"] / times["none"]
    # proportional to the weight bytes, but for the (bf16) KV the step also reads
    assert ratio == pytest.approx(LLAMA3_8B.read_bytes(QUANTIZATIONS["w4a16"]) / LLAMA3_8B.weight_bytes, abs=0.01)
    assert 0.30 < ratio < 0.33
    assert times["w8a16"] == times["w8a8"] == times["fp8"]        # same bytes; compute does not bind
    assert 0.52 < times["fp8"] / times["none"] < 0.55


def test_large_prefill_speeds_up_only_on_int8_fp8_tensor_cores():
    """Compute-bound: w4a16 / w8a16 run bf16 GEMMs (unchanged); fp8 halves the decoder-layer GEMM
    time on H100 but not on A100 (weight-only there); w8a8 halves it on both."""
    n, m = 8192, LLAMA3_8B
    layer_f = 2 * m.layers * m.layer_params * n
    head_f = 2 * m.vocab * m.hidden
    attn_f = 4 * m.layers * m.q_dim * (n * (n + 1) / 2)

    def expected(gpu, gemm_peak):
        return (layer_f / gemm_peak + (head_f + attn_f) / gpu.peak_flops) / 0.5

    for gpu in (A100, H100):
        none = RooflinePredictor(gpu, m, mfu=0.5).prefill_time(n)
        for name in ("w4a16", "w8a16"):
            assert RooflinePredictor(gpu, m, mfu=0.5, quantization=name).prefill_time(n) == none
        w8a8 = RooflinePredictor(gpu, m, mfu=0.5, quantization="w8a8")
        assert w8a8.cost([(n, 0)], []).compute_bound
        assert w8a8.prefill_time(n) == pytest.approx(expected(gpu, gpu.int8_flops), rel=1e-12)
        assert 0.55 < w8a8.prefill_time(n) / none < 0.65        # the attention stays at the bf16 peak
    assert RooflinePredictor(A100, m, mfu=0.5, quantization="fp8").prefill_time(n) == \
        RooflinePredictor(A100, m, mfu=0.5).prefill_time(n)
    fp8 = RooflinePredictor(H100, m, mfu=0.5, quantization="fp8").prefill_time(n)
    assert fp8 == pytest.approx(expected(H100, 1979e12), rel=1e-12)
    assert fp8 < 0.65 * RooflinePredictor(H100, m, mfu=0.5).prefill_time(n)


def test_quantized_fast_path_is_bit_exact():
    """`batch_time` / `prefill_time` (memoised, no StepCost) equal `cost`'s arithmetic under every scheme."""
    rng = random.Random(7)
    for name in QUANTIZATIONS:
        for gpu in ("A100", "H100"):
            for model in sorted(MODELS):
                tp, spp, kvp = rng.choice([(1, 1, 1), (8, 1, 1), (4, 2, 2)])
                p = RooflinePredictor(GPUS[gpu], MODELS[model], tp, spp, kvp, overhead_s=1e-3, quantization=name,
                                      chunk_size=rng.choice([None, 512]))
                for _ in range(20):
                    prefills = [(rng.randint(0, 5000), rng.randint(0, 100_000)) for _ in range(rng.choice([0, 1, 2]))]
                    decodes = [rng.randint(0, 50_000) for _ in range(rng.choice([0, 1, 7, 256]))]
                    if prefills or decodes:
                        c = p.cost(prefills, decodes)
                        assert p.batch_time(prefills, decodes) == spp * c.stage + (spp - 1) * c.send + 1e-3
                    nt = rng.randint(1, 9000)
                    size = p.chunk_size or nt
                    total, done, last = 0.0, 0, 0.0
                    for _ in range(math.ceil(nt / size)):
                        c = p.cost([(min(size, nt - done), done)], [])
                        last = c.stage + c.send
                        total += last
                        done += min(size, nt - done)
                    assert p.prefill_time(nt) == total + (spp - 1) * last + 1e-3


def test_predictor_refuses_an_unknown_scheme():
    with pytest.raises(ValueError, match="quantization: unknown 'int3'"):
        RooflinePredictor(quantization="int3")


def test_quantized_weights_leave_more_memory_for_kv():
    """Llama-3-70B at TP4 on A100-80GB: 141 GB of bf16 weights, 39.5 GB as w4a16."""
    m = LLAMA3_70B
    kvb = 2 * 2 * 80 * 8 * 128
    budget = 4 * 80e9 * 0.9
    emb = 2 * m.vocab * m.hidden * 2
    got = {}
    for name, w in (("none", 2), ("w4a16", W4), ("w8a16", 1), ("fp8", 1)):
        spec = SimSpec(gpu="a100", model="llama-3-70b", quantization=name, pools=[{"role": "mixed", "tp": 4}])
        got[name] = capacity(spec)
        assert got[name] == int((budget - (m.layers * m.layer_params * w + emb)) // kvb)
    assert got["none"] == 448288 and got["w4a16"] == 758368
    assert got["w8a16"] == got["fp8"] and got["none"] < got["fp8"] < got["w4a16"]


def test_a_model_that_does_not_fit_dense_fits_quantized():
    """Mixtral 8x7B (93 GB bf16) does not fit one H100; as w4a16 (24.5 GB) it does."""
    dense = SimSpec(gpu="h100", model="mixtral-8x7b", pools=[{"role": "mixed", "tp": 1}])
    with pytest.raises(ValueError, match=r"mixtral-8x7b does not fit in 1 x H100"):
        capacity(dense)
    spec = SimSpec(gpu="h100", model="mixtral-8x7b", quantization="w4a16", pools=[{"role": "mixed", "tp": 1}])
    x = MIXTRAL_8X7B
    stored = x.layers * x.layer_params + x.layers * 3 * x.hidden * x.intermediate * (x.experts - x.experts_per_token)
    weights = stored * W4 + 2 * x.vocab * x.hidden * 2
    assert 24e9 < weights < 25e9
    assert capacity(spec) == int((80e9 * 0.9 - weights) // (2 * 2 * 32 * 8 * 128))
    # Llama-3-70B as w8a16 (71 GB) still does not fit one A100 at 0.9 utilisation: the error says so.
    spec = SimSpec(gpu="a100", model="llama-3-70b", quantization="w8a16", pools=[{"role": "mixed", "tp": 1}])
    with pytest.raises(ValueError, match=r"llama-3-70b \(w8a16\) does not fit in 1 x A100"):
        capacity(spec)


def test_spec_names_the_field():
    with pytest.raises(ValidationError, match="quantization"):
        SimSpec(gpu="a100", quantization="int3")
    with pytest.raises(ValidationError, match="quantization: 'w4a16' needs a roofline gpu"):
        SimSpec(gpu="cpu", quantization="w4a16")
    SimSpec(gpu="cpu", quantization="none")


def test_the_spec_reaches_the_predictor():
    spec = SimSpec(gpu="h100", model="llama-3-70b", quantization="fp8", pools=[{"role": "mixed", "tp": 8}])
    p = make_predictor(spec, spec.pools[0])
    assert p.quantization == "fp8" and p.gemm_scale == 989e12 / 1979e12
    assert make_predictor(SimSpec(gpu="h100"), SimSpec().pools[0]).quantization == "none"


def test_none_is_the_unquantized_run_and_w4a16_decodes_faster():
    base = {"gpu": "a100", "model": "llama-3-8b", "engine": {"max_num_batched_tokens": 8192, "max_num_seqs": 64},
            "pools": [{"role": "mixed", "instances": 1}]}
    wl = dict(name="chat", seed=3, qps=4, num_requests=40)
    plain = simulate(SimSpec(**base), make_workload(**wl))
    none = simulate(SimSpec(**base, quantization="none"), make_workload(**wl))
    assert none["requests"] == plain["requests"]
    w4 = simulate(SimSpec(**base, quantization="w4a16"), make_workload(**wl))
    assert w4["summary"]["completed"] == 40
    assert w4["summary"]["tpot_p50_s"] < 0.5 * plain["summary"]["tpot_p50_s"]


def test_the_example_spec_is_w4a16_70b_on_4_a100s():
    spec = load_spec(Path(__file__).parents[2] / "sims" / "llama70b-w4a16-4xa100.yaml")
    assert (spec.gpu, spec.model, spec.quantization, spec.num_gpus) == ("a100", "llama-3-70b", "w4a16", 4)
    assert capacity(spec) == 758368
