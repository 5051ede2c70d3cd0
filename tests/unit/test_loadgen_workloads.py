"""Workloads: lengths follow their declared distributions; structure of sessions, apps, tenants."""

import math
from collections import Counter

import numpy as np
import pytest
from scipy import stats

from loadgen.workloads import PROFILES, make_workload, parse_range, parse_tenants


def _lognorm(d):
    return stats.lognorm(s=d.sigma, scale=math.exp(d.mu))


def _clipped_cdf(d):
    """CDF of the declared law: lognormal clipped to [lo, hi] (mass beyond piles at the ends)."""
    f = _lognorm(d).cdf
    return lambda x: np.where(x >= d.hi, 1.0, np.where(x < d.lo, 0.0, f(x)))


def _clipped_mean(d):
    ln = _lognorm(d)
    inner = ln.expect(lambda x: x, lb=d.lo, ub=d.hi)
    return inner + d.lo * ln.cdf(d.lo) + d.hi * ln.sf(d.hi)


@pytest.mark.parametrize("profile", ["sharegpt", "lmsys"])
def test_chat_lengths_follow_the_fitted_lognormals(profile):
    w = make_workload("chat", seed=7, qps=100.0, num_requests=20000, profile=profile)
    prof = PROFILES[profile]
    for lens, dist in ((np.array([r.prompt_tokens for r in w]), prof.prompt),
                       (np.array([r.output_tokens for r in w]), prof.output)):
        # KS distance to the declared (clipped) lognormal; rounding to ints adds < 0.01.
        assert stats.kstest(lens, _clipped_cdf(dist)).statistic < 0.02
        assert abs(lens.mean() / _clipped_mean(dist) - 1) < 0.03
        assert abs(lens.mean() / dist.mean - 1) < 0.05     # close to the published mean
        assert lens.min() >= dist.lo and lens.max() <= dist.hi
    assert all(r.klass == "short" and r.tenant == "default" and r.app_id is None for r in w)


def test_long_mix_fraction_class_and_uniform_long_lengths():
    w = make_workload("long-mix", seed=1, qps=10.0, num_requests=20000, long_fraction=0.05,
                      long_tokens=(2048, 8192))
    longs = [r for r in w if r.klass == "long"]
    p = len(longs) / len(w)
    assert abs(p - 0.05) < 3 * math.sqrt(0.05 * 0.95 / len(w))
    lp = np.array([r.prompt_tokens for r in longs])
    assert lp.min() >= 2048 and lp.max() <= 8192
    assert stats.kstest(lp, stats.uniform(2048, 8192 - 2048).cdf).pvalue > 0.01
    assert all(r.prompt_tokens < 2048 for r in w if r.klass == "short")
    assert all(r.ttft_slo_ms == max(2000.0, r.prompt_tokens * 1.0) for r in longs)


def test_counts_durations_and_seeds():
    a = make_workload("chat", seed=3, qps=5.0, num_requests=123)
    b = make_workload("chat", seed=3, qps=5.0, num_requests=123)
    c = make_workload("chat", seed=4, qps=5.0, num_requests=123)
    assert len(a) == 123 and a.requests == b.requests and a.requests != c.requests
    d = make_workload("chat", seed=3, qps=5.0, duration=20.0)
    assert max(r.arrival_s for r in d) < 20.0 and abs(len(d) - 100) < 40
    arr = [r.arrival_s for r in a]
    assert arr == sorted(arr)
    for name in ("multiturn", "apps", "tenants"):
        assert len(make_workload(name, seed=1, qps=2.0, num_requests=57)) == 57


def test_prompt_text_has_one_word_per_token_and_ids_the_exact_length():
    w = make_workload("chat", seed=0, qps=1.0, num_requests=20)
    for r in w:
        assert len(r.prompt_text().split()) == r.prompt_tokens
        ids = r.prompt_token_ids((10, 20))
        assert len(ids) == r.prompt_tokens and min(ids) >= 10 and max(ids) < 20
    assert w.requests[0].prompt_text() == w.requests[0].prompt_text()


