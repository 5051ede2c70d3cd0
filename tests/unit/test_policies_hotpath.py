"""Shortcuts taken on the simulator's hot path equal the definitions they stand in for."""

from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st

from raycluster.clock import VirtualClock
from raycluster.engine.kv_manager import BlockAllocator
from raycluster.request import SLO, Request
from raycluster.sched.base import PolicyContext
from raycluster.sched.predictor import LinearBatchPredictor
from raycluster.sched.slo import SLOTracker, prefill_over, remaining_prefill_tokens


@given(st.integers(0, 50), st.integers(0, 5), st.integers(0, 60))
def test_prefill_over_is_remaining_zero(prompt, out, computed):
    req = Request("r", [1] * prompt, output_token_ids=[2] * out)
    req.num_computed_tokens = computed
    assert prefill_over(req) == (remaining_prefill_tokens(req) == 0)


@settings(max_examples=60)
@given(st.integers(0, 3000), st.integers(0, 3), st.integers(0, 3000), st.booleans())
def test_slack_and_work_is_static_slack_and_total_work(prompt, out, computed, own_slo):
    ctx = PolicyContext(VirtualClock(), LinearBatchPredictor(overhead_s=0.01, per_prefill_token_s=1e-4))
    req = Request("r", [1] * prompt, output_token_ids=[2] * out, arrival_time=1.5,
                  slo=SLO(ttft_s=0.7 if own_slo else None))
    req.num_computed_tokens = min(computed, prompt + out)
    a, b = SLOTracker(ctx), SLOTracker(ctx)
    assert a.slack_and_work(req) == (b.static_slack(req), b.total_work(req))
    assert a.remaining_work(req) == b.remaining_work(req)


def test_free_all_matches_free_one_by_one():
    one, bulk = BlockAllocator(8), BlockAllocator(8)
    for a in (one, bulk):
        blocks = a.allocate(5)
        a.incref(blocks[1])
    for b in blocks:
        one.free(b)
    bulk.free_all(blocks)
    assert list(one._free) == list(bulk._free) and one._refs == bulk._refs
    with pytest.raises(ValueError, match="double free"):
        bulk.free_all([blocks[0]])
