"""Where a KVP group's blocks live: the leader's block allocators for the two layouts.

Every KVP rank holds `blocks_per_rank` blocks; global block g lives on rank g // blocks_per_rank
at local block g % blocks_per_rank, and each rank's free blocks form a pool of their own. The
layout says which pool a request's logical block i is taken from:

- striped (`StripedAllocator`): rank i % world, so each rank holds about 1/world of every
  request's KV and reads only that share in a step.
- progressive (`ProgressiveAllocator`, Medha's progressive scaling): contiguous ranges of
  `cap_blocks` blocks, rank (start + i // cap_blocks) % world, where `start` is chosen when the
  request's first block is taken: `first_fit` (the default) the lowest rank with a whole range
  free, else the one with the most free blocks; `least_loaded` always the one with the most free
  blocks. A short request lives on one rank; a long one onboards the next rank each time it has
  filled its share of the last. First fit keeps the group's short requests on rank 0 while it
  has room, so their steps run on the leader alone (raycluster.parallel.kvp `step_ranks`: the
  other ranks sit them out); least loaded spreads them, balancing KV over the ranks but making
  nearly every step a step of the whole group. When
  the rank a block should go to has no free block, it goes to the next rank (in ring order) that
  has one, so a request is refused only when the whole group is out of blocks: `can_allocate`
  is `n <= num_free`, and `allocate` never fails after it said yes.

The attention path (raycluster.parallel.kvp: `local_share`, `kvp_meta`) finds each rank's share
of a request from its block table, whatever the layout, so a placement is a preference for
balance and never a condition of correctness: a fallback block or a cached prefix laid out by
another request is read where it is.

With prefix caching the pools are LRUs (`StripedCachingAllocator`, `ProgressiveCachingAllocator`,
on raycluster.engine.prefix_cache's `PrefixCachingAllocator`). Striped: a cached block of logical
index i sits on rank i % world, where any request sharing the prefix needs it. Progressive: a
request's start is the rank of its first block, so a cached prefix (which includes block 0)
fixes the start rank of every request that shares it, and the rest continues that request's
ranges.

`allocate(n, first_index, first_block)`: `first_index` is the request's next logical block,
`first_block` its block 0 (None for a new request), which is how the progressive layout knows
the start of a request it keeps no state for; the KV manager grows a table through
`allocate_for(table, n)`, which passes both. `alias_tables` lays out the profiler's synthetic
tables as `allocate` would.
"""

from __future__ import annotations

from collections import OrderedDict, deque

from raycluster.engine.kv_manager import BlockAllocator, KVCacheManager, OutOfBlocks
from raycluster.engine.prefix_cache import PrefixCachingAllocator, PrefixCachingKVManager


