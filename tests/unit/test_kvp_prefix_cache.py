"""Prefix caching in KVP groups: the striped caching allocator (per-rank LRU pools, blocks kept
on the rank their chain position needs), and KVP engines (ranks as threads over gloo) reusing
cached prefixes with exactly the tokens a plain single engine computes -- sequential prompts
sharing a prefix across every rank, KV pressure with evictions, and a P/D handoff whose leading
blocks the group has cached."""

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
from raycluster.model.loader import load_model
from raycluster.parallel.kvp_layout import StripedAllocator, StripedCachingAllocator
from raycluster.request import Request, SamplingParams

BS = 8
GREEDY = SamplingParams(max_tokens=12, ignore_eos=True)
MAX_STEPS = 3000



@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return load_model(tiny_model_dir)[0]


def _keys(*blocks_of_tokens):
    out, parent = [], b""
    for toks in blocks_of_tokens:
        parent = block_key(parent, toks)
        out.append(parent)
    return out


def _striped(kv: PrefixCachingKVManager) -> None:
    """Every table's logical block i is on rank i % world: what makes a cached block usable."""
    a = kv.allocator
    for rid, table in kv.block_tables.items():
        assert [b // a.blocks_per_rank for b in table] == [i % a.world for i in range(len(table))], rid


# ---- the allocator -------------------------------------------------------------------------------
def test_blocks_are_striped_and_freed_ones_stay_findable_in_their_ranks_pool():
    a = StripedCachingAllocator(blocks_per_rank=3, world=2)     # rank 0: 0-2, rank 1: 3-5
    assert isinstance(a, PrefixCachingAllocator)
    t = a.allocate(4, 0)
    assert t == [0, 3, 1, 4]                                    # ranks 0, 1, 0, 1
    ks = _keys([1], [2], [3], [4])
    for b, k in zip(t, ks):
        a.register(b, k)
    a.free_all(t)                               # last to first: rank 0 frees 1 then 0, rank 1 4 then 3
    assert a.num_free == 6 and a.num_cached == 4
    assert [a.lookup(k) for k in ks] == t
    assert sorted(a.free_blocks()) == list(range(6))
    # Never-used blocks first, then each rank's least recently freed: index 0 -> rank 0 -> 2, then
    # 1 (the tail block of rank 0's share), losing its key; rank 1's cached blocks are untouched.
    assert a.allocate(1, 0) == [2]
    assert a.allocate(1, 2) == [1]
    assert a.lookup(ks[2]) is None and [a.lookup(k) for k in (ks[0], ks[1], ks[3])] == [0, 3, 4]
    assert a.num_free == 4 and a.num_cached == 3
    # Rank 0 has one free block (cached 0); rank 1 three.
    assert a.can_allocate(2, 0) and not a.can_allocate(3, 0) and a.can_allocate(3, 1)
    with pytest.raises(OutOfBlocks, match="free per pool"):
        a.allocate(3, 0)
    a.check_keys()


def test_take_revives_from_the_right_pool_with_refcounts_and_lru_order_per_rank():
    a = StripedCachingAllocator(blocks_per_rank=3, world=2)
    t = a.allocate(4, 0)                        # [0, 3, 1, 4]
    ks = _keys([1], [2], [3], [4])
    for b, k in zip(t, ks):
        a.register(b, k)
    a.free_all(t)                               # rank 1's pool: 5 (never used), 4, 3
    a.take(0)                                   # rank 0: 2, 1 left
    a.take(0)
    assert a.refcount(0) == 2 and a.num_free == 5
    assert not a.can_allocate(5, 0) and a.can_allocate(4, 0)      # rank 0 has 2 free, rank 1 has 3
    a.free(0)
    assert a.refcount(0) == 1 and 0 not in a.free_blocks()
    a.free(0)
    assert a.refcount(0) == 0 and a.lookup(ks[0]) == 0 and a.num_free == 6
    with pytest.raises(ValueError, match="double free"):
        a.free(0)
    # Rank 1: reviving 4 and freeing it again makes 3 its least recently freed cached block.
    a.take(4)
    a.free(4)
    assert a.allocate(2, 1) == [5, 2]           # ranks 1, 0: never-used blocks first
    assert a.allocate(1, 3) == [3]              # rank 1: 3 is evicted, not 4
    assert a.lookup(ks[1]) is None and a.lookup(ks[3]) == 4
    a.check_keys()
    a._block_of[ks[3]] = 0                      # a corrupted map is caught
    with pytest.raises(AssertionError, match="block 4"):
        a.check_keys()


def test_alias_table_and_validation_match_the_plain_striped_allocator():
    a, s = StripedCachingAllocator(4, 3), StripedAllocator(4, 3)
    assert a.alias_table(7, 2) == s.alias_table(7, 2)
    assert a.num_blocks == s.num_blocks == 12 and a.num_free == s.num_free == 12
    with pytest.raises(ValueError, match="blocks_per_rank"):
        StripedCachingAllocator(0, 2)


def test_a_match_shares_blocks_on_their_ranks_and_the_rest_continues_the_stripe():
    kv = PrefixCachingKVManager(8, 4, StripedCachingAllocator(4, 2))
    a = Request("a", list(range(18)))
    assert kv.try_allocate(a, 18)
    assert kv.block_tables["a"] == [0, 4, 1, 5, 2]
    kv.cache_full_blocks(a, 18)                 # 4 full blocks
    kv.free("a")
    kv.check()
    b = Request("b", list(range(16)) + [99, 98, 97])
    assert kv.cached_prefix_tokens(b.all_token_ids) == 16
    assert kv.match_prefix(b) == 16
    b.num_computed_tokens = 16
    assert kv.try_allocate(b, 3)                # logical block 4: rank 0, a never-used block
    assert kv.block_tables["b"] == [0, 4, 1, 5, 3]
    _striped(kv)
    assert (kv.hit_tokens, kv.query_tokens) == (16, 19)
    c = Request("c", list(range(8)) + [50] * 9)
    assert kv.match_prefix(c) == 8             # a's block 0, shared with b
    assert kv.allocator.refcount(0) == 2
    kv.check()
    kv.free("b")
    kv.withdraw("c")
    kv.check()
    assert kv.num_free_blocks == 8 and (kv.hit_tokens, kv.query_tokens) == (16, 19)
    # The default constructor still builds the single-pool allocator.
    assert type(PrefixCachingKVManager(8, 4).allocator) is PrefixCachingAllocator


# ---- the engine ------------------------------------------------------------------------------------
def _engine(model, kvp: int, caching: bool, **cfg) -> LLMEngine:
    # Chunks of 24: a prefill after a cached prefix (at a block boundary) starts where the plain
    # engine is mid-chunk, so the two compute the same tokens in differently cut steps.
    base = dict(policy="fcfs", packer="token", predictor="none", block_size=BS, chunk_size=24,
                kv_cache_tokens=4096, num_threads=1, enable_prefix_caching=caching, kvp=kvp, group_timeout_s=30)
    return LLMEngine(EngineConfig(**{**base, **cfg}), model, clock=VirtualClock())


def _run(eng: LLMEngine, arrivals):
    """Add each (step, id, prompt, sampling) at its step and step until done (bounded); checks
    the KV is consistent after every step and all free at the end. Returns the requests by id."""

    def check(eng: LLMEngine) -> None:
        eng.kv.check()
        if eng.config.kvp > 1 and eng.config.enable_prefix_caching:
            _striped(eng.kv)

    try:
        reqs = run_arrivals(eng, arrivals, MAX_STEPS, 0.01, after_step=check)
    finally:
        eng.close()
    if eng.config.kvp > 1:
        assert eng.runner.ranks.errors == []
    return reqs


def _outputs(reqs) -> dict[str, list[int]]:
    return {rid: list(r.output_token_ids) for rid, r in reqs.items()}


@pytest.mark.parametrize("world", [2, 3])
def test_a_kvp_engine_reuses_a_prefix_striped_over_every_rank_with_the_plain_engines_tokens(model, world):
    rng = random.Random(world)
    shared = [rng.randrange(3, 500) for _ in range(70)]          # 8 full blocks: every rank
    prompts = {f"r{i}": shared + [rng.randrange(3, 500) for _ in range(rng.randrange(1, 30))] for i in range(3)}
    prompts["again"] = list(prompts["r0"])                       # all of it cached but the last token
    arrivals = [(i * 8, rid, p, GREEDY) for i, (rid, p) in enumerate(prompts.items())]
    want = _outputs(_run(_engine(model, 1, False), arrivals))
    eng = _engine(model, world, True)
    assert type(eng.kv.allocator) is StripedCachingAllocator and eng.kv.allocator.world == world
    reqs = _run(eng, arrivals)
    assert _outputs(reqs) == want
    expect = {"r0": 0, "r1": 64, "r2": 64, "again": (len(prompts["r0"]) - 1) // BS * BS}
    assert {rid: r.num_cached_tokens for rid, r in reqs.items()} == expect
    assert eng.kv.hit_tokens == sum(expect.values())
    assert eng.kv.query_tokens == sum(len(p) for p in prompts.values())


@pytest.mark.parametrize("seed", [7, 8])
def test_under_kv_pressure_a_kvp_engine_evicts_per_rank_and_keeps_outputs_exact(model, seed):
    """Cached blocks are evicted, holders preempted and recomputed; outputs stay exact."""
    rng = random.Random(seed)
    arrivals = shared_prefix_arrivals(rng, 12, (20, 50), 40, (4, 20))
    want = _outputs(_run(_engine(model, 1, False), arrivals))
    eng = _engine(model, 2, True, kv_cache_tokens=96)            # 12 blocks per rank, 24 in all
    alloc = eng.kv.allocator
    evicted = []
    orig = alloc.allocate

    def allocate(n, first_index=0):
        before = alloc.num_cached
        out = orig(n, first_index)
        evicted.append(before - alloc.num_cached)               # allocate only ever drops keys
        return out
    alloc.allocate = allocate
    reqs = _run(eng, arrivals)
    assert _outputs(reqs) == want
    assert sum(evicted) > 0 and eng.kv.hit_tokens > 0 and eng.scheduler.preempted_total > 0


def test_a_handoff_into_a_kvp_group_moves_only_the_blocks_after_its_cached_prefix(model):
    """P/D into a KVP decode group with caching: the group holds the shared prefix (from an
    earlier request), so `fill_kv` gets the rest only; the blocks land striped on their ranks
    and decoding gives the plain engine's tokens."""
    rng = random.Random(3)
    shared = [rng.randrange(3, 500) for _ in range(40)]            # 5 full blocks
    first = shared + [rng.randrange(3, 500) for _ in range(6)]
    prompt = shared + [rng.randrange(3, 500) for _ in range(17)]
    want = _outputs(_run(_engine(model, 1, False), [(0, "h", prompt, GREEDY)]))["h"]

    prefill = _engine(model, 1, False)                          # the prefill instance: parks "h"
    try:
        prefill.add_request("h", prompt, GREEDY, prefill_only=True)
        for _ in range(50):
            if "h" in prefill.scheduler.parked:
                break
            prefill.step()
        src = prefill.parked_blocks("h")
        first_token = list(prefill.scheduler.parked["h"].output_token_ids)
        assert src is not None and first_token == want[:1]
        src_kv = prefill.runner.kv_cache[:, src].clone()
    finally:
        prefill.close()

    eng = _engine(model, 2, True)
    try:
        eng.add_request("warm", first, GREEDY)
        for _ in range(200):
            if not eng.has_unfinished():
                break
            eng.step()
        moved = []

        def fill_kv(block_ids, skip):
            moved.append((list(block_ids), skip))
            eng.runner.load_blocks(block_ids, src_kv[:, skip:])
            return True
        assert eng.add_prefilled("h", prompt, first_token, GREEDY, fill_kv)
        [(blocks, skip)] = moved
        assert skip == 5 and len(blocks) == len(src) - 5
        assert eng.kv.hit_tokens == 40
        _striped(eng.kv)
        h = eng.scheduler.requests["h"]
        for _ in range(200):
            if not eng.has_unfinished():
                break
            eng.step()
        assert eng.scheduler.requests == {}
        eng.kv.check()
        assert eng.kv.num_free_blocks == eng.kv.num_blocks
    finally:
        eng.close()
    assert eng.runner.ranks.errors == []
    # Its first token came from the prefill side, the rest were decoded by the group.
    assert h.output_token_ids == want
