"""MedhaPacker: time budget, one long prefill per batch, space sharing, adaptive chunk shrinkage."""

from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st

from raycluster.clock import VirtualClock
from raycluster.request import Request, SamplingParams
from raycluster.sched.base import PackLimits, PolicyContext
from raycluster.sched.medha_packer import MedhaPacker, PrefillTimeCache, largest_fitting_chunk
from raycluster.sched.policies.fcfs import FCFSPolicy
from raycluster.sched.predictor import LinearBatchPredictor


class FreeKV:
    def __init__(self, capacity: int = 10**9) -> None:
        self.capacity = capacity

    def try_allocate(self, req: Request, n: int) -> bool:
        if n > self.capacity:
            return False
        self.capacity -= n
        return True


def mk(rid: str, prompt: int, computed: int = 0, arrival: float = 0.0) -> Request:
    r = Request(rid, [1] * prompt, SamplingParams(max_tokens=8), arrival_time=arrival)
    r.num_computed_tokens = computed
    return r


def decode_req(rid: str, kv: int) -> Request:
    r = mk(rid, kv)
    r.num_computed_tokens = kv
    r.output_token_ids = [7]
    return r


def setup(reqs, clock=None):
    clock = clock or VirtualClock()
    pol = FCFSPolicy(PolicyContext(clock=clock))
    for r in reqs:
        pol.push(r)
    return clock, pol


LIMITS = PackLimits(max_num_batched_tokens=100_000, max_num_seqs=256)
PER_TOKEN = LinearBatchPredictor(per_prefill_token_s=1e-4, per_decode_s=1e-3)


def test_single_chunk_fills_budget_exactly():
    clock, pol = setup([mk("a", 2000)])
    packer = MedhaPacker(PER_TOKEN, clock, t_target_s=0.05)
    assert [(r.request_id, n) for r, n in packer.plan([], pol, LIMITS, FreeKV())] == [("a", 500)]


def test_decodes_take_budget_first():
    clock, pol = setup([mk("a", 2000)])
    packer = MedhaPacker(PER_TOKEN, clock, t_target_s=0.05)
    decodes = [decode_req(f"d{i}", 100) for i in range(10)]       # 10 ms of decodes
    assert [n for _, n in packer.plan(decodes, pol, LIMITS, FreeKV())] == [400]


def test_multi_prefill_batching_packs_several_shorts():
    clock, pol = setup([mk("a", 100, arrival=0), mk("b", 150, arrival=1), mk("c", 300, arrival=2)])
    packer = MedhaPacker(PER_TOKEN, clock, t_target_s=0.05)
    plan = packer.plan([], pol, LIMITS, FreeKV())
    assert [(r.request_id, n) for r, n in plan] == [("a", 100), ("b", 150), ("c", 250)]
    assert len(pol) == 0        # "c" was scheduled (partially); the caller pushes it back later


def test_at_most_one_long_prefill_and_second_is_pushed_back():
    clock, pol = setup([mk("L1", 5000, arrival=0), mk("L2", 5000, arrival=1), mk("s", 50, arrival=2)])
    packer = MedhaPacker(PER_TOKEN, clock, t_target_s=0.05, long_threshold=1000, rho_max=0.0)
    plan = packer.plan([], pol, LIMITS, FreeKV())
    assert [(r.request_id, n) for r, n in plan] == [("L1", 500)]
    assert len(pol) == 2
    assert pol.pop().request_id == "L2"          # order kept after push-back


def test_space_sharing_long_yields_rho_of_budget_when_short_waits():
    clock, pol = setup([mk("L", 5000, arrival=0), mk("s", 60, arrival=1)])
    packer = MedhaPacker(PER_TOKEN, clock, t_target_s=0.05, long_threshold=1000, rho_max=0.4,
                         relative_slack=lambda req, now: 0.2)
    plan = packer.plan([], pol, LIMITS, FreeKV())
    # Long uses (1 - 0.2) * 50 ms = 40 ms -> 400 tokens; the short rides in the freed 10 ms.
    assert [(r.request_id, n) for r, n in plan] == [("L", 400), ("s", 60)]


