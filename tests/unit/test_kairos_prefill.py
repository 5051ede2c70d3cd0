"""Kairos urgency (Alg. 1-2) on hand-computed queues.

u_r = (SLO_r - (finish_r - a_r)) / SLO_r / L_r with finish_r = now + sum of remaining prefill
times of the requests that arrived no later than r (FCFS walk); largest u is served first.
The predictor charges 1.0 per prefill token, so times equal token counts.
"""

from __future__ import annotations

import pytest

from raycluster.clock import VirtualClock
from raycluster.request import SLO, Request
from raycluster.sched.base import PolicyContext
from raycluster.sched.predictor import LinearBatchPredictor
from raycluster.sched.registry import make_policy


def setup(per_token: float = 1.0):
    clock = VirtualClock()
    return clock, make_policy("kairos", PolicyContext(clock, LinearBatchPredictor(per_prefill_token_s=per_token)))


def mk(rid, tokens, ttft, t=0.0):
    return Request(rid, [1] * tokens, arrival_time=t, slo=SLO(ttft_s=ttft))


def test_urgency_values_and_order():
    clock, pol = setup()
    r1, r2, r3 = mk("r1", 1000, 5000.0), mk("r2", 100, 2000.0), mk("r3", 200, 1000.0)
    for r in (r1, r2, r3):
        pol.push(r)
    # FCFS finish: 1000, 1100, 1300.  u1 = (5000-1000)/5000/1000, u2 = (2000-1100)/2000/100,
    # u3 = (1000-1300)/1000/200 (already late under FCFS: served last).
    assert pol.urgency(r1) == pytest.approx(0.0008)
    assert pol.urgency(r2) == pytest.approx(0.0045)
    assert pol.urgency(r3) == pytest.approx(-0.0015)
    assert [pol.pop().request_id for _ in range(3)] == ["r2", "r1", "r3"]


def test_order_flips_with_time_alone():
    clock, pol = setup()
    a, b = mk("a", 100, 1000.0), mk("b", 1000, 10_000.0)
    pol.push(a)
    pol.push(b)
    # u_a(t) = (900 - t) / 1e5, u_b(t) = (8900 - t) / 1e7: equal at t = 81100 / 99 = 819.19...
    clock.advance_to(819.0)
    top = pol.pop()
    assert top is a
    pol.push(a)
    clock.advance_to(820.0)
    assert pol.pop() is b


def test_progress_of_earlier_request_moves_later_finish_times():
    clock, pol = setup()
    r1, r2 = mk("r1", 1000, 5000.0), mk("r2", 100, 2000.0)
    pol.push(r1)
    pol.push(r2)
    assert pol.pop() is r2
    got = pol.pop()
    assert got is r1
    clock.advance(600.0)
    r1.num_computed_tokens += 600
    pol.on_progress(r1, 600)
    pol.push(r1)
    # r1: finish = 600 + 400 -> u1 = (5000 - 1000)/5000/1000; r2 (not re-pushed) now sees
    # finish = 600 + 400 + 100 = 1100 -> u2 = (2000 - 1100)/2000/100.
    assert pol.urgency(r1) == pytest.approx(0.0008)
    assert pol.urgency(r2) == pytest.approx(0.0045)


def test_paper_scenario_short_after_long_goes_first():
    clock, pol = setup(per_token=1e-4)            # 10k tokens/s
    long_r = mk("long", 128_000, 15.0)
    pol.push(long_r)
    clock.advance_to(0.1)
    short = mk("short", 8_000, 15.0, t=0.1)
    pol.push(short)
    # long: finish 0.1 + 12.8 -> u = (15 - 12.9)/15/128000; short: finish 0.1 + 13.6 ->
    # u = (15 - 13.6)/15/8000: ten times larger, so the short request is served first.
    assert pol.urgency(long_r) == pytest.approx(2.1 / 15 / 128_000)
    assert pol.urgency(short) == pytest.approx(1.4 / 15 / 8_000)
    assert pol.pop() is short
