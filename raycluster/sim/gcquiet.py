"""How a simulation run treats Python's cyclic garbage collector (speed only, never results).

Owns `quiet_gc()`, the context every run loop executes in (`SimCluster.run`, `sim.speed`).
Freezing moves the objects alive at the start (workload, records, instances) out of the
collector's view. The generation-0 threshold is raised because a run's young objects include
request token lists of thousands of ints that every young collection traverses: at the default
threshold collections took ~12-15% of a saturated run's CPU. The simulator creates no reference
cycles per event (tests/unit/test_sim_gc.py), so refcounting frees its garbage and the rare
collections left only bound memory if a cycle ever appears. Thresholds are restored on exit.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager

GEN0_THRESHOLD = 1_000_000


@contextmanager
def quiet_gc(gen0: int = GEN0_THRESHOLD) -> Iterator[None]:
    old = gc.get_threshold()
    gc.freeze()
    gc.set_threshold(max(gen0, old[0]), *old[1:])
    try:
        yield
    finally:
        gc.set_threshold(*old)
        gc.unfreeze()
