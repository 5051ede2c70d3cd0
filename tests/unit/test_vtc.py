"""VTC charges: prompt tokens at w_in, output tokens at w_out, whoever reports them."""

from __future__ import annotations

from raycluster.clock import VirtualClock
from raycluster.request import Request
from raycluster.sched.base import PolicyContext
from raycluster.sched.registry import make_policy


def _vtc():
    return make_policy("vtc", PolicyContext(VirtualClock()))


def test_engine_side_prefill_then_decode_charges():
    p = _vtc()
    r = Request("a", list(range(100)), tenant="t")
    p.push(r)
    p.pop()
    p.on_progress(r, 64)                    # a prefill chunk
    assert p.counter["t"] == 64.0
    p.on_progress(r, 36)
    r.output_token_ids = [5]                 # the step that finished the prompt sampled a token
    p.on_progress(r, 1)                      # a decode step
    assert p.counter["t"] == 100.0 + 2.0


def test_router_side_batched_delivery_is_decode_work():
    # The router appends k delivered tokens, then reports k: all output, all at w_out.
    p = _vtc()
    r = Request("a", list(range(10)), tenant="t")
    p.push(r)
    r.output_token_ids = [1, 2, 3]
    p.on_progress(r, 3)
    assert p.counter["t"] == 6.0


def test_recompute_after_preemption_is_prompt_work():
    p = _vtc()
    r = Request("a", list(range(50)), tenant="t")
    p.push(r)
    r.output_token_ids = [1, 2]
    p.on_progress(r, 52)                     # prompt + outputs recomputed in one chunk
    assert p.counter["t"] == 52.0
