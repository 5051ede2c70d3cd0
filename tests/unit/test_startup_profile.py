"""The startup batch-time profile: interleaved rounds keeping each shape's fastest repeat, the
small-step plan and serving-like held-out steps, exact fits on noiseless samples, and the
per-machine cache (a profile of an older fit version is measured again, not reused)."""

from __future__ import annotations

import json

import pytest

from raycluster.engine import profiler
from raycluster.engine.kv_manager import KVCacheManager
from raycluster.engine.model_runner import ModelRunner
from raycluster.model.loader import load_model
from raycluster.sched.predictor import LinearBatchPredictor
from raycluster.sched.profile import (
    error_report,
    fit_and_report,
    fit_predictor,
    profile,
    serving_plan,
)

TRUE = LinearBatchPredictor(overhead_s=3e-3, per_prefill_token_s=1e-4, per_attn_pair_s=8e-8,
                            per_decode_s=2e-4, per_decode_kv_s=1e-6, per_prefill_s=5e-4)
LIMITS = (32768, 2048, 128)          # the engine's defaults for the tiny model


def key(shape):
    prefills, decodes = shape
    return (tuple(map(tuple, prefills)), tuple(decodes))


def test_profile_runs_rounds_in_shuffled_orders_and_keeps_the_fastest_repeat():
    plan = [([(16 * (i + 1), 0)], []) for i in range(6)]
    calls = []
    # Every shape is slow except in one round of its own: the minimum must find that round.
    fast_round = {key(s): i % 3 for i, s in enumerate(plan)}

    def run(prefills, decodes):
        k = key((prefills, decodes))
        rnd = sum(1 for c in calls if c == k)
        calls.append(k)
        return 1.0 if rnd == fast_round[k] else 5.0 + rnd

    samples = profile(run, plan, repeats=3, warmup=0, seed=7)
    assert [s.seconds for s in samples] == [1.0] * len(plan)
    rounds = [calls[r * len(plan):(r + 1) * len(plan)] for r in range(3)]
    assert all(sorted(r) == sorted(key(s) for s in plan) for r in rounds)     # each shape once a round
    assert len({tuple(r) for r in rounds}) > 1                                 # orders differ
    calls.clear()
    profile(run, plan, repeats=3, warmup=0, seed=7)
    assert [calls[r * len(plan):(r + 1) * len(plan)] for r in range(3)] == rounds   # seeded


def test_profile_warmup_runs_are_not_timed_and_stat_is_pluggable():
    seen = []

    def run(prefills, decodes):
        seen.append(1)
        return 100.0 if len(seen) == 1 else float(len(seen))   # a cold first call

    [s] = profile(run, [([(8, 0)], [])], repeats=3, warmup=1, stat=max)
    assert len(seen) == 4 and s.seconds == 4.0
    with pytest.raises(ValueError):
        profile(run, [([(8, 0)], [])], repeats=0)


def test_noiseless_samples_of_the_startup_plan_recover_the_coefficients_exactly():
    fit_plan = profiler.quick_plan(*LIMITS)
    held = profiler.startup_holdout_plan(*LIMITS)
    run = lambda p, d: TRUE.batch_time(p, d)
    train = profile(run, fit_plan, repeats=1, warmup=0)
    test = profile(run, held, repeats=1, warmup=0)
    fitted, report = fit_and_report(train, test=test)
    assert fitted.coefficients() == pytest.approx(TRUE.coefficients(), rel=1e-6)
    assert report.n == len(held) and report.median_rel < 1e-9 and report.p90_rel < 1e-9
    assert fit_predictor(train).coefficients() == pytest.approx(TRUE.coefficients(), rel=1e-6)


def test_an_explicit_holdout_is_reported_on_and_then_fitted_too():
    run = lambda p, d: TRUE.batch_time(p, d)
    train = profile(run, profiler.quick_plan(*LIMITS), repeats=1, warmup=0)
    off = [s.__class__(s.prefills, s.decode_kv_lens, 2 * s.seconds) for s in
           profile(run, serving_plan(3, 8), repeats=1, warmup=0)]      # held-out steps 2x slower
    fitted, report = fit_and_report(train, test=off)
    assert report.n == 8 and report.median_rel == pytest.approx(0.5, rel=1e-6)   # the fit never saw them
    assert error_report(fitted, off).median_rel < 0.5                            # the returned fit did


