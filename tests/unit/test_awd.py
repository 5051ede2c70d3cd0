"""AWD short-prefill batching: window, depth adaptation, SLA early dispatch, buckets (hand cases)."""

from __future__ import annotations

import pytest

from raycluster.request import SLO, Request
from raycluster.sched.awd import AWDBatcher, AWDConfig, BatchOutcome
from raycluster.sched.base import SLOConfig

CFG = AWDConfig(buckets=(8, 16, 32, 64), depths=(1, 2, 4, 8), token_budget=256, sigma_s=0.005,
                w_min_s=0.0, w_max_s=0.02, t_max_s=0.05, service_s=0.01)


def req(rid: str, n: int, arrival: float = 0.0, ttft: float | None = None) -> Request:
    return Request(rid, [1] * n, arrival_time=arrival, slo=SLO(ttft_s=ttft))


def ids(batch):
    return None if batch is None else [r.request_id for r in batch]


def test_initial_depth_is_largest_captured_shape_in_budget():
    b = AWDBatcher(CFG)
    assert b.depth_target == 8 and b.window == 0.02
    assert b.ready_batch(0.0) is None and b.next_wakeup(0.0) is None


def test_window_expiry_dispatches_partial_batch_and_shrinks_depth():
    b = AWDBatcher(CFG)
    for i, t in enumerate((0.0, 0.001, 0.002)):
        b.add(req(f"r{i}", 10, arrival=t), t)
    assert b.ready_batch(0.01) is None
    assert b.next_wakeup(0.003) == pytest.approx(0.02)
    assert ids(b.ready_batch(0.02)) == ["r0", "r1", "r2"]
    assert b.depth_target == 2          # d = 3 < D = 8 -> D <- 3, rounded down to captured 2
    assert b.window == 0.02             # W only adapts on full batches


def test_full_batch_dispatches_at_once_and_sets_window_to_fill_time():
    b = AWDBatcher(CFG)
    b.depth_target = 2
    b.add(req("a", 10, arrival=1.0), 1.0)
    assert b.ready_batch(1.0) is None
    b.add(req("b", 12, arrival=1.001), 1.001)
    assert ids(b.ready_batch(1.001)) == ["a", "b"]
    assert b.window == pytest.approx(0.001) and b.depth_target == 2


def test_sla_slack_triggers_early_dispatch():
    b = AWDBatcher(CFG)
    b.add(req("u", 10, arrival=0.0, ttft=0.02), 0.0)
    # slack reaches sigma at DDL - S - sigma = 0.02 - 0.01 - 0.005
    assert b.next_wakeup(0.0) == pytest.approx(0.005)
    assert b.ready_batch(0.004) is None
    assert ids(b.ready_batch(0.005)) == ["u"]


def test_head_of_line_cap():
    b = AWDBatcher(AWDConfig(**{**CFG.__dict__, "w_max_s": 1.0}))
    b.add(req("a", 10), 0.0)
    assert b.next_wakeup(0.0) == pytest.approx(0.05)
    assert ids(b.ready_batch(0.05)) == ["a"]


def test_bucket_first_grouping_pads_smaller_into_anchor_bucket():
    b = AWDBatcher(CFG, SLOConfig(ttft_ms=1000))
    b.add(req("mid", 10, arrival=0.0), 0.0)       # bucket 16, most urgent (earliest arrival)
    b.add(req("big", 60, arrival=0.001), 0.001)   # bucket 64: not with a 16 anchor
    b.add(req("tiny", 5, arrival=0.002), 0.002)   # bucket 8: pads up to 16
    assert ids(b.ready_batch(0.02)) == ["mid", "tiny"]
    assert len(b) == 1 and b.round_start == pytest.approx(0.02)   # next round starts at once


def test_token_budget_caps_depth_and_counts_as_full():
    b = AWDBatcher(CFG)
    for i in range(5):
        b.add(req(f"r{i}", 60, arrival=i * 1e-4), i * 1e-4)    # bucket 64: 256 / 64 = 4 fit
    assert b.next_wakeup(0.0005) == 0.0005
    assert ids(b.ready_batch(0.0005)) == ["r0", "r1", "r2", "r3"]


def test_backlog_raises_depth_again():
    b = AWDBatcher(CFG)
    b.depth_target = 1
    for i in range(6):
        b.add(req(f"r{i}", 10, arrival=0.0), 0.0)
    assert len(b.ready_batch(0.0)) == 6           # backlog leaves together
    assert b.depth_target == 4                    # 6 rounded down to a captured depth


def test_graph_window_from_arrival_rate():
    b = AWDBatcher(CFG)
    b.depth_target = 2
    for i, t in enumerate((0.0, 0.001, 0.002)):    # 1 ms gaps -> 1000 req/s
        b.add(req(f"r{i}", 10, arrival=t), t)
    assert ids(b.ready_batch(0.002)) == ["r0", "r1", "r2"]   # depth 3 >= 2: full at once
    b.add(req("x", 10, arrival=0.003), 0.003)      # new round: D = 2, one missing -> ~1 ms
    assert b.round_window == pytest.approx(1 / b.arrival_rate())
    assert b.round_window < 0.002


def test_observe_updates_service_estimate():
    b = AWDBatcher(CFG)
    b.observe(BatchOutcome(depth=4, service_s=0.02))
    assert b.service == pytest.approx(0.012)
