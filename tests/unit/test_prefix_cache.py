"""Automatic prefix caching: the allocator's LRU of findable blocks, and the engine reusing a
cached prefix with exactly the tokens it would compute without the cache."""

from __future__ import annotations

import random

import pytest
from engine_arrivals import run_arrivals, shared_prefix_arrivals

from raycluster.clock import VirtualClock
from raycluster.engine.config import EngineConfig
from raycluster.engine.engine import LLMEngine
from raycluster.engine.kv_manager import OutOfBlocks
from raycluster.engine.prefix_cache import (
    PrefixCachingAllocator,
    PrefixCachingKVManager,
    block_key,
)
from raycluster.request import Request, SamplingParams
from raycluster.sched.predictor import LinearBatchPredictor

# A fixed predictor for the medha packer: the test is about tokens, not timing, and profiling
# the machine would cost seconds.
PREDICTOR = LinearBatchPredictor(overhead_s=2e-3, per_prefill_token_s=2e-5, per_decode_s=1e-4)
# Likewise a virtual clock, advanced by `_run` a fixed time per step: time-aware policies (Kairos,
# LARS) order by arrival stamps and slack, so on the wall clock a stall between two
# `add_request` calls on a loaded machine (19 ms seen) reorders requests "arriving together".
STEP_S = 0.01


# ---- the allocator -------------------------------------------------------------------------------
def test_freed_blocks_stay_findable_until_handed_out_least_recently_freed_first():
    a = PrefixCachingAllocator(4)
    b0, b1 = a.allocate(2)
    k0, k1 = block_key(b"", [1, 2]), block_key(block_key(b"", [1, 2]), [3, 4])
    a.register(b0, k0)
    a.register(b1, k1)
    a.free_all([b0, b1])                    # tail first: b1 is evicted before b0
    assert a.num_free == 4 and a.num_cached == 2
    assert a.lookup(k0) == b0 and a.lookup(k1) == b1
    assert a.allocate(2) == [2, 3]          # never-used blocks go first
    assert a.allocate(1) == [b1]            # then the least recently freed: b1, losing its key
    assert a.lookup(k1) is None and a.lookup(k0) == b0
    a.take(b0)                              # revived from the free pool
    assert a.num_free == 0 and a.refcount(b0) == 1
    with pytest.raises(OutOfBlocks):
        a.allocate(1)
    a.check_keys()


def test_register_keeps_the_first_block_of_a_prefix():
    a = PrefixCachingAllocator(3)
    x, y = a.allocate(2)
    k = block_key(b"", [5] * 4)
    a.register(x, k)
    a.register(y, k)                        # same content computed twice: y stays a plain block
    assert a.lookup(k) == x and a.num_cached == 1
    a.check_keys()


def test_keys_chain_over_the_whole_prefix():
    assert block_key(b"", [1, 2]) != block_key(b"", [2, 1])
    assert block_key(block_key(b"", [1, 2]), [3]) != block_key(block_key(b"", [9, 2]), [3])


def test_match_never_covers_the_last_token():
    kv = PrefixCachingKVManager(8, 4)
    a = Request("a", list(range(8)))
    assert kv.try_allocate(a, 8)
    kv.cache_full_blocks(a, 8)
    kv.free("a")
    b = Request("b", list(range(8)))        # same 8 tokens: only the first block is reused
    assert kv.match_prefix(b) == 4
    c = Request("c", list(range(9)))        # one more token: both blocks
    assert kv.match_prefix(c) == 8
    assert kv.hit_tokens == 12 and kv.query_tokens == 17
    kv.check()


# ---- the engine -----------------------------------------------------------------------------------
def _engine(loaded, caching: bool, **cfg) -> LLMEngine:
    model, tok = loaded
    base = {"kv_cache_tokens": 4096, "block_size": 8, "policy": "fcfs", "packer": "token", "chunk_size": 20,
            "enable_prefix_caching": caching, "num_threads": 1}
    return LLMEngine(EngineConfig(**{**base, **cfg}), model, tok, clock=VirtualClock(), predictor=PREDICTOR)


