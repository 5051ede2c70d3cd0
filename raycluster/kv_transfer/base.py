"""The KV connector interface shared by every transport, plus the pieces that need no transport.

Owns: `KVConnector` (the ABC: one instance per engine process, built around that engine's KV tensor
`[L, N, 2, B, Hkv, D]`), `LeaseTable` (clock-injected expiry of offers that nobody pulls),
the exact `gather_blocks` / `scatter_blocks` helpers, and `pull_with_fallback` (the
recompute | fail policy). `KVHandle`, the plain dataclass the prefill side hands to the
router/decode side, lives in `raycluster.kv_handle` (no torch) and is re-exported here.

Data flow: the prefill engine calls `offer(request_id, block_ids, num_tokens)` and ships the
returned handle (ints, lists, bytes, at most an ObjectRef) to the decode engine, which allocates
its own blocks and calls `pull(handle, dst_block_ids, timeout_s)` (a decode side whose prefix cache
holds the leading blocks sets `handle.skip_blocks` and passes blocks for the rest only, so only
those move). After admitting the request it
tells the prefill side, which calls `release(request_id)` and frees its blocks. Offers never
pulled come back from `expire()` after `lease_s`, so the engine can free those blocks too.
"""

from __future__ import annotations

import logging
import time
from abc import ABC, abstractmethod
from typing import Any

import torch

from kernels.rowcopy import index_copy
from raycluster.clock import WallClock
from raycluster.kv_handle import KVHandle  # noqa: F401  (re-exported: connectors import it from here)

log = logging.getLogger(__name__)


class KVTransferError(RuntimeError):
    """A transfer failed or timed out; the caller may recompute the prefill instead."""


class KVTransferUnquiesced(RuntimeError):
    """A transfer into this process's KV could neither finish nor be stopped, so its destination
    blocks may still be written. Not a KVTransferError: recomputing into (or reusing) those blocks
    could be overwritten later. The instance must stop using its KV (fail closed)."""


class KVLayoutError(ValueError):
    """Source and destination KV tensors disagree on per-block shape/dtype or block counts.
    A configuration bug, not a transient failure: never silently recomputed."""


def block_shape_of(kv_cache: torch.Tensor) -> tuple[int, ...]:
    """Shape of one block across all layers: kv_cache[:, b] -> (L, 2, B, Hkv, D)."""
    return (kv_cache.shape[0],) + tuple(kv_cache.shape[2:])


