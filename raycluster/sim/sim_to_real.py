"""Sim-to-real: one trace on the real local cluster and in the simulator, per class P50/P90 TTFT
and TPOT side by side.

    python -m raycluster.sim.sim_to_real --out-dir DIR [--qps 2] [--duration 60] [--seed 1[,2,...]]
        [--long-fraction 0.15] [--long-tokens 1024:2048] [--max-output-tokens 64]
        [--spec sims/local-cpu.yaml] [--sim-only]

Per seed (DIR/seed<N>/):
1. `trace.jsonl`: a loadgen `long-mix` trace (ShareGPT-shaped chat turns plus a fraction of
   long prompts, outputs clipped), and `calib.jsonl`: calibration requests from another seed:
   lone requests (prompts of 16-512 tokens, 32 output tokens, 1.2 s apart, so nothing queues)
   and bursts of 4 and 8 requests of 64 tokens sent together.
2. A fresh local Ray cluster in a child process (127.0.0.1, no dashboard, its own temp dir) with
   the topology of deployments/local.yaml (one mixed instance, policy lars) and
   threads_per_instance=1. `loadgen run --prompt-format ids` replays `calib.jsonl` first
   (-> `calib.json`), then `trace.jsonl` (-> `real.json`); then the cluster is torn down.
   `host_load.json`: the host's load averages around the two replays.
3. Calibration (`calibrate`): TPOT minus the profiled predictor's decode step time, per burst
   size k, is engine work per step outside the model: a line through k = 1, 4, 8 gives
   `step_overhead_s` (per step) and `step_overhead_per_seq_s` (per sequence in the step); over
   lone requests, TTFT minus the predicted prefill step minus one step's overhead is the
   serving path's fixed latency (`dispatch_latency_s`: HTTP/SSE client, gateway, router
   messaging). Lower quartiles over the calibration requests (other processes on the shared
   host only add time, in bursts; medians are saved too). Never fitted on the test trace.
4. The simulator on `trace.jsonl` twice: the spec as is (`sim.json`, the idealised cluster) and
   with the measured overheads (`sim-calibrated.json`, spec in `local-cpu-calibrated.yaml`).
   With `--calib-trace` also: `sim_tcal` (fit_on_trace: the overheads scaled so the calibration
   trace's TPOT P50 matches, dispatch latency = its median TTFT gap), and `sim_noise`, the real
   cluster's variability on top (sim/s2r_noise.py, fitted on the calibration trace only): step
   times x an empirical, time-correlated multiplier (spec `step_noise`), per-request dispatch
   latencies drawn from a measured distribution (`dispatch_noise`), the step overheads' level
   refitted; 8 seeded replicas pooled into `sim-noise-calibrated.json` (spec in
   `local-cpu-noise-calibrated.yaml`).
5. `compare.json` and the printed table: per class (short, long) P50/P90 TTFT and TPOT, real vs
   each sim, rel. diff = (sim - real) / real; `within` = |rel. diff| <= 15% (the issue's target).
DIR/summary.json gathers every seed (docs/results.md's `sim-to-real` section reads it).
`--sim-only` reuses the real results already in DIR (re-runs calibration fit and the sims).
All three results files share loadgen's schema: `loadgen report DIR/seed1/real.json
DIR/seed1/sim-calibrated.json` compares them too.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

TARGET = 0.15
METRICS = ("ttft_p50_s", "ttft_p90_s", "tpot_p50_s", "tpot_p90_s")
CLASSES = ("short", "long")
CLUSTER = {"model": "tiny", "threads_per_instance": 1, "policy": "lars",
           "pools": [{"role": "mixed", "instances": 1}]}
CALIB_PROMPTS = (16, 64, 256, 512)      # lone requests; <= chunk_size: one prefill step each
CALIB_BURSTS = (4, 8)                   # k requests of CALIB_BURST_PROMPT tokens sent together
CALIB_BURST_PROMPT = 64
CALIB_OUTPUT = 32
CALIB_GAP_S = 1.2
CALIB_BURST_GAP_S = 1.6
CALIB_REPEATS = 4
CALIB_WARMUP = 4
CALIB_TRACE_SEED = 1000


# ---- traces ----------------------------------------------------------------------------------------
def write_traces(args, seed: int, d: Path) -> None:
    from loadgen.trace import write_trace
    from loadgen.workloads import WorkloadRequest, make_workload

    wl = make_workload("long-mix", seed=seed, qps=args.qps, duration=args.duration,
                       long_fraction=args.long_fraction, long_tokens=args.long_tokens,
                       max_output_tokens=args.max_output_tokens, ttft_slo_ms=2000.0, tpot_slo_ms=100.0)
    write_trace(wl, d / "trace.jsonl")
    if getattr(args, "calib_trace", False):     # same workload, another seed: the trace calibration
        write_trace(make_workload("long-mix", seed=CALIB_TRACE_SEED + seed, qps=args.qps, duration=args.duration,
                                  long_fraction=args.long_fraction, long_tokens=args.long_tokens,
                                  max_output_tokens=args.max_output_tokens, ttft_slo_ms=2000.0, tpot_slo_ms=100.0),
                    d / "calib-trace.jsonl")
    import numpy as np
    rng = np.random.default_rng(10_000 + seed)
    calib, t, i = [], 0.0, 0

    def add(k: int, n: int, gap: float) -> None:
        nonlocal t, i
        for _ in range(k):
            calib.append(WorkloadRequest(request_id=f"calib{i:03d}k{k}", arrival_s=t, prompt_tokens=n,
                                         output_tokens=CALIB_OUTPUT,
                                         segments=((int(rng.integers(0, 2**31 - 1)), n),)))
            i += 1
        t += gap

    for _ in range(CALIB_WARMUP):
        add(1, CALIB_PROMPTS[0], CALIB_GAP_S)
    for _ in range(CALIB_REPEATS):
        for n in CALIB_PROMPTS:
            add(1, n, CALIB_GAP_S)
        for k in CALIB_BURSTS:
            add(k, CALIB_BURST_PROMPT, CALIB_BURST_GAP_S)
    write_trace(calib, d / "calib.jsonl")


def loadgen_argv(url: str, trace: Path, out: Path, warmup_requests: int = 0) -> list[str]:
    return [sys.executable, "-m", "loadgen.cli", "run", "--url", url, "--workload", str(trace),
            "--prompt-format", "ids", "--timeout", "300", "--warmup-requests", str(warmup_requests),
            "--quiet", "--out", str(out)]


def real_child(d: Path, seed: int) -> int:
    """In a child process: fresh local cluster, calibration replay, test-trace replay, teardown."""
    from raycluster.bench.cluster_bench import local_cluster
    from raycluster.ports import free_port

    cfg = {**CLUSTER, "router_name": f"router-s2r-{seed}"}
    with tempfile.TemporaryDirectory(prefix="s2r-", dir="/tmp") as tmp:
        os.environ["RAY_TMPDIR"] = tmp
        with local_cluster(cfg, free_port(), tmp) as (url, _router):
            load = {"start": os.getloadavg()}      # 1/5/15-min load averages: how busy the host was
            files = {"calib": "calib.jsonl", "calib-trace": "calib-trace.jsonl", "real": "trace.jsonl"}
            for name, warm in (("calib", CALIB_WARMUP), ("calib-trace", 0), ("real", 0)):
                trace = d / files[name]
                if not trace.is_file():
                    continue
                t0 = time.monotonic()
                p = subprocess.run(loadgen_argv(url, trace, d / f"{name}.json", warm), timeout=900)
                print(f"sim_to_real seed {seed}: {name} replay exited {p.returncode} after "
                      f"{time.monotonic() - t0:.0f} s", flush=True)
                load[f"after_{name}"] = os.getloadavg()
                (d / "host_load.json").write_text(json.dumps(load))
                if p.returncode:
                    return p.returncode
    return 0


# ---- calibration -----------------------------------------------------------------------------------
def lower_quartile(xs: list[float]) -> float:
    return statistics.quantiles(xs, n=4, method="inclusive")[0] if len(xs) >= 2 else xs[0]


def calibrate(requests: list[dict], predictor, stat: str = "q1") -> dict:
    """Serving-path overheads from calibration requests (lone ones and bursts of k sent together).

    Per request, the TPOT residual is TPOT - mean predicted decode step of its batch (k sequences
    at KV length prompt+1 .. prompt+n-1); over the groups k = 1, 4, 8 a line a + b*k through the
    per-k statistic of the residuals gives `step_overhead_s` = a + ... per step and
    `step_overhead_per_seq_s` = b per sequence in the step (both clamped at 0). The dispatch latency
    is, over lone requests, TTFT - predicted prefill step - one step's overhead (a + b). `stat`:
    "q1" (lower quartile, the default) or "median". Load from other processes on the shared host
    only ever adds time and comes in bursts, so the lower quartile estimates the serving path
    itself; the medians are computed too (`median_*`) for comparison. Warm-up and failed
    requests are skipped; the group size k is the `k<N>` suffix of the request id (default 1)."""
    import numpy as np

    aggs = {"q1": lower_quartile, "median": statistics.median}
    lone, resid = [], {}
    for r in requests:
        if r.get("status") != "ok" or r.get("warmup") or r.get("ttft_s") is None:
            continue
        rid = str(r.get("request_id", ""))
        k = int(rid.rsplit("k", 1)[1]) if "k" in rid and rid.rsplit("k", 1)[1].isdigit() else 1
        p, n = int(r["prompt_tokens"]), int(r["num_output_tokens"])
        if n >= 2 and r.get("tpot_s") is not None:
            dec = statistics.fmean(predictor.batch_time([], [p + j] * k) for j in range(1, n))
            resid.setdefault(k, []).append(r["tpot_s"] - dec)
        if k == 1:
            lone.append({"prompt_tokens": p, "ttft_s": r["ttft_s"], "pred_prefill_s": predictor.batch_time([(p, 0)], []),
                         "tpot_s": r.get("tpot_s")})
    if not lone:
        raise ValueError("calibration: no completed lone calibration requests")
    out: dict = {"stat": stat, "n": len(lone) + sum(len(v) for k, v in resid.items() if k != 1),
                 "n_lone": len(lone), "groups": sorted(resid)}
    for name, agg in aggs.items():
        per_k = {k: agg(v) for k, v in sorted(resid.items())}
        if len(per_k) >= 2:
            b, a = np.polyfit(list(per_k), list(per_k.values()), 1)
            a, b = float(a), float(b)
            if b < 0:               # no per-sequence cost visible: one constant per step
                a, b = agg([x for v in resid.values() for x in v]), 0.0
        elif per_k:
            a, b = next(iter(per_k.values())), 0.0
        else:
            a, b = 0.0, 0.0
        a, b = max(0.0, a), max(0.0, b)
        disp = [x["ttft_s"] - x["pred_prefill_s"] - (a + b) for x in lone]
        by_len: dict[int, list[float]] = {}
        for x, v in zip(lone, disp):
            by_len.setdefault(x["prompt_tokens"], []).append(v)
        pre = "" if name == stat else f"{name}_"
        out.update({f"{pre}step_overhead_s": a, f"{pre}step_overhead_per_seq_s": b,
                    f"{pre}dispatch_latency_s": max(0.0, agg(disp)),
                    f"{pre}tpot_residual_by_k_s": {str(k): v for k, v in per_k.items()},
                    f"{pre}ttft_residual_by_prompt_s": {str(k): agg(v) for k, v in sorted(by_len.items())}})
    return out


def _p10p90(xs: list[float]) -> list[float] | None:
    if len(xs) < 2:
        return None
    q = statistics.quantiles(xs, n=10)
    return [q[0], q[-1]]


# ---- comparison ------------------------------------------------------------------------------------
def rel_diff(real: float | None, sim: float | None) -> float | None:
    if real is None or sim is None or real <= 0:
        return None
    return (sim - real) / real


def compare(real: dict, sims: dict[str, dict], target: float = TARGET) -> dict:
    """Per class and metric: the real value, each sim's value and rel. diff, and whether it is
    within `target`; per sim the count of cells within target. `sims` maps name -> results JSON."""
    rows, within = [], {name: [0, 0] for name in sims}
    for klass in CLASSES:
        rc = real.get("by_class", {}).get(klass)
        if not rc:
            continue
        for m in METRICS:
            row = {"class": klass, "metric": m, "real": rc.get(m), "n_real": rc.get("completed")}
            for name, res in sims.items():
                v = res.get("by_class", {}).get(klass, {}).get(m)
                d = rel_diff(rc.get(m), v)
                ok = d is not None and abs(d) <= target
                row[name] = v
                row[f"{name}_rel"] = d
                row[f"{name}_within"] = ok
                if d is not None:
                    within[name][0] += ok
                    within[name][1] += 1
            rows.append(row)
    return {"target": target, "rows": rows, "within": {k: {"ok": a, "cells": b} for k, (a, b) in within.items()}}


def render(cmp: dict, sims: list[str]) -> str:
    ms = lambda v: "-" if v is None else f"{v * 1000:.1f}"           # noqa: E731
    pc = lambda v: "-" if v is None else f"{v:+.0%}"                  # noqa: E731
    head = "| class | metric | real ms | " + " | ".join(f"{s} ms | rel." for s in sims) + " |"
    out = [head, "|" + "---|" * (3 + 2 * len(sims))]
    for r in cmp["rows"]:
        cells = " | ".join(f"{ms(r.get(s))} | {pc(r.get(s + '_rel'))}" for s in sims)
        out.append(f"| {r['class']} (n={r['n_real']}) | {r['metric'].replace('_s', '')} | {ms(r['real'])} | {cells} |")
    tail = ", ".join(f"{s}: {w['ok']}/{w['cells']}" for s, w in cmp["within"].items())
    out.append(f"\ncells within {cmp['target']:.0%}: {tail}")
    return "\n".join(out)


# ---- simulator -------------------------------------------------------------------------------------
def run_sim(spec_path: Path, trace: Path, out: Path) -> dict:
    from raycluster.sim.cli import main as sim_main

    rc = sim_main(["--cluster", str(spec_path), "--workload", str(trace), "--out", str(out), "--quiet"])
    if rc:
        raise RuntimeError(f"raycluster sim exited {rc}")
    return json.loads(out.read_text())


def fit_on_trace(cal_spec: Path, trace: Path, real: dict, d: Path, iters: int = 7) -> dict:
    """Trace calibration (`--calib-trace`): on the calibration trace (another seed, replayed on
    the same cluster just before the test trace), scale the measured step overheads by f so the
    simulated TPOT P50 over all requests matches the real one (bisection on f in [0, 8]: TPOT
    grows with f), then set dispatch_latency_s to the median over requests of real TTFT - simulated
    TTFT at dispatch 0. Writes local-cpu-trace-calibrated.yaml; the test trace is not looked at."""
    raw = yaml.safe_load(cal_spec.read_text())
    target = real["summary"]["tpot_p50_s"]
    tmp = d / "fit-sim.json"

    def sim_with(f: float, disp: float) -> dict:
        spec = {**raw, "dispatch_latency_s": disp, "step_overhead_s": raw["step_overhead_s"] * f,
                "step_overhead_per_seq_s": raw["step_overhead_per_seq_s"] * f}
        path = d / "fit-spec.yaml"
        path.write_text(yaml.safe_dump(spec, sort_keys=False))
        return run_sim(path, trace, tmp)

    lo, hi = 0.0, 8.0
    for _ in range(iters):                      # bounded: `iters` sims
        mid = (lo + hi) / 2
        if (sim_with(mid, 0.0)["summary"]["tpot_p50_s"] or 0.0) < target:
            lo = mid
        else:
            hi = mid
    f = (lo + hi) / 2
    res = sim_with(f, 0.0)
    simt = {r["request_id"]: r["ttft_s"] for r in res["requests"]}
    diffs = [r["ttft_s"] - simt[r["request_id"]] for r in real["requests"]
             if r.get("ttft_s") is not None and simt.get(r["request_id"]) is not None]
    disp = max(0.0, statistics.median(diffs)) if diffs else 0.0
    spec = {**raw, "dispatch_latency_s": round(disp, 6), "step_overhead_s": round(raw["step_overhead_s"] * f, 6),
            "step_overhead_per_seq_s": round(raw["step_overhead_per_seq_s"] * f, 7)}
    (d / "local-cpu-trace-calibrated.yaml").write_text(
        f"# {cal_spec.name} with its step overheads x {f:.3f} and dispatch latency fitted on calib-trace.jsonl\n"
        + yaml.safe_dump(spec, sort_keys=False))
    for x in (tmp, d / "fit-spec.yaml"):
        x.unlink(missing_ok=True)
    return {"scale": f, "dispatch_latency_s": spec["dispatch_latency_s"], "step_overhead_s": spec["step_overhead_s"],
            "step_overhead_per_seq_s": spec["step_overhead_per_seq_s"], "calib_trace_tpot_p50_s": target}


def one_seed(args, seed: int) -> dict | None:
    from raycluster.sim.cluster import cpu_predictor
    from raycluster.sim.s2r_noise import noise_column
    from raycluster.sim.spec import load_spec

    d = Path(args.out_dir) / f"seed{seed}"
    d.mkdir(parents=True, exist_ok=True)
    if not args.sim_only:
        write_traces(args, seed, d)
        cmd = [sys.executable, "-m", "raycluster.sim.sim_to_real", "--real-child", str(d), "--seed", str(seed),
               "--out-dir", args.out_dir]
        if not args.calib_trace:
            (d / "calib-trace.jsonl").unlink(missing_ok=True)
        env = {k: v for k, v in os.environ.items() if k != "RAY_SERVE_THROUGHPUT_OPTIMIZED"}
        try:
            rc = subprocess.run(cmd, env=env, timeout=args.duration * 6 + 900).returncode
        except subprocess.TimeoutExpired:
            rc = -1
        if rc:
            print(f"sim_to_real seed {seed}: real run failed (exit {rc})", flush=True)
            return None
    real = json.loads((d / "real.json").read_text())
    calib_res = json.loads((d / "calib.json").read_text())
    spec = load_spec(args.spec)
    cal = calibrate(calib_res["requests"], cpu_predictor(spec))
    raw = yaml.safe_load(Path(args.spec).read_text())
    cal_spec = {**raw, "dispatch_latency_s": round(cal["dispatch_latency_s"], 6),
                "step_overhead_s": round(cal["step_overhead_s"], 6),
                "step_overhead_per_seq_s": round(cal["step_overhead_per_seq_s"], 7)}
    (d / "local-cpu-calibrated.yaml").write_text(
        f"# {args.spec} + serving-path overheads measured from {d / 'calib.json'} (lone requests)\n"
        + yaml.safe_dump(cal_spec, sort_keys=False))
    sims = {"sim": run_sim(Path(args.spec), d / "trace.jsonl", d / "sim.json"),
            "sim_cal": run_sim(d / "local-cpu-calibrated.yaml", d / "trace.jsonl", d / "sim-calibrated.json")}
    if (d / "calib-trace.json").is_file():
        tcal = fit_on_trace(d / "local-cpu-calibrated.yaml", d / "calib-trace.jsonl",
                            json.loads((d / "calib-trace.json").read_text()), d)
        cal["trace_fit"] = tcal
        sims["sim_tcal"] = run_sim(d / "local-cpu-trace-calibrated.yaml", d / "trace.jsonl", d / "sim-trace-calibrated.json")
        sims.update(noise_column(d, seed, cal))
    cmp = compare(real, sims)
    load = d / "host_load.json"
    out = {"seed": seed, "calibration": cal, "compare": cmp,
           "host_load": json.loads(load.read_text()) if load.is_file() else None,
           "real_summary": {k: real["summary"].get(k) for k in ("completed", "failed", "num_requests",
                                                                "ttft_p50_s", "tpot_p50_s", "output_tok_s")},
           "files": {"trace": str(d / "trace.jsonl"), "real": str(d / "real.json"), "sim": str(d / "sim.json"),
                     "sim_cal": str(d / "sim-calibrated.json"), "calib": str(d / "calib.json")}}
    (d / "compare.json").write_text(json.dumps(out, indent=2))
    print(f"\n== seed {seed}: calibration ({cal['stat']}) step_overhead {cal['step_overhead_s'] * 1000:.2f} ms "
          f"+ {cal['step_overhead_per_seq_s'] * 1000:.3f} ms/seq, dispatch_latency "
          f"{cal['dispatch_latency_s'] * 1000:.2f} ms (n={cal['n']})")
    print(render(cmp, list(sims)))
    return out


def main(argv: list[str] | None = None) -> int:
    from loadgen.cli import parse_range

    ap = argparse.ArgumentParser(prog="python -m raycluster.sim.sim_to_real", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out-dir", required=True)
    ap.add_argument("--qps", type=float, default=2.0)
    ap.add_argument("--duration", type=float, default=60.0)
    ap.add_argument("--seed", default="1", help="one seed or a comma list (one fresh cluster per seed)")
    ap.add_argument("--long-fraction", type=float, default=0.15)
    ap.add_argument("--long-tokens", type=parse_range, default=(1024, 2048), metavar="MIN:MAX")
    ap.add_argument("--max-output-tokens", type=int, default=64)
    ap.add_argument("--spec", default="sims/local-cpu.yaml")
    ap.add_argument("--calib-trace", action="store_true",
                    help="also replay a calibration trace (seed + 1000) before the test trace and fit the overheads "
                         "on it (third column sim_tcal)")
    ap.add_argument("--sim-only", action="store_true", help="reuse DIR's real runs; redo calibration fit and sims")
    ap.add_argument("--real-child", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    seeds = [int(s) for s in str(args.seed).split(",") if s.strip()]
    if args.real_child:
        return real_child(Path(args.real_child), seeds[0])
    os.makedirs(args.out_dir, exist_ok=True)
    runs = {}
    for seed in seeds:
        r = one_seed(args, seed)
        if r is not None:
            runs[str(seed)] = r
    summary = {"meta": {"argv": sys.argv if argv is None else argv, "qps": args.qps, "duration_s": args.duration,
                        "seeds": seeds, "workload": "long-mix", "long_fraction": args.long_fraction,
                        "long_tokens": list(args.long_tokens), "max_output_tokens": args.max_output_tokens,
                        "spec": args.spec, "cluster": CLUSTER, "target": TARGET, "calib_trace": args.calib_trace,
                        "calibration_trace": {"prompts": CALIB_PROMPTS, "output_tokens": CALIB_OUTPUT,
                                              "gap_s": CALIB_GAP_S, "repeats": CALIB_REPEATS,
                                              "bursts": CALIB_BURSTS, "burst_prompt": CALIB_BURST_PROMPT,
                                              "burst_gap_s": CALIB_BURST_GAP_S, "warmup": CALIB_WARMUP},
                        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())},
               "runs": runs}
    prev = Path(args.out_dir) / "summary.json"
    if args.sim_only and prev.is_file():      # keep seeds not re-done this time, and the real runs' meta
        old = json.loads(prev.read_text())
        summary["runs"] = {**old.get("runs", {}), **runs}
        summary["meta"] = {**old.get("meta", {}), "refit": summary["meta"]["date"]}
    prev.write_text(json.dumps(summary, indent=2))
    print(f"\nwrote {prev}")
    return 0 if len(runs) == len(seeds) else 1


if __name__ == "__main__":
    sys.exit(main())
