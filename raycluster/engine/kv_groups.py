"""How a model whose layers mix sliding-window and full attention lays out its KV cache when the
engine keeps them apart (vLLM's hybrid KV cache manager): `kv_groups(model_config)`.

Full layers must keep every block of a request; sliding layers need only the blocks of the last
`window` tokens. With one block table per request, every layer keeps every block. Here layers are
split into groups of one kind, each of at most `num_slots` layers (the smaller kind's layer
count): the full layers in one or more groups, the sliding ones in others. Every group has its own
block table per request, and all groups draw from one pool of blocks. A pool block holds the KV
of `num_slots` layers for `block_size` tokens: the KV tensor is [num_slots, pool blocks, ...]
rather than [layers, blocks, ...], and layer i reads slot `slot_of[i]` of the blocks in its
group's table (`group_of[i]`). A sliding group's tables give back blocks that fall out of the
window (raycluster.engine.hybrid_kv), so a long request holds about its length in blocks for
each full group plus window / block_size for each sliding group.

For the same memory, the pool holds layers / num_slots times the blocks of an all-layers table.
gpt-oss (12 full, 12 sliding layers): 2 groups of 12, a pool of twice the blocks. A group with
fewer layers than slots (the last of its kind when the counts do not divide) leaves its blocks'
other slots unused.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass


@dataclass(frozen=True)
class KVGroups:
    windows: tuple[int | None, ...]         # per group: its layers' window, None for full attention
    layers: tuple[tuple[int, ...], ...]     # per group: its layers, in slot order
    num_slots: int                          # layers a pool block holds

    # Per layer: its group and its slot. Cached: every step's metadata reads them.
    @functools.cached_property
    def group_of(self) -> tuple[int, ...]:
        return tuple(g for _, g in sorted((i, g) for g, ls in enumerate(self.layers) for i in ls))

    @functools.cached_property
    def slot_of(self) -> tuple[int, ...]:
        return tuple(s for _, s in sorted((i, s) for ls in self.layers for s, i in enumerate(ls)))

    @property
    def num_groups(self) -> int:
        return len(self.layers)

    @property
    def num_layers(self) -> int:
        return sum(map(len, self.layers))

    def pool_blocks(self, table_blocks: int) -> int:
        """Pool blocks holding the memory of `table_blocks` blocks of every layer."""
        return table_blocks * self.num_layers // self.num_slots


def _chunks(layers: list[int], size: int) -> list[tuple[int, ...]]:
    return [tuple(layers[i:i + size]) for i in range(0, len(layers), size)]


def kv_groups(mcfg) -> KVGroups | None:
    """The groups of a model with both full and sliding layers (None otherwise: one table serves)."""
    n = mcfg.num_hidden_layers
    full = [i for i in range(n) if mcfg.window_of(i) is None]
    sliding = [i for i in range(n) if mcfg.window_of(i) is not None]
    if not full or not sliding:
        return None
    slots = min(len(full), len(sliding))
    full_groups, sliding_groups = _chunks(full, slots), _chunks(sliding, slots)
    return KVGroups(windows=(None,) * len(full_groups) + (mcfg.sliding_window,) * len(sliding_groups),
                    layers=tuple(full_groups + sliding_groups), num_slots=slots)