def test_space_sharing_capped_at_rho_max_and_off_without_shorts():
    clock, pol = setup([mk("L", 5000), mk("s", 60, arrival=1)])
    packer = MedhaPacker(PER_TOKEN, clock, t_target_s=0.05, long_threshold=1000, rho_max=0.4,
                         relative_slack=lambda req, now: 5.0)
    assert [n for _, n in packer.plan([], pol, LIMITS, FreeKV())] == [300, 60]
    clock, pol = setup([mk("L", 5000)])
    packer = MedhaPacker(PER_TOKEN, clock, t_target_s=0.05, long_threshold=1000, rho_max=0.4,
                         relative_slack=lambda req, now: 5.0)
    assert [n for _, n in packer.plan([], pol, LIMITS, FreeKV())] == [500]   # nobody to yield to


def test_negative_slack_means_no_yield():
    clock, pol = setup([mk("L", 5000), mk("s", 60, arrival=1)])
    packer = MedhaPacker(PER_TOKEN, clock, t_target_s=0.05, long_threshold=1000,
                         relative_slack=lambda req, now: -3.0)
    assert [n for _, n in packer.plan([], pol, LIMITS, FreeKV())] == [500]


def test_minimal_chunk_when_decodes_fill_budget():
    clock, pol = setup([mk("a", 2000), mk("b", 10, arrival=1)])
    packer = MedhaPacker(PER_TOKEN, clock, t_target_s=0.05, min_chunk=4)
    decodes = [decode_req(f"d{i}", 10) for i in range(60)]          # 60 ms > 50 ms
    plan = packer.plan(decodes, pol, LIMITS, FreeKV())
    assert [(r.request_id, n) for r, n in plan] == [("a", 4)]
    assert len(pol) == 1


def test_kv_full_pushes_back_and_stops():
    clock, pol = setup([mk("a", 100), mk("b", 100, arrival=1)])
    packer = MedhaPacker(PER_TOKEN, clock, t_target_s=0.05)
    plan = packer.plan([], pol, LIMITS, FreeKV(capacity=150))
    assert [(r.request_id, n) for r, n in plan] == [("a", 100)]
    assert len(pol) == 1


def test_token_and_seq_limits_respected():
    clock, pol = setup([mk(f"r{i}", 40, arrival=i) for i in range(5)])
    packer = MedhaPacker(PER_TOKEN, clock, t_target_s=1.0)
    plan = packer.plan([decode_req("d", 5)], pol, PackLimits(max_num_batched_tokens=101, max_num_seqs=4), FreeKV())
    assert [n for _, n in plan] == [40, 40, 20]
    assert len(pol) == 2


ATTN = LinearBatchPredictor(overhead_s=2e-3, per_prefill_token_s=5e-5, per_attn_pair_s=2e-9)


def test_chunks_shrink_as_kv_grows_hand_case():
    sizes = []
    for kv in (0, 20_000, 100_000, 400_000):
        clock, pol = setup([mk("a", 500_000, computed=kv)])
        packer = MedhaPacker(ATTN, clock, t_target_s=0.05)
        (_, n), = packer.plan([], pol, PackLimits(1 << 20, 8), FreeKV())
        sizes.append(n)
    assert sizes == sorted(sizes, reverse=True) and sizes[0] > 4 * sizes[-1]


def test_prefill_time_cache_matches_chunked_simulation():
    cache = PrefillTimeCache(LinearBatchPredictor(overhead_s=1e-3, per_prefill_token_s=1e-4), t_target=0.051)
    # Each chunk holds 500 tokens (0.001 + 0.05 s); 1200 tokens = 2 full chunks + 200 clipped.
    assert cache.time_to(1200) == pytest.approx(2 * 0.051 + (0.001 + 0.02))
    assert cache.remaining(1200, 500) == pytest.approx(cache.time_to(1200) - 0.051)
    assert cache.time_to(0) == 0.0


