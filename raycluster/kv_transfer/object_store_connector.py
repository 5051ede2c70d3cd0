"""Ray object-store connector: the prefill side puts the request's blocks, the decode side gets
them (zero-copy views of shared memory on the same node) and copies them into its KV cache.

Owns the ObjectRefs of live offers: `offer` puts the blocks and keeps the ref so the object
lives until `release`/`expire` drops it; the handle carries the ref (Ray passes refs nested in a
dataclass as borrowed references, not values). `pull` does `ray.get(ref, timeout)` and scatters
straight from the zero-copy views into the destination blocks. No peer setup and no descriptor.

Copies: `ray.put` copies every out-of-band numpy buffer into plasma once. When the request's
blocks form few runs (what the engine's allocator hands out; at most `max_pieces` per-layer
runs of >= `min_piece_bytes` on average: Ray pays ~25 us per out-of-band buffer on put and the
pull ~20 us per piece, about a memcpy of 128-256 KiB, so smaller pieces are cheaper gathered),
the offer puts a list of views kv[l, start:start+n] (contiguous, no gather, cut to <= 1 MiB:
Ray copies a larger buffer with threads it starts per copy), so the put itself is the only pass
over the data on the prefill side; otherwise (scattered blocks) it first gathers into a reused
staging buffer (2 passes, no fresh allocation). The decode side always does exactly one pass (a
row copy out of plasma, kernels.rowcopy). Buffers are the KV's bits as integers of its width
(numpy has no bf16). The copy made at offer time means the prefill engine could free its blocks
right after `offer`; the lease still bounds how long the object-store copy lives.
Each process pays ~2 us per 4 KiB page of plasma it touches the first time (a 32 MiB put: +16
ms); a long-running instance has paid that once for the pages its objects cycle through.
A dead prefill process (the ref's owner) makes `ray.get` raise, which becomes KVTransferError.
"""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np
import ray
import torch

from kernels.rowcopy import index_copy, numpy_bits
from raycluster.kv_transfer.base import (KVConnector, KVHandle, KVTransferError, check_compatible,
                                         scatter_blocks)


def src_runs(block_ids: list[int]) -> list[tuple[int, int]]:
    """[(position, length)] of maximal runs of consecutive ids in `block_ids`."""
    s = np.asarray(block_ids, dtype=np.int64)
    if len(s) == 0:
        return []
    starts = np.concatenate(([0], np.flatnonzero(np.diff(s) != 1) + 1))
    lengths = np.diff(np.concatenate((starts, [len(s)])))
    return [(int(p), int(n)) for p, n in zip(starts, lengths)]


PIECE_BYTES = 1 << 20     # Ray's put copies a larger buffer with threads it starts per copy


