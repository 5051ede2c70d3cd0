"""Step-time and dispatch-latency variability in the simulator (sim/step_noise.py, spec
`step_noise` / `dispatch_noise`, sim/s2r_noise.py's pooling): the draws, their fits on synthetic
calibration data, determinism per seed, and that absent blocks change nothing (no Ray)."""

from __future__ import annotations

import math
import random
import statistics

import pytest
from pydantic import ValidationError

from loadgen.workloads import make_workload
from raycluster.sim.run import simulate
from raycluster.sim.spec import SimSpec
from raycluster.sim.step_noise import (StepNoise, corr_time, fit_dispatch, fit_from_samples, inverse_cdf,
                                       normal_cdf, trace_ratios)

PRED = {"overhead_s": 0.002, "per_prefill_token_s": 1e-5, "per_decode_kv_s": 1e-6}
BASE = dict(gpu="cpu", model="tiny", policy="lars", predictor=PRED, kv_cache_tokens=65536)


def lone_workload(n: int = 5, out: int = 8):
    """Requests 5 s apart: each one alone on the instance, so its times are its own steps."""
    return make_workload("chat", seed=3, qps=0.2, num_requests=n, max_output_tokens=out)


def reqs(spec: dict, wl) -> list[dict]:
    return simulate(SimSpec(**spec), wl)["requests"]


# ---- the draws ---------------------------------------------------------------------------------------
def test_inverse_cdf_is_linear_between_evenly_spaced_quantiles():
    q = [1.0, 2.0, 4.0]             # at probabilities 0, 0.5, 1
    assert [inverse_cdf(q, u) for u in (0.0, 0.25, 0.5, 0.75, 1.0)] == [1.0, 1.5, 2.0, 3.0, 4.0]
    assert normal_cdf(0.0) == 0.5


def test_factor_independent_steps_are_the_inverse_cdf_of_the_seeded_normals():
    spec = SimSpec(step_noise={"quantiles": [0.5, 1.0, 3.0], "seed": 7}).step_noise
    noise = StepNoise.for_instance(spec, "mixed-0")
    rng = random.Random("7/mixed-0")            # what for_instance seeds: "<seed>/<instance id>"
    for t in (0.0, 0.01, 0.5, 0.5):
        e = rng.normalvariate(0.0, 1.0)
        assert noise.factor(t) == inverse_cdf([0.5, 1.0, 3.0], 0.5 * (1 + math.erf(e / math.sqrt(2))))


def test_factor_is_an_ornstein_uhlenbeck_process_in_virtual_time():
    spec = SimSpec(step_noise={"quantiles": [0.5, 1.0, 3.0], "corr_time_s": 2.0, "seed": 1}).step_noise
    noise = StepNoise.for_instance(spec, "mixed-0")
    rng = random.Random("1/mixed-0")
    z = rng.normalvariate(0.0, 1.0)             # the first step: a stationary draw
    noise.factor(1.0)
    assert noise.z == z
    for t_prev, t in ((1.0, 1.5), (1.5, 4.0), (4.0, 4.0)):
        a = math.exp(-(t - t_prev) / 2.0)
        z = a * z + math.sqrt(1 - a * a) * rng.normalvariate(0.0, 1.0)
        f = noise.factor(t)
        assert noise.z == pytest.approx(z, abs=1e-12)
        assert f == pytest.approx(inverse_cdf([0.5, 1.0, 3.0], normal_cdf(z)), abs=1e-12)
    assert noise.factor(4.0) == pytest.approx(f, abs=1e-12)   # dt = 0: a = 1, the factor holds


def test_same_seed_same_draws_other_seed_or_instance_other_draws():
    spec = SimSpec(step_noise={"quantiles": [0.5, 1.0, 3.0], "corr_time_s": 0.3, "seed": 4}).step_noise
    other = SimSpec(step_noise={"quantiles": [0.5, 1.0, 3.0], "corr_time_s": 0.3, "seed": 5}).step_noise
    ts = [0.01 * i for i in range(50)]
    draw = lambda s, iid: [StepNoise.for_instance(s, iid).factor(t) for t in ts]     # noqa: E731
    a = StepNoise.for_instance(spec, "mixed-0")
    seq = [a.factor(t) for t in ts]
    b = StepNoise.for_instance(spec, "mixed-0")
    assert [b.factor(t) for t in ts] == seq
    assert draw(other, "mixed-0") != draw(spec, "mixed-0")
    c = StepNoise.for_instance(spec, "mixed-1")
    assert [c.factor(t) for t in ts] != seq


