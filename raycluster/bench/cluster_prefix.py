"""Prefix caching on the real cluster: one multi-turn chat trace (every turn re-sends the
conversation so far) replayed over HTTP against each configuration, side by side in one run.

    python -m raycluster.bench.cluster_prefix --out-dir DIR [--configs nocache,cache-load,cache]
        [--configs pd-cache,pd-cache-prefill-only] [--configs pd2-cache,pd2-cache-load]
        [--qps 0.5] [--duration 90] [--max-output-tokens 32] [--seed 0]

Configurations (deployments/mixed.yaml's topology: 2 mixed instances, lars with the Medha packer,
threads_per_instance=1, on this machine's 2 cores):
- `nocache`: no prefix caching (every turn prefills its whole conversation);
- `cache-load`: `enable_prefix_caching` on every instance, router placement by load alone
  (`prefix_affinity: false`): a turn finds its conversation cached only if it lands where the
  previous turn ran;
- `cache`: caching plus prefix affinity (the router's PrefixIndex sends a turn where its
  conversation probably is, unless that instance is busier by more than the cached part).
- `pd-cache` / `pd-cache-prefill-only` (not in the default set): deployments/pd.yaml's P/D pools
  with caching on every pool, or not on the decode pool. With it, a handoff pulls only the KV
  blocks the decode instance lacks (`decode_reuse_rate`: the share of handed-off tokens whose KV
  it already had).
- `pd2-cache` / `pd2-cache-load` (not in the default set): the same with 2 decode instances,
  handoffs placed by the router's prefix index (`decode_affinity_slack`) or by load alone
  (`prefix_affinity: false`; each prefill pool has one instance, so only decode placement differs).
Each runs in a child process (fresh local Ray, 127.0.0.1, no dashboard) that starts the cluster,
runs `loadgen run --workload multiturn --prompt-format ids` (same seed: the same trace), saves
DIR/<config>.json and the router's final status (prefix-cache counters) in
DIR/<config>.status.json. DIR/summary.json holds TTFT and E2E percentiles per configuration,
the hit rate, and the ratios against `nocache`.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

MIXED = {"model": "tiny", "threads_per_instance": 1, "policy": "lars",
         "pools": [{"role": "mixed", "instances": 2}]}
CONFIGS = {"nocache": {**MIXED},
           "cache-load": {**MIXED, "engine": {"enable_prefix_caching": True}, "prefix_affinity": False},
           "cache": {**MIXED, "engine": {"enable_prefix_caching": True}, "prefix_affinity": True}}
# P/D (deployments/pd.yaml's pools, object_store): caching on both sides, or on the prefill
# pools only; the decode pool's hit tokens are handed-off tokens whose KV was not pulled.
PD = {"model": "tiny", "threads_per_instance": 1, "policy": "lars", "connector": "object_store",
      "initial_l_m": 1024, "engine": {"enable_prefix_caching": True},
      "pools": [{"role": "prefill-short", "instances": 1, "engine": {"packer": "awd"}},
                {"role": "prefill-long", "instances": 1},
                {"role": "decode", "instances": 1,
                 "engine": {"policy": "fcfs", "packer": "token", "decode_selector": "kairos"}}]}
CONFIGS["pd-cache"] = PD
CONFIGS["pd-cache-prefill-only"] = {**PD, "pools": PD["pools"][:2] + [
    {**PD["pools"][2], "engine": {**PD["pools"][2]["engine"], "enable_prefix_caching": False}}]}
# Two caching decode instances: handoffs follow their conversation's prefix, or go by load alone.
PD2 = {**PD, "pools": PD["pools"][:2] + [{**PD["pools"][2], "instances": 2}]}
CONFIGS["pd2-cache"] = PD2
CONFIGS["pd2-cache-load"] = {**PD2, "prefix_affinity": False}
DEFAULT_CONFIGS = "nocache,cache-load,cache"


def loadgen_argv(args, url: str, out: str) -> list[str]:
    return [sys.executable, "-m", "loadgen.cli", "run", "--url", url, "--workload", "multiturn",
            "--qps", str(args.qps), "--duration", str(args.duration), "--seed", str(args.seed),
            "--max-output-tokens", str(args.max_output_tokens), "--prompt-format", "ids",
            "--timeout", "300", "--quiet", "--out", out]


def one(args) -> int:
    import httpx

    from raycluster.bench.cluster_bench import local_cluster
    from raycluster.ports import free_port

    cfg = {**CONFIGS[args.config], "router_name": f"router-{args.config}"}
    out = os.path.join(args.out_dir, f"{args.config}.json")
    with tempfile.TemporaryDirectory(prefix="rcp-", dir="/tmp") as tmp:
        os.environ["RAY_TMPDIR"] = tmp
        with local_cluster(cfg, free_port(), tmp) as (url, _router):
            t0 = time.monotonic()
            p = subprocess.run(loadgen_argv(args, url, out), timeout=args.duration * 6 + 600)
            status = httpx.get(url + "/v1/cluster/status", timeout=30).json()
            with open(os.path.join(args.out_dir, f"{args.config}.status.json"), "w") as fh:
                json.dump(status, fh, indent=2)
            print(f"prefix {args.config}: loadgen exited {p.returncode} after {time.monotonic() - t0:.0f} s",
                  flush=True)
            return p.returncode


def run_summary(out_dir: str, name: str) -> dict:
    with open(os.path.join(out_dir, f"{name}.json")) as fh:
        s = json.load(fh)["summary"]
    with open(os.path.join(out_dir, f"{name}.status.json")) as fh:
        insts = json.load(fh)["instances"]
    q = sum(i.get("prefix_query_tokens", 0) for i in insts if i.get("role") != "decode")
    h = sum(i.get("prefix_hit_tokens", 0) for i in insts if i.get("role") != "decode")
    dq = sum(i.get("prefix_query_tokens", 0) for i in insts if i.get("role") == "decode")
    dh = sum(i.get("prefix_hit_tokens", 0) for i in insts if i.get("role") == "decode")
    keys = ("completed", "failed", "ttft_p50_s", "ttft_p90_s", "ttft_p99_s", "e2e_p50_s", "e2e_p90_s",
            "tpot_p50_s", "output_tok_s")
    return {**{k: s.get(k) for k in keys}, "prefix_hit_rate": h / q if q else None,
            "prefix_hit_tokens": h, "prefix_query_tokens": q,
            "decode_reused_tokens": dh, "decode_handoff_tokens": dq,
            "decode_reuse_rate": dh / dq if dq else None}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m raycluster.bench.cluster_prefix", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out-dir", required=True)
    ap.add_argument("--configs", default=DEFAULT_CONFIGS, help=f"of {','.join(CONFIGS)}")
    ap.add_argument("--qps", type=float, default=0.5, help="conversations started per second")
    ap.add_argument("--duration", type=float, default=90.0)
    ap.add_argument("--max-output-tokens", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--config", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    os.makedirs(args.out_dir, exist_ok=True)
    if args.config:
        return one(args)
    from raycluster.bench.cluster_bench import config_names, run_configs

    names = config_names(ap, args.configs, CONFIGS)
    done = run_configs("raycluster.bench.cluster_prefix", names,
                       lambda n: ["--out-dir", args.out_dir, "--qps", str(args.qps), "--duration", str(args.duration),
                                  "--max-output-tokens", str(args.max_output_tokens), "--seed", str(args.seed)],
                       lambda n: os.path.join(args.out_dir, f"{n}.status.json"), args.duration * 6 + 1200)
    summary: dict = {"meta": {"argv": sys.argv, "qps": args.qps, "duration_s": args.duration, "seed": args.seed,
                              "max_output_tokens": args.max_output_tokens,
                              "configs": {n: CONFIGS[n] for n in names}}, "runs": {}}
    for name in done:
        summary["runs"][name] = run_summary(args.out_dir, name)
    base = summary["runs"].get("nocache")
    for name, r in summary["runs"].items():
        if base and name != "nocache":
            summary[f"ratio_nocache_over_{name}"] = {
                k: (base[k] / r[k] if base.get(k) and r.get(k) else None) for k in ("ttft_p50_s", "ttft_p90_s", "e2e_p50_s")}
    with open(os.path.join(args.out_dir, "summary.json"), "w") as fh:
        json.dump(summary, fh, indent=2)
    for name, r in summary["runs"].items():
        print(f"{name:11s} TTFT p50 {r['ttft_p50_s']} p90 {r['ttft_p90_s']} E2E p50 {r['e2e_p50_s']} "
              f"hit rate {r['prefix_hit_rate']} decode reuse {r['decode_reuse_rate']} "
              f"completed {r['completed']} failed {r['failed']}")
    for k, v in summary.items():
        if k.startswith("ratio_"):
            print(f"{k}: {v}")
    return 0 if len(done) == len(names) else 1


if __name__ == "__main__":
    sys.exit(main())
