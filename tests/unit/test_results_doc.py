"""results_doc: the experiment setups and the verdicts computed from data (no simulation runs)."""

from __future__ import annotations

import math

from raycluster.sim import results_doc, results_kairos, results_render, results_setup
from raycluster.sim.spec import SimSpec


def test_every_job_has_a_valid_spec_and_experiment_renderer():
    for name in results_doc.EXPERIMENTS:
        assert name in results_doc.RENDER
        for job in results_setup.jobs_for(name, quick=True):
            assert job["key"][0] == name
            SimSpec(**job["spec"])


def test_kairos_setup_per_instance_queues_and_one_chunk_budget():
    jobs = results_setup.jobs_for("kairos", quick=False)
    assert {j["key"][1] for j in jobs} == set(results_setup.KAIROS_CFGS)
    for j in jobs:
        spec = j["spec"]
        assert spec["router"]["max_local_waiting"] >= 1000          # each prefill instance orders its own queue
        chunk = spec["engine"]["chunk_size"]
        assert chunk in (None, spec["engine"]["max_num_batched_tokens"])   # Alg. 1: one chunk budget C
        assert j["wl"]["long_tokens"] == results_setup.KAIROS_LONG_TOKENS
        assert j["wl"]["seed"] == j["key"][3] and j["ttft_misses"]
    whole = [j for j in jobs if j["key"][1] == "fcfs-whole/all"]
    assert whole and all(j["spec"]["engine"]["chunk_size"] is None for j in whole)
    assert len({tuple(j["key"]) for j in jobs}) == len(jobs)


def test_kairos_prefill_sweep_covers_every_seed_at_every_point():
    jobs = results_setup.jobs_for("kairos", quick=False)
    pre = [j for j in jobs if j["key"][4] == "prefill"]
    assert {(j["key"][1], j["key"][2], j["key"][3]) for j in pre} == {
        (c, q, s) for c in results_setup.KAIROS_PREFILL_CFGS for q in results_setup.KAIROS_QPS
        for s in results_setup.KAIROS_SEEDS}
    assert all(j["wl"]["duration"] == results_setup.KAIROS_DURATION_S for j in pre)
    dec = [j for j in jobs if j["key"][4] == "decode"]
    assert {j["key"][1] for j in dec} == set(results_setup.KAIROS_DECODE_CFGS)
    assert all(j["wl"]["seed"] == results_setup.KAIROS_DECODE_SEED for j in dec)


def test_ttft_misses_per_class():
    reqs = [{"klass": "short", "ttft_ok": True, "prompt_tokens": 100, "ttft_s": 1.0},
            {"klass": "long", "ttft_ok": False, "prompt_tokens": 30000, "ttft_s": 12.0},
            {"klass": "long", "ttft_ok": False, "prompt_tokens": 20000, "ttft_s": 9.0},
            {"klass": "long", "ttft_ok": True, "prompt_tokens": 9000, "ttft_s": 3.0},
            {"klass": "short", "ttft_ok": False, "prompt_tokens": 50, "ttft_s": 20.0, "warmup": True}]
    m = results_setup.ttft_misses(reqs)
    assert m["short"] == {"n": 1, "misses": 0, "prompt_min": None, "prompt_max": None,
                          "ttft_min_s": None, "ttft_max_s": None, "ttft_p50_s": None}
    assert m["long"]["n"] == 3 and m["long"]["misses"] == 2
    assert (m["long"]["prompt_min"], m["long"]["prompt_max"]) == (20000, 30000)
    assert (m["long"]["ttft_min_s"], m["long"]["ttft_max_s"], m["long"]["ttft_p50_s"]) == (9.0, 12.0, 10.5)


def test_highest_full_qps_stops_at_first_miss():
    assert results_kairos.highest_full_qps([2, 4, 6, 8], [1.0, 1.0, 0.99, 1.0]) == 4
    assert results_kairos.highest_full_qps([2, 4, 6, 8], [1.0, 1.0, 0.99, 1.0], 0.99) == 8
    assert results_kairos.highest_full_qps([2, 4], [0.9, 1.0]) is None


