"""Profiles the real engine on this machine as an instance does at start, and reports the fit's
error on steps it never saw: the startup report (its own held-out steps), a larger set of
serving-like steps, and a table of reference steps (prefills of 16-1024 tokens at KV 0, decode
batches of 1/4/16 at KV 256 and 2048), predicted vs measured.

    raycluster bench profile [--model tiny] [--threads 1] [--repeats 6] --out predictor.json

All steps are measured in the same interleaved rounds (`raycluster.sched.profile.profile`: each
step's fastest repeat), so a burst of foreign load on the shared host hits fit and test alike.
The output file holds the fitted coefficients (usable as `EngineConfig.predictor`), the errors
and the table.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from raycluster.engine.config import EngineConfig
from raycluster.engine.engine import LLMEngine
from raycluster.engine.profiler import make_run_batch, quick_plan, startup_holdout_plan
from raycluster.model.loader import load_model
from raycluster.model.registry import resolve_model_path
from raycluster.sched.profile import error_report, fit_and_report, profile, serving_plan

REFERENCE_STEPS = [([(q, 0)], []) for q in (16, 64, 256, 512, 1024)] + \
    [([], [kv] * n) for kv in (256, 2048) for n in (1, 4, 16)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="raycluster bench profile", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=6)
    ap.add_argument("--heldout", type=int, default=32, help="serving-like steps kept out of the fit")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    model, _ = load_model(resolve_model_path(args.model))
    eng = LLMEngine(EngineConfig(policy="fcfs", packer="token", predictor="none", kv_cache_tokens=65536), model)
    run = make_run_batch(eng.runner)
    limits = (eng.max_model_len, eng.config.max_num_batched_tokens, eng.config.max_num_seqs)
    fit_plan = quick_plan(*limits, seed=args.seed)
    startup_test = startup_holdout_plan(*limits, seed=args.seed + 1)
    test = serving_plan(args.seed + 2, args.heldout, 1024, 4096, 16)
    plans = [fit_plan, startup_test, test, REFERENCE_STEPS]
    t0 = time.perf_counter()
    samples = profile(run, [s for p in plans for s in p], repeats=args.repeats, warmup=0, seed=args.seed)
    wall = time.perf_counter() - t0
    parts, i = [], 0
    for p in plans:
        parts.append(samples[i:i + len(p)])
        i += len(p)
    predictor, startup = fit_and_report(parts[0], test=parts[1])     # what an instance fits
    rep = error_report(predictor, parts[2])
    report = {"train_samples": len(parts[0]) + len(parts[1]), "startup_heldout_median_rel_err": startup.median_rel,
              "startup_heldout_p90_rel_err": startup.p90_rel, "heldout_samples": rep.n,
              "heldout_median_rel_err": rep.median_rel, "heldout_p90_rel_err": rep.p90_rel,
              "heldout_max_rel_err": rep.max_rel, "threads": args.threads, "repeats": args.repeats,
              "profile_wall_s": wall}
    table = [{"prefills": s.prefills, "decode_kv_lens": s.decode_kv_lens, "measured_s": s.seconds,
              "predicted_s": predictor.batch_time(s.prefills, s.decode_kv_lens)} for s in parts[3]]
    with open(args.out, "w") as fh:
        json.dump({"predictor": predictor.__dict__, "report": report, "reference_steps": table}, fh, indent=2)
    print(json.dumps(report, indent=2))
    for row in table:
        d = row["decode_kv_lens"]
        step = f"prefill {row['prefills'][0][0]}" if row["prefills"] else f"decode {len(d)} x KV {d[0]}"
        print(f"{step:22s} measured {row['measured_s'] * 1e3:8.2f} ms  predicted {row['predicted_s'] * 1e3:8.2f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
