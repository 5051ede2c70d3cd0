"""The simulator leaves no cyclic garbage, so running it under `quiet_gc` (a generation-0
threshold of a million) costs no memory: refcounting frees every per-event object."""

from __future__ import annotations

import gc

import pytest

from loadgen.workloads import make_workload
from raycluster.sim.cluster import SimCluster
from raycluster.sim.gcquiet import quiet_gc
from raycluster.sim.spec import SimSpec
from tests.unit.test_sim_golden import CASES


@pytest.mark.parametrize("fast", [False, True])
@pytest.mark.parametrize("name", ["speed-stepwise", "pd-transfers", "tight-kv-preempt"])
def test_no_reference_cycles(name, fast):
    spec, wl = CASES[name]
    cluster = SimCluster(SimSpec(**spec), make_workload(**wl), fast_decode=fast)
    gc.collect()
    was = gc.isenabled()
    gc.disable()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        cluster.run()
        found = gc.collect()
        kinds = sorted({type(o).__name__ for o in gc.garbage})
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        if was:
            gc.enable()
    assert cluster.done == len(cluster.records)
    assert found == 0, f"cyclic garbage: {kinds}"


def test_quiet_gc_restores_thresholds():
    before = gc.get_threshold()
    with quiet_gc(123_456):
        assert gc.get_threshold()[0] == max(123_456, before[0])
    assert gc.get_threshold() == before
