"""torch.distributed connector: the same code moves KV over gloo (CPU) or NCCL (CUDA).

Owns this process's rank in one process group spanning all engine instances (joined at
construction through a TCPStore on 127.0.0.1 or the cluster head; every rank must construct at
the same time, as init_process_group is collective) and the two-sided send/recv protocol:

  decode (rank d)                               prefill (rank p, named Ray actor = instance id)
  1. buf = empty [L, k, 2, B, H, D]; tag = fresh
  2. irecv(header, p, tag)       ---- request_send(handle, d, tag, timeout) ---->
                                                3. send_blocks(request_id, d, tag, timeout):
                                                   isend([offered?, nbytes], d, tag); if offered:
                                                   gather blocks -> one contiguous buffer,
                                                   isend(buf, d, tag + 1); wait(timeout)
  4. header ok -> irecv(buf, p, tag + 1); wait (bounded), failing early if the ack reports
     an error; scatter buf into the destination blocks.

One contiguous buffer per transfer because many small sends are 4-60x slower. The decode side
picks the tag, so a retry never matches a stale send. `request_send` is injectable; the default
(`ray_actor_sender`) calls `kv_send(request_id, dst_rank, tag, timeout_s)` on the Ray actor named
after the source instance, which should call `send_blocks`. A dead or silent source gives
KVTransferError within timeout_s. A refusal still sends the header, so no recv is left
dangling; after a timeout the recv stays posted for recv_grace_s more (see pull) because an
expired gloo wait closes the pair's connection. With NCCL tags are ignored and order is per
pair, so after a timeout the pair must be re-created before the next transfer.
"""

from __future__ import annotations

import itertools
import threading
import time
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist

from raycluster.kv_transfer.base import (KVConnector, KVHandle, KVTransferError, check_compatible,
                                         gather_blocks, scatter_blocks)


def ray_actor_sender(method: str = "kv_send", namespace: str | None = None) -> Callable:
    """request_send that asks the source engine actor (named by its instance id) to send."""
    def request_send(handle: KVHandle, dst_rank: int, tag: int, timeout_s: float):
        import ray
        actor = ray.get_actor(handle.src_instance, namespace=namespace)
        return getattr(actor, method).remote(handle.request_id, dst_rank, tag, timeout_s)
    return request_send


def _ack_state(ack: Any) -> tuple[bool, BaseException | None]:
    """(done, error) of whatever request_send returned: an ObjectRef, a Future, or None."""
    if ack is None:
        return True, None
    try:
        import ray
        if isinstance(ack, ray.ObjectRef):
            ready, _ = ray.wait([ack], timeout=0)
            if not ready:
                return False, None
            try:
                ray.get(ack, timeout=0)
                return True, None
            except Exception as e:
                return True, e
    except ImportError:
        pass
    if hasattr(ack, "done"):
        if not ack.done():
            return False, None
        return True, ack.exception()
    return True, None


