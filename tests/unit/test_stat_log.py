"""The periodic stats line (raycluster.engine.stat_log) on a real tiny engine with a hand-driven clock."""

from __future__ import annotations

import pytest

from raycluster.engine.config import EngineConfig
from raycluster.engine.engine import LLMEngine
from raycluster.engine.stat_log import StatLogger
from raycluster.request import SamplingParams


class _Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def _engine(loaded, **cfg) -> LLMEngine:
    model, tok = loaded
    return LLMEngine(EngineConfig(**{"kv_cache_tokens": 1024, "block_size": 16, "policy": "fcfs", "packer": "token",
                                     "max_num_batched_tokens": 512, **cfg}), model, tok)


def test_a_window_reports_its_tokens_steps_and_requests(loaded):
    eng = _engine(loaded, enable_prefix_caching=False)
    clock, lines = _Clock(), []
    stats = StatLogger("mixed-a", 10.0, lines.append, clock=clock)
    eng.add_request("a", [5] * 40, SamplingParams(max_tokens=8, ignore_eos=True))
    eng.add_request("b", [6] * 24, SamplingParams(max_tokens=3, ignore_eos=True))
    results = []
    for _ in range(3):                      # one prefill step (both prompts) and two decode steps
        results.append(eng.step())
        assert stats.observe(eng, results[-1]) is None      # not due yet
    assert [r.num_prefill_tokens for r in results] == [64, 0, 0]
    clock.t += 10.0
    line = stats.observe(eng, None)
    mean_ms = 1e3 * sum(r.duration_s for r in results) / 3
    # 64 prompt tokens and 6 generated (2 per step) in 10 s; "b" is done after its 3rd token,
    # "a" still runs: its 42 tokens fill 3 of the 64 blocks of 16.
    assert line == (f"mixed-a: prompt 6.4 tok/s, generation 0.6 tok/s, 3 steps (mean {mean_ms:.1f} ms), "
                    f"running 1, waiting 0, preempted 0, KV cache {100 * 3 / 64:.1f}%")
    assert lines == [line]
    # The next window starts empty: a's last 5 tokens in 5 more steps, over 20 s.
    while eng.has_unfinished():
        stats.observe(eng, eng.step())
    clock.t += 20.0
    assert stats.observe(eng, None).startswith("mixed-a: prompt 0.0 tok/s, generation 0.2 tok/s, 5 steps")
    # Idle (nothing ran, nothing held): due, but silent.
    clock.t += 30.0
    assert stats.observe(eng, None) is None and len(lines) == 2


def test_prefix_hits_are_per_window(loaded):
    eng = _engine(loaded, enable_prefix_caching=True)
    clock, lines = _Clock(), []
    stats = StatLogger("e", 1.0, lines.append, clock=clock)
    prompt = list(range(10, 74))            # 64 tokens: 4 full blocks

    def run(rid: str) -> None:
        eng.add_request(rid, prompt, SamplingParams(max_tokens=1))
        while eng.has_unfinished():
            stats.observe(eng, eng.step())
        clock.t += 1.0
        stats.observe(eng, None)

    run("first")
    assert lines[-1].endswith("prefix cache hit 0.0%")
    run("again")        # the last block is recomputed to produce a token: 3 of 4 blocks hit
    hit = eng.kv.hit_tokens
    assert hit == 48 and lines[-1].endswith(f"prefix cache hit {100 * 48 / 64:.1f}%")
    assert len(lines) == 2


def test_draft_acceptance_is_per_window(loaded):
    from test_spec_decode import OracleProposer

    prompt, sp = [9, 400, 33, 1200, 78], SamplingParams(max_tokens=12, ignore_eos=True)
    want = _engine(loaded).generate([prompt], sp)[0]
    eng = _engine(loaded, speculative_method="ngram", num_speculative_tokens=3)
    eng.proposer = OracleProposer({tuple(prompt): want}, k=3, wrong_at=2)     # 2 of every 3 drafts right
    clock, lines = _Clock(), []
    stats = StatLogger("e", 1.0, lines.append, clock=clock)
    eng.add_request("a", prompt, sp)
    while eng.has_unfinished():
        stats.observe(eng, eng.step())
    clock.t += 1.0
    stats.observe(eng, None)
    drafted, accepted = eng.spec.draft_tokens, eng.spec.accepted_tokens
    assert drafted and accepted and accepted < drafted
    assert lines[-1].endswith(f"draft acceptance {100 * accepted / drafted:.1f}% of {drafted}")
    eng.add_request("b", [5, 6], SamplingParams(max_tokens=2, ignore_eos=True))   # the oracle knows no b
    while eng.has_unfinished():
        stats.observe(eng, eng.step())
    clock.t += 1.0
    assert "draft" not in stats.observe(eng, None)


def test_interval_must_be_positive():
    with pytest.raises(ValueError, match="interval_s"):
        StatLogger("x", 0, print)


def test_the_instance_worker_feeds_it_every_step(loaded):
    """The cluster instance's step thread path (`InstanceWorker._step`), without Ray or threads."""
    from raycluster.cluster.instance import InstanceWorker
    from raycluster.cluster.messages import PollReply, RequestMeta, WorkItem

    clock, lines = _Clock(), []
    eng = _engine(loaded)
    w = InstanceWorker(eng, "mixed", "mixed-x", poll_fn=lambda *a: PollReply(), push_fn=lambda r: None,
                       stat_logger=StatLogger("mixed-x", 5.0, lines.append, clock=clock))
    meta = RequestMeta(request_id="r", gateway_id="g", prompt_token_ids=[7] * 20,
                       sampling=SamplingParams(max_tokens=4, ignore_eos=True), arrival_time=0.0)
    w._apply(PollReply(work=[WorkItem(meta)]))
    for _ in range(4):
        w._step()
    assert not eng.has_unfinished() and lines == []
    clock.t += 5.0
    w._step()           # nothing left to run: an empty step, which still closes the window
    assert len(lines) == 1 and lines[0].startswith("mixed-x: prompt 4.0 tok/s, generation 0.8 tok/s, 5 steps")