def test_serving_plan_is_seeded_and_within_its_limits():
    a, b = serving_plan(5, 60, 512, 2048, 8), serving_plan(5, 60, 512, 2048, 8)
    assert a == b and a != serving_plan(6, 60, 512, 2048, 8)
    kinds = set()
    for prefills, decodes in a:
        assert prefills or decodes
        assert all(16 <= q <= 512 and 0 <= kv <= 2048 for q, kv in prefills)
        assert len(decodes) <= 8 and all(16 <= kv <= 2048 for kv in decodes)
        kinds.add((bool(prefills), bool(decodes)))
    assert kinds == {(True, False), (False, True), (True, True)}


@pytest.mark.parametrize("limits", [LIMITS, (64, 32, 2), (256, 2048, 1)])
def test_startup_plans_stay_within_the_instance_limits(limits):
    max_model_len, max_tokens, max_seqs = limits
    plan = profiler.quick_plan(*limits) + profiler.startup_holdout_plan(*limits)
    for prefills, decodes in plan:
        assert all(q >= 1 and q <= max_tokens and q + kv <= max_model_len for q, kv in prefills)
        assert len(decodes) <= max_seqs and all(1 <= kv <= max_model_len for kv in decodes)
    fit = profiler.quick_plan(*limits)
    assert sum(1 for p, d in fit if not d and p[0][1] == 0) >= 3    # small chunks at KV 0 pin the fixed cost


@pytest.fixture(scope="module")
def runner(tiny_model_dir):
    return ModelRunner(load_model(tiny_model_dir)[0], KVCacheManager(64, 16))


def test_load_or_profile_caches_and_a_stale_version_is_measured_again(runner, tmp_path, monkeypatch):
    monkeypatch.setenv("RAYCLUSTER_CACHE", str(tmp_path))
    limits = (64, 32, 2)
    runs = []
    real = profiler.profile_runner

    def counting(*a, **kw):          # one round: the cache is under test here, not the estimate
        runs.append(1)
        return real(*a, **{**kw, "repeats": 1})

    monkeypatch.setattr(profiler, "profile_runner", counting)
    p1 = profiler.load_or_profile(runner, *limits, log=lambda _: None)
    [path] = (tmp_path / "profiles").glob("*.json")
    saved = json.loads(path.read_text())
    assert runs == [1] and saved["predictor"] == p1.__dict__
    assert saved["report"]["estimator"] == "min" and saved["report"]["heldout_samples"] == 16
    assert saved["report"]["samples"] == len(profiler.quick_plan(*limits)) + 16
    assert profiler.load_or_profile(runner, *limits, log=lambda _: None) == p1 and runs == [1]   # cached
    old_key = profiler.profile_key(runner)
    monkeypatch.setattr(profiler, "PROFILE_VERSION", profiler.PROFILE_VERSION + 1)
    assert profiler.profile_key(runner) != old_key
    profiler.load_or_profile(runner, *limits, log=lambda _: None)
    assert runs == [1, 1] and len(list((tmp_path / "profiles").glob("*.json"))) == 2



def test_a_quantized_checkpoint_is_profiled_per_kind_of_matmul(tiny_model_dir, tmp_path):
    """One quantized checkpoint runs packed or dequantized (quant_kernels), at different speeds:
    each its own profile, and neither the dense model's."""
    from raycluster.engine.kv_manager import KVCacheManager
    from raycluster.engine.model_runner import ModelRunner
    from raycluster.engine.profiler import profile_key
    from raycluster.model.loader import load_model
    from raycluster.model.quant.write import quantize_checkpoint

    quantize_checkpoint(str(tiny_model_dir), str(tmp_path / "q"), "w4a16", 64)
    keys = {profile_key(ModelRunner(load_model(path, quant_kernels=k)[0], KVCacheManager(8, 16)))
            for path, k in ((tiny_model_dir, "auto"), (tmp_path / "q", "quantized"), (tmp_path / "q", "dense"))}
    assert len(keys) == 3
