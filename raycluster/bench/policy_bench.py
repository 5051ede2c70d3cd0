"""Scheduler decision time per policy and queue size.

A decision is what the engine does per scheduled prefill: pop the top request, report a chunk
of progress (`on_progress`), push it back (or `on_finish` it when its prefill is done), plus
one newly arriving request pushed. The queue is filled to n first (1k, 10k, 100k), the virtual
clock advances 1 ms per decision so time-dependent orders (lars, kairos) really move.
The garbage collector is off while timing (see bench_one).

    python -m raycluster.bench.policy_bench --out bench.json [--sizes 1000 10000 100000]
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
    pool = [_request(rng, i, 0.0) for i in range(n + decisions + 64)]
    for r in pool[:n]:
        pol.push(r)
    nxt = n
    samples = []
    # Collector pauses over 100k live requests would dominate the tail and measure Python, not
    # the policy: collect once, then keep the collector off while timing.
    gc.collect()
    gc.disable()
    for _ in range(decisions + 64):
        clock.advance(1e-3)
        new = pool[nxt]
        new.arrival_time = clock.now()
        nxt += 1
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
    gc.enable()
    samples = sorted(samples[64:])         # drop warm-up
    return {"policy": name, "queued": n, "decisions": decisions,
            "mean_us": statistics.fmean(samples) / 1e3,
            "p50_us": samples[len(samples) // 2] / 1e3,
            "p99_us": samples[int(len(samples) * 0.99)] / 1e3}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--sizes", type=int, nargs="+", default=[1_000, 10_000, 100_000])
    ap.add_argument("--decisions", type=int, default=3_000)
    ap.add_argument("--policies", nargs="+", default=policy_names())
    args = ap.parse_args(argv)
    rows = []
    for name in args.policies:
        for n in args.sizes:
            row = bench_one(name, n, args.decisions)
            rows.append(row)
            print(f"{name:9s} n={n:>7d}  mean {row['mean_us']:7.1f} us  p50 {row['p50_us']:7.1f}"
                  f"  p99 {row['p99_us']:7.1f}", flush=True)
    with open(args.out, "w") as f:
        json.dump({"decision": "pop + on_progress + push(top) + push(new)", "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