def kairos_data(att: dict[str, list[list[float]]], tpot: dict[str, list[float]], qps=(2, 4, 6), seeds=(1, 2)) -> dict:
    """att: config -> per QPS point, one TTFT attainment per seed; tpot: the decode runs (one seed)."""
    d = {}
    for c in results_setup.KAIROS_PREFILL_CFGS:
        for i, q in enumerate(qps):
            for j, s in enumerate(seeds):
                a = att.get(c, [[1.0] * len(seeds)] * len(qps))[i][j]
                d[("kairos", c, q, s, "prefill")] = {
                    "key": ["kairos", c, q, s, "prefill"], "num_requests": 1000,
                    "summary": {"ttft_slo_attainment": a},
                    "by_class": {"short": {"ttft_p99_s": 2.0}, "long": {"ttft_p99_s": 9.0}},
                    "ttft_misses": {"short": {"n": 900, "misses": 0},
                                    "long": {"n": 100, "misses": round((1 - a) * 1000), "prompt_min": 20000,
                                             "prompt_max": 40000, "ttft_min_s": 8.1, "ttft_max_s": 15.0}}}
    for c in results_setup.KAIROS_DECODE_CFGS:
        for i, q in enumerate(qps):
            d[("kairos", c, q, 1, "decode")] = {"summary": {"tpot_slo_attainment": tpot.get(c, [1.0] * len(qps))[i]}}
    return d


def test_kairos_verdict_from_mean_over_seeds(monkeypatch):
    monkeypatch.setattr(results_kairos, "_plot", lambda *a, **k: None)     # not over docs/figures
    d = kairos_data({"fcfs-whole/all": [[1.0, 1.0], [0.9, 0.95], [0.5, 0.6]],
                     "fcfs/all": [[1.0, 1.0], [0.99, 1.0], [0.6, 0.7]],
                     "kairos/all": [[1.0, 1.0], [1.0, 1.0], [0.7, 0.8]]},
                    {"kairos/all": [1.0, 0.98, 0.9], "kairos/kairos": [1.0, 0.99, 0.8]})
    v = results_kairos.kairos_verdict(d)
    assert v["kairos/all"]["full"] == 4 and v["fcfs/all"]["full"] == 2 and v["fcfs/all"]["99"] == 4
    assert v["fcfs/all"]["mean"][1] == 0.995 and v["fcfs/all"]["min"][1] == 0.99
    assert v["fcfs/all"]["seed_full"] == {1: 2, 2: 4} and v["kairos/all"]["seed_full"] == {1: 4, 2: 4}
    assert v["claim_full"] and not v["claim_99"]
    assert v["seeds_higher_full"] == [1] and v["seeds_lower_full"] == []
    assert v["tpot_better"] == [4] and v["tpot_worse"] == [6]
    text = results_kairos.render_kairos(d)
    assert "Urgency keeps 100% to a higher QPS than both FCFS baselines: yes" in text
    assert "| 4 | 2000 |" in text and "0.9950 [0.9900, 1.0000]" in text


def test_kairos_verdict_no_when_urgency_misses_first(monkeypatch):
    monkeypatch.setattr(results_kairos, "_plot", lambda *a, **k: None)
    d = kairos_data({"kairos/all": [[1.0, 0.999], [0.99, 0.995], [0.9, 0.9]],
                     "fcfs/all": [[1.0, 1.0], [1.0, 0.999], [0.9, 0.9]]}, {})
    v = results_kairos.kairos_verdict(d)
    assert v["kairos/all"]["full"] is None and v["fcfs/all"]["full"] == 2 and v["fcfs-whole/all"]["full"] == 6
    text = results_kairos.render_kairos(d)
    assert "Urgency keeps 100% to a higher QPS than both FCFS baselines: NO" in text
    # Who misses: at QPS 4 (every order >= 99% on average) urgency's misses are long prompts.
    assert "At QPS 4" in text and "urgency misses 0 short and 15 long" in text


def test_bounded_tail():
    assert results_render.bounded_tail([70.0, 90.0, 100.0, 101.0, 100.5])
    assert not results_render.bounded_tail([80.0, 111.0, 179.0, 311.0, 564.0])
    assert not results_render.bounded_tail([80.0, 90.0, math.inf])
    assert not results_render.bounded_tail([80.0, 90.0])


def test_justitia_jobs_cover_both_service_rates():
    jobs = results_setup.jobs_for("justitia", quick=True)
    pols = {j["key"][1] for j in jobs}
    assert pols == set(results_setup.JUSTITIA_POLS)
    kv = [j for j in jobs if j["key"][1] == "justitia-kv"]
    assert kv and all(j["justitia_m"] == "kv" and j["spec"]["policy"] == "justitia" for j in kv)
    assert all(j["wl"]["mice_qps"] == results_setup.JUSTITIA_MICE_QPS for j in jobs)


