"""sim_to_real's `sim_noise` column: the trace-calibrated spec plus step-time and dispatch-latency
variability, all fitted on the calibration trace (calib-trace.jsonl and its real replay), then run
on the test trace as several seeded replicas pooled into one results file.

Fit (`fit_noise_spec`), starting from local-cpu-trace-calibrated.yaml (overheads x f and a
constant dispatch latency D fitted by sim_to_real.fit_on_trace):
1. the simulator, noise-free at dispatch 0, on the calibration trace;
2. `step_noise` from each request's real / simulated TPOT (sim/step_noise.trace_ratios: the
   multiplier's marginal over its median and its correlation time), `dispatch_noise` from real -
   simulated TTFT of the requests the simulator served alone (step_noise.fit_dispatch; it
   replaces D);
3. the decode level: the step overheads' scale g (bisection on [0, 2]) so the pooled replicas'
   TPOT P50 over all requests matches the real one again (the noise's mean is above its median).
Written to local-cpu-noise-calibrated.yaml. The test trace is only simulated at the end.

Why replicas: with noise a simulated percentile is one random draw (a class of 16-30 requests has
a P90 of 2-3 requests); pooling `reps` seeds estimates the distribution the model predicts.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import yaml

from loadgen.metrics import RequestRecord, build_results
from raycluster.sim.step_noise import fit_dispatch, fit_from_samples, trace_ratios

SPEC_NAME = "local-cpu-noise-calibrated.yaml"
FIT_REPS = 4            # replicas per bisection step
TEST_REPS = 8           # replicas on the test trace
LEVEL_ITERS = 7
_RECORD_FIELDS = tuple(f.name for f in dataclasses.fields(RequestRecord))


def with_seeds(spec: dict, seed: int) -> dict:
    """The spec with every noise block's seed set to `seed`."""
    out = dict(spec)
    for key in ("step_noise", "dispatch_noise"):
        if out.get(key) is not None:
            out[key] = {**out[key], "seed": seed}
    return out


def pool(results: list[dict], meta: dict | None = None) -> dict:
    """One loadgen results dict over the requests of every replica (ids prefixed `r<i>/`)."""
    recs = []
    for i, res in enumerate(results):
        for r in res["requests"]:
            rec = RequestRecord(**{k: r[k] for k in _RECORD_FIELDS if k in r})
            rec.request_id = f"r{i}/{rec.request_id}"
            recs.append(rec)
    return build_results(recs, {**(results[0]["meta"] if results else {}), **(meta or {}),
                                "replicas": len(results)})


def run_replicas(spec: dict, trace: Path, out: Path, reps: int, seed0: int) -> dict:
    """`reps` sims of `trace`, noise seeds seed0 .. seed0 + reps - 1, pooled into `out`."""
    from raycluster.sim.sim_to_real import run_sim

    tmp_spec, tmp_out = out.with_suffix(".spec.yaml"), out.with_suffix(".rep.json")
    results = []
    for i in range(reps):
        tmp_spec.write_text(yaml.safe_dump(with_seeds(spec, seed0 + i), sort_keys=False))
        results.append(run_sim(tmp_spec, trace, tmp_out))
    for x in (tmp_spec, tmp_out):
        x.unlink(missing_ok=True)
    res = pool(results, {"noise_seeds": [seed0, seed0 + reps - 1]})
    out.write_text(json.dumps(res, indent=1))
    return res


def block(fit: dict) -> dict:
    """A fit's spec block (without its `fit` notes)."""
    return {k: v for k, v in fit.items() if k != "fit"}


def scaled(spec: dict, g: float) -> dict:
    """The step overheads (the decode level) x g."""
    return {**spec, "step_overhead_s": spec["step_overhead_s"] * g,
            "step_overhead_per_seq_s": spec["step_overhead_per_seq_s"] * g}


def bisect(make, trace: Path, metric, target: float, d: Path, seed0: int, hi: float,
           iters: int = LEVEL_ITERS) -> float:
    """x in [0, hi] with metric(pooled replicas of make(x)) = target (the metric grows with x)."""
    lo = 0.0
    out = d / "fit-noise.json"
    for _ in range(iters):
        mid = (lo + hi) / 2
        if (metric(run_replicas(make(mid), trace, out, FIT_REPS, seed0)) or 0.0) < target:
            lo = mid
        else:
            hi = mid
    out.unlink(missing_ok=True)
    return (lo + hi) / 2


def base_run(spec: dict, d: Path) -> dict:
    """The spec noise-free at dispatch 0 on the calibration trace."""
    from raycluster.sim.sim_to_real import run_sim

    path, out = d / "fit-zero.yaml", d / "fit-zero.json"
    path.write_text(yaml.safe_dump({**spec, "dispatch_latency_s": 0.0}, sort_keys=False))
    res = run_sim(path, d / "calib-trace.jsonl", out)
    for x in (path, out):
        x.unlink(missing_ok=True)
    return res


def fit_noise_spec(d: Path, seed: int) -> dict:
    """Fit (see the module docstring) on d/calib-trace.jsonl and d/calib-trace.json; writes
    d/SPEC_NAME and returns what was fitted."""
    from raycluster.sim.cluster import make_predictor
    from raycluster.sim.spec import load_spec

    tcal = yaml.safe_load((d / "local-cpu-trace-calibrated.yaml").read_text())
    real = json.loads((d / "calib-trace.json").read_text())
    base = base_run(tcal, d)
    step = fit_from_samples(trace_ratios(real["requests"], base["requests"]), seed=seed)
    sspec = load_spec({**tcal, "dispatch_latency_s": 0.0})
    disp = fit_dispatch(real["requests"], base["requests"], make_predictor(sspec, sspec.pools[0]), seed=seed)
    spec = {**tcal, "dispatch_latency_s": 0.0, "step_noise": block(step), "dispatch_noise": block(disp)}
    g = bisect(lambda x: scaled(spec, x), d / "calib-trace.jsonl", lambda r: r["summary"]["tpot_p50_s"],
               real["summary"]["tpot_p50_s"], d, seed * 1000, hi=2.0)
    spec = scaled(spec, g)
    spec["step_overhead_s"] = round(spec["step_overhead_s"], 6)
    spec["step_overhead_per_seq_s"] = round(spec["step_overhead_per_seq_s"], 7)
    (d / SPEC_NAME).write_text(
        "# local-cpu-trace-calibrated.yaml + step-time and dispatch-latency variability fitted on calib-trace.jsonl "
        f"(sim/s2r_noise.py), step overheads x {g:.3f}\n" + yaml.safe_dump(spec, sort_keys=False))
    return {"step_noise": step, "dispatch_noise": disp, "level_scale": g, "step_overhead_s": spec["step_overhead_s"],
            "step_overhead_per_seq_s": spec["step_overhead_per_seq_s"]}


def noise_column(d: Path, seed: int, cal: dict) -> dict[str, dict]:
    """Fit, then the test trace: {"sim_noise": pooled results}; the fit goes to cal["noise_fit"]."""
    cal["noise_fit"] = fit_noise_spec(d, seed)
    spec = yaml.safe_load((d / SPEC_NAME).read_text())
    return {"sim_noise": run_replicas(spec, d / "trace.jsonl", d / "sim-noise-calibrated.json", TEST_REPS,
                                      seed * 1000 + 500)}
