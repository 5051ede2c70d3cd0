"""Profiles the real engine on this machine, fits the batch-time predictor and reports its error on
held-out batches (shapes the fit never saw).

    raycluster bench profile [--model tiny] [--threads 1] [--repeats 3] --out predictor.json

The output file holds the fitted coefficients (usable as `EngineConfig.predictor`) and the
held-out median / P90 / max relative error.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time

import torch

from raycluster.engine.config import EngineConfig
from raycluster.engine.engine import LLMEngine
from raycluster.engine.profiler import make_run_batch, quick_plan
from raycluster.model.loader import load_model
from raycluster.model.registry import resolve_model_path
from raycluster.sched.profile import error_report, fit_predictor, profile


def held_out_plan(seed: int, n: int, max_chunk: int, max_kv: int, max_decodes: int) -> list:
    """Random mixed batches: the kind of step a serving engine actually runs."""
    rng = random.Random(seed)
    plan = []
    for _ in range(n):
        pre = [(rng.randint(1, max_chunk), rng.randint(0, max_kv)) for _ in range(rng.randint(0, 2))]
        dec = [rng.randint(16, max_kv // 2) for _ in range(rng.randint(0 if pre else 1, max_decodes))]
        plan.append((pre, dec))
    return plan


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="raycluster bench profile", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--heldout", type=int, default=24, help="random mixed batches kept out of the fit")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    model, _ = load_model(resolve_model_path(args.model))
    eng = LLMEngine(EngineConfig(policy="fcfs", packer="token", predictor="none", kv_cache_tokens=65536), model)
    run = make_run_batch(eng.runner)
    t0 = time.perf_counter()
    train_plan = quick_plan(eng.max_model_len, 2048, 128, seed=args.seed) + \
        held_out_plan(args.seed + 1, 24, 1024, 8192, 32)
    train = profile(run, train_plan, repeats=args.repeats)
    test = profile(run, held_out_plan(args.seed + 2, args.heldout, 1024, 8192, 32), repeats=args.repeats)
    predictor = fit_predictor(train)
    rep = error_report(predictor, test)
    report = {"train_samples": len(train), "heldout_samples": rep.n, "heldout_median_rel_err": rep.median_rel,
              "heldout_p90_rel_err": rep.p90_rel, "heldout_max_rel_err": rep.max_rel,
              "threads": args.threads, "profile_wall_s": time.perf_counter() - t0}
    with open(args.out, "w") as fh:
        json.dump({"predictor": predictor.__dict__, "report": report}, fh, indent=2)
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
