"""Block allocator and KV manager bookkeeping: allocate / append / free / fork, invariants."""

import pytest

from raycluster.engine.kv_manager import BlockAllocator, KVCacheManager, OutOfBlocks
from raycluster.request import Request


def _req(rid: str, n_prompt: int, computed: int = 0) -> Request:
    r = Request(rid, list(range(n_prompt)))
    r.num_computed_tokens = computed
    return r


def test_allocate_append_free_exact_block_counts():
    kv = KVCacheManager(num_blocks=10, block_size=4)
    a = _req("a", 9)
    assert kv.try_allocate(a, 9)
    assert len(kv.block_tables["a"]) == 3 and kv.num_free_blocks == 7
    a.num_computed_tokens = 9
    assert kv.try_allocate(a, 3)            # 12 tokens still fit in 3 blocks
    assert len(kv.block_tables["a"]) == 3
    a.num_computed_tokens = 12
    assert kv.try_allocate(a, 1)            # the 13th token opens a 4th block
    assert len(kv.block_tables["a"]) == 4 and kv.num_free_blocks == 6
    kv.check()
    kv.free("a")
    assert kv.num_free_blocks == 10 and not kv.holds("a")
    kv.check()


def test_allocation_failure_reserves_nothing():
    kv = KVCacheManager(num_blocks=3, block_size=4)
    assert kv.try_allocate(_req("a", 8), 8)
    assert not kv.try_allocate(_req("b", 8), 8)
    assert kv.num_free_blocks == 1 and not kv.holds("b")
    kv.check()


def test_fork_shares_blocks_with_refcounts():
    kv = KVCacheManager(num_blocks=6, block_size=4)
    kv.try_allocate(_req("a", 8), 8)
    kv.fork("a", "b")
    assert kv.block_tables["a"] == kv.block_tables["b"]
    assert all(kv.allocator.refcount(b) == 2 for b in kv.block_tables["a"])
    kv.free("a")
    assert kv.num_free_blocks == 4     # still referenced by b
    kv.check()
    kv.free("b")
    assert kv.num_free_blocks == 6
    kv.check()


def test_double_free_and_overdraw_raise():
    alloc = BlockAllocator(2)
    (b,) = alloc.allocate(1)
    alloc.free(b)
    with pytest.raises(ValueError, match="double free"):
        alloc.free(b)
    with pytest.raises(OutOfBlocks):
        alloc.allocate(3)


def test_check_catches_leak():
    kv = KVCacheManager(num_blocks=4, block_size=4)
    kv.allocator.allocate(1)                # a block no table owns
    with pytest.raises(AssertionError):
        kv.check()
