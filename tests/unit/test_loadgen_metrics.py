"""build_results: the results schema, percentiles equal numpy's, SLOs, warm-up, apps, fairness."""

import json

import numpy as np
from hypothesis import given, settings, strategies as st

from loadgen.metrics import RequestRecord, build_results, jain

SUMMARY_KEYS = {"completed", "failed", "ttft_p50_s", "ttft_p90_s", "ttft_p99_s", "tpot_p50_s",
                "tpot_p99_s", "e2e_p50_s", "e2e_p99_s", "slo_attainment", "goodput_rps", "output_tok_s",
                "ttft_slo_attainment", "tpot_slo_attainment", "tbt_p50_s", "tbt_p99_s", "throughput_rps"}


def rec(i, ttft, tpot, n=5, klass="short", tenant="default", status="ok", app=None, arrival=None,
        ttft_slo=1000.0, tpot_slo=100.0):
    a = float(i) if arrival is None else arrival
    times = [a + ttft + k * tpot for k in range(n)]
    return RequestRecord(f"r{i}", arrival_s=a, send_s=a, first_token_s=times[0], finish_s=times[-1],
                         num_output_tokens=n, token_times_s=times, status=status, klass=klass,
                         tenant=tenant, app_id=app, prompt_tokens=10, ttft_slo_ms=ttft_slo,
                         tpot_slo_ms=tpot_slo)


def test_schema_and_percentiles_equal_numpy():
    rng = np.random.default_rng(0)
    ttft, tpot = rng.exponential(0.5, 200), rng.exponential(0.05, 200)
    recs = [rec(i, a, b, klass="long" if i % 10 == 0 else "short") for i, (a, b) in enumerate(zip(ttft, tpot))]
    res = build_results(recs, {"source": "test"})
    assert set(res) >= {"meta", "summary", "by_class", "by_tenant", "apps", "requests"}
    assert SUMMARY_KEYS <= set(res["summary"]) and set(res["by_class"]) == {"short", "long"}
    assert SUMMARY_KEYS <= set(res["by_class"]["long"])
    s = res["summary"]
    # Same data: the per-request values the records carry (times are absolute, so re-derived
    # values differ from the inputs in the last bits), then numpy's percentile, exactly.
    d_ttft, d_tpot, d_e2e = ([getattr(r, k) for r in recs] for k in ("ttft_s", "tpot_s", "e2e_s"))
    for q in (50, 90, 99):
        assert s[f"ttft_p{q}_s"] == np.percentile(d_ttft, q)
        assert s[f"tpot_p{q}_s"] == np.percentile(d_tpot, q)
        assert s[f"e2e_p{q}_s"] == np.percentile(d_e2e, q)
        assert np.isclose(s[f"ttft_p{q}_s"], np.percentile(ttft, q))
    assert s["tbt_p99_s"] == np.percentile([g for r in recs for g in np.diff(r.token_times_s)], 99)
    assert np.isclose(s["tbt_p50_s"], np.percentile(np.repeat(tpot, 4), 50))
    assert res["by_class"]["long"]["ttft_p99_s"] == np.percentile(d_ttft[::10], 99)
    assert [r["ttft_s"] for r in res["requests"]] == d_ttft
    ok = (ttft <= 1.0) & (tpot <= 0.1)
    assert s["slo_attainment"] == ok.mean()
    assert s["ttft_slo_attainment"] == (ttft <= 1.0).mean() and s["tpot_slo_attainment"] == (tpot <= 0.1).mean()
    window = max(r.finish_s for r in recs) - 0.0
    assert np.isclose(s["goodput_rps"], ok.sum() / window) and np.isclose(s["throughput_rps"], 200 / window)
    assert np.isclose(s["output_tok_s"], 1000 / window)
    json.dumps(res, allow_nan=False)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.floats(0.001, 100.0), min_size=1, max_size=50))
def test_ttft_percentiles_equal_numpy_property(xs):
    recs = [RequestRecord(f"r{i}", arrival_s=0.0, first_token_s=x, finish_s=x, num_output_tokens=1)
            for i, x in enumerate(xs)]
    res = build_results(recs, {})
    for q in (50, 90, 99):
        assert res["summary"][f"ttft_p{q}_s"] == np.percentile(xs, q)


def test_failures_miss_slos_and_empty_classes_are_null():
    recs = [rec(0, 0.1, 0.01), rec(1, 0.1, 0.01, status="http_error"), rec(2, 5.0, 0.01)]
    recs[1].first_token_s = None
    s = build_results(recs, {})["summary"]
    assert (s["completed"], s["failed"]) == (2, 1)
    assert s["slo_attainment"] == 1 / 3 and s["ttft_slo_attainment"] == 1 / 3 and s["tpot_slo_attainment"] == 2 / 3
    long = build_results(recs, {})["by_class"]["long"]
    assert long["num_requests"] == 0 and long["ttft_p50_s"] is None and long["slo_attainment"] is None


def test_virtual_time_records_without_token_times():
    """The simulator's path: counts and first/finish times only, SLOs may be absent."""
    recs = [RequestRecord("a", arrival_s=10.0, first_token_s=10.5, finish_s=11.5, num_output_tokens=11),
            RequestRecord("b", arrival_s=11.0, first_token_s=11.2, finish_s=11.2, num_output_tokens=1,
                          ttft_slo_ms=100.0)]
    res = build_results(recs, {"source": "simulator"})
    s = res["summary"]
    assert np.isclose(s["ttft_p50_s"], 0.35) and np.isclose(s["tpot_p50_s"], 0.1)
    assert s["tbt_p50_s"] is None and s["slo_attainment"] == 0.5 and s["window_s"] == 1.5


def test_warmup_is_excluded_by_time_and_count():
    recs = [rec(i, 0.1 if i >= 5 else 9.0, 0.01) for i in range(20)]
    assert build_results(recs, {}, warmup_s=5.0)["summary"]["slo_attainment"] == 1.0
    res = build_results(recs, {}, warmup_requests=5)
    assert res["summary"]["num_requests"] == 15 and res["meta"]["num_warmup"] == 5
    assert sum(r["warmup"] for r in res["requests"]) == 5 and len(res["requests"]) == 20


def test_apps_completion_and_tenant_fairness():
    recs = [rec(0, 1.0, 0.1, app="x", arrival=0.0), rec(1, 1.0, 0.1, app="x", arrival=2.0),
            rec(2, 0.5, 0.1, app="y", arrival=1.0), rec(3, 0.5, 0.1, app="z", arrival=1.0, status="error")]
    for r, t in zip(recs, ["A", "A", "B", "B"]):
        r.tenant = t
    res = build_results(recs, {})
    apps = res["apps"]
    assert (apps["count"], apps["completed"], apps["failed"]) == (3, 2, 1)
    comp = [recs[1].finish_s - 0.0, recs[2].finish_s - 1.0]
    assert np.isclose(apps["completion_avg_s"], np.mean(comp))
    assert np.isclose(apps["completion_p90_s"], np.percentile(comp, 90))
    f = res["fairness"]
    x = [np.mean([r.e2e_s / 5 for r in recs[:2]]), recs[2].e2e_s / 5]
    assert np.isclose(f["jain_index"], sum(x) ** 2 / (2 * sum(v * v for v in x)))
    assert set(res["by_tenant"]) == {"A", "B"}
    assert jain([1, 1, 1]) == 1.0 and np.isclose(jain([1, 0, 0]), 1 / 3) and jain([]) is None
