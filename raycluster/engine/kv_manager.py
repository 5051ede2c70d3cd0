"""Paged KV bookkeeping: which fixed-size blocks of the KV tensor belong to which request.

`BlockAllocator` owns the free list and reference counts of physical blocks; `KVCacheManager`
maps request ids to block tables and grows them as tokens are scheduled. The KV tensor itself
lives in the model runner; this module only hands out block ids. `check()` verifies
free + used == total and that every table's refcounts add up, and tests call it after every
scenario.

Which free blocks a request gets does not matter to attention, but it does to a KV handoff: a
connector moves one message or descriptor per run of consecutive ids (per layer), so a table of
scattered single blocks costs a syscall or message per block. A plain FIFO free list scatters
tables within a few hundred admissions, since concurrent requests' chunks and one-block decode
growth interleave. So allocation is run-seeking (`take_runs`): a table first grows into the
blocks right after its last one, then takes whole runs from the largest free extents near the
front of the free queue.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from itertools import islice

from raycluster.request import Request


class OutOfBlocks(RuntimeError):
    pass


# Where a new run may start: the largest free extent around one of this many blocks at the
# front of the free order (FIFO, or LRU for cached blocks), the first that covers the request
# winning. In a steady-state P/D churn (raycluster.bench.kv_layouts) a 1024-block handoff is
# 4-32 pieces instead of the ~950 of plain queue order.
RUN_SCAN = 32
# A lone block (a decode's next block) goes into an isolated hole among this many front blocks
# if there is one, rather than chipping a run another request could take whole.
HOLE_SCAN = 16


def take_runs(pool: OrderedDict, n: int, after: int | None, out: list[int],
              group: list[int] | None = None) -> None:
    """Move `n` blocks from the ordered free set `pool` into `out` in as few ascending runs as
    it allows cheaply: first the blocks right after `after` (a table's last block, None for a
    new table); then a single block into an isolated hole near the front; else runs out of the
    largest free extents found around the front blocks. With `group` (a label per block that
    does not decrease along `pool`'s order, e.g. which free call returned it), only blocks
    labelled no later than the `n`-th block in the order are taken: the first `n` blocks in
    order, or others of the same label or earlier. `pool` must hold at least `n`."""
    want = len(out) + n
    if group is None:
        ok = pool.__contains__      # a C call: this runs per block looked at
    else:
        limit = group[next(islice(pool, n - 1, None))]

        def ok(b: int) -> bool:
            return b in pool and group[b] <= limit
    if after is not None:
        b = after + 1
        while len(out) < want and ok(b):
            del pool[b]
            out.append(b)
            b += 1
    if want - len(out) == 1:
        for b in islice(pool, HOLE_SCAN):
            if not ok(b):
                break           # labels only grow from here
            if not ok(b - 1) and not ok(b + 1):
                del pool[b]
                out.append(b)
                return
    while len(out) < want:
        need = want - len(out)
        best_lo = best_hi = 0
        for b in islice(pool, RUN_SCAN):
            if not ok(b):
                break
            hi = b + 1
            while hi - b < need and ok(hi):
                hi += 1
            lo = b
            while hi - lo < need and ok(lo - 1):
                lo -= 1
            if hi - lo > best_hi - best_lo:
                best_lo, best_hi = lo, hi
                if hi - lo == need:
                    break
        for b in range(best_lo, best_hi):
            del pool[b]
        out.extend(range(best_lo, best_hi))


class BlockAllocator:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        # An ordered set: FIFO order picks where a run starts, membership tests extend it.
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._refs = [0] * num_blocks

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    def can_allocate(self, n: int, first_index: int = 0) -> bool:
        """Whether `n` more blocks fit (`first_index`: the request's next logical block, which a
        sharded allocator places by; this one has a single pool)."""
        return n <= len(self._free)

    def free_blocks(self) -> list[int]:
        return list(self._free)

    def allocate(self, n: int, first_index: int = 0) -> list[int]:
        """`n` blocks for a new table, as few runs as the free set allows."""
        return self._take(n, None)

    def allocate_for(self, table: list[int], n: int) -> list[int]:
        """`n` more blocks for the request whose blocks so far are `table`, continuing its last
        run where the blocks after it are free."""
        return self._take(n, table[-1] if table else None)

    def _take(self, n: int, after: int | None) -> list[int]:
        if n > len(self._free):
            raise OutOfBlocks(f"need {n} blocks, {len(self._free)} free")
        blocks: list[int] = []
        take_runs(self._free, n, after, blocks)
        refs = self._refs
        for b in blocks:
            refs[b] = 1
        return blocks

    def incref(self, block: int) -> None:
        if self._refs[block] <= 0:
            raise ValueError(f"block {block} is free; cannot share it")
        self._refs[block] += 1

    def free(self, block: int) -> None:
        if self._refs[block] <= 0:
            raise ValueError(f"double free of block {block}")
        self._refs[block] -= 1
        if self._refs[block] == 0:
            self._release(block)

    def _release(self, block: int) -> None:
        """Return a block whose last reference is gone to the free pool."""
        self._free[block] = None

    def free_all(self, blocks) -> None:
        """`free` of each block in order (same free-list order, same error on a double free):
        one call per table instead of one per block."""
        refs, free = self._refs, self._free
        for b in blocks:
            r = refs[b]
            if r <= 0:
                raise ValueError(f"double free of block {b}")
            refs[b] = r - 1
            if r == 1:
                free[b] = None

    def refcount(self, block: int) -> int:
        return self._refs[block]

    def alias_table(self, num_blocks: int, offset: int) -> list[int]:
        """A synthetic table (blocks may be shared with other synthetic tables) for profiling."""
        return [(offset + i) % self.num_blocks for i in range(num_blocks)]

    def alias_tables(self, lengths: list[int]) -> list[list[int]]:
        """Synthetic tables of `lengths` blocks, one per request of a profiled step: here each
        `alias_table` after the ones before it (a layout that places requests by the load
        before them overrides this)."""
        tables, offset = [], 0
        for n in lengths:
            tables.append(self.alias_table(n, offset))
            offset += n
        return tables


class KVCacheManager:
    prefix_caching = False      # PrefixCachingKVManager (prefix_cache.py) finds shared prefixes
    releases_window = False     # SlidingWindowKVManager (window_kv.py) gives back blocks out of a window
    # A hybrid model's KV groups and the tables of all but the first (HybridKVManager, hybrid_kv.py):
    # here one table per request serves every layer.
    groups = None
    extra_group_tables: tuple = ()
    released_total = 0          # blocks given back early as they left a sliding window (the managers that do)

    def __init__(self, num_blocks: int, block_size: int, allocator=None) -> None:
        """`allocator`: a `BlockAllocator`-like pool (e.g. the KVP ranks' striped one);
        default a single pool of `num_blocks`."""
        if block_size <= 0:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.allocator = allocator or BlockAllocator(num_blocks)
        self.block_tables: dict[str, list[int]] = {}

    @property
    def num_free_blocks(self) -> int:
        return self.allocator.num_free

    @property
    def num_blocks(self) -> int:
        """Blocks requests can hold (a sliding-window manager's reserved null block is not one)."""
        return self.allocator.num_blocks

    @property
    def num_physical_blocks(self) -> int:
        """Blocks the KV tensor holds: every id the tables may name."""
        return self.allocator.num_blocks

    def usage(self) -> float:
        return self.allocator.num_used / self.allocator.num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def capacity_tokens(self) -> int:
        return self.allocator.num_blocks * self.block_size

    def kv_slots(self, num_layers: int) -> int:
        """The KV tensor's leading size for a model of `num_layers` layers: one slot per layer."""
        return num_layers

    def placement_blocks(self) -> tuple[int, int]:
        """(free, total) blocks as the router counts them (a block per block_size tokens)."""
        return self.num_free_blocks, self.num_blocks

    def handoff_table(self, request_id: str) -> list[int]:
        """The blocks a KV handoff of `request_id` moves, in the order the receiver allocates them."""
        return list(self.block_tables[request_id])

    def handoff_skip(self, blocks: int) -> int:
        """Entries of `handoff_table` that cover a request's first `blocks` logical blocks."""
        return blocks

    def try_allocate(self, req: Request, num_new_tokens: int) -> bool:
        """Grow `req`'s table to hold its computed tokens plus `num_new_tokens`."""
        table = self.block_tables.get(req.request_id, [])
        need = self.blocks_needed(req.num_computed_tokens + num_new_tokens) - len(table)
        if need <= 0:
            self.block_tables.setdefault(req.request_id, table)
            return True
        if not self.allocator.can_allocate(need, len(table)):
            return False
        table = self.block_tables.setdefault(req.request_id, table)
        table.extend(self.allocator.allocate_for(table, need))
        return True

    def fork(self, src_id: str, dst_id: str) -> None:
        """Share all of `src_id`'s blocks with a new request (e.g. parallel samples of one prompt).
        Shared blocks are read-only by convention; a writer must own its last block."""
        if dst_id in self.block_tables:
            raise ValueError(f"request {dst_id!r} already has blocks")
        table = self.block_tables[src_id]
        for b in table:
            self.allocator.incref(b)
        self.block_tables[dst_id] = list(table)

    def free(self, request_id: str) -> None:
        table = self.block_tables.pop(request_id, None)
        if table:
            self.allocator.free_all(table)

    def withdraw(self, request_id: str) -> None:
        """Free an admission that never ran (KV short)."""
        self.free(request_id)

    def holds(self, request_id: str) -> bool:
        return request_id in self.block_tables

    def check(self) -> None:
        """Raise AssertionError if the bookkeeping is inconsistent."""
        a = self.allocator
        free = a.free_blocks()
        free_set = set(free)
        assert len(free_set) == len(free), "a block is on the free list twice"
        refs = Counter(b for table in self.block_tables.values() for b in table)
        for b in range(a.num_blocks):
            assert a._refs[b] == refs.get(b, 0), f"block {b}: refcount {a._refs[b]} != {refs.get(b, 0)} tables"
            assert (a._refs[b] == 0) == (b in free_set), f"block {b}: refcount {a._refs[b]}, on free list: {b in free_set}"
        used = sum(1 for r in a._refs if r > 0)
        assert a.num_free + used == a.num_blocks, f"free {a.num_free} + used {used} != total {a.num_blocks}"
