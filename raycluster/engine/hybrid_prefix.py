"""Prefix caching on the hybrid KV cache (raycluster.engine.hybrid_kv): full blocks found again by
the tokens they hold, in every layer group, as vLLM's hybrid manager caches them.

Keys chain over tokens as raycluster.engine.prefix_cache's do (one chain per request, the same for
every group); a group's block is registered under the chain key with the group's number appended,
so each group finds its own blocks. All groups share one `PrefixCachingAllocator`: a freed block
keeps its key in the LRU free pool until the pool hands it out again, whichever group asks.

A hit of h blocks (tokens [0, h * block_size) already computed) needs, in every full group, each
of blocks 0..h-1 cached; in a sliding group only the blocks the next query can still see, from the
one holding position h * block_size - window + 1 on (the earlier entries are null, as if released).
`match_prefix` takes the longest h that every group can serve. A sliding group's blocks are
registered when they become full, before the step's release gives back those out of the window
(`Scheduler.update` caches first), so what a request leaves behind stays findable until evicted.
"""

from __future__ import annotations

from raycluster.engine.hybrid_kv import HybridKVManager
from raycluster.engine.kv_groups import KVGroups
from raycluster.engine.prefix_cache import PrefixCachingAllocator, PrefixLookups, block_key, chain_root, image_extras
from raycluster.request import Request


def _group_key(key: bytes, group: int) -> bytes:
    return key + group.to_bytes(2, "little")


class HybridPrefixCachingKVManager(HybridKVManager):
    prefix_caching = True
    rerun_last_match = False        # only with an EAGLE head, which keeps the engine off the hybrid cache

    def __init__(self, num_blocks: int, block_size: int, groups: KVGroups) -> None:
        super().__init__(num_blocks, block_size, groups, PrefixCachingAllocator(num_blocks + 1))
        self._keys: dict[str, list[bytes]] = {}     # per request: the chain keys of its leading full blocks
        self.lookups = PrefixLookups()
        self.lora_roots: dict[str, str] = {}        # as PrefixCachingKVManager's

    @property
    def query_tokens(self) -> int:
        return self.lookups.query_tokens

    @property
    def hit_tokens(self) -> int:
        return self.lookups.hit_tokens

    def hit_rate(self) -> float:
        return self.lookups.rate()

    def _root(self, lora_adapter: str | None) -> bytes:
        return chain_root(None if lora_adapter is None else self.lora_roots.get(lora_adapter, lora_adapter))

    def _first_visible(self, group: int, hit: int) -> int:
        """The first block a sliding group still needs after a hit of `hit` blocks."""
        return max(0, (hit * self.block_size - self.groups.windows[group] + 1) // self.block_size)

    def _longest_cached(self, tokens: list[int], root: bytes, extras: dict[int, bytes]
                        ) -> tuple[list[bytes], list[list[int | None]]]:
        """Chain keys of the longest hit and, per group, its blocks (None: before a sliding
        group's window, left null). `extras`: `image_extras` of the prompt's images."""
        bs, lookup, windows = self.block_size, self.allocator.lookup, self.groups.windows
        full = [g for g, w in enumerate(windows) if w is None]
        keys: list[bytes] = []
        parent = root
        for i in range((len(tokens) - 1) // bs):        # the run every full group has
            parent = block_key(parent, tokens[i * bs:(i + 1) * bs], extras.get(i, b""))
            if any(lookup(_group_key(parent, g)) is None for g in full):
                break
            keys.append(parent)
        # Each group's cached block of each key, looked up once; the longest hit the sliding
        # groups serve too (only the blocks inside the window at its end need be there).
        found = [[lookup(_group_key(k, g)) for k in keys] for g in range(len(windows))]
        for hit in range(len(keys), 0, -1):
            firsts = [0 if w is None else self._first_visible(g, hit) for g, w in enumerate(windows)]
            if all(None not in blocks[first:hit] for blocks, first in zip(found, firsts)):
                return keys[:hit], [[None] * first + blocks[first:hit] for blocks, first in zip(found, firsts)]
        return [], [[] for _ in windows]

    def match_prefix(self, req: Request) -> int:
        """As PrefixCachingKVManager's, over every group: the hit's blocks shared (a sliding
        group's entries before its window null), the tokens they cover returned."""
        rid = req.request_id
        if rid in self.block_tables:
            return 0
        tokens = req.all_token_ids
        keys, tables = self._longest_cached(tokens, self._root(req.sampling.lora_adapter),
                                            image_extras(req.sampling.images, self.block_size))
        self.lookups.count(rid, len(tokens), len(keys) * self.block_size)
        if not keys:
            return 0
        for g, blocks in enumerate(tables):
            for b in blocks:
                if b is not None:
                    self.allocator.take(b)
            self.group_tables[g][rid] = [self.null_block if b is None else b for b in blocks]
            if self.groups.windows[g] is not None and (dead := self._first_visible(g, len(keys))):
                self._released[g][rid] = dead
        self._keys[rid] = keys
        return len(keys) * self.block_size

    def cached_prefix_tokens(self, tokens: list[int], lora_adapter: str | None = None, images=()) -> int:
        extras = image_extras(images, self.block_size)
        return len(self._longest_cached(tokens, self._root(lora_adapter), extras)[0]) * self.block_size

    def cache_full_blocks(self, req: Request, num_computed_tokens: int) -> None:
        """Register `req`'s full, computed blocks not registered yet, in every group."""
        table = self.block_tables.get(req.request_id)
        if not table:
            return
        keys = self._keys.setdefault(req.request_id, [])
        bs = self.block_size
        n_full = min(num_computed_tokens // bs, len(table))
        if len(keys) >= n_full:
            return
        tokens, register, null = req.all_token_ids, self.allocator.register, self.null_block
        tables = [t[req.request_id] for t in self.group_tables]
        parent = keys[-1] if keys else self._root(req.sampling.lora_adapter)
        extras = image_extras(req.sampling.images, bs)
        for i in range(len(keys), n_full):
            parent = block_key(parent, tokens[i * bs:(i + 1) * bs], extras.get(i, b""))
            for g, t in enumerate(tables):
                if t[i] != null:
                    register(t[i], _group_key(parent, g))
            keys.append(parent)

    def free(self, request_id: str) -> None:
        self._keys.pop(request_id, None)
        self.lookups.forget(request_id)
        super().free(request_id)

    def withdraw(self, request_id: str) -> None:
        self.lookups.withdraw(request_id)
        self.free(request_id)

    def fork(self, src_id: str, dst_id: str) -> None:
        super().fork(src_id, dst_id)
        self._keys[dst_id] = list(self._keys.get(src_id, ()))

    def check(self) -> None:
        super().check()
        self.allocator.check_keys()
        for rid, keys in self._keys.items():
            assert len(keys) <= len(self.block_tables.get(rid, [])), f"{rid}: more keys than blocks"
