"""Profiling: measure real steps, fit a `LinearBatchPredictor`, report held-out error.

Owns: the offline/startup calibration of the batch-time model. Data enters as a plan of batch
shapes (`default_plan`, `serving_plan` or the caller's) and a `run_batch(prefills, decode_kv_lens)
-> seconds` callable that the engine supplies (it runs one real step of that shape and times it).
`profile` returns `ProfileSample`s; `fit_predictor` turns samples into coefficients by
non-negative least squares over `raycluster.sched.predictor.batch_features`; `error_report`
gives median and P90 relative error on samples the fit did not see; `fit_and_report` does the
split (a random share, or a held-out set the caller measured alongside) and both.

Measuring on a shared host: other processes only ever add time to a step, in bursts of a second
or so that slow every shape run meanwhile. So `profile` runs the plan in rounds (every shape once
per round, in a fresh random order each round) and keeps each shape's fastest repeat: a burst
then costs one repeat of a few random shapes instead of all repeats of one, and the minimum is
the estimate of the step's own time that the burst cannot bias. (Sorted or fixed orders measured
worse: a burst then hits a run of neighbouring shapes and tilts the fit.)

Fitting minimizes relative error by default (each row divided by its measured time): step times
span 1 ms to seconds and the scheduler cares about ratios against a budget, not absolute error.
Columns are scaled to unit norm before NNLS because the attention feature is ~1e9 times the
overhead feature.
"""

from __future__ import annotations

import itertools
import random
import statistics
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from raycluster.sched.predictor import LinearBatchPredictor, batch_features

Shape = tuple[list[tuple[int, int]], list[int]]          # (prefills as (chunk, kv_before), decode kv lens)
RunBatch = Callable[[list[tuple[int, int]], list[int]], float]


@dataclass
class ProfileSample:
    prefills: list[tuple[int, int]]
    decode_kv_lens: list[int]
    seconds: float


@dataclass
class ErrorReport:
    n: int
    median_rel: float
    p90_rel: float
    max_rel: float

    def __str__(self) -> str:
        return (f"n={self.n} median_rel_err={self.median_rel:.3%} p90_rel_err={self.p90_rel:.3%} "
                f"max_rel_err={self.max_rel:.3%}")


def nnls(a: np.ndarray, b: np.ndarray, scale: bool = True) -> np.ndarray:
    """argmin ||a x - b|| subject to x >= 0, exact for the few columns used here: least squares
    on every subset of columns, keeping the best all-non-negative solution (2^k solves, k <= 8).
    No scipy dependency at runtime."""
    a = np.asarray(a, dtype=float)
    b = np.asarray(b, dtype=float)
    k = a.shape[1]
    if k > 10:
        raise ValueError(f"nnls: at most 10 columns, got {k}")
    norms = np.linalg.norm(a, axis=0) if scale else np.ones(k)
    norms[norms == 0] = 1.0
    a_s = a / norms
    best_x, best_r = np.zeros(k), float(np.dot(b, b))
    for size in range(1, k + 1):
        for cols in itertools.combinations(range(k), size):
            sub = a_s[:, cols]
            x_sub, *_ = np.linalg.lstsq(sub, b, rcond=None)
            if np.any(x_sub < 0):
                continue
            r = float(np.sum((sub @ x_sub - b) ** 2))
            if r < best_r - 1e-18 * max(1.0, best_r):
                best_r = r
                best_x = np.zeros(k)
                best_x[list(cols)] = x_sub
    return best_x / norms


def fit_predictor(samples: Sequence[ProfileSample], relative: bool = True) -> LinearBatchPredictor:
    if not samples:
        raise ValueError("fit_predictor: no samples")
    a = np.array([batch_features(s.prefills, s.decode_kv_lens) for s in samples], dtype=float)
    b = np.array([s.seconds for s in samples], dtype=float)
    if relative:
        w = 1.0 / np.maximum(b, 1e-9)
        a, b = a * w[:, None], b * w
    return LinearBatchPredictor(*[float(c) for c in nnls(a, b)])


def error_report(predictor, samples: Sequence[ProfileSample]) -> ErrorReport:
    errs = sorted(abs(predictor.batch_time(s.prefills, s.decode_kv_lens) - s.seconds) / max(s.seconds, 1e-12)
                  for s in samples)
    if not errs:
        return ErrorReport(0, float("nan"), float("nan"), float("nan"))
    p90 = errs[min(len(errs) - 1, int(round(0.9 * (len(errs) - 1))))]
    return ErrorReport(len(errs), statistics.median(errs), p90, errs[-1])


