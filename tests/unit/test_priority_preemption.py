"""Preemption under KV pressure follows the policy: with `priority`, the running request with the
highest (priority, arrival) gives up its KV, as in vLLM, and a decode that ranks below every other
holder waits instead of evicting one. The default (FCFS and the other policies) evicts the latest
admitted request other than the one asking (vLLM's FCFS would make the asker itself wait when it
is the latest; left as it was, the simulator's golden results depend on it)."""

import pytest

from raycluster.clock import VirtualClock
from raycluster.engine.kv_manager import KVCacheManager
from raycluster.engine.scheduler import Scheduler, SchedulerConfig
from raycluster.request import Request, RequestStatus, SamplingParams
from raycluster.sched.base import PolicyContext
from raycluster.sched.registry import make_policy
from raycluster.sched.token_packer import TokenBudgetPacker


def _sched(policy: str, num_blocks: int) -> Scheduler:
    clock = VirtualClock()
    return Scheduler(SchedulerConfig(64, 8, 4096), KVCacheManager(num_blocks, 4),
                     make_policy(policy, PolicyContext(clock=clock)), TokenBudgetPacker(64), clock)


def _run_until_preempted(s: Scheduler, limit: int = 20) -> list[str]:
    for _ in range(limit):
        out = s.schedule()
        s.update(out, {r.request_id: 2 for r, _ in out.prefills} | {r.request_id: 2 for r in out.decodes})
        s.kv.check()
        if out.preempted:
            return out.preempted
    raise AssertionError("no preemption")


def _three(s: Scheduler, priorities: tuple[int, int, int]) -> None:
    # Prompts of 8 tokens fill 2 blocks each; their first decode token needs a third block.
    for k, (rid, prio) in enumerate(zip("abc", priorities)):
        s.add_request(Request(rid, [1] * 8, SamplingParams(max_tokens=20, ignore_eos=True),
                              arrival_time=float(k), priority=prio))


@pytest.mark.parametrize("policy, priorities, victim", [
    ("priority", (2, 0, 1), "a"),      # the worst priority goes, not the latest admitted
    ("priority", (0, 1, 1), "c"),      # equal priority: the later arrival
    ("priority", (0, 0, 0), "c"),      # "c" asks for the block and ranks last: it waits
    ("fcfs", (2, 0, 1), "b"),          # FCFS ignores priority: the latest admitted but the asker
])
def test_kv_pressure_preempts_the_policys_victim(policy, priorities, victim):
    s = _sched(policy, num_blocks=8)    # 3 x 2 prompt blocks, 2 to grow into
    _three(s, priorities)
    assert _run_until_preempted(s) == [victim]
    req = s.requests[victim]
    assert req.status is RequestStatus.WAITING and req.num_computed_tokens == 0
    assert req.num_preemptions == 1 and victim not in s.kv.block_tables
    assert set(s.decoding) == set("abc") - {victim}


def test_a_lowest_priority_decode_waits_instead_of_evicting():
    """The request asking for a block ranks below every other holder: it gives up its own KV,
    and the others keep theirs (before: the latest admitted other decode was evicted)."""
    s = _sched("priority", num_blocks=8)
    sp = SamplingParams(max_tokens=20, ignore_eos=True)
    s.add_request(Request("lo", [1] * 13, sp, arrival_time=0.0, priority=5))
    out = s.schedule()                  # "lo" alone: 4 blocks, room for 3 more tokens
    s.update(out, {"lo": 2})
    s.add_request(Request("hi", [1] * 6, sp, arrival_time=1.0))
    s.add_request(Request("mid", [1] * 6, sp, arrival_time=2.0, priority=1))
    # All 8 blocks held from here on; "lo" decodes first in each step and is the first to need a
    # new block (at its 17th token, while "hi" and "mid" still have room in theirs).
    assert _run_until_preempted(s) == ["lo"]
    assert s.requests["lo"].status is RequestStatus.WAITING and "lo" not in s.kv.block_tables
    assert set(s.decoding) == {"hi", "mid"}
    # "lo" recomputes once there is room: every request ends.
    for _ in range(200):
        if not s.has_unfinished():
            break
        out = s.schedule()
        s.update(out, {r.request_id: 2 for r, _ in out.prefills} | {r.request_id: 2 for r in out.decodes})
    assert not s.has_unfinished()
    s.kv.check()