# ---- the fits ----------------------------------------------------------------------------------------
def test_fit_from_samples_quantiles_over_the_median():
    # ratios 0.5 1 1.5 2 3 (median 1.5); n=5: min, the quartiles (inclusive: 1, 1.5, 2), max
    samples = [(0.0, 1.0), (0.5, 3.0), (1.0, 0.5), (1.5, 2.0), (2.0, 1.5)]
    fit = fit_from_samples(samples, n=5, seed=3)
    assert fit["quantiles"] == [round(x / 1.5, 6) for x in (0.5, 1.0, 1.5, 2.0, 3.0)]
    assert fit["quantiles"][2] == 1.0 and fit["seed"] == 3
    assert fit["fit"]["median_ratio"] == 1.5 and fit["fit"]["samples"] == 5 and fit["fit"]["mean_gap_s"] == 0.5
    fit3 = fit_from_samples(samples, n=3)
    assert fit3["quantiles"] == [round(0.5 / 1.5, 6), 1.0, 2.0]


def test_corr_time_from_lag1_correlation_of_normal_scores():
    # ranks 1 2 4 3 5 -> scores Phi^-1(r/6) = -a, -b, b, 0, a; lag-1 pairs (x, y) by hand
    a, b = statistics.NormalDist().inv_cdf(5 / 6), statistics.NormalDist().inv_cdf(4 / 6)
    x, y = [-a, -b, b, 0.0], [-b, b, 0.0, a]
    mx, my = sum(x) / 4, sum(y) / 4
    rho = (sum((u - mx) * (v - my) for u, v in zip(x, y))
           / math.sqrt(sum((u - mx) ** 2 for u in x) * sum((v - my) ** 2 for v in y)))
    assert rho == pytest.approx(0.4335074559, abs=1e-9)
    samples = [(0.5 * i, v) for i, v in enumerate((1.0, 2.0, 4.0, 3.0, 5.0))]
    r, tau = corr_time(samples)
    assert r == pytest.approx(rho, abs=1e-12)
    assert tau == pytest.approx(-0.5 / math.log(rho), abs=1e-12)
    assert corr_time([(0.5 * i, v) for i, v in enumerate((1.0, 3.0, 2.0, 4.0))]) == (pytest.approx(-0.42378635), 0.0)


def test_trace_ratios_pairs_real_and_simulated_tpot_in_time_order():
    real = [{"request_id": "a", "status": "ok", "tpot_s": 0.012, "first_token_s": 2.0},
            {"request_id": "b", "status": "ok", "tpot_s": 0.010, "first_token_s": 1.0},
            {"request_id": "c", "status": "timeout", "tpot_s": None, "first_token_s": None},
            {"request_id": "d", "status": "ok", "tpot_s": 0.010, "first_token_s": 3.0, "warmup": True}]
    sim = [{"request_id": k, "tpot_s": 0.008} for k in "abcd"]
    assert trace_ratios(real, sim) == [(1.0, 1.25), (2.0, 1.5)]


def test_fit_dispatch_uses_requests_the_simulator_served_alone():
    from raycluster.sched.predictor import LinearBatchPredictor

    pred = LinearBatchPredictor(**PRED)
    alone = pred.batch_time([(100, 0)], [])         # 3 ms
    real, sim = [], []
    for i, (excess, queued) in enumerate([(0.02, 0), (0.01, 0), (0.05, 0), (0.03, 0), (0.5, 0.1), (-0.001, 0)]):
        sim.append({"request_id": f"r{i}", "ttft_s": alone + queued})
        real.append({"request_id": f"r{i}", "status": "ok", "prompt_tokens": 100,
                     "ttft_s": alone + queued + excess})
    fit = fit_dispatch(real, sim, pred, n=3, seed=2)
    # r4 queued in the sim: left out; r5 clamped at 0 -> 0, 0.01, 0.02, 0.03, 0.05: min, median, max
    assert fit == {"quantiles": [0.0, 0.02, 0.05], "seed": 2, "fit": {"samples": 5}}
    with pytest.raises(ValueError, match="alone"):
        fit_dispatch(real[4:5], sim[4:5], pred)


