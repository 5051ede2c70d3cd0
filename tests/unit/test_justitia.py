"""Justitia: finish tags and order equal GPS's on hand-computed cases, and the delay bound
f_j <= GPS f_j + 2 c_max + C_max / M holds on random workloads served by M non-preemptive
slots (an inference of KV token-time c holds one slot for c time units)."""

from __future__ import annotations

import heapq

import pytest
from hypothesis import given, settings, strategies as st

from raycluster.clock import VirtualClock
from raycluster.request import Request
from raycluster.sched.base import PolicyContext
from raycluster.sched.predictor import LinearBatchPredictor
from raycluster.sched.policies.justitia import JustitiaPolicy, kv_token_time, request_cost
from raycluster.sched.registry import make_policy


def req(rid: str, app: str, p: int, d: int, t: float = 0.0) -> Request:
    return Request(rid, [1] * p, arrival_time=t, app_id=app, expected_output_tokens=d)


def test_cost_formula():
    assert kv_token_time(100, 10) == 100 * 10 + 50
    assert request_cost(req("x", "a", 9, 2)) == 20.0
    r = Request("y", [1] * 3)          # no app, no expectation: max_tokens (16)
    assert request_cost(r) == 3 * 16 + 128


def test_simultaneous_apps_follow_gps_finish_order():
    clock = VirtualClock()
    pol = make_policy("justitia", PolicyContext(clock, num_slots=1))
    # Costs 2p + 2: A = 20 (two inferences of 10), B = 10, C = 30.
    for r in [req("a1", "A", 4, 2), req("a2", "A", 4, 2), req("b1", "B", 4, 2), req("c1", "C", 14, 2)]:
        pol.push(r)
    assert {a: pol.finish_tag(a) for a in "ABC"} == {"A": 20.0, "B": 10.0, "C": 30.0}
    assert [pol.pop().request_id for _ in range(4)] == ["b1", "a1", "a2", "c1"]
    # GPS with M = 1: three apps share until V = 10 at t = 30, two until V = 20 at t = 50.
    assert pol.gps.advance(30.0) == 10.0 and set(pol.gps.finish) == {"A", "C"}
    assert pol.gps.advance(50.0) == 20.0 and set(pol.gps.finish) == {"C"}
    assert pol.gps.advance(60.0) == 30.0 and not pol.gps.finish


def test_late_short_app_overtakes_by_virtual_time():
    clock = VirtualClock()
    pol = make_policy("justitia", PolicyContext(clock, num_slots=1))
    pol.push(req("a1", "A", 19, 2))            # C = 40 at t = 0: F = 40
    clock.advance_to(10.0)                     # V(10) = 10 (A alone at rate 1)
    pol.push(req("b1", "B", 4, 2))             # C = 10: F = 20 < 40
    assert (pol.finish_tag("A"), pol.finish_tag("B")) == (40.0, 20.0)
    assert pol.pop().request_id == "b1"
    assert pol.gps.advance(30.0) == 20.0       # two apps at rate 1/2: B leaves GPS at t = 30
    clock.advance_to(35.0)
    pol.push(req("b2", "B", 4, 2))             # B idle in GPS: F = V(35) + 10 = 25 + 10
    assert pol.finish_tag("B") == 35.0
    assert [pol.pop().request_id for _ in range(2)] == ["b2", "a1"]


def gps_reference(apps, m):
    """Exact fluid GPS: apps [(arrival, total cost)] -> finish times."""
    events = sorted((a, j) for j, (a, _) in enumerate(apps))
    rem: dict[int, float] = {}
    fin = [0.0] * len(apps)
    t, k = 0.0, 0
    while k < len(events) or rem:
        nxt_arr = events[k][0] if k < len(events) else float("inf")
        if rem:
            rate = m / len(rem)
            j_min = min(rem, key=rem.get)
            t_dep = t + rem[j_min] / rate
        else:
            t_dep = float("inf")
        t_next = min(nxt_arr, t_dep)
        if rem:
            for j in rem:
                rem[j] -= (t_next - t) * rate
        t = t_next
        for j in [j for j, r in rem.items() if r <= 1e-9]:
            fin[j] = t
            del rem[j]
        while k < len(events) and events[k][0] <= t:
            rem[events[k][1]] = apps[events[k][1]][1]
            k += 1
    return fin


