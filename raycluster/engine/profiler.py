"""Profiles the real model to fit the batch-time predictor the schedulers use.

`make_run_batch(runner)` returns a function that runs one forward pass of a synthetic batch with
the given shape (prefill chunks as (tokens, kv_before), decode KV lengths) on the engine's own
model and KV tensor and returns its wall time. Block tables are synthetic and may alias: the
values read are junk, only the work matters. `quick_plan` is what an instance profiles at start
(mostly small steps: serving steps are), `startup_holdout_plan` the serving-like steps its
report is measured on (`raycluster.sched.profile` says how repeats are taken). `load_or_profile`
caches the fitted predictor per (model, threads, dtype, fit version) under the cache directory,
so an instance profiles once per machine.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import time
from pathlib import Path
from typing import Callable, Sequence

import torch

from raycluster.engine.model_runner import ModelRunner, plan_logits
from raycluster.parallel.plan import StepPlan
from raycluster.model.registry import cache_dir
from raycluster.sched.predictor import LinearBatchPredictor
from raycluster.sched.profile import fit_and_report, profile, serving_plan

RunBatch = Callable[[Sequence[tuple[int, int]], Sequence[int]], float]


def make_run_batch(runner: ModelRunner) -> RunBatch:
    """Times synthetic steps through `runner.run_plan`, so a parallel group is profiled as it runs."""
    bs = runner.kv.block_size
    vocab = runner.model.config.vocab_size
    head = runner.model.config.has_lm_head

    def run(prefills: Sequence[tuple[int, int]], decode_kv: Sequence[int]) -> float:
        starts = [kv for _, kv in prefills]
        lens = [q for q, _ in prefills]
        # Laid out as the engine's allocator would lay out these requests (a KVP group's layout).
        tables = runner.kv.allocator.alias_tables([-(-(kv + q) // bs) for q, kv in prefills]
                                                  + [-(-kv // bs) for kv in decode_kv])
        p_tables, d_tables = tables[:len(prefills)], tables[len(prefills):]
        n = sum(lens) + len(decode_kv)
        rows = list(range(n - max(1, len(prefills) + len(decode_kv)), n))
        plan = StepPlan(input_ids=torch.randint(6, vocab, (n,)).tolist(), prefill_starts=starts,
                        prefill_lens=lens, prefill_tables=p_tables,
                        decode_positions=[kv - 1 for kv in decode_kv], decode_tables=d_tables, sample_rows=rows)
        t0 = time.perf_counter()
        if head:
            plan_logits(runner, plan)
        else:                   # a pooling-only checkpoint: its steps end at the final hidden states
            runner.run_plan(plan)
        return time.perf_counter() - t0

    return run


# Bump when the plan, the estimator or the features change: cached profiles are then re-measured.
PROFILE_VERSION = 4


def _plan_limits(max_model_len: int, max_num_batched_tokens: int, max_num_seqs: int) -> tuple[int, int, int]:
    """(largest chunk, deepest KV, largest decode batch) the startup profile covers: the range an
    instance of this config mostly runs, not its limits (a fit stretched to 128 decodes of 8K
    tokens is off at the small end, where most steps are)."""
    max_kv = max(1, min(4096, max_model_len // 2))
    return max(1, min(1024, max_num_batched_tokens, max_model_len // 2)), max_kv, max(1, min(16, max_num_seqs))


def quick_plan(max_model_len: int, max_num_batched_tokens: int, max_num_seqs: int,
               seed: int = 0) -> list:
    """~35 shapes, most of them small (serving steps are; the fixed per-step cost and the small-
    chunk rate are pinned by them): prefill chunks 1..max_chunk at KV 0 (doubling), a few chunks
    over earlier KV, decode batches of 1..16 at three KV lengths, a few mixed steps. With the
    held-out steps about 2.5 s a round for the tiny model on one thread."""
    max_chunk, max_kv, max_dec = _plan_limits(max_model_len, max_num_batched_tokens, max_num_seqs)
    plan: list = []
    for q in sorted({q for q in (1, 4, 16, 32, 64, 128, 256, 512) if q < max_chunk} | {max_chunk}):
        plan.append(([(q, 0)], []))
    for q in sorted({min(16, max_chunk), min(64, max_chunk), max(1, max_chunk // 4)}):
        for kv in sorted({max(1, max_kv // 4), max_kv}):
            plan.append(([(q, kv)], []))
    for n in sorted({min(n, max_dec) for n in (1, 2, 4, 8, 16)}):
        for kv in sorted({max(1, min(kv, max_kv)) for kv in (128, 512, max_kv // 2)}):
            plan.append(([], [kv] * n))
    # Mixed steps as the serving ones are (short chunks mostly): a uniform draw up to max_chunk
    # made these four cost half a round.
    plan += [s for s in serving_plan(seed, 24, max(1, max_chunk // 2), max_kv, max_dec) if s[0] and s[1]][:4]
    return plan


def startup_holdout_plan(max_model_len: int, max_num_batched_tokens: int, max_num_seqs: int,
                         seed: int = 1, n: int = 16) -> list:
    """Steps like those the instance serves (`serving_plan` within `_plan_limits`), measured in the
    same rounds as the fit's shapes and kept out of the fit for the report."""
    max_chunk, max_kv, max_dec = _plan_limits(max_model_len, max_num_batched_tokens, max_num_seqs)
    return serving_plan(seed, n, max_chunk, max_kv, max_dec)