# ---- the simulator -----------------------------------------------------------------------------------
def test_off_by_default_is_bit_identical():
    wl = make_workload("chat", seed=5, qps=4.0, num_requests=40, max_output_tokens=16)
    spec = SimSpec(**BASE)
    assert spec.step_noise is None and spec.dispatch_noise is None
    a = simulate(spec, wl)["requests"]
    b = simulate(SimSpec(**BASE, step_noise=None, dispatch_noise=None), wl)["requests"]
    assert a == b


def test_constant_multiplier_scales_every_step_exactly():
    wl = lone_workload()
    a = reqs(BASE, wl)
    for m in (2.0, 0.5):
        b = reqs({**BASE, "step_noise": {"quantiles": [m, m]}}, wl)
        for ra, rb in zip(a, b):
            assert rb["ttft_s"] == pytest.approx(ra["ttft_s"] * m, rel=1e-9)    # dispatch 0: the prefill step
            assert rb["tpot_s"] == pytest.approx(ra["tpot_s"] * m, rel=1e-9)


def test_each_step_gets_the_instances_next_factor():
    """Independent steps: a lone request's prefill and each decode step are the predicted times times
    the instance's draws in order (one draw per step)."""
    from raycluster.sched.predictor import LinearBatchPredictor

    pred = LinearBatchPredictor(**PRED)
    q = [0.5, 1.0, 3.0]
    wl = lone_workload(n=1, out=4)
    r = reqs({**BASE, "step_noise": {"quantiles": q, "seed": 9}}, wl)[0]
    noise = StepNoise.for_instance(SimSpec(step_noise={"quantiles": q, "seed": 9}).step_noise, "mixed-0")
    p = r["prompt_tokens"]
    # decode step j attends over the prompt and the j - 1 tokens decoded before it (num_computed_tokens)
    steps = [pred.batch_time([(p, 0)], [])] + [pred.batch_time([], [p + j - 1]) for j in range(1, 4)]
    ends, t = [], 0.0
    for s in steps:
        t += s * noise.factor(t)
        ends.append(t)
    assert r["ttft_s"] == pytest.approx(ends[0], abs=1e-12)
    assert r["e2e_s"] == pytest.approx(ends[-1], abs=1e-12)
    assert r["tpot_s"] == pytest.approx((ends[-1] - ends[0]) / 3, abs=1e-12)


def test_dispatch_noise_draws_each_requests_latency_in_workload_order():
    wl = lone_workload()
    a = reqs(BASE, wl)
    q = [0.01, 0.02, 0.2]
    b = reqs({**BASE, "dispatch_noise": {"quantiles": q, "seed": 3}}, wl)
    rng = random.Random("3/dispatch")
    for w, ra, rb in zip(wl, a, b):
        assert ra["request_id"] == rb["request_id"] == w.request_id
        assert rb["ttft_s"] - ra["ttft_s"] == pytest.approx(inverse_cdf(q, rng.random()), abs=1e-12)
        assert rb["tpot_s"] == pytest.approx(ra["tpot_s"], rel=1e-12)


def test_noisy_runs_are_deterministic_per_seed():
    wl = make_workload("long-mix", seed=2, qps=4.0, num_requests=40, long_fraction=0.2, long_tokens=(512, 1024),
                       max_output_tokens=16)
    noisy = {**BASE, "step_noise": {"quantiles": [0.6, 1.0, 2.5], "corr_time_s": 0.5, "seed": 1},
             "dispatch_noise": {"quantiles": [0.0, 0.01, 0.1], "seed": 1}}
    a, b = reqs(noisy, wl), reqs(noisy, wl)
    assert a == b
    c = reqs({**noisy, "step_noise": {**noisy["step_noise"], "seed": 2}}, wl)
    assert [r["ttft_s"] for r in c] != [r["ttft_s"] for r in a]
    assert simulate(SimSpec(**noisy), wl)["meta"]["sim"]["decode_path"] == "stepwise"    # no decode runs


