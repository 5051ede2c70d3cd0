"""Where a KV connector meets a runner's KV: the tensor it wraps and how blocks get in and out.

A single-process runner's port is its own KV tensor (`DirectPort`): a pull lands in the engine's
blocks, an offer exposes them, nothing is copied. A KVP / SPP / TP group's KV is spread over its
ranks (by block, by layer or by KV head), so its port (`StagedPort`) is a staging tensor on the leader holding
whole blocks, all layers, with its own block allocator: a pull lands there and
`runner.load_blocks` spreads it to the ranks; an offer first collects the blocks from the ranks
(`runner.save_blocks`) and then exposes the staged copy, so the engine may free its own blocks
at once. A full staging area makes an offer return None and a pull fail, and the caller falls back
to recomputing the prefill.

`KVLoad` / `KVSave` are the messages the leader posts to its ranks (beside `StepPlan`s)
before the block data moves over the group.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from kernels.rowcopy import index_copy
from raycluster.engine.kv_manager import BlockAllocator
from raycluster.parallel.lora_ranks import LoRAChange


@dataclass
class KVLoad:
    block_ids: list[int]        # engine block ids the leader's data [L, n, 2, B, Hkv, D] goes to


@dataclass
class KVSave:
    block_ids: list[int]        # engine block ids whose data the ranks send to the leader


class DirectPort:
    """The runner's own KV tensor, used in place."""

    copies = False

    def __init__(self, kv_cache: torch.Tensor) -> None:
        self.tensor = kv_cache

    def receive(self, dst_block_ids: list[int], fill: Callable[[list[int]], bool]) -> bool:
        return fill(dst_block_ids)

    def stage(self, request_id: str, block_ids: list[int]) -> list[int] | None:
        return block_ids

    def unstage(self, request_id: str) -> None:
        pass


class StagedPort:
    """A leader-side staging tensor [L, S, 2, B, Hkv, D] in front of a group runner, which
    provides `load_blocks(dst_ids, data)` and `save_blocks(src_ids) -> data`."""

    copies = True

    def __init__(self, runner, shape: tuple[int, ...], dtype: torch.dtype, device) -> None:
        self.runner = runner
        self.tensor = torch.zeros(shape, dtype=dtype, device=device)
        self.allocator = BlockAllocator(shape[1])
        self._staged: dict[str, list[int]] = {}

    def _index(self, ids: list[int]) -> torch.Tensor:
        return torch.tensor(ids, dtype=torch.long, device=self.tensor.device)

    def receive(self, dst_block_ids: list[int], fill: Callable[[list[int]], bool]) -> bool:
        """Pull into staging blocks (`fill(staging_ids)`), then spread them to the ranks."""
        if not self.allocator.can_allocate(len(dst_block_ids)):
            return False
        ids = self.allocator.allocate(len(dst_block_ids))
        try:
            if not fill(ids):
                return False
            self.runner.load_blocks(dst_block_ids, self.tensor.index_select(1, self._index(ids)))
            return True
        finally:
            self.allocator.free_all(ids)

    def stage(self, request_id: str, block_ids: list[int]) -> list[int] | None:
        """Copy the request's blocks from the ranks into staging; their ids there, or None
        when staging is full."""
        if request_id in self._staged:
            raise ValueError(f"request {request_id!r} is already staged")
        if not self.allocator.can_allocate(len(block_ids)):
            return None
        ids = self.allocator.allocate(len(block_ids))
        index_copy(self.tensor, 1, ids, self.runner.save_blocks(block_ids))
        self._staged[request_id] = ids
        return ids

    def unstage(self, request_id: str) -> None:
        ids = self._staged.pop(request_id, None)
        if ids:
            self.allocator.free_all(ids)


KV_TAG = 3      # group send/recv of block data, leader <-> rank


def rank_handler(rank) -> Callable:
    """What a non-leader rank runs for each message the leader posts: a step plan (`rank.run`), a
    block move (`rank.load` / `rank.save`) or a LoRA adapter change (`rank.adapters.apply`)."""
    def handle(msg) -> None:
        if isinstance(msg, KVLoad):
            rank.load(msg)
        elif isinstance(msg, KVSave):
            rank.save(msg)
        elif isinstance(msg, LoRAChange):
            rank.adapters.apply(msg)
        else:
            rank.run(msg)
    return handle