def test_justitia_apps_jobs_and_verdict():
    jobs = results_setup.jobs_for("justitia-apps", quick=True)
    assert jobs and all(j["tenant_per_app"] and j["wl"]["name"] == "apps" for j in jobs)
    d = {}
    for q, avg in ((1.0, {"justitia": 3.0, "justitia-kv": 5.0, "vtc": 4.0}), (2.0, {"justitia": 8.0, "justitia-kv": 27.0, "vtc": 15.0})):
        for p, a in avg.items():
            d[("justitia-apps", p, q)] = {"apps": {"completion_avg_s": a, "completion_p99_s": 2 * a}}
    text = results_render.render_justitia_apps(d)
    assert "Justitia (M measured): True" in text and "Justitia (M = KV cache / iteration): False" in text


def test_speed_window_row_states_minutes_per_hour_and_verdict():
    from raycluster.sim.results_render import render_speed
    from raycluster.sim.results_setup import jobs_for

    keys = [j["key"] for j in jobs_for("speed", quick=True)]
    assert ["speed", "window", 700.0] in keys
    run = {"window_s": [10.0, 20.0], "wall_s": 5.0, "events_per_s": 1000.0}
    fast = {**run, "path": "fast", "wall_s_per_sim_hour": 1800.0}
    exact = {**run, "path": "exact", "wall_s": 20.0, "wall_s_per_sim_hour": 7200.0}
    text = render_speed({("speed", "window", 700.0): {"runs": [fast, exact]}})
    assert "30.0 minutes per simulated hour" in text and "120.0 minutes per hour" in text
    assert "speed-up 4.0x" in text and "NOT met" in text


def test_prefix_jobs_and_verdict():
    from raycluster.sim import results_prefix as rp

    jobs = results_setup.jobs_for("prefix", quick=False)
    assert {(j["key"][1], j["key"][2]) for j in jobs} == {(c, q) for c in rp.PREFIX_CFGS for q in rp.PREFIX_QPS}
    for j in jobs:
        eng = SimSpec(**j["spec"]).engine_config(SimSpec(**j["spec"]).pools[0])
        assert eng.enable_prefix_caching == (j["key"][1] != "nocache")
        assert j["spec"].get("router", {}).get("prefix_affinity", True) == (j["key"][1] != "cache-load")
    p90 = {"nocache": [0.3, 0.9, 5.0], "cache-load": [0.2, 0.5, 1.2], "cache": [0.1, 0.3, 0.6]}
    d = {("prefix", c, q): {"summary": {"ttft_p90_s": v}, "sim": {}} for c, vs in p90.items()
         for q, v in zip([4, 8, 12], vs)}
    assert [rp.holds_up_to(d, c) for c in ("nocache", "cache-load", "cache")] == [8, 8, 12]
    d[("prefix", "cache", 4)]["summary"]["ttft_p90_s"] = 1.5        # the first point already fails
    assert rp.holds_up_to(d, "cache") is None
    assert rp.hit_rate({"sim": {"prefix_query_tokens": 200, "prefix_hit_tokens": 50}}) == 0.25
    assert rp.hit_rate({"sim": {}}) is None


def test_spec_decode_jobs_and_verdict(tmp_path, monkeypatch):
    from raycluster.sim import results_spec as rs

    jobs = results_setup.jobs_for("spec-decode", quick=False)
    assert {(j["key"][1], j["key"][2]) for j in jobs} == {(c, q) for c in rs.SPEC_CFGS for q in rs.SPEC_QPS}
    for j in jobs:
        spec = SimSpec(**j["spec"])
        assert (spec.engine_config(spec.pools[0]).speculative_method != "none") == (j["key"][1] != "plain")
    tpot = {"plain": [10.0, 12.0, 15.0], "free-k3": [4.0, 11.0, 20.0], "draft-k4": [4.5, 13.0, 19.0]}
    d = {("spec-decode", c, q): {"summary": {"tpot_p50_s": v / 1e3, "tpot_p99_s": v / 1e3, "ttft_p90_s": 0.1},
                                 "num_requests": 100} for c, vs in tpot.items() for q, v in zip([4, 16, 32], vs)}
    assert [rs.helps_up_to(d, c) for c in ("free-k3", "draft-k4")] == [16, 4]
    monkeypatch.setattr(rs, "DOCS", tmp_path)
    (tmp_path / "figures").mkdir()
    text = rs.render_spec(d)
    assert "at 4 requests/s drafts cut TPOT P50 2.50x / 2.22x" in text
    assert "below the no-draft run up to 16 / 4 requests/s" in text
    assert (tmp_path / "figures" / "spec_decode_tpot.png").exists()