def _run(eng: LLMEngine, arrivals: list[tuple[int, str, list[int], SamplingParams]], max_steps: int = 5000):
    """Add each (step, id, prompt, sampling) at its step, step until done; outputs by id."""
    reqs = run_arrivals(eng, arrivals, max_steps, STEP_S)
    return {rid: list(r.output_token_ids) for rid, r in reqs.items()}, reqs


GREEDY = SamplingParams(max_tokens=12, ignore_eos=True)


def test_a_later_prompt_reuses_the_shared_prefix_and_generates_the_same_tokens(loaded):
    rng = random.Random(0)
    system = [rng.randrange(3, 500) for _ in range(45)]
    prompts = {f"r{i}": system + [rng.randrange(3, 500) for _ in range(rng.randrange(1, 30))] for i in range(5)}
    arrivals = [(i * 40, rid, p, GREEDY) for i, (rid, p) in enumerate(prompts.items())]   # one after another
    want, _ = _run(_engine(loaded, False), arrivals)
    eng = _engine(loaded, True)
    got, reqs = _run(eng, arrivals)
    assert got == want
    assert reqs["r0"].num_cached_tokens == 0
    for rid in list(prompts)[1:]:
        assert reqs[rid].num_cached_tokens == 40         # the 5 full blocks of the 45 shared tokens
    assert eng.kv.hit_tokens == 4 * 40


@pytest.mark.parametrize("policy, packer", [("fcfs", "token"), ("lars", "medha"), ("kairos", "medha")])
def test_requests_arriving_together_reuse_what_the_first_ones_computed(loaded, policy, packer):
    """All at once: nothing is cached when they arrive, so the ones scheduled after the first
    chunks of the shared prefix ran take those blocks when they are popped."""
    rng = random.Random(2)
    shared = [rng.randrange(3, 500) for _ in range(80)]
    arrivals = [(0, f"r{i}", shared + [rng.randrange(3, 500) for _ in range(5)], GREEDY) for i in range(8)]
    cfg = {"policy": policy, "packer": packer, "max_num_batched_tokens": 48}
    want, _ = _run(_engine(loaded, False, **cfg), arrivals)
    eng = _engine(loaded, True, **cfg)
    got, reqs = _run(eng, arrivals)
    assert got == want
    cached = [r.num_cached_tokens for r in reqs.values()]
    assert cached[0] == 0 and cached[-5:] == [80] * 5      # the whole shared prefix, 10 blocks
    # Each request is looked up on arrival and again when first scheduled, but counted once.
    assert eng.kv.query_tokens == sum(len(p) for _, _, p, _ in arrivals)
    assert eng.kv.hit_tokens == sum(cached)
    assert eng.scheduler.prefill_backlog == 0 == eng.scheduler.prefill_backlog_slow()


def test_a_repeated_prompt_recomputes_only_its_last_block(loaded):
    prompt = list(range(3, 3 + 33))
    arrivals = [(0, "a", prompt, GREEDY), (60, "b", prompt, GREEDY)]
    want, _ = _run(_engine(loaded, False), arrivals)
    got, reqs = _run(_engine(loaded, True), arrivals)
    assert got == want and got["a"] == got["b"]
    assert reqs["b"].num_cached_tokens == 32


