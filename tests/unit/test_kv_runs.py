"""Run-seeking block allocation: exact picks of `take_runs`, the allocators' invariants under
random churn, LRU eviction kept at the level of freed tables, and the layouts a steady-state P/D
churn hands a KV connector (raycluster.bench.kv_layouts) against a plain free queue."""

from collections import OrderedDict

import numpy as np
import pytest

from raycluster.bench.kv_layouts import QueueOrderAllocator, pd_churn, pieces, runs
from raycluster.engine.kv_manager import BlockAllocator, OutOfBlocks, take_runs
from raycluster.engine.prefix_cache import PrefixCachingAllocator, block_key


def _take(order: list[int], n: int, after: int | None = None) -> tuple[list[int], list[int]]:
    pool = OrderedDict.fromkeys(order)
    out: list[int] = []
    take_runs(pool, n, after, out)
    return out, list(pool)


def test_take_runs_continues_the_table_then_seeks_extents_then_holes():
    # The blocks right after the table's last one come first, in order.
    assert _take([9, 5, 6, 7, 2], 3, after=4) == ([5, 6, 7], [9, 2])
    # A new run: the first front block whose extent covers the request wins (20 alone does not).
    assert _take([20, 1, 2, 3, 4], 3) == ([1, 2, 3], [20, 4])
    # No extent covers it: the largest first, then the next.
    assert _take([20, 30, 31], 3) == ([30, 31, 20], [])
    # An extent is taken around its front block: right first, then left ...
    assert _take([11, 10, 12, 13, 40], 3) == ([11, 12, 13], [10, 40])
    assert _take([13, 10, 11, 12, 40], 3) == ([11, 12, 13], [10, 40])
    # With labels (which free call returned each block, growing along the order), only blocks
    # labelled no later than the n-th in order: 12 was freed after the first two.
    group = [0] * 64
    for b, g in ((11, 1), (10, 1), (12, 2), (13, 3), (40, 3)):
        group[b] = g
    for labels, taken in ((None, [11, 12]), (group, [10, 11])):
        out: list[int] = []
        pool = OrderedDict.fromkeys([11, 10, 12, 13, 40])
        take_runs(pool, 2, None, out, labels)
        assert out == taken
    # One block: an isolated hole near the front rather than the edge of a run.
    assert _take([2, 3, 4, 7, 9, 10], 1) == ([7], [2, 3, 4, 9, 10])
    # ... but growing the table's own run beats any hole.
    assert _take([2, 3, 7], 1, after=1) == ([2], [3, 7])
    # No hole: the front block.
    assert _take([4, 5, 6], 1) == ([4], [5, 6])


def test_block_allocator_grows_tables_as_runs_and_refills_freed_extents():
    a = BlockAllocator(12)
    t1 = a.allocate(4)
    t2 = a.allocate(4)
    assert (t1, t2) == ([0, 1, 2, 3], [4, 5, 6, 7])
    assert a.allocate_for(t2, 2) == [8, 9]
    assert a.allocate(1) == [10]
    a.free_all(t1)
    assert a.allocate_for(t2, 2) == [0, 1]      # 10 is taken; a run beats the queue's front (11)
    assert a.allocate(3) == [2, 3, 11]          # the largest extent first, then the front
    with pytest.raises(OutOfBlocks):
        a.allocate(a.num_free + 1)


def test_prefix_cache_hands_out_plain_blocks_before_cached_ones_and_evicts_oldest_table_first():
    a = PrefixCachingAllocator(16)
    old, new, plain = a.allocate(4), a.allocate(4), a.allocate(4)
    keys = {}
    for table in (old, new):
        parent = b""
        for b in table:
            parent = keys[b] = block_key(parent, [b])
            a.register(b, parent)
    a.free_all(old)                 # least recently freed
    a.free_all(plain)               # no keys: handed out before any cached block
    a.free_all(new)
    assert a.allocate(4) == [12, 13, 14, 15]        # never-used blocks first
    # Then freed plain ones, then evicts `old` (4..7 would make one run with 3, but `new` was
    # freed after it).
    assert a.allocate(8) == plain + old
    assert all(a.lookup(keys[b]) == b for b in new)
    assert all(a.lookup(keys[b]) is None for b in old)
    assert a.allocate(2) == [6, 7]                  # `new` loses its tail, not its head
    assert a.lookup(keys[4]) == 4 and a.lookup(keys[5]) == 5
    a.check_keys()


@pytest.mark.parametrize("cls", [BlockAllocator, PrefixCachingAllocator])
def test_random_churn_keeps_every_block_owned_once(cls):
    rng = np.random.default_rng(3)
    a = cls(200)
    tables: list[list[int]] = []
    uid = 0
    for _ in range(3000):
        if tables and (rng.random() < 0.45 or a.num_free < 20):
            a.free_all(tables.pop(int(rng.integers(len(tables)))))
        elif tables and rng.random() < 0.5:
            t = tables[int(rng.integers(len(tables)))]
            n = int(rng.integers(1, 4))
            if a.can_allocate(n):
                before = set(a.free_blocks())
                new = a.allocate_for(t, n)
                assert len(set(new)) == n and set(new) <= before
                t.extend(new)
        else:
            n = int(rng.integers(1, 30))
            if a.can_allocate(n):
                before = set(a.free_blocks())
                if cls is PrefixCachingAllocator:     # what strict LRU would evict for this call
                    keyed = [b for b in a.free_blocks() if b not in a._keyless]
                    evict = n - len(a._keyless)
                    latest = a._freed_by[keyed[evict - 1]] if evict > 0 else -1
                new = a.allocate(n)
                assert len(set(new)) == n and set(new) <= before
                if cls is PrefixCachingAllocator:     # only blocks freed no later than those
                    assert all(a._freed_by[b] <= latest for b in new if b in keyed)
                tables.append(new)
                if cls is PrefixCachingAllocator:
                    for b in new:
                        uid += 1
                        a.register(b, block_key(b"", [uid]))
        held = [b for t in tables for b in t]
        assert len(held) == len(set(held)) and len(held) + a.num_free == 200
    assert set(a.free_blocks()).isdisjoint(held)
    if cls is PrefixCachingAllocator:
        a.check_keys()


@pytest.mark.parametrize("cls", [BlockAllocator, PrefixCachingAllocator])
def test_a_steady_state_pd_handoff_moves_few_pieces_where_a_free_queue_moves_one_per_block(cls):
    """The headline layout of the handoff benchmark: after P/D churn, a 1024-block handoff
    through the engine's allocators is a few dozen pieces at most; through a plain free queue
    (what the engine did before run-seeking) nearly every block is its own piece."""
    seeds = range(4)
    ours = [pd_churn(cls, 2064, 1024, rng=np.random.default_rng(s)) for s in seeds]
    queue = [pd_churn(QueueOrderAllocator, 2064, 1024, rng=np.random.default_rng(s)) for s in seeds]
    ours_pieces = [pieces(s, d) for s, d in ours]
    queue_pieces = [pieces(s, d) for s, d in queue]
    assert max(ours_pieces) <= 48, ours_pieces                  # 4-32 seen
    assert min(queue_pieces) >= 0.85 * 1024, queue_pieces       # 927-991 seen
    assert all(len(runs(s)) <= 40 for s, _ in ours)     # the source: about a run per 128-block chunk


def test_pieces_and_runs():
    assert runs([3, 4, 5, 9, 10, 2]) == [0, 3, 5]
    assert pieces([3, 4, 5, 9], [7, 8, 20, 21]) == 3     # breaks where either side breaks
    assert pieces([], []) == 0
