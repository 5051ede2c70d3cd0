"""torch.distributed connector: the same code moves KV over gloo (CPU) or NCCL (CUDA).

Owns this process's rank in one process group spanning all engine instances (joined at
construction through a TCPStore on 127.0.0.1 or the cluster head; every rank must construct at
the same time, as init_process_group is collective) and the two-sided send/recv protocol:

  decode (rank d)                               prefill (rank p, named Ray actor = instance id)
  1. buf = [L * k, 2, B, H, D] (pooled); tag = fresh; plan = chunks (chunk_plan)
  2. irecv(header, p, tag); irecv(buf[chunk i], p, tag + 1 + i) for every chunk, all posted
     up front                    ---- request_send(handle, d, tag, timeout) ---->
                                                3. send_blocks(request_id, d, tag, timeout, k):
                                                   isend([offered?, nbytes, chunks], d, tag);
                                                   per chunk: gather its blocks straight into
                                                   the (pooled) send buffer, isend it on
                                                   tag + 1 + i; wait all (timeout)
  4. a waiter thread waits header, then chunk by chunk; the caller scatters each chunk into the
     destination blocks as soon as it lands (overlapping the next chunk's gather + transfer),
     failing early if the ack reports an error.

Chunks are equal ranges of the layer-major (layer, block) grid, >= ~1 MiB each and at most
MAX_CHUNKS (many small sends are 4-60x slower); chunks let
the sender's gather, the wire and the receiver's scatter run concurrently instead of in three
passes one after another. No round trip precedes the data: all receives are posted before the
send is requested, so a refusal must still complete them: the sender answers a refused offer
with header [0, 0, n] and a 1-element message per chunk (gloo completes a receive with a
shorter message), which is why `request_send` passes the block count. The decode side picks the
tag, so a retry never matches a stale send. `request_send` is injectable; the default
(`ray_actor_sender`) calls `kv_send(request_id, dst_rank, tag, timeout_s, num_blocks=k)` on the
Ray actor named after the source instance, which should call `send_blocks`. A dead or silent
source gives KVTransferError within timeout_s. After a timeout the receives stay posted for
recv_grace_s more (see pull) because an expired gloo wait closes the pair's connection; the
abandoned buffer is never reused and nothing is scattered from it. With NCCL tags are ignored
and order is per pair, so after a timeout the pair must be re-created before the next transfer.
"""

from __future__ import annotations

import itertools
import queue
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
        return getattr(actor, method).remote(handle.request_id, dst_rank, tag, timeout_s,
                                             num_blocks=len(handle.src_block_ids))
    return request_send


TAG_STRIDE = 64          # tags [tag, tag + TAG_STRIDE) belong to one transfer
MAX_CHUNKS = 8           # header + chunks must fit in one tag stride
MIN_CHUNK_BYTES = 1 << 20