def test_prompt_length_is_exact_for_the_tiny_model_tokenizer():
    """n words -> n tokens (+ BOS) with the project's tiny-model BPE (skipped if unavailable).

    Exact today; the tokenizer is retrained when the model's corpus changes, so allow 2%.
    """
    try:
        from raycluster.model.tiny import _tokenizer_json
        from tokenizers import Tokenizer
    except ImportError as e:
        pytest.skip(f"tiny tokenizer unavailable: {e}")
    tok = Tokenizer.from_str(_tokenizer_json())
    w = make_workload("multiturn", seed=0, qps=1.0, num_requests=30)
    got = np.array([len(tok.encode(r.prompt_text()).ids) - 1 for r in w])
    want = np.array([r.prompt_tokens for r in w])
    assert np.all(np.abs(got - want) <= 0.02 * want + 1), list(zip(got, want))


def test_multiturn_resends_history_plus_a_new_message():
    w = make_workload("multiturn", seed=2, qps=1.0, num_requests=400)
    by_id = {r.request_id: r for r in w}
    sessions = Counter(r.app_id for r in w)
    assert max(sessions.values()) > 1
    chained = [r for r in w if r.depends_on]
    assert chained
    for r in chained:
        prev = by_id[r.depends_on[0]]
        assert r.app_id == prev.app_id and r.arrival_s == prev.arrival_s
        n = len(prev.segments)
        assert r.segments[:n] == prev.segments                 # the history, verbatim
        assert r.segments[n][1] == prev.output_tokens          # the previous reply
        assert len(r.segments) == n + 2                        # plus one new message
        assert r.prompt_text().startswith(prev.prompt_text())
        assert r.prompt_tokens + r.output_tokens <= 8192
        assert r.think_s >= 0


def test_apps_are_dags_sharing_an_app_id():
    w = make_workload("apps", seed=5, qps=1.0, num_requests=600,
                      app_mix={"fact_verification": 1, "self_consistency": 1, "map_reduce": 1})
    seen, by_id = set(), {r.request_id: r for r in w}
    for r in w:
        assert r.app_id is not None and r.app_type in {"fact_verification", "self_consistency", "map_reduce"}
        for d in r.depends_on:
            assert d in seen and by_id[d].app_id == r.app_id   # topological, same app
        seen.add(r.request_id)
    mr = [r for r in w if r.app_type == "map_reduce" and r.depends_on]
    assert mr and all(4 <= len(r.depends_on) <= 8 and r.output_tokens == 256 for r in mr)
    sc = Counter(r.app_id for r in w if r.app_type == "self_consistency")
    assert all(not r.depends_on for r in w if r.app_type == "self_consistency")
    assert 5 <= np.median(list(sc.values())) <= 8
    # Justitia's default mix: 72% small, 26% medium, 2% large applications.
    apps = {r.app_id: r.app_type for r in make_workload("apps", seed=5, qps=1.0, duration=3000.0)}
    share = {k: v / len(apps) for k, v in Counter(apps.values()).items()}
    for kind, p in (("fact_verification", 0.72), ("self_consistency", 0.26), ("map_reduce", 0.02)):
        assert abs(share[kind] - p) < 3 * math.sqrt(p * (1 - p) / len(apps)), (kind, share)


def test_tenants_arrive_at_their_shares_of_the_rate():
    w = make_workload("tenants", seed=9, qps=10.0, duration=600.0, tenants="A:3,B:1")
    n = Counter(r.tenant for r in w)
    assert abs(n["A"] / 600.0 - 7.5) < 0.5 and abs(n["B"] / 600.0 - 2.5) < 0.3


def test_parsers_and_errors():
    assert parse_range("2048:8192") == (2048, 8192)
    assert parse_range("128k:1m") == (131072, 1048576)
    assert parse_tenants("A:3,B:1") == {"A": 0.75, "B": 0.25}
    with pytest.raises(ValueError):
        parse_range("5")
    with pytest.raises(ValueError, match="unknown workload"):
        make_workload("nope", num_requests=1)
    with pytest.raises(ValueError, match="num_requests or duration"):
        make_workload("chat")
