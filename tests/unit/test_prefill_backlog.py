"""The scheduler's incremental prefill backlog (reported to the router as `queued_tokens`) equals
its definition after every operation: arrivals, chunked prefill, decode growth, preemption by
recompute (a KV cache too small for the load), aborts and prefill-only parking."""

import random

import pytest

from raycluster.clock import VirtualClock
from raycluster.engine.kv_manager import KVCacheManager
from raycluster.engine.scheduler import Scheduler, SchedulerConfig
from raycluster.request import Request, SamplingParams
from raycluster.sched.base import PolicyContext
from raycluster.sched.registry import make_policy
from raycluster.sched.token_packer import TokenBudgetPacker


def _sched(policy: str, num_blocks: int) -> Scheduler:
    clock = VirtualClock()
    return Scheduler(SchedulerConfig(96, 8, 4096), KVCacheManager(num_blocks, 16),
                     make_policy(policy, PolicyContext(clock=clock)), TokenBudgetPacker(64), clock)


def test_hand_computed():
    s = _sched("fcfs", 64)
    s.add_request(Request("a", [1] * 100, SamplingParams(max_tokens=3, ignore_eos=True)))
    s.add_request(Request("b", [1] * 20, SamplingParams(max_tokens=3, ignore_eos=True)))
    assert s.prefill_backlog == 120
    out = s.schedule()                       # a: 64 tokens (chunk), b: 20 (budget 96 - 64 = 32)
    assert [(r.request_id, n) for r, n in out.prefills] == [("a", 64), ("b", 20)]
    s.update(out, {"b": 2})
    assert s.prefill_backlog == 36           # a's last 36; b decodes now
    s.abort("a")
    assert s.prefill_backlog == 0


@pytest.mark.parametrize("policy", ["fcfs", "srpt", "lars", "priority"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_matches_definition_under_churn(policy, seed):
    rng = random.Random(seed)
    s = _sched(policy, num_blocks=24)        # 384 token slots: preemption happens
    live, n = [], 0
    for step in range(400):
        if rng.random() < 0.3:
            n += 1
            req = Request(f"r{n}", [1] * rng.randint(1, 200),
                          SamplingParams(max_tokens=rng.randint(1, 40), ignore_eos=True),
                          prefill_only=rng.random() < 0.2, priority=rng.randint(0, 3))
            s.add_request(req)
            live.append(req.request_id)
        if live and rng.random() < 0.05:
            s.abort(live.pop(rng.randrange(len(live))))
        for rid in list(s.parked):
            if rng.random() < 0.5:
                s.release(rid)
        out = s.schedule()
        assert s.prefill_backlog == s.prefill_backlog_slow(), step
        sampled = {r.request_id: 2 for r, _ in out.prefills} | {r.request_id: 2 for r in out.decodes}
        s.update(out, sampled)
        assert s.prefill_backlog == s.prefill_backlog_slow(), step
        assert s.prefill_backlog >= 0
    assert s.preempted_total > 0             # the churn did exercise recompute
    while s.has_unfinished():
        s.abort(next(iter(s.requests)))
    assert s.prefill_backlog == 0
