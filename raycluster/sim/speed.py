"""Simulator speed benchmark (issue 6): wall seconds per simulated hour at a given load.

Owns the measurement only. One workload (default: chat at the speed spec's saturation QPS) runs
through a `SimCluster` per decode path; the clock is read at virtual time `--warm` and again at
`--until`, so start-up and ramp-up are not counted, and the steady-state cost is extrapolated to
one simulated hour. Paths alternate in one process (fast, exact, fast, ...) so machine noise hits
both; the ratio is what to quote, not an absolute time.

    python -m raycluster.sim.speed --cluster sims/speed-128xh100.yaml --qps 700 --warm 10 --until 20 \
        [--paths fast,exact,runs] [--repeat 1] [--out speed.json]

Per path: wall and CPU seconds of the window, events processed in it and events/s, steps,
simulated seconds per wall second, wall seconds per simulated hour (window-extrapolated).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from loadgen.workloads import make_workload
from raycluster.sim.cluster import SimCluster
from raycluster.sim.gcquiet import quiet_gc
from raycluster.sim.spec import load_spec

PATHS = {"fast": ({"coalesce_decode": False}, True), "exact": ({"coalesce_decode": False}, False),
         "runs": ({"coalesce_decode": True}, False)}


def measure(spec, path: str, workload: str, qps: float, seed: int, warm: float, until: float) -> dict:
    update, fast = PATHS[path]
    wl = make_workload(name=workload, seed=seed, qps=qps, duration=until + 1.0)
    cluster = SimCluster(spec.model_copy(update=update), wl, fast_decode=fast)
    cluster.loop.run(until=warm)
    with quiet_gc():              # as SimCluster.run does
        ev0, steps0 = cluster.loop.processed, sum(i.steps for i in cluster.instances.values())
        w0, c0 = time.perf_counter(), time.process_time()
        cluster.loop.run(until=until)
        wall, cpu = time.perf_counter() - w0, time.process_time() - c0
    ev = cluster.loop.processed - ev0
    span = until - warm
    scheds = [i.scheduler for i in cluster.instances.values()]
    grouped = {"group_steps": sum(getattr(s, "group_steps", 0) for s in scheds),
               "group_dissolved": sum(getattr(s, "dissolved", 0) for s in scheds),
               "preemptions": sum(s.preempted_total for s in scheds),
               "decoding_at_end": sum(len(s.decoding) for s in scheds)}
    return {"path": path, "window_s": [warm, until], "wall_s": wall, "cpu_s": cpu, "events": ev,
            "events_per_s": ev / wall, "steps": sum(i.steps for i in cluster.instances.values()) - steps0,
            "output_tokens": cluster.tokens_out, "completed": cluster.done,
            "sim_s_per_wall_s": span / wall, "wall_s_per_sim_hour": wall / span * 3600.0,
            "cpu_s_per_sim_hour": cpu / span * 3600.0, "decode_path": "fast" if cluster.fast_decode else path,
            **grouped}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m raycluster.sim.speed", description=__doc__.split("\n")[0])
    ap.add_argument("--cluster", default="sims/speed-128xh100.yaml")
    ap.add_argument("--workload", default="chat")
    ap.add_argument("--qps", type=float, default=700.0)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--warm", type=float, default=10.0, help="virtual seconds before the window")
    ap.add_argument("--until", type=float, default=20.0, help="virtual end of the window")
    ap.add_argument("--paths", default="fast,exact")
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    spec = load_spec(args.cluster)
    rows = []
    for _ in range(args.repeat):
        for path in args.paths.split(","):
            r = measure(spec, path, args.workload, args.qps, args.seed, args.warm, args.until)
            rows.append(r)
            print(f"{path:6s} window {args.warm:g}-{args.until:g} s: wall {r['wall_s']:.2f} s cpu {r['cpu_s']:.2f} s, "
                  f"{r['events']} events ({r['events_per_s']:.0f}/s), {r['steps']} steps, "
                  f"{r['wall_s_per_sim_hour'] / 60:.1f} wall min per simulated hour; {r['decoding_at_end']} decoding, "
                  f"{r['preemptions']} preemptions, group dissolved {r['group_dissolved']}x", flush=True)
    by = {p: [r for r in rows if r["path"] == p] for p in args.paths.split(",")}
    if "fast" in by and "exact" in by:
        ratio = sum(r["cpu_s"] for r in by["exact"]) / sum(r["cpu_s"] for r in by["fast"])
        print(f"exact/fast CPU time ratio: {ratio:.2f}x")
    if args.out:
        Path(args.out).write_text(json.dumps({"argv": sys.argv[1:], "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
