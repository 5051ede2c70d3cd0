"""Block tables for a model whose layers mix full and sliding-window attention, one per KV group
(raycluster.engine.kv_groups), all drawn from one pool: vLLM's hybrid KV cache manager.

A request's tables all have one entry per `block_size` tokens. Growing a request grows every
group's table by the same count (`try_allocate` needs that many blocks times the group count).
After each step (`release_outside_window`, called by `Scheduler.update`) a sliding group's
leading blocks that no later query can see (wholly before position computed - window + 1) go
back to the pool and their entries point at one reserved null block, which the attention
backend never reads (it starts at the window's first block). Full groups keep every block.

The first group (full attention) is the one `block_tables` shows: the scheduler reads a table's
length to see whether a decode's next token fits, and every group's table has that length. The
others are `extra_group_tables`; a step plan carries them (raycluster.parallel.plan). A KV
handoff moves `handoff_table`: every group's blocks, which the receiving
engine, laid out alike, allocates in the same order (block by block, each block in every group, so a
cached prefix the receiver has already is skipped in every group). Requests that will be handed off
(prefill-only) keep every block until then, as do requests parked for it.

Prefix caching on it: raycluster.engine.hybrid_prefix. Not used with an EAGLE head or MTP layer,
or KV / sequence-pipeline parallelism (raycluster.parallel.factory decides).
"""

from __future__ import annotations

from collections import Counter
from typing import Iterable

from raycluster.engine.kv_groups import KVGroups
from raycluster.engine.kv_manager import KVCacheManager
from raycluster.request import Request


class HybridKVManager(KVCacheManager):
    releases_window = True

    def __init__(self, num_blocks: int, block_size: int, groups: KVGroups, allocator=None) -> None:
        """`num_blocks`: the pool's blocks (KVGroups.pool_blocks of the all-layer count);
        `allocator`: of num_blocks + 1 blocks (prefix caching's, raycluster.engine.hybrid_prefix)."""
        super().__init__(num_blocks + 1, block_size, allocator)
        self.groups = groups
        # What a released entry points to, never handed out (kept at refcount 1).
        self.null_block = self.allocator.allocate(1)[0]
        self.group_tables: list[dict[str, list[int]]] = [{} for _ in groups.layers]
        self.block_tables = self.group_tables[0]
        self.extra_group_tables = self.group_tables[1:]
        self._sliding = [g for g, w in enumerate(groups.windows) if w is not None]
        self._released: list[dict[str, int]] = [{} for _ in groups.layers]   # leading null entries
        self.released_total = 0

    @property
    def num_blocks(self) -> int:
        return self.allocator.num_blocks - 1

    def usage(self) -> float:
        return (self.num_blocks - self.num_free_blocks) / self.num_blocks

    def capacity_tokens(self) -> int:
        """The longest prompt sure to fit: allocated whole in every group at once (its first chunk
        of a long prompt on a releasing engine would need less, as for SlidingWindowKVManager)."""
        return self.num_blocks // self.groups.num_groups * self.block_size

    def placement_blocks(self) -> tuple[int, int]:
        """(free, total) in blocks of every group at once, the unit the router counts a request's
        need in (a table block per block_size tokens): conservative for sliding groups."""
        n = self.groups.num_groups
        return self.num_free_blocks // n, self.num_blocks // n

    def kv_slots(self, num_layers: int) -> int:
        return self.groups.num_slots

    def try_allocate(self, req: Request, num_new_tokens: int) -> bool:
        rid = req.request_id
        have = len(self.block_tables.get(rid, ()))
        need = self.blocks_needed(req.num_computed_tokens + num_new_tokens) - have
        if need <= 0:
            for tables in self.group_tables:
                tables.setdefault(rid, [])
            return True
        if not self.allocator.can_allocate(need * self.groups.num_groups):
            return False
        for tables in self.group_tables:
            table = tables.setdefault(rid, [])
            table.extend(self.allocator.allocate_for(table, need))
        return True

    def release_outside_window(self, reqs: Iterable[Request]) -> None:
        """Give back the sliding groups' blocks of `reqs` (ones that ran a step) no later query sees."""
        bs, null, free = self.block_size, self.null_block, self.allocator.free
        for req in reqs:
            if req.prefill_only or req.status.finished:
                continue
            rid = req.request_id
            for g in self._sliding:
                table = self.group_tables[g].get(rid)
                if table is None:
                    continue
                dead = min((req.num_computed_tokens - self.groups.windows[g] + 1) // bs, len(table))
                done = self._released[g].get(rid, 0)
                if dead <= done:
                    continue
                for i in range(done, dead):
                    free(table[i])
                    table[i] = null
                self._released[g][rid] = dead
                self.released_total += dead - done

    def handoff_table(self, request_id: str) -> list[int]:
        """Every group's block of each logical block in turn (block-major), so that skipping a
        prefix's blocks skips them in every group (`handoff_skip`)."""
        return [b for blocks in zip(*(tables[request_id] for tables in self.group_tables)) for b in blocks]

    def handoff_skip(self, blocks: int) -> int:
        return blocks * self.groups.num_groups

    def fork(self, src_id: str, dst_id: str) -> None:
        if dst_id in self.block_tables:
            raise ValueError(f"request {dst_id!r} already has blocks")
        for tables, released in zip(self.group_tables, self._released):
            done = released.get(src_id, 0)
            table = tables[src_id]
            for b in table[done:]:
                self.allocator.incref(b)
            tables[dst_id] = list(table)
            if done:
                released[dst_id] = done

    def free(self, request_id: str) -> None:
        for tables, released in zip(self.group_tables, self._released):
            table = tables.pop(request_id, None)
            done = released.pop(request_id, 0)
            if table:
                self.allocator.free_all(table[done:])

    def check(self) -> None:
        """As KVCacheManager's over every group's tables, with the null block held once, null
        entries not counted, and every group's table as long as the first's."""
        a = self.allocator
        free = a.free_blocks()
        free_set = set(free)
        assert len(free_set) == len(free), "a block is on the free list twice"
        refs = Counter(b for tables, released in zip(self.group_tables, self._released)
                       for rid, table in tables.items() for b in table[released.get(rid, 0):])
        refs[self.null_block] += 1
        for b in range(a.num_blocks):
            assert a._refs[b] == refs.get(b, 0), f"block {b}: refcount {a._refs[b]} != {refs.get(b, 0)} tables"
            assert (a._refs[b] == 0) == (b in free_set), f"block {b}: refcount {a._refs[b]}, on free list: {b in free_set}"
        for tables, released in zip(self.group_tables, self._released):
            assert tables.keys() == self.block_tables.keys(), "a request is missing from a group"
            for rid, table in tables.items():
                assert len(table) == len(self.block_tables[rid]), f"{rid}: group tables differ in length"
                done = released.get(rid, 0)
                assert all(b == self.null_block for b in table[:done]), f"{rid}: a released entry is live"
