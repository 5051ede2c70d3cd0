"""Every registered policy: queue consistency under random push/pop/remove (hypothesis), removed
ids never pop; LARS/EDF/SRPT/LRS pops equal a brute-force argmin at every step."""

from __future__ import annotations

from fractions import Fraction

import pytest
from hypothesis import given, settings, strategies as st

from raycluster.clock import VirtualClock
from raycluster.request import SLO, Request
from raycluster.sched.base import PolicyContext
from raycluster.sched.predictor import LinearBatchPredictor
from raycluster.sched.registry import make_policy, policy_names

ALL = ["fcfs", "edf", "srpt", "lrs", "lars", "kairos", "justitia", "vtc", "srjf", "priority"]


def ctx_for(clock: VirtualClock) -> PolicyContext:
    # 1 time unit per prefill token: integer works, deadlines and times compare exactly.
    return PolicyContext(clock, LinearBatchPredictor(per_prefill_token_s=1.0), num_slots=2)


def mk(i: int, prompt: int, arrival: float, ttft: float | None, app: int) -> Request:
    return Request(f"r{i}", [1] * prompt, arrival_time=arrival, slo=SLO(ttft_s=ttft),
                   tenant=f"t{app}", app_id=f"a{app}", expected_output_tokens=prompt % 7 + 1)


def test_registry_has_all_names():
    assert set(ALL) <= set(policy_names())
    for name in ALL:
        assert make_policy(name, ctx_for(VirtualClock())).name == name
    with pytest.raises(ValueError, match="unknown name"):
        make_policy("nope", ctx_for(VirtualClock()))


def test_priority_pops_lower_values_first_then_by_arrival():
    clock = VirtualClock()
    pol = make_policy("priority", ctx_for(clock))
    for i, prio in enumerate([2, 0, 1, 0, 2]):
        r = mk(i, 10, float(i), None, 0)
        r.priority = prio
        pol.push(r)
    assert [pol.pop().request_id for _ in range(5)] == ["r1", "r3", "r2", "r0", "r4"]
    assert pol.pop() is None


ops = st.lists(st.tuples(st.sampled_from(["push", "pop", "remove", "progress"]),
                         st.integers(0, 11), st.integers(0, 30)), max_size=80)


@pytest.mark.parametrize("name", ALL)
@settings(max_examples=60, deadline=None)
@given(script=ops, prompts=st.lists(st.integers(1, 60), min_size=12, max_size=12),
       apps=st.lists(st.integers(0, 3), min_size=12, max_size=12))
def test_queue_consistency(name, script, prompts, apps):
    clock = VirtualClock()
    pol = make_policy(name, ctx_for(clock))
    reqs: dict[int, Request] = {}
    queued: set[str] = set()
    removed: set[str] = set()
    for op, i, dt in script:
        clock.advance(dt)
        if op == "push":
            if i not in reqs:
                reqs[i] = mk(i, prompts[i], clock.now(), float(prompts[i] * (i % 3 + 1)), apps[i])
            r = reqs[i]
            if r.request_id in removed or r.num_uncomputed_tokens == 0:
                continue
            pol.push(r)
            queued.add(r.request_id)
        elif op == "pop":
            r = pol.pop()
            if not queued:
                assert r is None
                continue
            assert r is not None and r.request_id in queued and r.request_id not in removed
            queued.discard(r.request_id)
            n = min(r.num_uncomputed_tokens, dt + 1)
            r.num_computed_tokens += n
            pol.on_progress(r, n)
            if r.num_uncomputed_tokens > 0:
                pol.push(r)
                queued.add(r.request_id)
        elif op == "remove" and i in reqs:
            rid = reqs[i].request_id
            pol.remove(rid)
            pol.on_finish(reqs[i])
            queued.discard(rid)
            removed.add(rid)
        assert len(pol) == len(queued)
    drained = []
    while (r := pol.pop()) is not None:
        drained.append(r.request_id)
    assert sorted(drained) == sorted(queued)
    assert not set(drained) & removed
    assert len(pol) == 0


def brute_key(name, r: Request, now: float, seq: int):
    ttft = Fraction(r.slo.ttft_s)
    d = Fraction(r.arrival_time) + ttft
    rem = Fraction(r.num_uncomputed_tokens)
    w = Fraction(r.num_prompt_tokens)
    tie = (r.arrival_time, seq)
    return {"edf": (d, tie), "srpt": (rem, tie), "lrs": (d - rem, tie),
            "lars": ((d - rem - Fraction(now)) / w, tie)}[name]


@pytest.mark.parametrize("name", ["edf", "srpt", "lrs", "lars"])
@settings(max_examples=80, deadline=None)
@given(jobs=st.lists(st.tuples(st.integers(1, 400), st.integers(0, 50), st.integers(1, 2000)),
                     min_size=1, max_size=25),
       quantum=st.integers(1, 120))