def simulate(apps_inferences, arrivals, m):
    """M slots, non-preemptive; returns each app's finish time under Justitia."""
    clock = VirtualClock()
    pol = JustitiaPolicy(PolicyContext(clock, num_slots=m))
    running: list[tuple[float, int, Request]] = []
    left = [len(inf) for inf in apps_inferences]
    fin = [0.0] * len(arrivals)
    order = sorted(range(len(arrivals)), key=lambda j: arrivals[j])
    k, seq = 0, 0
    while k < len(order) or running or len(pol):
        t_next = min(arrivals[order[k]] if k < len(order) else float("inf"),
                     running[0][0] if running else float("inf"))
        clock.advance_to(t_next)
        while running and running[0][0] <= t_next:
            _, _, r = heapq.heappop(running)
            pol.on_finish(r)
            j = int(r.app_id)
            left[j] -= 1
            if left[j] == 0:
                fin[j] = t_next
        while k < len(order) and arrivals[order[k]] <= t_next:
            j = order[k]
            for i, (p, d) in enumerate(apps_inferences[j]):
                pol.push(req(f"{j}.{i}", str(j), p, d, t_next))
            k += 1
        while len(running) < m and len(pol):
            r = pol.pop()
            heapq.heappush(running, (t_next + request_cost(r), seq, r))
            seq += 1
    return fin


inference = st.tuples(st.integers(1, 12), st.integers(1, 6))
app = st.tuples(st.integers(0, 60), st.lists(inference, min_size=1, max_size=4))


@settings(max_examples=150, deadline=None)
@given(apps=st.lists(app, min_size=1, max_size=8), m=st.integers(1, 3))
def test_delay_bound_against_fluid_gps(apps, m):
    arrivals = [float(a) for a, _ in apps]
    inferences = [inf for _, inf in apps]
    costs = [[kv_token_time(p, d) for p, d in inf] for inf in inferences]
    gps = gps_reference([(a, sum(c)) for a, c in zip(arrivals, costs)], m)
    real = simulate(inferences, arrivals, m)
    c_max = max(max(c) for c in costs)
    big_c = max(sum(c) for c in costs)
    for j in range(len(apps)):
        assert real[j] <= gps[j] + 2 * c_max + big_c / m + 1e-6, (j, real, gps)


def test_single_slot_sequential_arrivals_match_gps_order():
    # Non-overlapping GPS lifetimes: Justitia's order is arrival order, finish times exact.
    inf = [[(4, 2)], [(9, 2)], [(1, 2)]]          # costs 10, 20, 4
    arrivals = [0.0, 10.0, 30.0]
    assert simulate(inf, arrivals, 1) == gps_reference([(0.0, 10.0), (10.0, 20.0), (30.0, 4.0)], 1) \
        == pytest.approx([10.0, 30.0, 34.0])


# ---- the service rate M (issue 3) --------------------------------------------------------------


def elephant_and_mice(rate: float | None) -> list[str]:
    """Elephant E (cost 100) at t = 0, then mice (cost 10 each) at t = 2, 4, ..., 20, none served
    meanwhile; the order the queue would serve them in."""
    clock = VirtualClock()
    opts = {} if rate is None else {"rate": rate}
    pol = make_policy("justitia", PolicyContext(clock, num_slots=1), **opts)
    pol.push(req("e", "E", 49, 2))                      # 49*2 + 2 = 100
    for k in range(1, 11):
        clock.advance_to(2.0 * k)
        pol.push(req(f"m{k}", f"M{k}", 4, 2))           # 4*2 + 2 = 10
    return [pol.pop().request_id for _ in range(11)]


