"""Automatic prefix caching: full KV blocks found again by the tokens they hold.

A full block's key chains SHA-256 over every token up to its end (vLLM's scheme:
key_i = H(key_{i-1} || tokens of block i)), so equal keys mean equal token prefixes at equal
positions, hence equal KV. `PrefixCachingAllocator` is a `BlockAllocator` whose block, when
its last reference goes away, keeps its key and joins the free pool, which is an LRU (least
recently freed is handed out, and loses its key, first). So a freed prefix stays findable until
its blocks are needed for something else, and cached blocks never reduce the free count. Free
blocks holding no prefix are handed out before any cached one, and allocation seeks runs of
consecutive ids as raycluster.engine.kv_manager's does (what a KV handoff moves in one piece),
but eviction keeps LRU order at the granularity of free calls: taking n blocks evicts only
blocks freed no later than the n-th least recently freed one, i.e. LRU's choice give or take
the rest of the table that block came back with. (Extents across any free neighbours made
runs longer but evicted prefixes freed moments before: a multi-turn simulation lost 12 points
of hit rate.) The free pool may be sharded (KVP's `StripedCachingAllocator` and
`ProgressiveCachingAllocator`, one LRU per rank, raycluster.parallel.kvp_layout, which place
blocks per rank and do not seek runs): a key fixes its block's position in the chain,
and the layout places a position's block on a rank (striped: by the position alone; progressive:
from the rank of the chain's block 0), so a cached block is on the rank a request sharing it
would have placed it on.

`PrefixCachingKVManager` is the `KVCacheManager` on top: the scheduler asks it for a new
request's cached prefix (`match_prefix`: shares those blocks, returns the tokens they cover) and
tells it after every step which requests computed more tokens (`cache_full_blocks`: registers
the blocks that became full). Hits are counted in tokens, as vLLM's prefix-cache metrics are.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict

from raycluster.engine.kv_manager import BlockAllocator, KVCacheManager, OutOfBlocks, take_runs
from raycluster.request import Request


def block_key(parent: bytes, tokens: list[int], extra: bytes = b"") -> bytes:
    """The key of a full block holding `tokens`, after the block whose key is `parent`
    (`chain_root` for the first block). `extra`: what else decides its KV besides the tokens
    (`image_extras`)."""
    return hashlib.sha256(parent + extra + array("q", tokens).tobytes()).digest()


def image_extras(images, block_size: int) -> dict[int, bytes]:
    """Per block index, the digests of the prompt images (`ImageInput`s) whose placeholders
    start in that block: equal placeholder tokens under other pixels have other KV (vLLM keys
    blocks on their multimodal inputs' hashes too). The chain carries a digest into every later
    block, so the block an image starts in is the only one that needs it."""
    out: dict[int, bytes] = {}
    for image in images:
        i = image.offset // block_size
        out[i] = out.get(i, b"") + b"img:" + image.digest
    return out


def chain_root(lora_adapter: str | None) -> bytes:
    """The parent of a request's first block: the same tokens under a LoRA adapter have other
    KV than under the base weights (or another adapter), so each keeps a chain of its own."""
    return b"" if lora_adapter is None else b"lora:" + lora_adapter.encode()


class PrefixCachingAllocator(BlockAllocator):
    """Free blocks live in LRU pools (`_pools`: ordered sets, least recently freed first), and
    a block keeps its key there until it is handed out again. This class has one pool; a
    sharded subclass (KVP's, raycluster.parallel.kvp_layout) lays out several by overriding
    `_make_pools`, `_pool_for` and `_pool_of` (and `can_allocate`): the key maps, refcounts,
    eviction and revival are the same whichever pool a block lives in."""

    def __init__(self, num_blocks: int) -> None:
        super().__init__(num_blocks)
        del self._free                  # the base class's deque: the pools replace it
        # Ordered sets rather than deques: a cached block can leave its pool from the middle
        # when a prefix match revives it.
        self._pools: list[OrderedDict[int, None]] = self._make_pools()
        self._keyless: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))  # free, no key
        self._freed_by = [0] * num_blocks   # per block: which free call returned it last
        self._free_calls = 0
        self._num_free = num_blocks
        self._key_of: dict[int, bytes] = {}
        self._block_of: dict[bytes, int] = {}

    # ---- where free blocks live ------------------------------------------------------------------
    def _make_pools(self) -> list[OrderedDict[int, None]]:
        return [OrderedDict.fromkeys(range(self.num_blocks))]

    def _pool_for(self, index: int, first_block: int | None = None) -> OrderedDict[int, None]:
        """The pool a request's logical block `index` is taken from (`first_block`: the
        request's block 0, None for a new request; a layout may place by it)."""
        return self._pools[0]

    def _pool_of(self, block: int) -> OrderedDict[int, None]:
        """The pool `block` returns to when free."""
        return self._pools[0]

    @property
    def num_free(self) -> int:
        return self._num_free

    def can_allocate(self, n: int, first_index: int = 0) -> bool:
        return n <= self._num_free

    def free_blocks(self) -> list[int]:
        return [b for p in self._pools for b in p]

    @property
    def num_cached(self) -> int:
        """Blocks holding a findable prefix (in use or free)."""
        return len(self._key_of)

    def allocate(self, n: int, first_index: int = 0, first_block: int | None = None,
                 after: int | None = None) -> list[int]:
        """`n` blocks for logical blocks `first_index`.. of a request whose block 0 is
        `first_block` and last block `after` (None: a new request); cached ones lose their key."""
        if not self.can_allocate(n, first_index):
            raise OutOfBlocks(f"need {n} blocks from index {first_index}; free per pool "
                              f"{[len(p) for p in self._pools]}")
        blocks = self._pick(n, first_index, first_block, after)
        key_of, block_of, refs = self._key_of, self._block_of, self._refs
        for b in blocks:
            key = key_of.pop(b, None)
            if key is not None:             # evicted: its prefix is gone
                del block_of[key]
            refs[b] = 1
        self._num_free -= n
        return blocks

    def allocate_for(self, table: list[int], n: int) -> list[int]:
        return self.allocate(n, len(table), table[0] if table else None, table[-1] if table else None)

    def _pick(self, n: int, first_index: int, first_block: int | None, after: int | None) -> list[int]:
        """Take `n` free blocks out of the pool(s): blocks holding no prefix first (continuing
        the table's last run where it can), then cached ones in runs within LRU's choice."""
        keyless, lru = self._keyless, self._pools[0]
        blocks: list[int] = []
        plain = min(n, len(keyless))
        if plain:
            take_runs(keyless, plain, after, blocks)
            for b in blocks:
                del lru[b]
        if n > plain:               # no plain block left: evict
            # Labelled by free call: runs never reach a prefix freed after LRU's n-th choice.
            take_runs(lru, n - plain, blocks[-1] if blocks else after, blocks, self._freed_by)
        return blocks

    def _release(self, block: int) -> None:
        self._pool_of(block)[block] = None  # keeps its key: findable until handed out again
        self._freed_by[block] = self._free_calls
        if block not in self._key_of:
            self._keyless[block] = None
        self._num_free += 1

    def free(self, block: int) -> None:
        self._free_calls += 1
        super().free(block)

    def free_all(self, blocks) -> None:
        """Free a table's blocks last to first, so that under pressure a freed prefix loses its
        tail before its head (the head is what other prompts are likeliest to share)."""
        self._free_calls += 1
        for b in reversed(list(blocks)):
            BlockAllocator.free(self, b)    # one free call for the whole table

    # ---- the cache -----------------------------------------------------------------------------
    def lookup(self, key: bytes) -> int | None:
        return self._block_of.get(key)

    def take(self, block: int) -> None:
        """One more reference to a cached block, reviving it from the free pool if needed."""
        if self._refs[block] == 0:
            del self._pool_of(block)[block]
            self._num_free -= 1
        self._refs[block] += 1

    def register(self, block: int, key: bytes) -> None:
        """Make a full, computed block findable. A prefix cached already keeps its first block
        (the duplicate is freed as a plain block later)."""
        if key not in self._block_of and block not in self._key_of:
            self._block_of[key] = block
            self._key_of[block] = key

    def check_keys(self) -> None:
        assert len(self._key_of) == len(self._block_of), "key maps differ in size"
        plain = {b for p in self._pools for b in p if b not in self._key_of}
        assert plain == set(self._keyless), "the keyless set is not the free blocks without a key"
        for b, k in self._key_of.items():
            assert self._block_of.get(k) == b, f"block {b}: its key maps to {self._block_of.get(k)}"


class PrefixLookups:
    """The prefix cache's hit counters, in tokens. A request is counted once per admission (it is
    looked up on arrival and again when first scheduled; a preemption, which frees its blocks,
    starts a new admission); one that never runs (`withdraw`) takes its counts back."""

    def __init__(self) -> None:
        self._queried: dict[str, list[int]] = {}    # per request: the (query, hit) tokens counted
        self.query_tokens = 0       # known tokens of requests looked up
        self.hit_tokens = 0         # of those, found cached

    def count(self, request_id: str, known: int, hit: int) -> None:
        counted = self._queried.get(request_id)
        if counted is None:
            counted = self._queried[request_id] = [known, 0]
            self.query_tokens += known
        self.hit_tokens += hit
        counted[1] += hit

    def forget(self, request_id: str) -> None:
        self._queried.pop(request_id, None)

    def withdraw(self, request_id: str) -> None:
        q, h = self._queried.pop(request_id, (0, 0))
        self.query_tokens -= q
        self.hit_tokens -= h

    def rate(self) -> float:
        return self.hit_tokens / self.query_tokens if self.query_tokens else 0.0


class PrefixCachingKVManager(KVCacheManager):
    prefix_caching = True

    def __init__(self, num_blocks: int, block_size: int, allocator: PrefixCachingAllocator | None = None) -> None:
        """`allocator`: a `PrefixCachingAllocator` (e.g. KVP's striped one); default a single
        pool of `num_blocks`."""
        super().__init__(num_blocks, block_size, allocator or PrefixCachingAllocator(num_blocks))
        self._keys: dict[str, list[bytes]] = {}     # per request: keys of its leading full blocks
        self.lookups = PrefixLookups()
        # adapter name -> what its chains are rooted at (the engine's `LoRASet.roots`), so KV
        # made by an unloaded adapter never matches a later load under the same name
        self.lora_roots: dict[str, str] = {}
        # With an EAGLE head the draft KV at a cached run's last position was made with the token
        # that followed it in the request that cached it; as vLLM, such an engine recomputes the
        # run's last block instead of sharing it.
        self.rerun_last_match = False

    def match_prefix(self, req: Request) -> int:
        """Share the blocks of the longest cached prefix of `req`'s known tokens with it and
        return the tokens they cover (a multiple of the block size). The last known token is
        never matched: its logits are what the request needs next."""
        rid = req.request_id
        if rid in self.block_tables:
            return 0
        tokens, bs, a = req.all_token_ids, self.block_size, self.allocator
        keys, blocks = self._longest_cached(tokens, self._root(req.sampling.lora_adapter),
                                            image_extras(req.sampling.images, bs))
        self.lookups.count(rid, len(tokens), len(blocks) * bs)
        if not blocks:
            return 0
        for b in blocks:
            a.take(b)
        self.block_tables[rid] = blocks
        self._keys[rid] = keys
        return len(blocks) * bs

    def cached_prefix_tokens(self, tokens: list[int], lora_adapter: str | None = None, images=()) -> int:
        """What `match_prefix` would find for these known tokens, touching nothing."""
        extras = image_extras(images, self.block_size)
        return len(self._longest_cached(tokens, self._root(lora_adapter), extras)[1]) * self.block_size

    def _root(self, lora_adapter: str | None) -> bytes:
        return chain_root(None if lora_adapter is None else self.lora_roots.get(lora_adapter, lora_adapter))

    def _longest_cached(self, tokens: list[int], root: bytes = b"", extras: dict[int, bytes] | None = None
                        ) -> tuple[list[bytes], list[int]]:
        """Keys and blocks of the longest cached run of full blocks before the last token
        (`extras`: `image_extras` of its images)."""
        bs, a = self.block_size, self.allocator
        keys: list[bytes] = []
        blocks: list[int] = []
        parent = root
        for i in range((len(tokens) - 1) // bs):
            key = block_key(parent, tokens[i * bs:(i + 1) * bs], extras.get(i, b"") if extras else b"")
            block = a.lookup(key)
            if block is None:
                break
            keys.append(key)
            blocks.append(block)
            parent = key
        if self.rerun_last_match and blocks:
            keys.pop()
            blocks.pop()
        return keys, blocks

    def cache_full_blocks(self, req: Request, num_computed_tokens: int) -> None:
        """Register `req`'s blocks that are full and computed (its first `num_computed_tokens`
        tokens have KV) and not registered yet."""
        table = self.block_tables.get(req.request_id)
        if not table:
            return
        keys = self._keys.setdefault(req.request_id, [])
        bs = self.block_size
        n_full = min(num_computed_tokens // bs, len(table))
        if len(keys) >= n_full:
            return
        tokens, a = req.all_token_ids, self.allocator
        parent = keys[-1] if keys else self._root(req.sampling.lora_adapter)
        extras = image_extras(req.sampling.images, bs)
        for i in range(len(keys), n_full):
            parent = block_key(parent, tokens[i * bs:(i + 1) * bs], extras.get(i, b""))
            a.register(table[i], parent)
            keys.append(parent)

    @property
    def query_tokens(self) -> int:
        return self.lookups.query_tokens

    @property
    def hit_tokens(self) -> int:
        return self.lookups.hit_tokens

    def hit_rate(self) -> float:
        return self.lookups.rate()

    def free(self, request_id: str) -> None:
        self._keys.pop(request_id, None)
        self.lookups.forget(request_id)
        super().free(request_id)

    def withdraw(self, request_id: str) -> None:
        """Free an admission that never ran (KV short): its lookup leaves the counters, since the
        request will be looked up again when it is admitted for real."""
        self.lookups.withdraw(request_id)
        self.free(request_id)

    def fork(self, src_id: str, dst_id: str) -> None:
        super().fork(src_id, dst_id)
        self._keys[dst_id] = list(self._keys.get(src_id, ()))

    def check(self) -> None:
        super().check()
        self.allocator.check_keys()
        for rid, keys in self._keys.items():
            table = self.block_tables.get(rid, [])
            assert len(keys) <= len(table), f"{rid}: {len(keys)} keys for {len(table)} blocks"
