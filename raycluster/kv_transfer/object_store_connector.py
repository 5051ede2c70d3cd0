"""Ray object-store connector: the prefill side puts the request's blocks as one numpy array,
the decode side gets it (a zero-copy view of shared memory on the same node) and copies it in.

Owns the ObjectRefs of live offers: `offer` gathers kv_cache[:, blocks] into one contiguous
array, `ray.put`s it and keeps the ref so the object lives until `release`/`expire` drops it;
the handle carries the ref (Ray passes refs nested in a dataclass as borrowed references, not
values). `pull` does `ray.get(ref, timeout)` and scatters into the destination blocks. No
peer setup and no descriptor. The copy made at offer time means the prefill engine could free
its blocks right after `offer`; the lease still bounds how long the object-store copy lives.
A dead prefill process (the ref's owner) makes `ray.get` raise, which becomes KVTransferError.
"""

from __future__ import annotations

import warnings
from typing import Any

import ray
import torch

from raycluster.kv_transfer.base import (KVConnector, KVHandle, KVTransferError, check_compatible,
                                         gather_blocks, scatter_blocks)


class ObjectStoreConnector(KVConnector):
    name = "object_store"

    def __init__(self, kv_cache: torch.Tensor, instance_id: str, lease_s: float = 30.0,
                 clock=None) -> None:
        super().__init__(kv_cache, instance_id, lease_s, clock)
        self._refs: dict[str, ray.ObjectRef] = {}

    def _offer_extra(self, handle: KVHandle) -> dict[str, Any]:
        arr = gather_blocks(self.kv_cache, handle.src_block_ids).cpu().numpy()
        ref = ray.put(arr)
        self._refs[handle.request_id] = ref
        return {"ref": ref}

    def _drop(self, request_id: str) -> None:
        self._refs.pop(request_id, None)  # last local ref gone -> Ray frees the object

    def pull(self, handle: KVHandle, dst_block_ids: list[int], timeout_s: float) -> None:
        check_compatible(self.kv_cache, handle, dst_block_ids)
        try:
            arr = ray.get(handle.extra["ref"], timeout=timeout_s)
        except Exception as e:  # GetTimeoutError, OwnerDiedError, ObjectLostError, ...
            raise KVTransferError(f"object-store get of {handle.request_id!r} from "
                                  f"{handle.src_instance}: {type(e).__name__}: {e}") from e
        with warnings.catch_warnings():
            # The view is read-only shared memory; we only read it (index_copy_ copies out).
            warnings.simplefilter("ignore", UserWarning)
            data = torch.from_numpy(arr)
        expect = (self.kv_cache.shape[0], len(dst_block_ids)) + tuple(self.kv_cache.shape[2:])
        if tuple(data.shape) != expect:
            raise KVTransferError(f"object for {handle.request_id!r} has shape {tuple(data.shape)}, "
                                  f"expected {expect}")
        scatter_blocks(self.kv_cache, dst_block_ids, data)
