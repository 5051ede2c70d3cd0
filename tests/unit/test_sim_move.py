"""The simulator's pressure-controller move: the moved instance schedules by the target pool's
config from its next step on (policy, packer, decode selector), with or without the decode fast
path, every request still finishes, and its stats report the new role and scheduling together.
(The engine's side: test_move_reconf.py.)"""

from __future__ import annotations

import pytest

from loadgen.workloads import make_workload
from raycluster.sched.base import AllDecodes
from raycluster.sched.kairos_decode import KairosDecodeSelector
from raycluster.sched.medha_packer import MedhaPacker
from raycluster.sched.policies.fcfs import FCFSPolicy
from raycluster.sched.policies.lars import LARSPolicy
from raycluster.sched.token_packer import TokenBudgetPacker
from raycluster.sim.cluster import SimCluster
from raycluster.sim.spec import SimSpec

SPEC = {"gpu": "cpu", "model": "tiny", "policy": "lars", "kv_cache_tokens": 32768,
        "predictor": {"overhead_s": 0.005, "per_prefill_token_s": 0.0001, "per_decode_s": 0.0003,
                      "per_decode_kv_s": 1e-6},
        "engine": {"max_num_batched_tokens": 1024, "max_num_seqs": 64},
        # (The short pool uses the token packer here; tests/unit/test_sim_awd.py covers AWD.)
        "pools": [{"role": "prefill-short", "instances": 2,
                   "engine": {"policy": "edf", "packer": "token", "chunk_size": 256}},
                  {"role": "prefill-long", "instances": 1},
                  {"role": "decode", "instances": 1,
                   "engine": {"policy": "fcfs", "packer": "token", "decode_selector": "kairos"}}]}


@pytest.mark.parametrize("fast", [False, True])
@pytest.mark.parametrize("target", ["decode", "prefill-long"])
def test_sim_moved_instance_runs_the_target_pools_scheduling(fast, target):
    wl = make_workload("long-mix", seed=3, qps=30, num_requests=80, long_fraction=0.2,
                       long_tokens=(1024, 3000), max_output_tokens=24)
    cluster = SimCluster(SimSpec(**SPEC), wl, fast_decode=fast)
    cluster.loop.run(until=0.8)                          # mid-run: requests queued and running
    inst = cluster.instances["prefill-short-0"]
    assert type(inst.scheduler.packer) is TokenBudgetPacker and inst.scheduling == "edf/token/all"
    assert inst.scheduler.requests, "moved too late: nothing to carry over"
    cluster.move("prefill-short-0", target)
    if inst.busy:           # a step is running: the move waits for its end, as on the real instance
        assert inst.role == "prefill-short" and inst.scheduling == "edf/token/all"
    cluster.run()
    want = {"decode": (FCFSPolicy, TokenBudgetPacker, KairosDecodeSelector, "fcfs/token/kairos"),
            "prefill-long": (LARSPolicy, MedhaPacker, AllDecodes, "lars/medha/all")}[target]
    s = inst.scheduler
    assert (type(s.policy), type(s.packer), type(s.decode_selector), inst.scheduling) == want
    assert inst.role == target and inst.stats().scheduling == want[3]
    assert cluster.router.instances["prefill-short-0"].role == target
    assert all(r.status == "ok" for r in cluster.records.values())
    cluster.check_conservation()


def test_sim_instance_moved_away_and_back_takes_up_its_old_pieces():
    """There and back (the controller's moves between the prefill pools): the pieces it had
    come back (RetiredScheduling), and every request still finishes."""
    wl = make_workload("long-mix", seed=3, qps=30, num_requests=80, long_fraction=0.2,
                       long_tokens=(1024, 3000), max_output_tokens=24)
    cluster = SimCluster(SimSpec(**SPEC), wl)
    cluster.loop.run(until=0.8)
    inst = cluster.instances["prefill-short-0"]
    pieces = (inst.scheduler.policy, inst.scheduler.packer)
    cluster.move("prefill-short-0", "prefill-long")
    cluster.loop.run(until=1.2)
    assert inst.role == "prefill-long" and type(inst.scheduler.packer) is MedhaPacker
    cluster.move("prefill-short-0", "prefill-short")
    cluster.run()
    assert inst.role == "prefill-short"
    assert inst.scheduler.policy is pieces[0] and inst.scheduler.packer is pieces[1]
    assert all(r.status == "ok" for r in cluster.records.values())
    cluster.check_conservation()