def fit_and_report(samples: Sequence[ProfileSample], holdout: float = 0.25, seed: int = 0,
                   relative: bool = True, test: Sequence[ProfileSample] | None = None
                   ) -> tuple[LinearBatchPredictor, ErrorReport]:
    """Fit on the training share, report on the rest; then refit on everything (the report
    describes how well the model generalizes, the returned fit uses all data). `test`: a
    held-out set measured alongside (e.g. `serving_plan` shapes), used instead of a random
    `holdout` share of `samples`."""
    if test is not None:
        train = list(samples)
    else:
        idx = list(range(len(samples)))
        random.Random(seed).shuffle(idx)
        n_test = max(1, int(len(idx) * holdout)) if len(idx) > 1 else 0
        test = [samples[i] for i in idx[:n_test]]
        train = [samples[i] for i in idx[n_test:]]
    report = error_report(fit_predictor(train, relative), test)
    return fit_predictor(list(train) + list(test), relative), report


def default_plan(max_chunk: int = 2048, max_kv: int = 16384, max_decodes: int = 64,
                 seed: int = 0, n_mixed: int = 16) -> list[Shape]:
    """Shapes that excite every feature: prefill-only chunks over several KV depths, decode-only
    batches over batch size and length, and random mixed steps."""
    plan: list[Shape] = []
    chunks = sorted({max(1, max_chunk >> s) for s in range(0, 7)})
    kvs = sorted({0} | {max_kv >> s for s in range(0, 4)})
    for q in chunks:
        for kv in kvs:
            plan.append(([(q, kv)], []))
    batch_sizes = sorted({max(1, max_decodes >> s) for s in range(0, 6)})
    for n in batch_sizes:
        for kv in kvs[1:]:
            plan.append(([], [kv] * n))
    rng = random.Random(seed)
    for _ in range(n_mixed):
        pre = [(rng.randint(1, max_chunk), rng.randint(0, max_kv)) for _ in range(rng.randint(1, 3))]
        plan.append((pre, [rng.randint(1, max_kv) for _ in range(rng.randint(0, max_decodes))]))
    return plan


def serving_plan(seed: int, n: int, max_chunk: int = 1024, max_kv: int = 4096,
                 max_decodes: int = 16) -> list[Shape]:
    """`n` random steps of the kind a serving instance runs: decode-only batches of 1 to
    `max_decodes` requests (about a third), one prefill chunk at KV 0 or over an earlier part of
    its prompt (a third), and a chunk with a decode batch beside it (the rest). Chunk sizes
    (16..max_chunk) and KV lengths (16..max_kv) are log-uniform: most requests are short, a few
    long ones set the tail (as in chat traces)."""
    rng = random.Random(seed)

    def log_uniform(lo: int, hi: int) -> int:
        lo = max(1, min(lo, hi))
        return max(1, round(lo * (hi / lo) ** rng.random()))

    def decodes() -> list[int]:
        return [log_uniform(16, max_kv) for _ in range(rng.randint(1, max(1, max_decodes)))]

    plan: list[Shape] = []
    for _ in range(n):
        kind = rng.random()
        if kind < 1 / 3:
            plan.append(([], decodes()))
        elif kind < 2 / 3:
            plan.append(([(log_uniform(16, max_chunk), rng.choice((0, log_uniform(16, max_kv))))], []))
        else:
            plan.append(([(log_uniform(16, max_chunk), log_uniform(16, max(1, max_kv // 2)))], decodes()))
    return plan


def profile(run_batch: RunBatch, plan: Sequence[Shape], repeats: int = 3, warmup: int = 1,
            seed: int = 0, stat: Callable[[list[float]], float] = min) -> list[ProfileSample]:
    """Run the plan `warmup` times (untimed), then `repeats` timed rounds, each visiting every
    shape once in its own shuffled order (seeded: reproducible call order); keep `stat` of each
    shape's repeats, by default the minimum (noise on a shared host only adds time)."""
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    for _ in range(warmup):
        for prefills, decode_kv in plan:
            run_batch(list(prefills), list(decode_kv))
    times: list[list[float]] = [[] for _ in plan]
    rng = random.Random(seed)
    order = list(range(len(plan)))
    for _ in range(repeats):
        rng.shuffle(order)
        for i in order:
            prefills, decode_kv = plan[i]
            times[i].append(float(run_batch(list(prefills), list(decode_kv))))
    return [ProfileSample(list(p), list(d), float(stat(t))) for (p, d), t in zip(plan, times)]
