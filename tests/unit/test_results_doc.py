"""results_doc: the experiment setups and the verdicts computed from data (no simulation runs)."""

from __future__ import annotations

import math

from raycluster.sim import results_doc, results_render, results_setup
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
    whole = [j for j in jobs if j["key"][1] == "fcfs-whole/all"]
    assert whole and all(j["spec"]["engine"]["chunk_size"] is None for j in whole)


def test_highest_full_qps_stops_at_first_miss():
    assert results_render.highest_full_qps([2, 4, 6, 8], [1.0, 1.0, 0.99, 1.0]) == 4
    assert results_render.highest_full_qps([2, 4, 6, 8], [1.0, 1.0, 0.99, 1.0], 0.99) == 8
    assert results_render.highest_full_qps([2, 4], [0.9, 1.0]) is None


def kairos_data(att: dict[str, list[float]], tpot: dict[str, list[float]], qps=(2, 4, 6)) -> dict:
    d = {}
    for c in results_setup.KAIROS_CFGS:
        for i, q in enumerate(qps):
            d[("kairos", c, q)] = {"summary": {"ttft_slo_attainment": att.get(c, [1.0] * len(qps))[i],
                                               "tpot_slo_attainment": tpot.get(c, [1.0] * len(qps))[i]}}
    return d


def test_kairos_verdict_from_data():
    d = kairos_data({"fcfs-whole/all": [1.0, 0.9, 0.5], "fcfs/all": [1.0, 0.99, 0.6],
                     "kairos/all": [1.0, 1.0, 0.7]},
                    {"kairos/all": [1.0, 0.98, 0.9], "kairos/kairos": [1.0, 0.99, 0.8]})
    v = results_render.kairos_verdict(d)
    assert v["kairos/all"]["full"] == 4 and v["fcfs/all"]["full"] == 2 and v["fcfs/all"]["99"] == 4
    assert v["tpot_better"] == [4] and v["tpot_worse"] == [6]


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