def test_elephant_competitive_after_bounded_number_of_mice():
    # M = 10 units/s. [0, 2): E alone, V(2) = 20. From t = 2 exactly two apps are active in
    # GPS (each mouse leaves when V has grown by 10, i.e. 2 s at rate 5, as the next arrives),
    # so V(2k) = 20 + 10(k - 1) and mouse k's tag is V(2k) + 10 = 10k + 20. F_E = 100: mice
    # 1..7 (tags 30..90) go first, mouse 8 ties at 100 and loses to E (seen first): after
    # C_E / (M/2) - 2 = 18 s of mice the elephant runs, however many mice follow.
    assert elephant_and_mice(10.0) == ["m1", "m2", "m3", "m4", "m5", "m6", "m7", "e", "m8", "m9", "m10"]
    # M = 1 unit/s (the old default against KV token-time costs): V(2k) = k + 1, tags k + 11,
    # every mouse up to k = 88 beats the elephant -- SRJF order, the starvation of issue 3.
    assert elephant_and_mice(1.0)[-1] == "e"


def decoding(r: Request, generated: int) -> Request:
    r.output_token_ids = [7] * generated
    r.num_computed_tokens = r.num_prompt_tokens + generated     # as the engine reports a decode
    return r


def test_measured_rate_counts_kv_served_while_saturated():
    clock = VirtualClock()
    pol = make_policy("justitia", PolicyContext(clock, num_slots=1))
    assert pol.measured and pol.service_rate == 1.0            # no predictor: prior 1 unit/s
    a, b = req("a", "A", 100, 10), req("b", "B", 100, 10)
    pol.push(a)
    pol.push(b)
    assert pol.pop() is a                                      # b waits: saturated from t = 0
    clock.advance_to(0.5)
    pol.on_progress(decoding(a, 1), 1)                         # one step holding 101 tokens
    assert pol.samples == 0
    clock.advance_to(1.0)
    pol.on_progress(decoding(a, 3), 2)                         # two steps: 103 + 102 tokens
    assert pol.samples == 1 and pol.service_rate == pytest.approx((101 + 103 + 102) / 1.0)
    assert pol.pop() is b                                      # nobody waits any more
    clock.advance_to(3.0)
    pol.on_progress(decoding(b, 1), 1)                         # idle capacity is not measured
    clock.advance_to(5.0)
    pol.on_progress(decoding(b, 2), 1)
    assert pol.samples == 1


def test_kv_capacity_rate_is_cache_per_iteration():
    pred = LinearBatchPredictor(overhead_s=0.01, per_decode_kv_s=1e-7)
    pol = make_policy("justitia", PolicyContext(VirtualClock(), pred, num_slots=2), kv_capacity_tokens=1000)
    # A full cache: 2 sequences of 500 tokens; a step reads 1000 KV tokens: 0.01 + 1e-4 s.
    assert not pol.measured and pol.service_rate == pytest.approx(1000 / 0.0101)
    with pytest.raises(ValueError):
        make_policy("justitia", PolicyContext(VirtualClock(), num_slots=2), kv_capacity_tokens=1000)


def test_prior_from_predictor_then_registry_rejects_unknown_options():
    pred = LinearBatchPredictor(overhead_s=0.01, per_decode_kv_s=1e-7)
    pol = make_policy("justitia", PolicyContext(VirtualClock(), pred, num_slots=4))
    pol.push(req("a", "A", 1000, 200))                         # L = 1000 + 100: 4 x 1100 per step
    assert pol.service_rate == pytest.approx(4 * 1100 / (0.01 + 1e-7 * 4400))
    with pytest.raises(ValueError, match="bad options"):
        make_policy("fcfs", PolicyContext(VirtualClock()), rate=3.0)