class _Ranks:
    """Block geometry shared by the layouts: `world` ranks of `blocks_per_rank` blocks each;
    `_pools[r]` holds rank r's free blocks (built by the allocator classes below)."""

    def _shard(self, blocks_per_rank: int, world: int) -> None:
        if blocks_per_rank <= 0 or world <= 0:
            raise ValueError(f"blocks_per_rank and world must be >= 1, got {blocks_per_rank}, {world}")
        self.blocks_per_rank, self.world = blocks_per_rank, world
        self.num_blocks = blocks_per_rank * world

    def _rank_blocks(self, rank: int) -> range:
        return range(rank * self.blocks_per_rank, (rank + 1) * self.blocks_per_rank)

    def rank_of(self, block: int) -> int:
        return block // self.blocks_per_rank

    def _pool_of(self, block: int):
        return self._pools[block // self.blocks_per_rank]

    def free_per_rank(self) -> list[int]:
        return [len(p) for p in self._pools]


class _Striping(_Ranks):
    """Logical block i of a request on rank i % world."""

    def _pool_for(self, index: int, first_block: int | None = None):
        return self._pools[index % self.world]

    def _per_rank(self, n: int, first_index: int) -> list[int]:
        base, extra = divmod(n, self.world)
        return [base + ((r - first_index) % self.world < extra) for r in range(self.world)]

    def can_allocate(self, n: int, first_index: int = 0) -> bool:
        return all(k <= len(p) for k, p in zip(self._per_rank(n, first_index), self._pools))

    def alias_table(self, num_blocks: int, offset: int) -> list[int]:
        """A synthetic table laid out as `allocate` would lay it out (blocks may be shared with
        other synthetic tables): what the profiler times steps with."""
        n, w = self.blocks_per_rank, self.world
        return [(i % w) * n + (offset + i // w) % n for i in range(num_blocks)]

    def layout_label(self, block_size: int) -> str:
        return ""


START_RULES = ("first_fit", "least_loaded")


class _Progressive(_Ranks):
    """Logical block i of a request on rank (start + i // cap_blocks) % world, start the rank of
    its block 0 (for a new request: `start` "first_fit", the lowest rank with `cap_blocks` free,
    else as "least_loaded", the rank with the most free blocks, the lowest on a tie); a full rank
    passes the block on to the next one with room."""

    def __init__(self, blocks_per_rank: int, world: int, cap_blocks: int, start: str = "first_fit") -> None:
        if cap_blocks <= 0:
            raise ValueError(f"cap_blocks must be >= 1, got {cap_blocks}")
        if start not in START_RULES:
            raise ValueError(f"kvp_start: {start!r} is not one of {', '.join(START_RULES)}")
        self.cap_blocks, self.start = cap_blocks, start
        super().__init__(blocks_per_rank, world)

    def _start_rank(self, free: list[int]) -> int:
        """The start rank of a new request, given each rank's free blocks."""
        if self.start == "first_fit":
            fits = next((r for r, f in enumerate(free) if f >= self.cap_blocks), None)
            if fits is not None:
                return fits
        return max(range(self.world), key=free.__getitem__)     # the lowest of the fullest

    def target_rank(self, index: int, start: int) -> int:
        """The rank logical block `index` of a request starting on `start` belongs on."""
        return (start + index // self.cap_blocks) % self.world

    def _pool_for(self, index: int, first_block: int | None = None):
        if first_block is None:
            if index:
                raise ValueError(f"progressive KVP layout: logical block {index} needs the request's block 0 "
                                 "(first_block) to know its start rank")
            return self._pools[self._start_rank([len(p) for p in self._pools])]
        want = self.target_rank(index, self.rank_of(first_block))
        for step in range(self.world):
            pool = self._pools[(want + step) % self.world]
            if pool:
                return pool
        raise OutOfBlocks(f"no free block for logical block {index}")     # can_allocate said no

    def can_allocate(self, n: int, first_index: int = 0) -> bool:
        return n <= self.num_free       # any rank with room takes a block its target cannot

    def allocate_for(self, table: list[int], n: int) -> list[int]:
        """`n` more blocks for the request whose blocks so far are `table` (its block 0 says
        where it started)."""
        return self.allocate(n, len(table), table[0] if table else None)

    def alias_tables(self, lengths: list[int]) -> list[list[int]]:
        """Synthetic tables of `lengths` blocks, one per request of a profiled step, laid out as
        `allocate` would lay them out from an empty pool, in order (each starts where `allocate`
        would start it, counting the blocks taken so far); ids wrap within a rank, so tables
        longer than the pool alias blocks, which the profiler allows."""
        used, tables = [0] * self.world, []
        for n in lengths:
            start = self._start_rank([self.blocks_per_rank - u for u in used])
            table = []
            for i in range(n):
                r = self.target_rank(i, start)
                table.append(r * self.blocks_per_rank + used[r] % self.blocks_per_rank)
                used[r] += 1
            tables.append(table)
        return tables

    def alias_table(self, num_blocks: int, offset: int) -> list[int]:
        """The synthetic table of a request laid out after one of `offset` blocks."""
        return self.alias_tables([offset, num_blocks])[1]

    def layout_label(self, block_size: int) -> str:
        return f"+prog{self.cap_blocks * block_size}" + ("ff" if self.start == "first_fit" else "ll")


class _RankPools(BlockAllocator):
    """A `BlockAllocator` over per-rank FIFO pools (the layout mixin places blocks). Reference
    counting is the base class's; only where free blocks live differs."""

    def __init__(self, blocks_per_rank: int, world: int) -> None:   # per-rank pools, not one list
        self._shard(blocks_per_rank, world)
        self._pools = [deque(self._rank_blocks(r)) for r in range(world)]
        self._refs = [0] * self.num_blocks
        self._num_free = self.num_blocks

    @property
    def num_free(self) -> int:
        return self._num_free

    def free_blocks(self) -> list[int]:
        return [b for p in self._pools for b in p]

    def allocate(self, n: int, first_index: int = 0, first_block: int | None = None) -> list[int]:
        if not self.can_allocate(n, first_index):
            raise OutOfBlocks(f"need {n} blocks from index {first_index}; free per rank {self.free_per_rank()}")
        blocks = []
        for j in range(n):
            b = self._pool_for(first_index + j, first_block).popleft()
            self._refs[b] = 1
            blocks.append(b)
            first_block = b if first_block is None else first_block
        self._num_free -= n
        return blocks

    def allocate_for(self, table: list[int], n: int) -> list[int]:
        return self.allocate(n, len(table))

    def _release(self, block: int) -> None:
        self._pool_of(block).append(block)
        self._num_free += 1

    def free_all(self, blocks) -> None:
        for b in blocks:
            self.free(b)


class _CachingRankPools(PrefixCachingAllocator):
    """Prefix caching over per-rank LRU pools: a cached block stays in its rank's pool, `take`
    revives it from there, and eviction is least recently freed first within the rank a block
    is taken from."""

    def __init__(self, blocks_per_rank: int, world: int) -> None:
        self._shard(blocks_per_rank, world)
        PrefixCachingAllocator.__init__(self, self.num_blocks)

    def _make_pools(self):
        return [OrderedDict.fromkeys(self._rank_blocks(r)) for r in range(self.world)]

    def allocate_for(self, table: list[int], n: int) -> list[int]:
        return self.allocate(n, len(table))

    def _pick(self, n: int, first_index: int, first_block: int | None, after: int | None) -> list[int]:
        """Each logical block from the pool the layout places it in, least recently freed first
        (a rank's own placement, not run-seeking: a request's runs are per rank here)."""
        blocks, keyless = [], self._keyless
        for j in range(n):
            b, _ = self._pool_for(first_index + j, first_block).popitem(last=False)
            keyless.pop(b, None)
            blocks.append(b)
            first_block = b if first_block is None else first_block
        return blocks


class StripedAllocator(_Striping, _RankPools):
    """Striped KVP blocks: logical block i on rank i % world."""


class StripedCachingAllocator(_Striping, _CachingRankPools):
    """Prefix caching over striped KV: a cached block of logical index i sits on rank i % world,
    which is where any request sharing that prefix needs its block i."""


class ProgressiveAllocator(_Progressive, _RankPools):
    """Medha's progressive KVP: `cap_blocks` contiguous blocks of a request per rank, from its
    start rank on."""


class ProgressiveCachingAllocator(_Progressive, _CachingRankPools):
    """Prefix caching over the progressive layout: a shared prefix's block 0 fixes the start."""


def kvp_kv_manager(blocks_per_rank: int, world: int, block_size: int, prefix_caching: bool = False,
                   tokens_per_rank: int | None = None, start: str = "first_fit") -> KVCacheManager:
    """The leader's block bookkeeping over `world` KVP ranks of `blocks_per_rank` blocks each
    (plain KVP's, and each stage's of a KVP x SPP group): striped, or progressive with
    `tokens_per_rank` tokens of a request per rank (a multiple of `block_size`), a new request
    starting on the rank `start` ("first_fit" | "least_loaded") picks."""
    if tokens_per_rank is None:
        alloc = (StripedCachingAllocator if prefix_caching else StripedAllocator)(blocks_per_rank, world)
    else:
        if tokens_per_rank <= 0 or tokens_per_rank % block_size:
            raise ValueError(f"kvp_tokens_per_rank: {tokens_per_rank} is not a positive multiple of block_size "
                             f"{block_size}")
        cls = ProgressiveCachingAllocator if prefix_caching else ProgressiveAllocator
        alloc = cls(blocks_per_rank, world, tokens_per_rank // block_size, start)
    # A prefill after a cached prefix is a later chunk to the ranks (`kvp_meta`: each attends the
    # earlier tokens it holds), so nothing below the allocator changes with prefix caching.
    manager = PrefixCachingKVManager if prefix_caching else KVCacheManager
    return manager(blocks_per_rank * world, block_size, alloc)
