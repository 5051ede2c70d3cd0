"""sim_to_real's comparison and calibration logic (no Ray): rel. diffs, the 15% check, the
overheads measured from lone requests, and the spec parameters they feed."""

from __future__ import annotations

import pytest

from raycluster.sched.predictor import LinearBatchPredictor
from raycluster.sim.sim_to_real import calibrate, compare, rel_diff, render


def res(**by_class):
    return {"by_class": {k: {"completed": 10, **v} for k, v in by_class.items()}}


def test_rel_diff():
    assert rel_diff(0.1, 0.11) == pytest.approx(0.1)
    assert rel_diff(0.2, 0.1) == pytest.approx(-0.5)
    assert rel_diff(None, 0.1) is None and rel_diff(0.1, None) is None and rel_diff(0.0, 0.1) is None


def test_compare_rows_and_within():
    real = res(short={"ttft_p50_s": 0.10, "ttft_p90_s": 0.20, "tpot_p50_s": 0.010, "tpot_p90_s": 0.020},
               long={"ttft_p50_s": 1.0, "ttft_p90_s": 2.0, "tpot_p50_s": 0.010, "tpot_p90_s": None})
    sim = res(short={"ttft_p50_s": 0.114, "ttft_p90_s": 0.25, "tpot_p50_s": 0.009, "tpot_p90_s": 0.020},
              long={"ttft_p50_s": 0.86, "ttft_p90_s": 2.0, "tpot_p50_s": 0.010, "tpot_p90_s": 0.01})
    c = compare(real, {"sim": sim})
    assert [(r["class"], r["metric"]) for r in c["rows"]][:2] == [("short", "ttft_p50_s"), ("short", "ttft_p90_s")]
    assert len(c["rows"]) == 8
    row = {(r["class"], r["metric"]): r for r in c["rows"]}
    assert row["short", "ttft_p50_s"]["sim_rel"] == pytest.approx(0.14)
    assert row["short", "ttft_p50_s"]["sim_within"]
    assert not row["short", "ttft_p90_s"]["sim_within"]            # +25%
    assert row["long", "ttft_p50_s"]["sim_within"]                 # -14%
    assert row["long", "tpot_p90_s"]["sim_rel"] is None            # no real value: not counted
    assert c["within"]["sim"] == {"ok": 6, "cells": 7}
    text = render(c, ["sim"])
    assert "| short (n=10) | ttft_p50 | 100.0 | 114.0 | +14% |" in text
    assert "6/7" in text


def test_compare_missing_class_skipped():
    c = compare(res(short={"ttft_p50_s": 0.1}), {"a": res(short={"ttft_p50_s": 0.1}), "b": {"by_class": {}}})
    assert {r["class"] for r in c["rows"]} == {"short"}
    assert c["within"]["a"] == {"ok": 1, "cells": 1} and c["within"]["b"] == {"ok": 0, "cells": 0}


def _calib_reqs(pred, step, per_seq, disp, jitter=()):
    """Lone requests of 4 prompt lengths and bursts of 4 and 8, timed by pred + the overheads."""
    reqs, i = [], 0
    n = 32
    for rep in range(3):
        for k, prompts in ((1, [16, 64, 256, 512]), (4, [64] * 4), (8, [64] * 8)):
            for p in prompts:
                dec = sum(pred.batch_time([], [p + j] * k) for j in range(1, n)) / (n - 1)
                extra = jitter[i % len(jitter)] if jitter else 0.0
                reqs.append({"request_id": f"calib{i:03d}k{k}", "status": "ok", "warmup": False,
                             "prompt_tokens": p, "num_output_tokens": n,
                             "ttft_s": disp + pred.batch_time([(p, 0)], []) + step + per_seq + extra,
                             "tpot_s": dec + step + per_seq * k + extra / 10})
                i += 1
    return reqs


def test_calibrate_recovers_overheads():
    pred = LinearBatchPredictor(overhead_s=0.002, per_prefill_token_s=1e-5, per_decode_kv_s=1e-6)
    step, per_seq, disp = 0.0015, 0.0002, 0.012
    reqs = _calib_reqs(pred, step, per_seq, disp)
    reqs.append({"request_id": "w", "status": "ok", "warmup": True, "prompt_tokens": 16, "num_output_tokens": 32,
                 "ttft_s": 5.0, "tpot_s": 1.0})                  # warm-up requests are ignored
    reqs.append({"request_id": "f", "status": "error", "prompt_tokens": 16, "num_output_tokens": 0,
                 "ttft_s": None, "tpot_s": None})
    for stat in ("q1", "median"):
        cal = calibrate(reqs, pred, stat=stat)
        assert cal["n_lone"] == 12 and cal["n"] == 12 + 36 and cal["groups"] == [1, 4, 8]
        assert cal["step_overhead_s"] == pytest.approx(step)
        assert cal["step_overhead_per_seq_s"] == pytest.approx(per_seq)
        assert cal["dispatch_latency_s"] == pytest.approx(disp)
        assert all(v == pytest.approx(disp) for v in cal["ttft_residual_by_prompt_s"].values())
        other = "median" if stat == "q1" else "q1"
        assert cal[f"{other}_dispatch_latency_s"] == pytest.approx(disp)