def test_requests_share_blocks_of_one_still_running(loaded):
    """b and c arrive while a still decodes: they hold a's registered prompt blocks too."""
    rng = random.Random(1)
    shared = [rng.randrange(3, 500) for _ in range(64)]
    arrivals = [(0, "a", shared + [7], SamplingParams(max_tokens=40, ignore_eos=True)),
                (6, "b", shared + [8, 9], GREEDY), (7, "c", shared[:50], GREEDY)]
    want, _ = _run(_engine(loaded, False), arrivals)
    eng = _engine(loaded, True)
    seen_shared = []
    orig_step = eng.step

    def step():
        res = orig_step()
        seen_shared.append(max((eng.kv.allocator.refcount(b) for t in eng.kv.block_tables.values() for b in t),
                               default=0))
        return res
    eng.step = step
    got, reqs = _run(eng, arrivals)
    assert got == want
    assert reqs["b"].num_cached_tokens == 64 and reqs["c"].num_cached_tokens == 48
    assert max(seen_shared) == 3


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_under_kv_pressure_evictions_and_preemptions_keep_outputs_exact(loaded, seed):
    """A KV cache too small for the load: cached blocks are evicted, holders are preempted and
    recompute; every output still equals the run without the cache, and nothing leaks."""
    rng = random.Random(seed)
    arrivals = shared_prefix_arrivals(rng, 14, (10, 50), 60, (4, 25))
    cfg = {"kv_cache_tokens": 160, "policy": "lars", "packer": "medha"}
    want, _ = _run(_engine(loaded, False, **cfg), arrivals)
    eng = _engine(loaded, True, **cfg)
    got, reqs = _run(eng, arrivals)
    assert got == want
    assert eng.kv.hit_tokens > 0
    assert eng.scheduler.preempted_total > 0


def test_a_resumed_request_matches_over_its_delivered_tokens_too(loaded):
    prompt = list(range(10, 30))
    eng = _engine(loaded, True)
    first, _ = _run(eng, [(0, "a", prompt, SamplingParams(max_tokens=20, ignore_eos=True))])
    # Resume after 10 delivered tokens: prompt + 10 tokens = 30 known; blocks 0-2 (24 tokens)
    # were registered while "a" ran.
    r = eng.add_request("a2", prompt, SamplingParams(max_tokens=20, ignore_eos=True),
                        output_token_ids=first["a"][:10])
    assert r.num_cached_tokens == 24
    for _ in range(100):
        if not eng.has_unfinished():
            break
        eng.step()
    assert r.output_token_ids == first["a"]


def test_a_parked_prefill_is_findable_and_released_blocks_stay_cached(loaded):
    eng = _engine(loaded, True)
    prompt = list(range(40, 80))
    eng.add_request("p", prompt, GREEDY, prefill_only=True)
    for _ in range(20):
        eng.step()
    assert "p" in eng.scheduler.parked
    r = eng.add_request("q", prompt + [5], GREEDY)
    assert r.num_cached_tokens == 40
    eng.release("p")
    for _ in range(100):
        if not eng.has_unfinished():
            break
        eng.step()
    eng.kv.check()
    assert eng.kv.num_free_blocks == eng.kv.num_blocks and eng.kv.allocator.num_cached >= 5


def test_a_handoff_admission_short_of_kv_leaves_the_hit_counters_alone():
    """A decode-side admission that fails for lack of KV is looked up again when it is admitted
    for real: only that one counts, and the cached prefix it matched stays findable."""
    from raycluster.engine.sched_factory import build_scheduler

    kv = PrefixCachingKVManager(6, 4)
    sched = build_scheduler(EngineConfig(policy="fcfs", packer="token", block_size=4, enable_prefix_caching=True),
                            kv, VirtualClock(), 4096, PREDICTOR)
    a = Request("a", list(range(9)))
    assert kv.try_allocate(a, 8)
    kv.cache_full_blocks(a, 8)
    kv.free("a")                                     # 2 cached blocks in the free pool
    hog = Request("hog", [99] * 12)
    assert kv.try_allocate(hog, 12)                  # 3 of the 4 uncached blocks
    b = Request("b", list(range(16)), SamplingParams(max_tokens=4))
    b.output_token_ids.append(7)                     # KV for 16 tokens: 2 cached + 2 new blocks
    before = (kv.query_tokens, kv.hit_tokens)
    assert sched.admit_prefilled(b) is None          # 1 block free
    assert (kv.query_tokens, kv.hit_tokens) == before
    assert kv.cached_prefix_tokens(b.all_token_ids) == 8
    kv.check()
    kv.free("hog")
    blocks, skip = sched.admit_prefilled(b)
    assert (len(blocks), skip) == (2, 2)
    assert (kv.query_tokens - before[0], kv.hit_tokens - before[1]) == (17, 8)
