"""The KV transfer message plan (pure): which block runs move in place and which are staged."""

import numpy as np
import pytest

from raycluster.kv_transfer.transfer_plan import (TransferPlan, from_runs, ids_checksum,
                                                  plan_transfer, to_runs)

BB = 8 << 10    # bytes of one block of one layer (the tiny model's)
MIN = 32 << 10  # a low direct threshold, so short test runs exercise both paths


def pairs_of(plan: TransferPlan) -> list[tuple[int, int]]:
    out = [(s + i, d + i) for s, d, n in plan.direct for i in range(n)]
    return out + list(zip(plan.gather_src, plan.gather_dst))


def test_runs_roundtrip_and_checksum():
    assert to_runs([]) == [] and from_runs([]) == []
    ids = [4, 5, 6, 9, 10, 3, 7]
    assert to_runs(ids) == [[4, 3], [9, 2], [3, 1], [7, 1]]
    assert from_runs(to_runs(ids)) == ids
    assert ids_checksum(ids) == ids_checksum(list(ids)) != ids_checksum(ids[::-1])


def test_long_runs_go_direct_short_ones_are_staged():
    # a 10-block run, a 3-block run (24 KiB < 32 KiB), a 4-block run, two loose blocks
    src = list(range(100, 110)) + [7, 8, 9] + [50, 51, 52, 53] + [1, 30]
    dst = list(range(0, 10)) + [20, 21, 22] + [40, 41, 42, 43] + [60, 70]
    plan = plan_transfer(src, dst, num_layers=4, block_bytes=BB, min_direct_bytes=MIN)
    assert plan.direct == ((100, 0, 10), (50, 40, 4))
    assert plan.gather_src == (7, 8, 9, 1, 30) and plan.gather_dst == (20, 21, 22, 60, 70)
    assert plan.num_direct_msgs == 8 and plan.chunks == ((0, 20),)
    assert plan.direct_msgs()[:3] == [(0, 100, 0, 10), (0, 50, 40, 4), (1, 100, 0, 10)]
    assert sorted(pairs_of(plan)) == sorted(zip(src, dst))
    # a run is direct only if consecutive on both sides
    p2 = plan_transfer(list(range(8)), [0, 1, 2, 3, 9, 10, 11, 12], 4, BB, min_direct_bytes=MIN)
    assert p2.direct == ((0, 0, 4), (4, 9, 4)) and not p2.gather_src and not p2.chunks
    # the default threshold (1 MiB per layer) stages runs this short
    assert plan_transfer(src, dst, num_layers=4, block_bytes=BB).direct == ()
    assert plan_transfer(list(range(128)), list(range(5, 133)), 4, BB).direct == ((0, 5, 128),)


def test_budget_keeps_the_longest_runs_and_zero_stages_everything():
    src = list(range(0, 4)) + list(range(10, 18)) + list(range(30, 36))
    dst = list(range(100, 118))
    plan = plan_transfer(src, dst, num_layers=4, block_bytes=BB, min_direct_bytes=MIN,
                         max_direct_msgs=8)
    assert plan.direct == ((10, 104, 8), (30, 112, 6))      # 2 runs x 4 layers, the longest two
    assert plan.gather_src == (0, 1, 2, 3)
    staged = plan_transfer(src, dst, 4, BB, min_direct_bytes=MIN, max_direct_msgs=0)
    assert staged.direct == () and staged.gather_src == tuple(src)
    assert staged.gather_dst == tuple(dst)
    with pytest.raises(ValueError, match="destination"):
        plan_transfer([1, 2], [3], 4, BB)


def test_random_plans_partition_the_pairs_and_survive_the_wire():
    rng = np.random.default_rng(0)
    for trial in range(200):
        n = int(rng.integers(1, 300))
        src = rng.permutation(1000)[:n].tolist() if trial % 3 == 0 else \
            sorted(rng.choice(1000, n, replace=False).tolist())
        dst = sorted(rng.choice(2000, n, replace=False).tolist()) if trial % 2 else list(range(n))
        layers = int(rng.integers(1, 40))
        plan = plan_transfer(src, dst, layers, BB, min_direct_bytes=MIN,
                             max_direct_msgs=int(rng.integers(0, 300)))
        assert sorted(pairs_of(plan)) == sorted(zip(src, dst))
        assert plan.num_direct_msgs <= 300
        assert all(n_ * BB >= 32 << 10 for _, _, n_ in plan.direct)
        cells = layers * len(plan.gather_src)
        if cells:
            assert (plan.chunks[0][0], plan.chunks[-1][1]) == (0, cells)
        else:
            assert plan.chunks == ()
        assert TransferPlan.from_wire(plan.to_wire()) == plan
