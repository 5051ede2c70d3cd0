"""Block layouts a KV handoff moves: which block ids a request holds on the prefill instance
(source) and the decode instance (destination).

A connector moves one descriptor or message per *piece*: a stretch where both the source and
the destination ids are consecutive (per layer). So the pieces per block of a handoff is what
fragmentation costs it. Layouts come from two places:

- `pd_churn`: a steady-state prefill/decode churn run through an allocator class (the engine's
  own by default, `PrefixCachingAllocator`, or `QueueOrderAllocator` for a plain free queue):
  concurrent chunked prefills on one pool, handoffs allocated at once on the other, decodes
  growing a block at a time and finishing; then one handoff of the asked size. This is what a
  P/D pair under load hands a connector.
- `synthetic`: fresh (one run each side), runs of 16, or uniformly scattered ids.

Used by raycluster.bench.kv_transfer_bench (the handoff bandwidth benchmark) and its tests.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict

import numpy as np

from raycluster.engine.prefix_cache import PrefixCachingAllocator


def runs(ids: list[int]) -> list[int]:
    """Indices where a run of consecutive ids starts."""
    return [i for i in range(len(ids)) if i == 0 or ids[i] != ids[i - 1] + 1]


def pieces(src: list[int], dst: list[int]) -> int:
    """Stretches where source and destination ids are both consecutive: what a connector moves
    as one descriptor (per layer)."""
    return sum(1 for i in range(len(src))
               if i == 0 or src[i] != src[i - 1] + 1 or dst[i] != dst[i - 1] + 1)


class QueueOrderAllocator:
    """A plain free queue for comparison: blocks handed out in the order they were freed
    (a table last block first, as the engine frees), no run seeking, no cache."""

    def __init__(self, num_blocks: int) -> None:
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free)

    def allocate_for(self, table: list[int], n: int) -> list[int]:
        return [self._free.popitem(last=False)[0] for _ in range(n)]

    def free_all(self, blocks) -> None:
        for b in reversed(list(blocks)):
            self._free[b] = None


def pd_churn(allocator_cls=PrefixCachingAllocator, num_blocks: int = 4096, k: int = 128,
             steps: int = 400, chunk: int = 128, concurrency: int = 8,
             rng: np.random.Generator | None = None) -> tuple[list[int], list[int]]:
    """(source ids, destination ids) of a `k`-block handoff after `steps` steps of P/D churn on
    two pools of `num_blocks` (>= 2k) built by `allocator_cls`. Each step the `concurrency`
    prefilling requests (1..k blocks, uniform; admitted while the pool has room for all of them)
    share a budget of `chunk` blocks first come first served, as chunked prefill does; a
    finished prefill is handed off (the destination allocates the whole prompt at once, finishing
    the oldest decodes while it does not fit) and freed; a decode grows by one block with
    probability 1/2 per step until its 1..64 blocks of output are in. Every full block is
    registered with a unique key, so with prefix caching all of it stays cached and eviction is
    LRU's. The last request to finish after `steps` is the `k`-block one."""
    rng = rng or np.random.default_rng(0)
    if num_blocks < 2 * k:
        raise ValueError(f"num_blocks ({num_blocks}) must be >= 2k ({2 * k})")
    pre, dec = allocator_cls(num_blocks), allocator_cls(num_blocks)
    uid = itertools.count()

    def alloc(a, table: list[int], n: int) -> None:
        new = a.allocate_for(table, n)
        if isinstance(a, PrefixCachingAllocator):
            for b in new:
                a.register(b, next(uid).to_bytes(8, "little"))
        table.extend(new)

    prefilling: list[list] = []     # [table, blocks still to prefill, is the k-block request]
    decoding: list[list] = []       # [table, output blocks still to come]
    for step in range(steps + 64 * (k // chunk + 8)):     # the last request needs k / chunk steps
        while len(prefilling) < concurrency:
            last = step >= steps and not any(p[2] for p in prefilling)
            size = k if last else int(rng.integers(1, k + 1))
            if size + sum(p[1] for p in prefilling) > pre.num_free:
                break               # admitted only with room to finish, as a scheduler would
            prefilling.append([[], size, last])
        budget = chunk
        for p in list(prefilling):
            n = min(budget, p[1])
            if not n or not pre.can_allocate(n):
                break
            budget -= n
            alloc(pre, p[0], n)
            p[1] -= n
            if p[1]:
                continue
            prefilling.remove(p)
            while not dec.can_allocate(len(p[0])) and decoding:
                dec.free_all(decoding.pop(0)[0])
            dst: list[int] = []
            alloc(dec, dst, len(p[0]))
            if p[2]:
                return p[0], dst
            pre.free_all(p[0])
            decoding.append([dst, int(rng.integers(1, 65))])
        for d in list(decoding):
            if rng.random() < 0.5:
                if d[1] == 0:
                    decoding.remove(d)
                    dec.free_all(d[0])
                elif dec.can_allocate(1):
                    alloc(dec, d[0], 1)
                    d[1] -= 1
    raise RuntimeError(f"pd_churn: the {k}-block request did not finish (pool of {num_blocks})")


def synthetic(rng: np.random.Generator, num_blocks: int, k: int, layout: str, run: int = 16) -> list[int]:
    """k distinct block ids < num_blocks: `fresh` (one run at a random start), `runs16` (runs of
    `run` consecutive ids in random order) or `scattered` (uniformly random)."""
    if layout == "scattered":
        return rng.choice(num_blocks, k, replace=False).tolist()
    if layout == "fresh":
        start = int(rng.integers(0, num_blocks - k + 1))
        return list(range(start, start + k))
    if layout == "runs16":
        chunks = rng.permutation(num_blocks // run)[: -(-k // run)]
        return [int(c) * run + j for c in chunks for j in range(run)][:k]
    raise ValueError(f"unknown layout {layout!r}")