def test_pop_matches_brute_force(name, jobs, quantum):
    """A preemptive single server: every pop must be the exact argmin at that instant."""
    clock = VirtualClock()
    pol = make_policy(name, ctx_for(clock))
    arrivals = sorted((sum(j[1] for j in jobs[: k + 1]), k) for k in range(len(jobs)))
    queue: dict[str, tuple[Request, int]] = {}
    seq = 0
    k = 0
    while k < len(arrivals) or queue:
        while k < len(arrivals) and arrivals[k][0] <= clock.now():
            t, idx = arrivals[k]
            prompt, _, ttft = jobs[idx]
            r = Request(f"r{idx}", [1] * prompt, arrival_time=float(t), slo=SLO(ttft_s=float(ttft)))
            pol.push(r)
            queue[r.request_id] = (r, seq)
            seq += 1
            k += 1
        if not queue:
            clock.advance_to(float(arrivals[k][0]))
            continue
        now = clock.now()
        want = min(queue.values(), key=lambda e: brute_key(name, e[0], now, e[1]))[0]
        got = pol.pop()
        assert got is want
        r, s = queue.pop(got.request_id)
        n = min(quantum, r.num_uncomputed_tokens)
        clock.advance(n)
        r.num_computed_tokens += n
        pol.on_progress(r, n)
        if r.num_uncomputed_tokens:
            pol.push(r)
            queue[r.request_id] = (r, s)
        else:
            pol.on_finish(r)


def test_slo_defaults_and_proxy():
    from raycluster.sched.base import SLOConfig
    from raycluster.sched.slo import PROXY_SECONDS_PER_TOKEN, SLOTracker
    clock = VirtualClock(10.0)
    ctx = PolicyContext(clock, LinearBatchPredictor(per_prefill_token_s=1e-3),
                        slo=SLOConfig(ttft_ms=2000.0, ttft_scale=5.0))
    tr = SLOTracker(ctx)
    short = Request("s", [1] * 100, arrival_time=4.0)          # W = 0.1 s -> 2 s floor
    long = Request("l", [1] * 1000, arrival_time=4.0)          # W = 1 s -> 5 x 1 s
    assert tr.deadline(short) == pytest.approx(6.0)
    assert tr.deadline(long) == pytest.approx(9.0)
    long.num_computed_tokens = 400
    assert tr.remaining_work(long) == pytest.approx(0.6)
    assert tr.slack(long, 10.0) == pytest.approx(9.0 - 10.0 - 0.6)
    assert tr.relative_slack(long, 10.0) == pytest.approx(-1.6)
    own = Request("o", [1] * 1000, arrival_time=4.0, slo=SLO(ttft_s=0.5))
    assert tr.deadline(own) == pytest.approx(4.5)
    noproxy = SLOTracker(PolicyContext(clock))
    assert noproxy.total_work(long) == pytest.approx(1000 * PROXY_SECONDS_PER_TOKEN)


@pytest.mark.parametrize("seed", range(3))
def test_lars_burst_matches_brute_force(seed):
    """200 requests at t = 0 sharing two TTFTs: every untouched request's rho line passes through
    (D, -1), so whole groups tie exactly at t = D (broken by arrival, then push order) and the
    order reverses there. Each pop is checked against the exact argmin, with the clock stepping
    onto those instants, through progress, re-pushes, arrivals and removals."""
    import random
    rng = random.Random(seed)
    clock = VirtualClock()
    pol = make_policy("lars", ctx_for(clock))
    queue: dict[str, tuple[Request, int]] = {}
    seq = 0

    def arrive(i: int) -> None:
        nonlocal seq
        prompt = rng.choice([3, 5, 8, 8, 20, 50])
        r = Request(f"r{i}", [1] * prompt, arrival_time=clock.now(),
                    slo=SLO(ttft_s=rng.choice([100.0, 400.0])))
        pol.push(r)
        queue[r.request_id] = (r, seq)
        seq += 1

    for i in range(200):
        arrive(i)
    nxt = 200
    while queue:
        now = clock.now()
        want = min(queue.values(), key=lambda e: brute_key("lars", e[0], now, e[1]))[0]
        got = pol.pop()
        assert got is want, now
        r, s = queue.pop(got.request_id)
        n = min(rng.choice([2, 4, 8]), r.num_uncomputed_tokens)
        r.num_computed_tokens += n
        pol.on_progress(r, n)
        if r.num_uncomputed_tokens:
            pol.push(r)
            queue[r.request_id] = (r, s)
        else:
            pol.on_finish(r)
        if nxt < 300 and rng.random() < 0.3:
            arrive(nxt)
            nxt += 1
        if queue and rng.random() < 0.02:
            rid = rng.choice(sorted(queue))
            pol.remove(rid)
            pol.on_finish(queue.pop(rid)[0])
        step = clock.now() + rng.choice([0, 1, 1, 2, 5])
        clock.advance_to(min([step] + [d for d in (100.0, 400.0) if clock.now() < d < step]))