class ObjectStoreConnector(KVConnector):
    name = "object_store"

    def __init__(self, kv_cache: torch.Tensor, instance_id: str, lease_s: float = 30.0,
                 clock=None, max_pieces: int = 512, min_piece_bytes: int = 128 << 10) -> None:
        super().__init__(kv_cache, instance_id, lease_s, clock)
        self.max_pieces, self.min_piece_bytes = max_pieces, min_piece_bytes
        self._refs: dict[str, ray.ObjectRef] = {}
        self._staging: torch.Tensor | None = None   # reused gather buffer (already faulted in)

    def _offer_extra(self, handle: KVHandle) -> dict[str, Any]:
        ids = handle.src_block_ids
        runs = src_runs(ids)
        kv = self.kv_cache
        pieces = len(runs) * kv.shape[0]
        piece_bytes = len(ids) * kv[0, 0].numel() * kv.element_size() / len(runs)
        if kv.device.type == "cpu" and pieces <= self.max_pieces and \
                piece_bytes >= self.min_piece_bytes:
            # Views into the KV tensor: ray.put copies them into plasma, nothing else does.
            # Sliced from one numpy view of the cache (~0.3 us each vs ~3 us per torch slice).
            # Ray copies a buffer over 1 MiB with 6 threads it starts for that one copy: a
            # 32 MiB offer in 1032 KiB pieces took 6.5 ms, in 1 MiB pieces 1.9 ms (in one
            # 32 MiB piece 2.1 ms), so runs are cut into pieces of at most 1 MiB.
            step = max(1, PIECE_BYTES // (kv[0, 0].numel() * kv.element_size()))
            runs = [(p + i, min(step, n - i)) for p, n in runs for i in range(0, n, step)]
            kvn = self._numpy_kv()
            value = [kvn[l, ids[p]:ids[p] + n] for l in range(kv.shape[0]) for p, n in runs]
            extra: dict[str, Any] = {"runs": runs}
        else:
            # Gather into a reused buffer: ray.put copies it out before returning, and a fresh
            # 32 MiB tensor per offer costs more in page faults than the gather itself.
            shape = (kv.shape[0], len(ids)) + tuple(kv.shape[2:])
            numel = kv.shape[0] * len(ids) * kv[0, 0].numel()
            if self._staging is None or self._staging.numel() < numel or \
                    self._staging.device != kv.device:
                self._staging = torch.empty(numel, dtype=kv.dtype, device=kv.device)
            out = self._staging[:numel].view(shape)
            torch.index_select(kv, 1, torch.as_tensor(ids, dtype=torch.long, device=kv.device),
                               out=out)
            value = numpy_bits(out.cpu())
            extra = {}
        ref = ray.put(value)
        self._refs[handle.request_id] = ref
        return {"ref": ref, **extra}

    def _numpy_kv(self) -> np.ndarray:
        if getattr(self, "_kvn", None) is None:
            self._kvn = numpy_bits(self.kv_cache)
        return self._kvn

    def _drop(self, request_id: str) -> None:
        self._refs.pop(request_id, None)  # last local ref gone -> Ray frees the object

    def pull(self, handle: KVHandle, dst_block_ids: list[int], timeout_s: float) -> None:
        check_compatible(self.kv_cache, handle, dst_block_ids)
        try:
            obj = ray.get(handle.extra["ref"], timeout=timeout_s)
        except Exception as e:  # GetTimeoutError, OwnerDiedError, ObjectLostError, ...
            raise KVTransferError(f"object-store get of {handle.request_id!r} from "
                                  f"{handle.src_instance}: {type(e).__name__}: {e}") from e
        kv = self.kv_cache
        skip, total = handle.skip_blocks, len(handle.src_block_ids)
        runs = handle.extra.get("runs")
        with warnings.catch_warnings():
            # The views are read-only shared memory; we only read them (the copies go out of them).
            warnings.simplefilter("ignore", UserWarning)
            if runs is None:
                data = torch.from_numpy(obj).view(kv.dtype)
                expect = (kv.shape[0], total) + tuple(kv.shape[2:])
                if tuple(data.shape) != expect:
                    raise KVTransferError(f"object for {handle.request_id!r} has shape "
                                          f"{tuple(data.shape)}, expected {expect}")
                scatter_blocks(kv, dst_block_ids, data[:, skip:])
                return
            pieces = [torch.from_numpy(a).view(kv.dtype) for a in obj]
        if len(pieces) != kv.shape[0] * len(runs) or sum(n for _, n in runs) != total or \
                any(tuple(pc.shape) != (n,) + tuple(kv.shape[2:])
                    for pc, (_, n) in zip(pieces, runs * kv.shape[0])):
            raise KVTransferError(f"object for {handle.request_id!r} does not match its runs "
                                  f"{runs} and {total} source blocks")
        # Per source run, the part after `skip` and where it lands, computed once (not per
        # layer): one copy per piece when the destination is consecutive too, else one row scatter.
        dst = np.asarray(dst_block_ids, dtype=np.int64)
        idx = torch.as_tensor(dst, dtype=torch.long, device=kv.device)
        where = []
        for r, (p, n) in enumerate(runs):
            cut = min(max(skip - p, 0), n)          # leading blocks of this run already cached
            if cut == n:
                continue
            a, k = p + cut - skip, n - cut          # its blocks' positions in dst_block_ids
            d = dst[a:a + k]
            contiguous = k == 1 or bool((np.diff(d) == 1).all())
            where.append((r, cut, int(d[0]), k, None if contiguous else idx[a:a + k]))
        for l in range(kv.shape[0]):
            kl = kv[l]
            for r, cut, d0, k, scattered in where:
                piece = pieces[l * len(runs) + r][cut:]
                if scattered is None:
                    kl[d0:d0 + k].copy_(piece)
                else:
                    index_copy(kl, 0, scattered, piece.to(kv.device))