def dtype_name(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


def check_compatible(kv_cache: torch.Tensor, handle: KVHandle, dst_block_ids: list[int]) -> None:
    mine = block_shape_of(kv_cache)
    if tuple(handle.block_shape) != mine or handle.dtype != dtype_name(kv_cache):
        raise KVLayoutError(
            f"KV layout mismatch for {handle.request_id!r}: source block {tuple(handle.block_shape)} "
            f"{handle.dtype}, destination block {mine} {dtype_name(kv_cache)}")
    if not 0 <= handle.skip_blocks <= len(handle.src_block_ids):
        raise KVLayoutError(f"{handle.request_id!r}: skip_blocks {handle.skip_blocks} outside "
                            f"[0, {len(handle.src_block_ids)}]")
    if len(dst_block_ids) != len(handle.pull_block_ids):
        raise KVLayoutError(f"{handle.request_id!r}: {len(handle.pull_block_ids)} source blocks to pull but "
                            f"{len(dst_block_ids)} destination blocks")
    n = kv_cache.shape[1]
    if any(b < 0 or b >= n for b in dst_block_ids):
        raise KVLayoutError(f"destination block id out of range [0, {n}): {dst_block_ids}")


def _index(block_ids: list[int], device: torch.device) -> torch.Tensor:
    return torch.as_tensor(block_ids, dtype=torch.long, device=device)


def gather_blocks(kv_cache: torch.Tensor, block_ids: list[int]) -> torch.Tensor:
    """Copy kv_cache[:, block_ids] into one new contiguous tensor [L, k, 2, B, Hkv, D]."""
    return kv_cache.index_select(1, _index(block_ids, kv_cache.device))


def scatter_blocks(kv_cache: torch.Tensor, block_ids: list[int], data: torch.Tensor) -> None:
    """kv_cache[:, block_ids] = data, in place; touches no other block."""
    index_copy(kv_cache, 1, block_ids, data.to(kv_cache.device))


class LeaseTable:
    """Offers with a deadline. Pure bookkeeping: the owner frees what `expired()` returns."""

    def __init__(self, lease_s: float, clock=None) -> None:
        if lease_s <= 0:
            raise ValueError(f"lease_s must be > 0, got {lease_s}")
        self.lease_s = lease_s
        self.clock = clock or WallClock()
        self._deadline: dict[str, float] = {}

    def add(self, request_id: str, now: float | None = None) -> float:
        if request_id in self._deadline:
            raise ValueError(f"request {request_id!r} already has a lease")
        t = self.clock.now() if now is None else now
        self._deadline[request_id] = t + self.lease_s
        return self._deadline[request_id]

    def renew(self, request_id: str, now: float | None = None) -> None:
        """Push the deadline out (e.g. while a transfer of this offer is in flight)."""
        if request_id in self._deadline:
            t = self.clock.now() if now is None else now
            self._deadline[request_id] = max(self._deadline[request_id], t + self.lease_s)

    def remove(self, request_id: str) -> bool:
        return self._deadline.pop(request_id, None) is not None

    def expired(self, now: float | None = None) -> list[str]:
        """Drop and return the leases whose deadline is at or before `now`, oldest first."""
        t = self.clock.now() if now is None else now
        out = sorted((d, r) for r, d in self._deadline.items() if d <= t)
        for _, r in out:
            del self._deadline[r]
        return [r for _, r in out]

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._deadline

    def __len__(self) -> int:
        return len(self._deadline)


class KVConnector(ABC):
    """One per engine process. Subclasses implement `_offer_extra`, `pull` and optionally
    `local_descriptor`, `_drop` and `close`; offer/release/expire bookkeeping lives here."""

    name = "base"

    def __init__(self, kv_cache: torch.Tensor, instance_id: str, lease_s: float = 30.0,
                 clock=None) -> None:
        if kv_cache.dim() != 6 or not kv_cache.is_contiguous():
            raise KVLayoutError(f"kv_cache must be a contiguous [L, N, 2, B, Hkv, D] tensor, "
                                f"got shape {tuple(kv_cache.shape)}")
        self.kv_cache = kv_cache
        self.instance_id = instance_id
        self.leases = LeaseTable(lease_s, clock)
        self._offers: dict[str, list[int]] = {}
        # pull_with_fallback's outcomes on this (decode) side: KV moved vs recomputed, and the
        # blocks and wall seconds of the pulls that moved it (the instance reports them).
        self.pull_counts = {"ok": 0, "failed": 0, "blocks": 0, "seconds": 0.0}

    # -- both sides --------------------------------------------------------------------------
    def local_descriptor(self) -> Any:
        """What a peer needs to reach this instance (None when nothing is needed)."""
        return None

    def close(self) -> None:
        for rid in list(self._offers):
            self.release(rid)

    # -- prefill side ------------------------------------------------------------------------
    def offer(self, request_id: str, block_ids: list[int], num_tokens: int) -> KVHandle:
        """Make the request's blocks pullable and start its lease. The engine must keep the
        blocks allocated until release()/expire() names the request."""
        if request_id in self._offers:
            raise ValueError(f"request {request_id!r} is already offered")
        block_ids = [int(b) for b in block_ids]
        n = self.kv_cache.shape[1]
        if not block_ids or any(b < 0 or b >= n for b in block_ids):
            raise ValueError(f"bad source block ids for {request_id!r}: {block_ids}")
        handle = KVHandle(request_id, self.instance_id, block_ids, int(num_tokens),
                          block_shape_of(self.kv_cache), dtype_name(self.kv_cache))
        handle.extra = self._offer_extra(handle)
        self._offers[request_id] = block_ids
        self.leases.add(request_id)
        return handle

    def release(self, request_id: str) -> bool:
        """Forget an offer (decode confirmed). Returns False if it was unknown/already gone."""
        self.leases.remove(request_id)
        if self._offers.pop(request_id, None) is None:
            return False
        self._drop(request_id)
        return True

    def expire(self, now: float | None = None) -> list[str]:
        """Release offers whose lease ran out; returns their ids so the engine frees the blocks."""
        gone = self.leases.expired(now)
        for rid in gone:
            if self._offers.pop(rid, None) is not None:
                self._drop(rid)
        return gone

    def offered(self, request_id: str) -> list[int] | None:
        return self._offers.get(request_id)

    def offered_ids(self) -> list[str]:
        return list(self._offers)

    def _offer_extra(self, handle: KVHandle) -> dict[str, Any]:
        return {}

    def _drop(self, request_id: str) -> None:
        """Free connector-side resources of one offer (e.g. an object-store copy)."""

    # -- decode side -------------------------------------------------------------------------
    @abstractmethod
    def pull(self, handle: KVHandle, dst_block_ids: list[int], timeout_s: float) -> None:
        """Fill kv_cache[:, dst_block_ids] with the source's blocks `handle.pull_block_ids`, or
        raise KVTransferError (failure, dead peer, or `timeout_s` elapsed). Raises KVLayoutError
        on mismatch."""


def pull_with_fallback(connector: KVConnector, handle: KVHandle, dst_block_ids: list[int],
                       timeout_s: float, on_failure: str = "recompute") -> bool:
    """True if the KV arrived; False if the caller should recompute the prefill locally
    (on_failure="recompute"); re-raises KVTransferError when on_failure="fail".
    KVTransferUnquiesced always propagates: there are no blocks to recompute into."""
    if on_failure not in ("recompute", "fail"):
        raise ValueError(f"on_failure must be 'recompute' or 'fail', got {on_failure!r}")
    t0 = time.monotonic()
    counts = getattr(connector, "pull_counts", None)
    try:
        connector.pull(handle, dst_block_ids, timeout_s)
        if counts is not None:
            counts["ok"] += 1
            counts["blocks"] += len(dst_block_ids)
            counts["seconds"] += time.monotonic() - t0
        return True
    except KVTransferError as e:
        if counts is not None:
            counts["failed"] += 1
        if on_failure == "fail":
            raise
        log.warning("KV pull of %s from %s failed after %.3fs (%s); recomputing prefill",
                    handle.request_id, handle.src_instance, time.monotonic() - t0, e)
        return False