@pytest.mark.parametrize("bad, field", [
    ({"step_noise": {"quantiles": [1.0]}}, "step_noise.quantiles"),
    ({"step_noise": {"quantiles": [1.0, 0.5]}}, "step_noise.quantiles: must be nondecreasing"),
    ({"step_noise": {"quantiles": [0.0, 1.0]}}, "step_noise.quantiles: every value must be finite and > 0"),
    ({"step_noise": {"quantiles": [1.0, 2.0], "corr_time_s": -1}}, "step_noise.corr_time_s"),
    ({"step_noise": {"quantiles": [1.0, 2.0], "sigma": 1}}, "step_noise.sigma"),
    ({"dispatch_noise": {"quantiles": [-0.1, 0.1]}}, "dispatch_noise.quantiles: every value must be finite and >= 0"),
    ({"dispatch_noise": {"quantiles": [0.0, 0.1]}, "dispatch_latency_s": 0.02}, "dispatch_noise: replaces"),
])
def test_spec_errors_name_the_field(bad, field):
    with pytest.raises(ValidationError, match=field.replace(".", r"\.").replace("(", r"\(")):
        SimSpec(**bad)


# ---- sim_to_real's pooling ---------------------------------------------------------------------------
def test_pool_and_seeds():
    from raycluster.sim.s2r_noise import pool, with_seeds

    spec = {"step_noise": {"quantiles": [1.0, 2.0], "seed": 0}, "dispatch_noise": {"quantiles": [0, 1], "seed": 0},
            "dispatch_latency_s": 0.0}
    assert with_seeds(spec, 5)["step_noise"]["seed"] == 5 and with_seeds(spec, 5)["dispatch_noise"]["seed"] == 5
    assert spec["step_noise"]["seed"] == 0          # a copy
    wl = lone_workload()
    runs = [simulate(SimSpec(**BASE, **with_seeds({k: v for k, v in spec.items() if k != "dispatch_noise"}, s)), wl)
            for s in (1, 2)]
    res = pool(runs)
    assert res["summary"]["num_requests"] == 10 and res["meta"]["replicas"] == 2
    assert [r["request_id"] for r in res["requests"]][:1] == ["r0/" + runs[0]["requests"][0]["request_id"]]
    ttfts = sorted(r["ttft_s"] for run in runs for r in run["requests"])
    assert sorted(r["ttft_s"] for r in res["requests"]) == ttfts


def test_fit_noise_spec_recovers_a_noise_free_truth(tmp_path):
    """A 'real' calibration trace made by the simulator itself, noise-free, with the tcal spec's own
    overheads and dispatch latency: the fit finds no step noise (every ratio 1), a dispatch
    distribution at that latency, and a level ~1."""
    import json

    import yaml

    from loadgen.trace import write_trace
    from raycluster.sim.s2r_noise import SPEC_NAME, fit_noise_spec

    truth = {**BASE, "step_overhead_s": 0.002, "step_overhead_per_seq_s": 0.0005, "dispatch_latency_s": 0.03}
    wl = make_workload("long-mix", seed=4, qps=2.0, num_requests=40, long_fraction=0.2, long_tokens=(512, 1024),
                       max_output_tokens=16)
    write_trace(wl, tmp_path / "calib-trace.jsonl")
    (tmp_path / "calib-trace.json").write_text(json.dumps(simulate(SimSpec(**truth), wl)))
    (tmp_path / "local-cpu-trace-calibrated.yaml").write_text(yaml.safe_dump(truth))
    fit = fit_noise_spec(tmp_path, seed=1)
    assert set(fit["step_noise"]["quantiles"]) == {1.0}
    assert fit["dispatch_noise"]["quantiles"] == [pytest.approx(0.03, abs=1e-6)] * 11
    assert fit["level_scale"] == pytest.approx(1.0, abs=2 / 2 ** 7)        # bisection on [0, 2], 7 steps
    spec = yaml.safe_load((tmp_path / SPEC_NAME).read_text())
    assert spec["dispatch_latency_s"] == 0.0 and spec["step_noise"]["quantiles"][0] == 1.0
    assert "fit" not in spec["step_noise"] and "fit" not in spec["dispatch_noise"]
    assert not list(tmp_path.glob("fit-*"))