def chunk_plan(num_layers: int, num_blocks: int, block_bytes: int,
               max_chunks: int = MAX_CHUNKS,
               min_chunk_bytes: int = MIN_CHUNK_BYTES) -> list[tuple[int, int]]:
    """Split the layer-major (layer, block) grid, flattened as l * num_blocks + j, into
    consecutive [a, b) ranges of >= min_chunk_bytes each (when possible), at most max_chunks.
    A range is one contiguous slice of the [L, k, ...] staging buffer. Both sides compute it
    from (L, k, block bytes)."""
    cells = num_layers * num_blocks
    n = max(1, min(cells, max_chunks, cells * block_bytes // max(min_chunk_bytes, 1)))
    bounds = [round(i * cells / n) for i in range(n + 1)]
    return [(bounds[i], bounds[i + 1]) for i in range(n)]


def _segments(a: int, b: int, k: int) -> list[tuple[int, int, int]]:
    """(layer, j0, j1) pieces of the flattened range [a, b) over a [L, k] grid."""
    return [(l, max(a, l * k) - l * k, min(b, (l + 1) * k) - l * k)
            for l in range(a // k, (b - 1) // k + 1)]


class _BufferPool:
    """Reusable, already-faulted-in flat buffers (a fresh 32 MiB tensor costs ~8k page faults
    per transfer). A buffer handed out is owned by the caller until given back; one abandoned by
    a timed-out receive is simply never given back."""

    def __init__(self, keep: int = 2) -> None:
        self.keep = keep
        self._free: list[torch.Tensor] = []
        self._lock = threading.Lock()

    def take(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        with self._lock:
            for i, b in enumerate(self._free):
                if b.numel() >= numel and b.dtype == dtype and b.device == device:
                    return self._free.pop(i)
        return torch.empty(numel, dtype=dtype, device=device)

    def give(self, buf: torch.Tensor) -> None:
        with self._lock:
            self._free.append(buf)
            self._free.sort(key=lambda b: b.numel())
            del self._free[:-self.keep]


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
                 lease_s: float = 30.0, clock=None, recv_grace_s: float = 60.0,
                 max_chunks: int = MAX_CHUNKS, min_chunk_bytes: int = MIN_CHUNK_BYTES) -> None:
        super().__init__(kv_cache, instance_id, lease_s, clock)
        if not 1 <= max_chunks < TAG_STRIDE:
            raise ValueError(f"max_chunks must be in [1, {TAG_STRIDE - 1}], got {max_chunks}")
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
        self.max_chunks, self.min_chunk_bytes = max_chunks, min_chunk_bytes
        self.block_bytes = kv_cache[0, 0].numel() * kv_cache.element_size()
        self._tags = itertools.count(1)
        self._send_pool, self._recv_pool = _BufferPool(), _BufferPool()
        # Where the last transfer's time went (seconds), for benchmarks and logs.
        self.last_send_stats: dict[str, float] = {}
        self.last_pull_stats: dict[str, float] = {}

    def local_descriptor(self) -> dict[str, int]:
        return {"rank": self.rank}

    def _offer_extra(self, handle: KVHandle) -> dict[str, Any]:
        return {"rank": self.rank}

    def _plan(self, num_blocks: int) -> list[tuple[int, int]]:
        if num_blocks <= 0:
            return [(0, 0)]
        return chunk_plan(self.kv_cache.shape[0], num_blocks, self.block_bytes,
                          self.max_chunks, self.min_chunk_bytes)

    def _staging(self, pool: _BufferPool, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        kv = self.kv_cache
        shape = (kv.shape[0], k) + tuple(kv.shape[2:])
        flat = pool.take(kv.shape[0] * k * kv[0, 0].numel(), kv.dtype, kv.device)
        # [L * k, 2, B, H, D]: a chunk [a, b) of the flattened (layer, block) grid is buf[a:b].
        return flat, flat[: kv.shape[0] * k * kv[0, 0].numel()].view(
            (kv.shape[0] * k,) + tuple(kv.shape[2:]))

    def _rows(self, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The KV tensor as [L * N, block elems] rows and the row index of cell (l, j) at
        l * k + j (the staging buffer's flattened order)."""
        kv = self.kv_cache
        n = kv.shape[1]
        layers = torch.arange(kv.shape[0], dtype=torch.long, device=kv.device)
        return kv.view(kv.shape[0] * n, -1), (layers[:, None] * n + idx[None, :]).reshape(-1)

    # -- prefill side ------------------------------------------------------------------------
    def send_blocks(self, request_id: str, dst_rank: int, tag: int, timeout_s: float,
                    num_blocks: int | None = None) -> int:
        """Send a header (ok?, nbytes, chunks) on `tag`, then the offered blocks in layer chunks
        on tag + 1 + i, each gathered straight into the send buffer just before its isend.
        `num_blocks` is the receiver's block count (the layout's chunk plan); a refusal answers
        every posted receive (header [0, 0, n] + one element per chunk) so the gloo pair stays
        healthy. Without `num_blocks` (an old receiver) only the header is sent on refusal.
        Returns the bytes sent."""
        kv = self.kv_cache
        blocks = self.offered(request_id)
        if blocks is not None and num_blocks is not None and num_blocks != len(blocks):
            blocks = None  # the receiver expects another layout: refuse rather than misplace
        plan = self._plan(len(blocks) if blocks is not None else (num_blocks or 0))
        if blocks is None and num_blocks is None:
            plan = []
        nbytes = 0 if blocks is None else len(blocks) * kv.shape[0] * self.block_bytes
        header = torch.tensor([int(blocks is not None), nbytes, len(plan)], dtype=torch.int64,
                              device=kv.device)
        flat = None
        works = []
        try:
            works.append(dist.isend(header, dst_rank, tag=tag))
            if blocks is None:
                filler = torch.zeros(1, dtype=kv.dtype, device=kv.device)
                works.extend(dist.isend(filler, dst_rank, tag=tag + 1 + i) for i in range(len(plan)))
            else:
                self.leases.renew(request_id)  # a transfer in flight must not lose its blocks
                flat, buf = self._staging(self._send_pool, len(blocks))
                idx = torch.as_tensor(blocks, dtype=torch.long, device=kv.device)
                t0 = time.perf_counter()
                rows, fidx = self._rows(idx)
                for i, (a, b) in enumerate(plan):
                    # one row-wise index_select over the [L * N, block] view: the fastest gather
                    torch.index_select(rows, 0, fidx[a:b], out=buf[a:b].view(b - a, -1))
                    works.append(dist.isend(buf[a:b], dst_rank, tag=tag + 1 + i))
                t1 = time.perf_counter()
                for w in works:
                    w.wait(timeout=timedelta(seconds=timeout_s))
                self.last_send_stats = {"gather_s": t1 - t0, "drain_s": time.perf_counter() - t1,
                                        "chunks": len(plan)}
            if blocks is None:
                for w in works:
                    w.wait(timeout=timedelta(seconds=timeout_s))
        except Exception as e:
            flat = None  # may still be read by a half-done send: never reuse it
            raise KVTransferError(f"send of {request_id!r} to rank {dst_rank} failed: {e}") from e
        finally:
            if flat is not None:
                self._send_pool.give(flat)
        if blocks is None:
            raise KVTransferError(f"{request_id!r} is not offered here (released or lease expired)")
        return nbytes

    # -- decode side -------------------------------------------------------------------------
    def pull(self, handle: KVHandle, dst_block_ids: list[int], timeout_s: float) -> None:
        check_compatible(self.kv_cache, handle, dst_block_ids)
        src = int(handle.extra["rank"])
        deadline = time.monotonic() + timeout_s
        kv = self.kv_cache
        k = len(dst_block_ids)
        plan = self._plan(k)
        flat, buf = self._staging(self._recv_pool, k)
        header = torch.zeros(3, dtype=torch.int64, device=kv.device)
        tag = TAG_STRIDE * next(self._tags)   # header on tag, chunk i on tag + 1 + i
        what = f"recv of {handle.request_id!r} from rank {src}"
        try:
            works = [dist.irecv(header, src=src, tag=tag)]
            works += [dist.irecv(buf[a:b], src=src, tag=tag + 1 + i)
                      for i, (a, b) in enumerate(plan)]
        except Exception as e:  # dead pair, ...
            raise KVTransferError(f"{what}: could not start: {type(e).__name__}: {e}") from e
        try:
            ack = self.request_send(handle, self.rank, tag, timeout_s)
        except KVTransferError:
            raise
        except Exception as e:  # unknown actor, ...
            raise KVTransferError(f"{what}: could not start: {type(e).__name__}: {e}") from e
        # gloo's is_completed() stays False until someone waits, and a wait that times out closes
        # the pair's connection (every later transfer on it fails). So one thread waits, with
        # timeout_s + recv_grace_s, letting a late sender finish into the abandoned buffer and
        # keep the pair usable, and reports each completed receive; this thread scatters each
        # chunk as it lands, gives up at timeout_s and watches the sender's ack (fast failure
        # for a refused offer or a dead actor). Only this thread touches the KV cache.
        landed: queue.Queue = queue.Queue()
        long_wait = timedelta(seconds=timeout_s + self.recv_grace_s)

        def _wait() -> None:
            for i, w in enumerate(works):
                try:
                    w.wait(timeout=long_wait)
                except BaseException as e:  # noqa: BLE001 - handed to the caller below
                    landed.put(e)
                    return
                landed.put(i)

        threading.Thread(target=_wait, name=f"kv-recv-{tag}", daemon=True).start()
        rows, fidx = self._rows(torch.as_tensor(dst_block_ids, dtype=torch.long, device=kv.device))
        got, t_start, t_first, scatter_s = 0, time.perf_counter(), None, 0.0
        while got < len(works):
            try:
                item = landed.get(timeout=0.005)
            except queue.Empty:
                _, err = _ack_state(ack)   # ray.wait costs ~0.1 ms: every 5 ms is plenty
                if err is not None:
                    raise KVTransferError(f"{what}: sender failed: {type(err).__name__}: {err}") \
                        from err
                if time.monotonic() > deadline:
                    raise KVTransferError(f"{what} timed out after {timeout_s}s")
                continue
            if isinstance(item, BaseException):
                msg = "timed out" if "imeout" in str(item) else "failed"
                raise KVTransferError(f"{what} {msg} after {timeout_s}s: {item}") from item
            if item == 0 and int(header[0]) != 1:
                # The remaining chunk receives complete with the sender's one-element filler messages.
                raise KVTransferError(f"{what}: sender refused: not offered (released or lease "
                                      "expired)")
            if item == 0 and int(header[2]) != len(plan):
                raise KVTransferError(f"{what}: sender uses {int(header[2])} chunks, expected "
                                      f"{len(plan)} (max_chunks/min_chunk_bytes differ)")
            if item > 0:
                a, b = plan[item - 1]
                ts = time.perf_counter()
                t_first = ts if t_first is None else t_first
                rows.index_copy_(0, fidx[a:b], buf[a:b].view(b - a, -1))
                scatter_s += time.perf_counter() - ts
            got += 1
        self._recv_pool.give(flat)   # only a fully received buffer is reused
        t_end = time.perf_counter()
        self.last_pull_stats = {"first_chunk_s": (t_first or t_end) - t_start,
                                "scatter_s": scatter_s, "total_s": t_end - t_start,
                                "chunks": len(plan)}