def profile_runner(runner: ModelRunner, plan: list, repeats: int = 6,
                   holdout_plan: list | None = None) -> tuple[LinearBatchPredictor, dict]:
    """Measure `plan` (+ `holdout_plan`, interleaved in the same rounds so host noise hits both
    alike), fit, and report the error on the held-out shapes (a random quarter of `plan` without
    one); the returned fit uses every shape."""
    t0 = time.perf_counter()
    held = list(holdout_plan or [])
    # No warm-up pass: the first round's cold steps (workspace growth) lose to later ones in the
    # minimum anyway, so a warm-up round is better spent as one more repeat.
    samples = profile(make_run_batch(runner), list(plan) + held, repeats=repeats, warmup=0)
    train, test = samples[:len(plan)], (samples[len(plan):] if held else None)
    predictor, report = fit_and_report(train, test=test)
    return predictor, {"samples": len(samples), "heldout_samples": report.n, "repeats": repeats,
                       "estimator": "min", "heldout_median_rel_err": report.median_rel,
                       "heldout_p90_rel_err": report.p90_rel, "heldout_max_rel_err": report.max_rel,
                       "profile_wall_s": time.perf_counter() - t0}


def _matmul_kinds(model) -> list[str]:
    """The kinds of matmul a quantized model's layers run (a group's: its leader's shard's)."""
    from raycluster.model.quant.linear import QuantLinear

    module = getattr(model, "leader_shard", model)
    return sorted({type(m.matmul).__name__ for m in module.modules() if isinstance(m, QuantLinear)})


def profile_key(runner: ModelRunner) -> str:
    cfg = runner.model.config
    ident = {"features": PROFILE_VERSION, "cfg": repr(cfg), "threads": torch.get_num_threads(),
             "dtype": str(runner.dtype), "block": runner.kv.block_size}
    if runner.layout != "single":    # a KVP / SPP / TP group runs the same step in a different time
        ident["layout"] = runner.layout
    if cfg.quant is not None:        # one quantized checkpoint runs packed or dequantized (quant_kernels)
        ident["matmuls"] = _matmul_kinds(runner.model)
    ident = json.dumps(ident, sort_keys=True)
    return hashlib.sha256(ident.encode()).hexdigest()[:16]


def load_or_profile(runner: ModelRunner, max_model_len: int, max_num_batched_tokens: int,
                    max_num_seqs: int, log: Callable[[str], None] = print) -> LinearBatchPredictor:
    path = cache_dir() / "profiles" / f"{profile_key(runner)}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    # Instances starting together take turns: the first profiles, the others read its file.
    with open(path.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if path.is_file():
            return LinearBatchPredictor(**json.loads(path.read_text())["predictor"])
        return _profile_and_save(runner, path, max_model_len, max_num_batched_tokens, max_num_seqs, log)


def _profile_and_save(runner: ModelRunner, path: Path, max_model_len: int, max_num_batched_tokens: int,
                      max_num_seqs: int, log: Callable[[str], None]) -> LinearBatchPredictor:
    log("raycluster: profiling the model for the batch-time predictor (once per machine)...")
    predictor, report = profile_runner(runner, quick_plan(max_model_len, max_num_batched_tokens, max_num_seqs),
                                       holdout_plan=startup_holdout_plan(max_model_len, max_num_batched_tokens,
                                                                         max_num_seqs))
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"predictor": predictor.__dict__, "report": report}, indent=2))
    tmp.rename(path)
    log(f"raycluster: predictor fitted; held-out median error {report['heldout_median_rel_err']:.1%}, "
        f"P90 {report['heldout_p90_rel_err']:.1%}")
    return predictor


def save_predictor(path: str | Path, predictor: LinearBatchPredictor, report: dict) -> None:
    Path(path).write_text(json.dumps({"predictor": predictor.__dict__, "report": report}, indent=2))
