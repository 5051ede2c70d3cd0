"""Capacity search (raycluster.sim.search, `raycluster sim-search`): the bisection against a known
threshold, against the simulator itself (the QPS it returns meets the SLOs when re-simulated, the
bracket's other end does not), candidates and grids merged onto the base spec, and the CLI."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import yaml

from loadgen.workloads import make_workload
from raycluster.sim.run import simulate
from raycluster.sim.search import (Constraint, QPSRange, SearchSpec, capacity, check, expand, load_search, merged,
                                   search)
from raycluster.sim.spec import SimSpec

BASE = {"gpu": "a100", "model": "llama-3-8b", "policy": "lars", "pools": [{"role": "mixed", "instances": 1}]}
TTFT_1S = [Constraint(metric="ttft_p99_s", max=1.0)]


def chat_at(q: float):
    return make_workload("chat", seed=1, qps=q, num_requests=150)


def run(spec: SimSpec, q: float) -> dict:
    return simulate(spec, chat_at(q))


def fake_results(q: float, threshold: float) -> dict:
    """A run whose TTFT P99 crosses 1 s exactly at `threshold` QPS."""
    s = {"num_requests": 10, "completed": 10, "ttft_p99_s": q / threshold}
    return {"summary": s, "by_class": {"short": s, "long": s}}


def test_bisection_stops_within_rel_tol_of_a_known_threshold():
    seen = []

    def fake(spec, q):
        seen.append(q)
        return fake_results(q, 7.3)

    qps = QPSRange(min=0.5, max=64, rel_tol=0.05)
    cap = capacity("x", SimSpec(**BASE), fake, TTFT_1S, qps)
    assert cap.status == "ok"
    lo, hi = cap.bracket
    assert lo == cap.capacity_qps <= 7.3 < hi <= lo * 1.05
    # min and max, then geometric halving of log(128) down to log(1.05): ceil(log2(log 128 / log 1.05))
    assert len(seen) == 2 + math.ceil(math.log2(math.log(128) / math.log(1.05)))
    assert seen[:2] == [0.5, 64] and seen[2] == pytest.approx(math.sqrt(32))
    assert [p.ok for p in cap.probes] == [q <= 7.3 for q in seen]


def test_ends_of_the_range():
    spec = SimSpec(**BASE)
    qps = QPSRange(min=1, max=8)
    low = capacity("x", spec, lambda s, q: fake_results(q, 0.5), TTFT_1S, qps)
    assert (low.status, low.capacity_qps, low.bracket, len(low.probes)) == ("below_min", 0.0, (0.0, 1), 1)
    high = capacity("x", spec, lambda s, q: fake_results(q, 100), TTFT_1S, qps)
    assert (high.status, high.capacity_qps, len(high.probes)) == ("at_max", 8, 2)
    cut = capacity("x", spec, lambda s, q: fake_results(q, 100), TTFT_1S, QPSRange(min=1, max=8, max_probes=4))
    assert len(cut.probes) <= 4


def test_the_capacity_found_on_the_simulator_holds_when_simulated_again():
    spec = SimSpec(**BASE)
    qps = QPSRange(min=0.5, max=64, rel_tol=0.05)
    cap = capacity("one", spec, run, TTFT_1S, qps)
    assert cap.status == "ok" and cap.capacity_qps > 0.5
    lo, hi = cap.bracket
    assert hi <= lo * 1.05
    at_lo, at_hi = run(spec, lo), run(spec, hi)
    assert check(at_lo, TTFT_1S) == [] and at_lo["summary"]["ttft_p99_s"] <= 1.0
    assert check(at_hi, TTFT_1S) == ["ttft_p99_s <= 1.0"]
    # The simulator is deterministic for a seed: the probe recorded what this run shows.
    probe = next(p for p in cap.probes if p.qps == lo)
    assert probe.summary["ttft_p99_s"] == at_lo["summary"]["ttft_p99_s"]


def test_two_instances_serve_more_and_win_per_gpu_only_if_they_scale():
    doc = {"spec": BASE, "slo": [{"metric": "ttft_p99_s", "max": 1.0}], "qps": {"min": 0.5, "max": 256},
           "candidates": [{"name": "one"}, {"name": "two", "pools": [{"role": "mixed", "instances": 2}]}]}
    res = search(SearchSpec(**doc), BASE, chat_at)
    one, two = res["candidates"]
    assert (one["num_gpus"], two["num_gpus"]) == (1, 2)
    assert two["capacity_qps"] > 1.5 * one["capacity_qps"]
    best = max(res["candidates"], key=lambda c: c["qps_per_gpu"])
    assert res["best"] == best["name"]
    assert one["at_capacity"]["ttft_p99_s"] <= 1.0


def test_candidates_in_worker_processes_give_the_same_search():
    doc = {"spec": BASE, "slo": [{"metric": "ttft_p99_s", "max": 1.0}], "qps": {"min": 1, "max": 64, "rel_tol": 0.2},
           "candidates": [{"name": "lars"}, {"name": "fcfs", "policy": "fcfs"}]}
    alone = search(SearchSpec(**doc), BASE, chat_at)
    assert search(SearchSpec(**doc), BASE, chat_at, jobs=2) == alone


def test_requests_cut_by_the_horizon_fail_the_probe():
    res = simulate(SimSpec(**BASE), chat_at(4.0), horizon_s=5.0)
    s = res["summary"]
    assert s["completed"] < s["num_requests"]
    assert check(res, TTFT_1S)[0] == f"completed ({s['completed']}/{s['num_requests']})"


def test_candidates_and_grid_merge_onto_the_base():
    base = {**BASE, "engine": {"chunk_size": 512, "max_num_seqs": 64}}
    doc = {"spec": base, "slo": [{"metric": "slo_attainment", "min": 0.99}],
           "candidates": [{"name": "m2", "pools": [{"role": "mixed", "instances": 2, "tp": 2}],
                           "engine": {"max_num_seqs": 32}},
                          {"name": "pd", "pools": [{"role": "prefill-short", "instances": 1},
                                                   {"role": "decode", "instances": 3}]}],
           "grid": {"policy": ["fcfs", "edf"], "engine.chunk_size": [256, 1024]}}
    specs = dict(expand(SearchSpec(**doc), base))
    assert list(specs) == [f"{c}/policy={p},engine.chunk_size={k}" for c in ("m2", "pd")
                           for p in ("fcfs", "edf") for k in (256, 1024)]
    m2 = specs["m2/policy=edf,engine.chunk_size=256"]
    assert (m2.policy, m2.engine, m2.num_gpus) == ("edf", {"chunk_size": 256, "max_num_seqs": 32}, 4)
    pd = specs["pd/policy=fcfs,engine.chunk_size=1024"]
    assert [p.role for p in pd.pools] == ["prefill-short", "decode"] and pd.num_gpus == 4
    assert pd.engine == {"chunk_size": 1024, "max_num_seqs": 64}
    assert merged({"a": {"b": 1, "c": [1]}}, {"a": {"c": [2]}}) == {"a": {"b": 1, "c": [2]}}


@pytest.mark.parametrize("doc, match", [
    ({"slo": [{"metric": "ttft_p99", "max": 1}]}, "metric: 'ttft_p99' is not a results summary key"),
    ({"slo": [{"metric": "ttft_p99_s", "max": 1, "min": 0}]}, "exactly one of max or min"),
    ({"slo": [{"metric": "ttft_p99_s", "max": 1, "class": "medium"}]}, "class: 'medium'"),
    ({"slo": []}, "slo"),
    ({"qps": {"min": 4, "max": 2}}, r"qps.max \(2.0\) must exceed qps.min"),
    ({"candidates": [{"name": "a"}, {"name": "a"}]}, "names must be unique"),
    ({"base": "x.yaml"}, "not both or neither"),
])
def test_search_file_errors_name_the_field(doc, match):
    full = {"spec": BASE, "slo": [{"metric": "ttft_p99_s", "max": 1}], **doc}
    with pytest.raises(ValueError, match=match):
        SearchSpec(**full)


def test_a_candidate_the_simulator_refuses_is_named():
    doc = {"spec": BASE, "slo": [{"metric": "ttft_p99_s", "max": 1}],
           "candidates": [{"name": "nodecode", "pools": [{"role": "prefill-short", "instances": 1}]}]}
    with pytest.raises(ValueError, match="(?s)candidate .nodecode.: .*prefill pools need a decode pool"):
        expand(SearchSpec(**doc), BASE)


def test_a_class_constraint_reads_that_class():
    c = Constraint.model_validate({"metric": "ttft_p90_s", "max": 0.5, "class": "long"})
    res = {"summary": {"ttft_p90_s": 0.1}, "by_class": {"short": {"ttft_p90_s": 0.1}, "long": {"ttft_p90_s": 0.9}}}
    assert (c.value(res), c.holds(res), c.label()) == (0.9, False, "long.ttft_p90_s <= 0.5")
    res["by_class"]["long"]["ttft_p90_s"] = 0.5           # bounds are inclusive
    assert c.holds(res)
    assert Constraint(metric="slo_attainment", min=0.99).holds({"summary": {"slo_attainment": 0.99}})
    res["by_class"]["long"]["ttft_p90_s"] = None          # no long request: nothing shows it is met
    assert not c.holds(res)


def test_cli_writes_the_search_and_prints_the_table(tmp_path, capsys):
    from raycluster.cli import main

    (tmp_path / "base.yaml").write_text(yaml.safe_dump(BASE))
    (tmp_path / "s.yaml").write_text(yaml.safe_dump({
        "base": "base.yaml", "slo": [{"metric": "ttft_p99_s", "max": 1.0}], "qps": {"min": 1, "max": 16},
        "candidates": [{"name": "one"}, {"name": "two", "pools": [{"role": "mixed", "instances": 2}]}]}))
    search_file, _ = load_search(tmp_path / "s.yaml")
    assert search_file.base == "base.yaml"
    out = tmp_path / "r.json"
    assert main(["sim-search", "--search", str(tmp_path / "s.yaml"), "--workload", "chat", "--num-requests", "80",
                 "--seed", "1", "--qps", "3", "--out", str(out), "--quiet"]) == 0
    res = json.loads(out.read_text())
    assert [c["name"] for c in res["candidates"]] == ["one", "two"]
    assert res["constraints"] == ["ttft_p99_s <= 1.0"] and res["meta"]["workload"] == "chat"
    for c in res["candidates"]:
        assert c["probes"] and all(p["ok"] == (p["qps"] <= c["capacity_qps"]) for p in c["probes"]), c
    printed = capsys.readouterr()
    assert printed.out.startswith("| candidate | GPUs | capacity QPS |") and f"best: {res['best']}" in printed.out
    assert "--qps is ignored" in printed.err

    (tmp_path / "bad.yaml").write_text(yaml.safe_dump({"base": "base.yaml", "slo": [{"metric": "nope", "max": 1}]}))
    assert main(["sim-search", "--search", str(tmp_path / "bad.yaml"), "--workload", "chat", "--num-requests", "8",
                 "--out", str(out)]) == 2
    assert "metric: 'nope'" in capsys.readouterr().err


@pytest.mark.parametrize("name", sorted(p.name for p in (Path(__file__).parents[2] / "sims" / "searches").glob("*.yaml")))
def test_every_shipped_search_file_expands(name):
    spec, base = load_search(Path(__file__).parents[2] / "sims" / "searches" / name)
    candidates = expand(spec, base)
    assert len(candidates) == len(spec.candidates) * math.prod(len(v) for v in spec.grid.values())
