"""KV blocks of a sliding-window model that no future query can see, given back as requests advance
(vLLM's sliding-window KV manager): a model whose every layer slides over `window` tokens reads,
for a query at position p, only keys at positions > p - window. Once a request has computed n
tokens, every later query sits at position >= n, so the blocks wholly before position
n - window + 1 are dead: their entries in its table become a reserved null block and the blocks
go back to the pool. A long request then holds about window / block_size + 1 blocks instead of
its whole context, and the pool serves that many more requests at once.

The table keeps its length (positions still map to block indices; the attention backend starts
its reads at the window's first block, raycluster/kernels' `_first_block`, so the null block is
never read); `free` skips null entries. The scheduler calls `release_outside_window` after each
step (`Scheduler.update`). Requests whose table a KV handoff will move (prefill-only, parked)
keep every block until they are handed off: the connector moves whole tables. Used only when
every layer slides, without prefix caching (a cached prefix is exactly what this gives back) and
without an EAGLE head (its own attention is not windowed): raycluster.parallel.factory decides.
"""

from __future__ import annotations

from collections import Counter
from typing import Iterable

from raycluster.engine.kv_manager import KVCacheManager
from raycluster.request import Request


class SlidingWindowKVManager(KVCacheManager):
    releases_window = True

    def __init__(self, num_blocks: int, block_size: int, window: int, allocator=None) -> None:
        super().__init__(num_blocks, block_size, allocator)
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        self.window = window
        # One block never handed out: what a released entry points to (kept at refcount 1).
        self.null_block = self.allocator.allocate(1)[0]
        self._released: dict[str, int] = {}     # request id -> how many leading entries are null
        self.released_total = 0                 # blocks given back early, over the manager's life

    # The null block is not part of the pool a caller sees: idle, free == total as without it.
    @property
    def num_blocks(self) -> int:
        return self.allocator.num_blocks - 1

    def usage(self) -> float:
        return (self.num_blocks - self.num_free_blocks) / self.num_blocks

    def capacity_tokens(self) -> int:
        return self.num_blocks * self.block_size

    def release_outside_window(self, reqs: Iterable[Request]) -> None:
        """Give back the blocks of `reqs` (ones that ran a step) that no later query can see."""
        bs, window, null = self.block_size, self.window, self.null_block
        tables, released, free = self.block_tables, self._released, self.allocator.free
        for req in reqs:
            if req.prefill_only or req.status.finished:
                continue
            table = tables.get(req.request_id)
            if table is None:
                continue
            dead = min((req.num_computed_tokens - window + 1) // bs, len(table))
            done = released.get(req.request_id, 0)
            if dead <= done:
                continue
            for i in range(done, dead):
                free(table[i])
                table[i] = null
            released[req.request_id] = dead
            self.released_total += dead - done

    def fork(self, src_id: str, dst_id: str) -> None:
        super().fork(src_id, dst_id)
        done = self._released.get(src_id, 0)
        if done:
            self._released[dst_id] = done
            for _ in range(done):       # the copy's null entries take no reference
                self.allocator.free(self.null_block)

    def free(self, request_id: str) -> None:
        table = self.block_tables.pop(request_id, None)
        done = self._released.pop(request_id, 0)
        if table:
            self.allocator.free_all(table[done:])

    def check(self) -> None:
        """As KVCacheManager's, with the null block held once and null entries not counted."""
        a = self.allocator
        free = a.free_blocks()
        free_set = set(free)
        assert len(free_set) == len(free), "a block is on the free list twice"
        refs = Counter(b for rid, table in self.block_tables.items() for b in table[self._released.get(rid, 0):])
        refs[self.null_block] += 1
        for b in range(a.num_blocks):
            assert a._refs[b] == refs.get(b, 0), f"block {b}: refcount {a._refs[b]} != {refs.get(b, 0)} tables"
            assert (a._refs[b] == 0) == (b in free_set), f"block {b}: refcount {a._refs[b]}, on free list: {b in free_set}"
        for rid, done in self._released.items():
            assert all(b == self.null_block for b in self.block_tables[rid][:done]), f"{rid}: a released entry is live"