def test_calibrate_lower_quartile_ignores_bursts_of_foreign_load():
    """Foreign load adds time to some requests only: q1 stays at the quiet value, the median moves."""
    pred = LinearBatchPredictor(overhead_s=0.002, per_prefill_token_s=1e-5, per_decode_kv_s=1e-6)
    jitter = [0.0, 0.0, 0.3, 0.5]            # half the requests slowed by others
    cal = calibrate(_calib_reqs(pred, 0.0015, 0.0, 0.012, jitter), pred)
    assert cal["dispatch_latency_s"] == pytest.approx(0.012, abs=1e-3)
    assert cal["median_dispatch_latency_s"] > 0.1


def test_calibrate_lone_only_and_clamps():
    pred = LinearBatchPredictor(overhead_s=0.01)
    reqs = [{"request_id": "calib000", "status": "ok", "prompt_tokens": 16, "num_output_tokens": 4,
             "ttft_s": 0.001, "tpot_s": 0.005}]            # faster than predicted: clamped at 0
    cal = calibrate(reqs, pred)
    assert cal["groups"] == [1]
    assert cal["step_overhead_s"] == 0.0 and cal["step_overhead_per_seq_s"] == 0.0
    assert cal["dispatch_latency_s"] == 0.0
    with pytest.raises(ValueError):
        calibrate([], pred)


def test_spec_overheads_shift_sim_times():
    """dispatch_latency_s adds to TTFT once per request; step_overhead_s slows every step (gpu: cpu)."""
    from loadgen.workloads import make_workload
    from raycluster.sim.run import simulate
    from raycluster.sim.spec import SimSpec

    pred = {"overhead_s": 0.002, "per_prefill_token_s": 1e-5, "per_decode_kv_s": 1e-6}
    base = dict(gpu="cpu", model="tiny", policy="lars", predictor=pred, kv_cache_tokens=65536)
    wl = make_workload("chat", seed=3, qps=0.2, num_requests=5, max_output_tokens=8)
    a = simulate(SimSpec(**base), wl)["requests"]
    b = simulate(SimSpec(**base, dispatch_latency_s=0.05), wl)["requests"]
    c = simulate(SimSpec(**base, step_overhead_s=0.001), wl)["requests"]
    e = simulate(SimSpec(**base, step_overhead_per_seq_s=0.001), wl)["requests"]
    for ra, rb, rc, re in zip(a, b, c, e):
        assert rb["ttft_s"] == pytest.approx(ra["ttft_s"] + 0.05)     # lone requests: a pure shift
        assert rb["tpot_s"] == pytest.approx(ra["tpot_s"])
        assert rb["arrival_s"] == ra["arrival_s"]
        assert rc["tpot_s"] == pytest.approx(ra["tpot_s"] + 0.001)
        assert re["tpot_s"] == pytest.approx(ra["tpot_s"] + 0.001)    # lone: one sequence per step


def test_fit_on_trace_recovers_dispatch_and_scale(tmp_path):
    """A 'real' run made by the simulator itself with known overheads: the trace fit finds them
    (step overheads as a multiple of the measured ones, dispatch as the median TTFT gap)."""
    import json

    import yaml

    from loadgen.trace import write_trace
    from loadgen.workloads import make_workload
    from raycluster.sim.run import simulate
    from raycluster.sim.sim_to_real import fit_on_trace
    from raycluster.sim.spec import SimSpec

    pred = {"overhead_s": 0.002, "per_prefill_token_s": 1e-5, "per_decode_kv_s": 1e-6}
    base = dict(gpu="cpu", model="tiny", policy="lars", predictor=pred, kv_cache_tokens=65536)
    wl = make_workload("chat", seed=4, qps=2.0, num_requests=30, max_output_tokens=16)
    write_trace(wl, tmp_path / "calib-trace.jsonl")
    truth = SimSpec(**base, step_overhead_s=0.002, step_overhead_per_seq_s=0.0005, dispatch_latency_s=0.03)
    real = simulate(truth, wl)
    measured = {**base, "step_overhead_s": 0.001, "step_overhead_per_seq_s": 0.00025, "dispatch_latency_s": 0.0}
    (tmp_path / "cal.yaml").write_text(yaml.safe_dump(measured))
    fit = fit_on_trace(tmp_path / "cal.yaml", tmp_path / "calib-trace.jsonl", json.loads(json.dumps(real)), tmp_path,
                       iters=10)
    assert fit["scale"] == pytest.approx(2.0, rel=0.05)
    assert fit["dispatch_latency_s"] == pytest.approx(0.03, abs=0.005)
    out = yaml.safe_load((tmp_path / "local-cpu-trace-calibrated.yaml").read_text())
    assert out["dispatch_latency_s"] == fit["dispatch_latency_s"]
    assert not (tmp_path / "fit-spec.yaml").exists()