def test_default_relative_slack_uses_slo_and_cache():
    clock = VirtualClock(1.0)
    packer = MedhaPacker(LinearBatchPredictor(per_prefill_token_s=1e-3), clock, t_target_s=0.1)
    r = mk("a", 1000)               # 1 s of work; default ttft = max(2 s, 5 * 1 s) = 5 s
    assert packer.default_relative_slack(r, 1.0) == pytest.approx((5.0 - 1.0 - 1.0) / 1.0)


def test_largest_fitting_chunk_zero_when_nothing_fits():
    assert largest_fitting_chunk(PER_TOKEN, [], [], 0, 100, 1e-5) == 0
    assert largest_fitting_chunk(PER_TOKEN, [], [], 0, 100, 1.0) == 100


# -- properties --------------------------------------------------------------------------------
coef = st.floats(min_value=0.0, max_value=1e-3)
reqs_st = st.lists(st.tuples(st.integers(1, 30_000), st.floats(0.0, 0.99)), min_size=0, max_size=12)


@settings(max_examples=150, deadline=None)
@given(reqs=reqs_st, n_dec=st.integers(0, 40), ov=coef, tok=st.floats(1e-7, 1e-4),
       attn=st.floats(0.0, 1e-8), dec=coef, t_target=st.floats(0.005, 0.2),
       min_chunk=st.integers(1, 16), long_thr=st.integers(500, 20_000),
       rho=st.floats(-1.0, 2.0), max_tokens=st.integers(1, 20_000), max_seqs=st.integers(1, 64))
def test_plan_properties(reqs, n_dec, ov, tok, attn, dec, t_target, min_chunk, long_thr, rho,
                         max_tokens, max_seqs):
    pred = LinearBatchPredictor(ov, tok, attn, dec, 1e-9)
    queue = [mk(f"r{i}", p, computed=int(p * f), arrival=i) for i, (p, f) in enumerate(reqs)]
    decodes = [decode_req(f"d{i}", 100 * i) for i in range(min(n_dec, max_seqs))]
    clock, pol = setup(queue)
    packer = MedhaPacker(pred, clock, t_target_s=t_target, min_chunk=min_chunk,
                         long_threshold=long_thr, relative_slack=lambda r, now: rho)
    limits = PackLimits(max_num_batched_tokens=max_tokens + len(decodes), max_num_seqs=max_seqs)
    plan = packer.plan(decodes, pol, limits, FreeKV())
    shapes = [(n, r.num_computed_tokens) for r, n in plan]
    t = pred.batch_time(shapes, [d.num_computed_tokens for d in decodes])
    if t > t_target + 1e-12:     # only decodes (chosen by the caller) or one minimal chunk
        assert not plan or (len(plan) == 1 and plan[0][1] <= min_chunk)
    assert sum(1 for r, _ in plan if r.num_prompt_tokens >= long_thr) <= 1
    assert all(1 <= n <= r.num_uncomputed_tokens for r, n in plan)
    assert sum(n for _, n in plan) <= max_tokens
    assert len(plan) + len(decodes) <= max_seqs
    assert len({r.request_id for r, _ in plan}) == len(plan)
    assert len(pol) + len(plan) == len(queue)            # every popped request is accounted for


@settings(max_examples=100, deadline=None)
@given(kv1=st.integers(0, 300_000), kv2=st.integers(0, 300_000), tok=st.floats(1e-6, 1e-4),
       attn=st.floats(1e-11, 1e-8), t_target=st.floats(0.01, 0.2))
def test_chunk_nonincreasing_in_kv(kv1, kv2, tok, attn, t_target):
    lo, hi = sorted((kv1, kv2))
    pred = LinearBatchPredictor(1e-3, tok, attn, 0.0, 0.0)
    sizes = []
    for kv in (lo, hi):
        clock, pol = setup([mk("a", 400_000, computed=kv)])
        (_, n), = MedhaPacker(pred, clock, t_target_s=t_target).plan([], pol, PackLimits(1 << 20, 4), FreeKV())
        sizes.append(n)
    assert sizes[1] <= sizes[0]