class TorchDistConnector(KVConnector):
    name = "torch_dist"

    def __init__(self, kv_cache: torch.Tensor, instance_id: str, rank: int | None = None,
                 world_size: int | None = None, store_host: str = "127.0.0.1",
                 store_port: int | None = None, backend: str | None = None,
                 init_timeout_s: float = 60.0, request_send: Callable | None = None,
                 lease_s: float = 30.0, clock=None, recv_grace_s: float = 60.0) -> None:
        super().__init__(kv_cache, instance_id, lease_s, clock)
        if not dist.is_initialized():
            if rank is None or world_size is None or store_port is None:
                raise ValueError("torch_dist needs rank, world_size and store_port to join the group")
            backend = backend or ("nccl" if kv_cache.is_cuda else "gloo")
            t = timedelta(seconds=init_timeout_s)
            store = dist.TCPStore(store_host, store_port, world_size, is_master=(rank == 0),
                                  timeout=t)
            dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                                    timeout=t)
        self.rank = dist.get_rank()
        self.request_send = request_send or ray_actor_sender()
        self.recv_grace_s = recv_grace_s
        self._tags = itertools.count(1)

    def local_descriptor(self) -> dict[str, int]:
        return {"rank": self.rank}

    def _offer_extra(self, handle: KVHandle) -> dict[str, Any]:
        return {"rank": self.rank}

    # -- prefill side ------------------------------------------------------------------------
    def send_blocks(self, request_id: str, dst_rank: int, tag: int, timeout_s: float) -> int:
        """Send a header (ok?, nbytes) on `tag`, then, if the request is offered, its blocks as
        one buffer on `tag + 1`. A refusal is still answered with a header so the receiver's
        posted recv completes and the gloo pair stays healthy. Returns the bytes sent."""
        blocks = self.offered(request_id)
        buf = None
        if blocks is not None:
            self.leases.renew(request_id)  # a transfer in flight must not lose its blocks
            buf = gather_blocks(self.kv_cache, blocks)
        nbytes = 0 if buf is None else buf.numel() * buf.element_size()
        header = torch.tensor([int(buf is not None), nbytes], dtype=torch.int64,
                              device=self.kv_cache.device)
        try:
            works = [dist.isend(header, dst_rank, tag=tag)]
            if buf is not None:
                works.append(dist.isend(buf, dst_rank, tag=tag + 1))
            for w in works:
                w.wait(timeout=timedelta(seconds=timeout_s))
        except Exception as e:
            raise KVTransferError(f"send of {request_id!r} to rank {dst_rank} failed: {e}") from e
        if buf is None:
            raise KVTransferError(f"{request_id!r} is not offered here (released or lease expired)")
        return nbytes

    # -- decode side -------------------------------------------------------------------------
    def pull(self, handle: KVHandle, dst_block_ids: list[int], timeout_s: float) -> None:
        check_compatible(self.kv_cache, handle, dst_block_ids)
        src = int(handle.extra["rank"])
        deadline = time.monotonic() + timeout_s
        kv = self.kv_cache
        buf = torch.empty((kv.shape[0], len(dst_block_ids)) + tuple(kv.shape[2:]),
                          dtype=kv.dtype, device=kv.device)
        header = torch.zeros(2, dtype=torch.int64, device=kv.device)
        tag = 2 * next(self._tags)          # header on tag, data on tag + 1
        what = f"recv of {handle.request_id!r} from rank {src}"
        try:
            hwork = dist.irecv(header, src=src, tag=tag)
            ack = self.request_send(handle, self.rank, tag, timeout_s)
        except KVTransferError:
            raise
        except Exception as e:  # unknown actor, dead pair, ...
            raise KVTransferError(f"{what}: could not start: {type(e).__name__}: {e}") from e
        # gloo's is_completed() stays False until someone waits, and a wait that times out closes
        # the pair's connection (every later transfer on it fails). So one thread waits, with
        # timeout_s + recv_grace_s, letting a late sender finish into the abandoned buffer and
        # keep the pair usable; this thread gives up at timeout_s and watches the sender's ack
        # (fast failure for a refused offer or a dead actor).
        result: list[BaseException | None] = []
        done = threading.Event()
        long_wait = timedelta(seconds=timeout_s + self.recv_grace_s)

        def _wait() -> None:
            try:
                hwork.wait(timeout=long_wait)
                if int(header[0]) != 1:
                    raise KVTransferError("sender refused: not offered (released or lease expired)")
                dist.irecv(buf, src=src, tag=tag + 1).wait(timeout=long_wait)
                result.append(None)
            except BaseException as e:  # noqa: BLE001 - handed to the caller below
                result.append(e)
            done.set()

        threading.Thread(target=_wait, name=f"kv-recv-{tag}", daemon=True).start()
        while not done.wait(0.005):
            _, err = _ack_state(ack)   # ray.wait costs ~0.1 ms: every 5 ms is plenty
            if err is not None:
                raise KVTransferError(f"{what}: sender failed: {type(err).__name__}: {err}") from err
            if time.monotonic() > deadline:
                raise KVTransferError(f"{what} timed out after {timeout_s}s")
        if result[0] is not None:
            e = result[0]
            msg = "timed out" if "imeout" in str(e) else "failed"
            raise KVTransferError(f"{what} {msg} after {timeout_s}s: {e}") from e
        scatter_blocks(kv, dst_block_ids, buf)
