"""Scheduler decision time per policy and queue size.

A decision is what the engine does per scheduled prefill: pop the top request, report a chunk
of progress (`on_progress`), push it back (or `on_finish` it when its prefill is done), plus
one newly arriving request pushed. The queue is filled to n first (1k, 10k, 100k), all
arriving at time 0 (a burst: the hardest case for the time-dependent orders of lars and kairos,
whose lines all cross in the first seconds), then the virtual clock advances 1 ms per decision
so those orders really move. The garbage collector is off while timing (see bench_one).

The window is max(3000, n / 2) decisions by default: kairos re-keys its whole queue once every
~n queue operations (about n / 2.5 decisions, O(n log n) at once), so a shorter window at 100k
would hold one whole re-key (the fill's pushes count towards it) in a tenth of its period and
report 10x its amortized cost; `--decisions 3000` gives the fixed window. `--repeats R` runs
every (policy, size) R times, policies interleaved, and reports the median of each statistic
(the machine is shared: single runs are noisy). Each decision is timed twice: wall clock
(`mean_us`, ...) and the thread's CPU time (`cpu_mean_us`, ...; clock_gettime, about 0.5 us
of its own), which leaves out the time the process spends descheduled on a busy machine.

    python -m raycluster.bench.policy_bench --out bench.json [--sizes 1000 10000 100000]
        [--policies edf lars kairos] [--decisions N] [--repeats R]
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import time

from raycluster.clock import VirtualClock
from raycluster.request import SLO, Request
from raycluster.sched.base import PolicyContext
from raycluster.sched.predictor import LinearBatchPredictor
from raycluster.sched.registry import make_policy, policy_names

CHUNK = 512
PREDICTOR = LinearBatchPredictor(overhead_s=2e-3, per_prefill_token_s=6e-5, per_attn_pair_s=1e-9)


def _request(rng: random.Random, i: int, now: float) -> Request:
    prompt = int(rng.lognormvariate(7.0, 1.2)) + 1
    slo = SLO(ttft_s=rng.choice([None, 0.5, 2.0, 10.0]))
    return Request(f"r{i}", [1] * prompt, arrival_time=now, slo=slo, tenant=f"t{i % 16}",
                   app_id=f"a{i % 997}", expected_output_tokens=rng.randint(16, 512))


def bench_one(name: str, n: int, decisions: int, seed: int = 0) -> dict:
    rng = random.Random(seed)
    clock = VirtualClock()
    pol = make_policy(name, PolicyContext(clock, PREDICTOR, num_slots=8))
    for i in range(n):
        pol.push(_request(rng, i, 0.0))
    nxt = n
    samples, cpu = [], []
    # Collector pauses over 100k live requests would dominate the tail and measure Python, not
    # the policy: collect once, then keep the collector off while timing.
    gc.collect()
    gc.disable()
    for _ in range(decisions + 64):
        clock.advance(1e-3)
        new = _request(rng, nxt, clock.now())     # made outside the timed part, in seed order
        nxt += 1
        c0 = time.thread_time_ns()
        t0 = time.perf_counter_ns()
        req = pol.pop()
        step = min(CHUNK, req.num_uncomputed_tokens)
        req.num_computed_tokens += step
        pol.on_progress(req, step)
        if req.num_uncomputed_tokens:
            pol.push(req)
        else:
            pol.remove(req.request_id)
            pol.on_finish(req)
        pol.push(new)
        samples.append(time.perf_counter_ns() - t0)
        cpu.append(time.thread_time_ns() - c0)
    gc.enable()
    row = {"policy": name, "queued": n, "decisions": decisions}
    for prefix, xs in (("", samples), ("cpu_", cpu)):
        xs = sorted(xs[64:])         # drop warm-up
        row.update({f"{prefix}mean_us": statistics.fmean(xs) / 1e3,
                    f"{prefix}p50_us": xs[len(xs) // 2] / 1e3,
                    f"{prefix}p99_us": xs[int(len(xs) * 0.99)] / 1e3,
                    f"{prefix}max_us": xs[-1] / 1e3})
    return row


STATS = tuple(f"{p}{k}_us" for p in ("", "cpu_") for k in ("mean", "p50", "p99", "max"))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--sizes", type=int, nargs="+", default=[1_000, 10_000, 100_000])
    ap.add_argument("--decisions", type=int, default=None,
                    help="timed decisions per run (default: max(3000, queued / 2))")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--policies", nargs="+", default=policy_names())
    args = ap.parse_args(argv)
    rows = []
    for n in args.sizes:
        decisions = args.decisions or max(3_000, n // 2)
        runs: dict[str, list[dict]] = {name: [] for name in args.policies}
        for _ in range(args.repeats):
            for name in args.policies:
                runs[name].append(bench_one(name, n, decisions))
        for name in args.policies:
            row = {"policy": name, "queued": n, "decisions": decisions, "repeats": args.repeats}
            row.update({k: statistics.median(r[k] for r in runs[name]) for k in STATS})
            if args.repeats > 1:
                row["runs"] = runs[name]
            rows.append(row)
            print(f"{name:9s} n={n:>7d}  mean {row['mean_us']:7.1f} us  p50 {row['p50_us']:7.1f}"
                  f"  p99 {row['p99_us']:7.1f}  max {row['max_us']:9.1f} | cpu mean"
                  f" {row['cpu_mean_us']:7.1f}  p50 {row['cpu_p50_us']:7.1f}"
                  f"  p99 {row['cpu_p99_us']:7.1f}  ({decisions} decisions, median of"
                  f" {args.repeats})", flush=True)
    with open(args.out, "w") as f:
        json.dump({"decision": "pop + on_progress + push(top) + push(new)", "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
