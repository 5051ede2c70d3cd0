"""The simulator with PLA-Serve's AWD packer (sched/awd_packer.py): requests AWD holds back for
its waiting window are released when the window (or head-of-line cap, or SLA trigger) falls
due, by a wake-up event at that time -- not by polling and not never. Checked: a hand-computed
case, every request finishing on P/D and mixed pools (stepwise, decode runs, fast path) and
after a move into an AWD pool, decode runs matching step-by-step while AWD holds requests, and
determinism.
"""

from __future__ import annotations

import json

import pytest

from loadgen.workloads import Workload, WorkloadRequest, make_workload
from raycluster.sched.awd import AWDConfig
from raycluster.sched.awd_packer import AWDPacker
from raycluster.sim.cluster import SimCluster
from raycluster.sim.run import simulate
from raycluster.sim.spec import SimSpec

PRED = {"overhead_s": 0.01, "per_prefill_token_s": 0.001, "per_decode_s": 0.0005, "per_decode_kv_s": 1e-6}
PD_POOLS = [{"role": "prefill-short", "engine": {"packer": "awd"}}, {"role": "decode", "engine": {"packer": "token"}}]
MIXED_POOLS = [{"role": "mixed", "engine": {"packer": "awd"}}]
W = AWDConfig().w_max_s          # the first round's window (no arrival rate known yet)


def spec(pools, **kw) -> SimSpec:
    base = dict(gpu="cpu", model="tiny", policy="fcfs", predictor=PRED, kv_cache_tokens=32768,
                engine={"max_num_batched_tokens": 2048, "max_num_seqs": 64}, pools=pools)
    base.update(kw)
    return SimSpec(**base)


def chat(**kw) -> Workload:
    return make_workload(**{"name": "chat", "seed": 0, "qps": 2, "duration": 20, "max_output_tokens": 8, **kw})


def test_held_request_is_released_when_its_window_expires():
    """One 100-token prompt at t=0.3: AWD waits its full window W (depth 1 < target), then the
    prefill runs (0.01 + 0.1 s); two decode steps of 0.01 + 0.0005 + KV term follow."""
    w = Workload("t", {"seed": 0}, [WorkloadRequest("r0", 0.3, 100, 3)])
    res = simulate(spec(MIXED_POOLS), w, check=True)
    r = res["requests"][0]
    assert r["status"] == "ok" and r["num_output_tokens"] == 3
    assert r["ttft_s"] == pytest.approx(W + 0.01 + 0.1, abs=1e-9)
    # No polling: arrival, one wake-up, the prefill step, two decode steps (one run or two).
    assert res["meta"]["sim"]["events"] <= 5


@pytest.mark.parametrize("pools", [PD_POOLS, MIXED_POOLS], ids=["pd", "mixed"])
@pytest.mark.parametrize("path", ["stepwise", "runs", "fast"])
def test_every_request_finishes_with_awd(pools, path):
    res = simulate(spec(pools, coalesce_decode=path == "runs"), chat(), check=True, fast_decode=path == "fast")
    assert res["summary"]["completed"] == len(res["requests"]) > 20
    assert all(r["status"] == "ok" for r in res["requests"])
    assert res["meta"]["sim"]["decode_path"] == path
    # Each held batch costs one wake-up at most: events stay a small multiple of the requests.
    assert res["meta"]["sim"]["events"] < 20 * len(res["requests"])


def test_requests_held_together_leave_as_one_batch_at_window_expiry():
    """Two prompts 5 ms apart: the second joins the round the first opened; both run in one
    prefill step when that round's window W expires (0.01 + 150 tokens x 1 ms)."""
    w = Workload("t", {"seed": 0}, [WorkloadRequest("r0", 0.0, 100, 2), WorkloadRequest("r1", 0.005, 50, 2)])
    res = simulate(spec(MIXED_POOLS), w, check=True)
    first = {r["request_id"]: r["first_token_s"] for r in res["requests"]}
    assert first["r0"] == first["r1"] == pytest.approx(W + 0.01 + 0.15, abs=1e-9)
    assert res["meta"]["sim"]["steps"] == 2


@pytest.mark.parametrize("pools", [PD_POOLS, MIXED_POOLS], ids=["pd", "mixed"])
def test_decode_runs_match_step_by_step_with_awd(pools):
    """Long decodes alongside short prompts AWD holds: a run never starts (and an arrival cuts
    one) while AWD holds requests, so runs give the step-by-step times."""
    w = lambda: chat(qps=6, duration=10, max_output_tokens=120)  # noqa: E731
    a = simulate(spec(pools, coalesce_decode=True), w(), check=True)
    b = simulate(spec(pools, coalesce_decode=False), w(), check=True)
    for ra, rb in zip(a["requests"], b["requests"]):
        assert ra["request_id"] == rb["request_id"] and ra["status"] == rb["status"] == "ok"
        for k in ("first_token_s", "finish_s"):
            assert ra[k] == pytest.approx(rb[k], abs=1e-9), (ra["request_id"], k)
    assert a["meta"]["sim"]["steps"] == b["meta"]["sim"]["steps"]
    assert a["meta"]["sim"]["events"] < b["meta"]["sim"]["events"]


def test_deterministic_with_awd():
    runs = [simulate(spec(PD_POOLS), chat(seed=3, qps=5)) for _ in range(2)]
    assert json.dumps(runs[0]["requests"], sort_keys=True) == json.dumps(runs[1]["requests"], sort_keys=True)
    assert runs[0]["meta"]["sim"]["events"] == runs[1]["meta"]["sim"]["events"]


@pytest.mark.parametrize("fast", [False, True])
def test_instance_moved_into_an_awd_pool_releases_what_it_holds(fast):
    pools = [{"role": "prefill-short", "instances": 1, "engine": {"packer": "awd"}},
             {"role": "prefill-long", "instances": 1, "engine": {"packer": "token"}},
             {"role": "decode", "instances": 1, "engine": {"packer": "token"}}]
    cluster = SimCluster(spec(pools), chat(qps=6), fast_decode=fast)
    cluster.loop.run(until=2.0)
    inst = cluster.instances["prefill-long-1"]
    before = inst.steps
    cluster.move("prefill-long-1", "prefill-short")
    cluster.run()
    assert type(inst.scheduler.packer) is AWDPacker and inst.steps > before
    assert all(r.status == "ok" for r in cluster.records.values())
    cluster.check_conservation()
