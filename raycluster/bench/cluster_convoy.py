"""The convoy demonstration on the real cluster: one loadgen long-mix trace replayed over HTTP
against each (topology, policy), side by side in one run.

    python -m raycluster.bench.cluster_convoy --out-dir DIR [--configs mixed-fcfs,mixed-lars,pd-fcfs,pd-lars,mixed-fcfs-np]
        [--qps 0.5] [--duration 300] [--long-tokens 12288:24576] [--max-output-tokens 64] [--seed 0]
        [--ttft-slo-ms 500] [--long-ttft-ms-per-token 3] [--tpot-ms 100]

The defaults are the setting of docs/benchmarks.md section 3e: long prompts 60-120x a chat
prompt (Medha's are 128K-1M tokens), since with two instances and placement by prefill backlog a
convoy forms only while both instances prefill long prompts; deadlines of 3 ms per prompt token,
which one long prompt alone meets on this CPU (as 1 ms per token does on the seed's GPUs); a short
prompt's TTFT SLO of 500 ms. Each configuration takes about 5-7 minutes.

Configurations (threads_per_instance=1 everywhere: mixed has 2 instances, pd 3, on 2 cores):
- `mixed-fcfs`: 2 mixed instances, router + engine policy fcfs, packer token, chunk_size 2048
  (a long prefill takes the whole 2048-token budget, as vLLM's default scheduler does);
- `mixed-fcfs-np`: the same with non-preemptive prefill (chunk_size and step budget 16384
  tokens: a long prompt takes one step, and shorts wait all of it), the baseline of Medha's
  30x / 174x claims;
- `mixed-lars`: 2 mixed instances, policy lars, Medha time-budget packer;
- `pd-fcfs` / `pd-lars`: deployments/pd.yaml (prefill-short, prefill-long, decode; object_store
  KV; initial_l_m 1024) with the same two policy settings on the prefill pools (the decode pool
  keeps its own fcfs/token override from pd.yaml).
`--tpot-ms` is every instance's TPOT SLO (`EngineConfig.tpot_ms`), which is also the Medha
packer's step budget, and the TPOT SLO the requests carry; the token packer ignores it. Under
lars a short prompt that arrives mid-step waits for that step and then runs in the next, so its
TTFT tail is about two step budgets.
Each configuration runs in a child process (fresh local Ray, 127.0.0.1, no dashboard, temp dir
under /tmp) that starts the cluster, runs `loadgen run --prompt-format ids` (same seed: the same
trace), writes DIR/<config>.json and tears the cluster down. Then `loadgen report` over all of
them, and DIR/summary.json with short-request TTFT P50/P99 and the fcfs/lars ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

FCFS = {"policy": "fcfs", "engine": {"packer": "token", "chunk_size": 2048}}
# Non-preemptive FCFS (Medha's baseline): a whole prompt, up to 16K tokens, prefills in one step.
FCFS_NP = {"policy": "fcfs", "engine": {"packer": "token", "chunk_size": 16384, "max_num_batched_tokens": 16384}}
LARS = {"policy": "lars", "engine": {"packer": "medha"}}
MIXED = {"pools": [{"role": "mixed", "instances": 2}]}
PD = {"connector": "object_store", "initial_l_m": 1024,
      "pools": [{"role": "prefill-short", "instances": 1}, {"role": "prefill-long", "instances": 1},
                {"role": "decode", "instances": 1, "engine": {"policy": "fcfs", "packer": "token"}}]}
CONFIGS = {"mixed-fcfs": {**MIXED, **FCFS}, "mixed-lars": {**MIXED, **LARS},
           "pd-fcfs": {**PD, **FCFS}, "pd-lars": {**PD, **LARS}, "mixed-fcfs-np": {**MIXED, **FCFS_NP}}
BASE = {"model": "tiny", "threads_per_instance": 1}


def loadgen_argv(args, url: str, out: str) -> list[str]:
    return [sys.executable, "-m", "loadgen.cli", "run", "--url", url, "--workload", "long-mix",
            "--qps", str(args.qps), "--duration", str(args.duration), "--seed", str(args.seed),
            "--long-fraction", str(args.long_fraction), "--long-tokens", args.long_tokens,
            "--max-output-tokens", str(args.max_output_tokens), "--prompt-format", "ids",
            "--ttft-slo-ms", str(args.ttft_slo_ms), "--tpot-slo-ms", str(args.tpot_ms),
            "--long-ttft-ms-per-token", str(args.long_ttft_ms_per_token),
            "--timeout", "300", "--quiet", "--out", out]


def cluster_config(name: str, tpot_ms: float) -> dict:
    """ClusterConfig fields of configuration `name` with every instance's TPOT SLO (the Medha
    step budget) set to `tpot_ms`; pool-level engine overrides still win."""
    base = CONFIGS[name]
    return {**BASE, **base, "engine": {**base.get("engine", {}), "tpot_ms": tpot_ms},
            "router_name": f"router-{name}"}


def one(args) -> int:
    from raycluster.bench.cluster_bench import local_cluster
    from raycluster.ports import free_port

    cfg = cluster_config(args.config, args.tpot_ms)
    out = os.path.join(args.out_dir, f"{args.config}.json")
    with tempfile.TemporaryDirectory(prefix="rcc-", dir="/tmp") as tmp:
        os.environ["RAY_TMPDIR"] = tmp
        with local_cluster(cfg, free_port(), tmp) as (url, router):
            t0, load0 = time.monotonic(), os.getloadavg()[0]
            p = subprocess.run(loadgen_argv(args, url, out), timeout=args.duration * 4 + 400)
            print(f"convoy {args.config}: loadgen exited {p.returncode} after {time.monotonic() - t0:.0f} s", flush=True)
            # The host is shared: the 1-minute load average around each run says how comparable they are.
            with open(os.path.join(args.out_dir, f"{args.config}.load.json"), "w") as fh:
                json.dump({"loadavg_1m_start": load0, "loadavg_1m_end": os.getloadavg()[0]}, fh)
            return p.returncode


def short_ttft(path: str) -> dict:
    with open(path) as fh:
        res = json.load(fh)
    s = res.get("by_class", {}).get("short", {})
    l = res.get("by_class", {}).get("long", {})
    return {"short_ttft_p50_s": s.get("ttft_p50_s"), "short_ttft_p99_s": s.get("ttft_p99_s"),
            "long_ttft_p50_s": l.get("ttft_p50_s"), "long_ttft_p99_s": l.get("ttft_p99_s"),
            "short_n": s.get("completed"), "long_n": l.get("completed"),
            "short_ttft_over_1s": sum(1 for r in res.get("requests", [])
                                      if r.get("klass") == "short" and (r.get("ttft_s") or 0) > 1.0),
            "summary": {k: v for k, v in res.get("summary", {}).items() if not isinstance(v, (dict, list))}}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m raycluster.bench.cluster_convoy", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out-dir", required=True)
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--qps", type=float, default=0.5)
    ap.add_argument("--duration", type=float, default=300.0)
    ap.add_argument("--long-fraction", type=float, default=0.05)
    ap.add_argument("--long-tokens", default="12288:24576")
    ap.add_argument("--max-output-tokens", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--ttft-slo-ms", type=float, default=500.0,
                    help="TTFT SLO the requests carry (lars orders by it; fcfs ignores it)")
    ap.add_argument("--long-ttft-ms-per-token", type=float, default=3.0,
                    help="a long prompt's TTFT SLO is max(--ttft-slo-ms, this x its prompt tokens): "
                         "Medha's 1 ms/token suits its GPUs; a prompt that cannot meet its deadline "
                         "even alone is overdue from arrival and lars then serves it ahead of shorts")
    ap.add_argument("--tpot-ms", type=float, default=100.0,
                    help="every instance's TPOT SLO, also the Medha packer's step budget (s/1000)")
    ap.add_argument("--config", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    os.makedirs(args.out_dir, exist_ok=True)
    if args.config:
        return one(args)

    from raycluster.bench.cluster_bench import config_names, run_configs

    names = config_names(ap, args.configs, CONFIGS)
    env = {k: v for k, v in os.environ.items() if k != "RAY_SERVE_THROUGHPUT_OPTIMIZED"}
    done = run_configs("raycluster.bench.cluster_convoy", names,
                       lambda n: ["--out-dir", args.out_dir, "--qps", str(args.qps), "--duration", str(args.duration),
                                  "--long-fraction", str(args.long_fraction), "--long-tokens", args.long_tokens,
                                  "--max-output-tokens", str(args.max_output_tokens), "--seed", str(args.seed),
                                  "--ttft-slo-ms", str(args.ttft_slo_ms), "--tpot-ms", str(args.tpot_ms),
                                  "--long-ttft-ms-per-token", str(args.long_ttft_ms_per_token)],
                       lambda n: os.path.join(args.out_dir, f"{n}.json"), args.duration * 4 + 700, env=env)
    summary: dict = {"meta": {"argv": sys.argv, "qps": args.qps, "duration_s": args.duration, "seed": args.seed,
                              "ttft_slo_ms": args.ttft_slo_ms, "tpot_ms": args.tpot_ms,
                              "long_ttft_ms_per_token": args.long_ttft_ms_per_token,
                              "long_tokens": args.long_tokens, "long_fraction": args.long_fraction,
                              "max_output_tokens": args.max_output_tokens, "threads_per_instance": 1,
                              "configs": {n: CONFIGS[n] for n in names}}, "runs": {}}
    for name in done:
        summary["runs"][name] = short_ttft(os.path.join(args.out_dir, f"{name}.json"))
        load = os.path.join(args.out_dir, f"{name}.load.json")
        if os.path.exists(load):
            with open(load) as fh:
                summary["runs"][name]["host_load"] = json.load(fh)
    for topo in ("mixed", "pd"):
        for base in ("fcfs", "fcfs-np"):
            f, l = summary["runs"].get(f"{topo}-{base}"), summary["runs"].get(f"{topo}-lars")
            if f and l:
                summary[f"ratio_{topo}_{base}_over_lars"] = {
                    k: (f[k] / l[k] if f.get(k) and l.get(k) else None) for k in ("short_ttft_p50_s", "short_ttft_p99_s")}
    with open(os.path.join(args.out_dir, "summary.json"), "w") as fh:
        json.dump(summary, fh, indent=2)
    for name, r in summary["runs"].items():
        print(f"{name:11s} short TTFT p50 {r['short_ttft_p50_s']} p99 {r['short_ttft_p99_s']} "
              f"long p50 {r['long_ttft_p50_s']} p99 {r['long_ttft_p99_s']}")
    for k, v in summary.items():
        if k.startswith("ratio_"):
            print(f"{k}: {v}")
    if done:
        subprocess.run([sys.executable, "-m", "loadgen.cli", "report",
                        *[os.path.join(args.out_dir, f"{n}.json") for n in done]], timeout=120)
    return 0 if len(done) == len(names) else 1


if __name__ == "__main__":
    sys.exit(main())
