"""The scheduler's image rules, whatever the packer asked: it never ends a prefill chunk inside a
request's bidirectional span (Gemma 3's images), stopping before the span or running on to its
end; and a step encodes at most `max_num_encoder_tokens` image tokens, a chunk stopping before
the first image past the budget (vLLM's encoder budget)."""

import random

import pytest

from raycluster.clock import VirtualClock
from raycluster.engine.kv_manager import KVCacheManager
from raycluster.engine.scheduler import Scheduler, SchedulerConfig
from raycluster.request import ImageInput, Request, SamplingParams
from raycluster.sched.base import PolicyContext
from raycluster.sched.registry import make_policy
from raycluster.sched.token_packer import TokenBudgetPacker


def _sched(chunk: int, budget: int = 96, num_blocks: int = 64, encoder: int | None = None) -> Scheduler:
    clock = VirtualClock()
    return Scheduler(SchedulerConfig(budget, 8, 4096, max_num_encoder_tokens=encoder), KVCacheManager(num_blocks, 16),
                     make_policy("fcfs", PolicyContext(clock=clock)), TokenBudgetPacker(chunk), clock)


def _request(rid: str, n: int, spans) -> Request:
    return Request(rid, [1] * n, SamplingParams(max_tokens=2, ignore_eos=True), bidirectional_spans=tuple(spans))


def test_hand_computed_chunks():
    s = _sched(chunk=32)
    s.add_request(_request("a", 100, [(20, 50), (60, 70)]))
    chunks = []
    for _ in range(10):
        out = s.schedule()
        if not out.prefills:
            break
        chunks += [n for _, n in out.prefills]
        s.update(out, {r.request_id: 2 for r, k in out.prefills if r.num_computed_tokens + k == 100})
    # 32 would cut (20, 50): stop at 20; 20 + 32 = 52 ends past it; 52 + 32 = 84 past (60, 70);
    # then the last 16.
    assert chunks == [20, 32, 32, 16]


def test_a_chunk_starting_at_a_span_runs_to_its_end():
    s = _sched(chunk=8)
    s.add_request(_request("a", 40, [(8, 30)]))
    out = s.schedule()
    assert [n for _, n in out.prefills] == [8]
    s.update(out, {})
    out = s.schedule()
    assert [n for _, n in out.prefills] == [22]          # 8 .. 30, past the chunk size
    assert len(s.kv.block_tables["a"]) * 16 >= 30


@pytest.mark.parametrize("seed", range(4))
def test_no_chunk_ends_inside_a_span_under_churn(seed):
    rng = random.Random(seed)
    s = _sched(chunk=rng.choice([7, 16, 40]), budget=64, num_blocks=40)
    n = 0
    spans_of = {}
    for step in range(300):
        if rng.random() < 0.3:
            n += 1
            length = rng.randint(5, 150)
            spans, at = [], rng.randint(0, 10)
            while at + 3 < length and len(spans) < 3:
                end = min(length, at + rng.randint(1, 40))
                spans.append((at, end))
                at = end + rng.randint(0, 20)
            req = _request(f"r{n}", length, spans)
            spans_of[req.request_id] = spans
            s.add_request(req)
        out = s.schedule()
        for req, k in out.prefills:
            end = req.num_computed_tokens + k
            assert not any(a < end < b for a, b in spans_of[req.request_id]), (step, req.request_id, end)
        s.update(out, {r.request_id: 2 for r, _ in out.prefills} | {r.request_id: 2 for r in out.decodes})
    assert n > 50


def _with_images(rid: str, n: int, images: list[tuple[int, int]]) -> Request:
    sp = SamplingParams(max_tokens=2, ignore_eos=True,
                        images=[ImageInput(offset, length, None, b"") for offset, length in images])
    return Request(rid, [1] * n, sp)


def test_a_step_encodes_at_most_its_encoder_budget():
    s = _sched(chunk=96, budget=96, encoder=20)
    s.add_request(_with_images("a", 60, [(4, 12), (20, 12), (40, 8)]))
    s.add_request(_with_images("b", 30, [(2, 10)]))
    out = s.schedule()
    # a: image 0 (12) fits, image 1 (12 more) does not: a stops at 20. b's image (10) does not
    # fit either: b stops before it.
    assert [(r.request_id, n) for r, n in out.prefills] == [("a", 20), ("b", 2)]
    for req, n in out.prefills:       # as the engine does: the images the chunk reached are encoded
        end = req.num_computed_tokens + n
        req.image_embeds.update({k: object() for k, im in enumerate(req.sampling.images) if im.offset < end})
    s.update(out, {})
    out = s.schedule()
    # a: images 1 and 2 (20) fill the budget; b, at its image, waits for the next step.
    assert [(r.request_id, n) for r, n in out.prefills] == [("a", 40)]
    s.update(out, {"a": 2})
    out = s.schedule()
    assert [(r.request_id, n) for r, n in out.prefills] == [("b", 28)]


def test_without_images_the_budget_changes_nothing():
    with_budget, without = _sched(chunk=16, encoder=4), _sched(chunk=16)
    for s in (with_budget, without):
        s.add_request(_request("a", 40, []))
        s.add_request(_request("b", 20, []))
    a, b = with_budget.schedule(), without.schedule()
    assert [(r.request_id, n) for r, n in a.prefills] == [(r.request_id, n) for r, n in b.prefills]


def test_an_image_the_encoder_cache_holds_costs_no_budget():
    s = _sched(chunk=96, budget=96, encoder=20)
    req = Request("a", [1] * 60, SamplingParams(max_tokens=2, ignore_eos=True, images=[
        ImageInput(4, 12, None, b"new"), ImageInput(20, 12, None, b"held"), ImageInput(40, 12, None, b"other")]))
    s.encoder_cached = {b"held"}
    s.add_request(req)
    out = s.schedule()
    # "new" (12) fits the budget, "held" is free, "other" (12 more than the 8 left) is not.
    assert [(r.request_id, n) for r, n in out.prefills] == [("a", 40)]


def test_given_embeddings_cost_no_encoder_budget():
    s = _sched(chunk=96, budget=96, encoder=20)
    s.add_request(Request("a", [1] * 60, SamplingParams(max_tokens=2, ignore_eos=True, images=[
        ImageInput(4, 12, None, b"new"), ImageInput(20, 30, None, b"given", embeds=True),
        ImageInput(50, 9, None, b"other")])))
    # 12 of the 20 go to the first image; the given embeddings (30 rows) cost none; the last
    # image (9 more than the 8 left) does not fit: the chunk stops before it.
    assert [(r.request_id, n) for r, n in s.schedule().prefills] == [("a", 50)]
