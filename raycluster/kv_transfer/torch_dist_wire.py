"""The message mechanics under the torch_dist connector (which keeps the offers and which pairs exist).

Owns: `BufferPool` (reusable staging buffers) and the views of the KV tensor and a staging
buffer that gathers and scatters index (`staging_view`, `kv_rows`), `Pair` (one side's record of
a pair group), `pair_group` (a 2-rank gloo / NCCL group over a store), and `wait_receives`
(waiting for one transfer's posted receives under a deadline, with the rules that keep a late
sender from writing into memory that was handed back).
Data enters as posted `Work`s and a header tensor; what leaves is phase timings or a
`KVTransferError`.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from raycluster.kv_transfer.base import KVTransferError

log = logging.getLogger(__name__)


class BufferPool:
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


def staging_view(pool: BufferPool, kv: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A pooled flat buffer for k blocks of every layer, and its [L * k, 2, B, H, D] view: a
    chunk [a, b) of the flattened (layer, block) grid is view[a:b]."""
    flat = pool.take(kv.shape[0] * k * kv[0, 0].numel(), kv.dtype, kv.device)
    return flat, flat[: kv.shape[0] * k * kv[0, 0].numel()].view((kv.shape[0] * k,) + tuple(kv.shape[2:]))


def kv_rows(kv: torch.Tensor, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The KV tensor as [L * N, block elems] rows, and the row of cell (l, j) of blocks `idx`
    at position l * k + j (the staging buffer's flattened order)."""
    n = kv.shape[1]
    layers = torch.arange(kv.shape[0], dtype=torch.long, device=kv.device)
    return kv.view(kv.shape[0] * n, -1), (layers[:, None] * n + idx[None, :]).reshape(-1)


@dataclass
class Pair:
    """One side's view of a pair group. Prefill side: `ready` is set once the group exists
    (or failed: pg stays None); sends on it are serialized by `lock`."""
    pair_id: str
    pg: Any = None
    store: Any = None            # decode side: client of the prefill's store
    last_used: float = field(default_factory=time.monotonic)
    ready: threading.Event = field(default_factory=threading.Event)
    lock: threading.Lock = field(default_factory=threading.Lock)


def pair_group(store, rank: int, host: str, timeout_s: float, cuda: bool):
    """A 2-rank process group over `store` (a PrefixStore unique to the pair): gloo on CPU,
    NCCL on CUDA. Collective: both ranks construct it concurrently."""
    t = timedelta(seconds=timeout_s)
    if cuda:  # pragma: no cover - no GPU here
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = t
        return dist.ProcessGroupNCCL(store, rank, 2, opts)
    opts = dist.ProcessGroupGloo._Options()
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
    opts._timeout = t
    opts._threads = 1
    return dist.ProcessGroupGloo(store, rank, 2, opts)


def wait_receives(works: list, *, tag: int, timeout_s: float, deadline: float,
                  recv_grace_s: float, what: str, header: torch.Tensor | None,
                  counts: tuple[int, int], on_chunk, in_place: bool = False) -> dict[str, float]:
    """Wait for posted receives `works`: the header (when given), `counts[0]` direct messages,
    then `counts[1]` staged chunks, calling on_chunk(i) as chunk i lands. Returns phase
    timings; raises KVTransferError on a refusal (header[0] != 1), a count mismatch, a failed
    peer or the deadline.

    gloo's is_completed() stays False until someone waits, and a wait that times out closes
    the pair's connection; so a daemon thread waits and reports each completed receive, while
    the calling thread applies chunks, gives up at the deadline and raises. Only the calling
    thread touches the KV cache, except gloo itself for `in_place` (direct) receives.
    Staged only: the daemon waits timeout_s + recv_grace_s, so a late sender finishes into the
    abandoned buffer. In place: a late sender must never write into blocks the engine has since
    reused, so the daemon waits only until the deadline (its timeout closes the connection) and
    this function does not return, success or failure, before the daemon has finished; a
    refusal first lets the sender's fillers land."""
    landed: queue.Queue = queue.Queue()
    long_wait = timedelta(seconds=timeout_s + recv_grace_s)

    def _wait() -> None:
        for i, w in enumerate(works):
            try:
                w.wait(timedelta(seconds=max(0.001, deadline - time.monotonic()))
                       if in_place else long_wait)
            except BaseException as e:  # noqa: BLE001 - handed to the caller below
                landed.put(e)
                return
            landed.put(i)

    waiter = threading.Thread(target=_wait, name=f"kv-recv-{tag}", daemon=True)
    waiter.start()
    off = (1 if header is not None else 0) + counts[0]
    got, t0, t_first, applied_s, t_header = 0, time.perf_counter(), None, 0.0, 0.0
    refused: KVTransferError | None = None
    try:
        while got < len(works):
            try:
                item = landed.get(timeout=max(0.0, min(0.05, deadline - time.monotonic())))
            except queue.Empty:
                if time.monotonic() >= deadline:
                    raise KVTransferError(f"{what} timed out after {timeout_s}s")
                continue
            if isinstance(item, BaseException):
                text = str(item).lower()      # gloo says "Timeout ..." or "Timed out waiting ..."
                msg = "timed out" if "timeout" in text or "timed out" in text else "failed"
                raise KVTransferError(f"{what} {msg} after {timeout_s}s: {item}") from item
            got += 1
            if header is not None and item == 0:
                t_header = time.perf_counter()
                if int(header[0]) != 1:
                    # Every other receive completes with the sender's one-element fillers.
                    refused = KVTransferError(f"{what}: sender refused: not offered "
                                              "(released or lease expired)")
                    if not in_place:
                        raise refused
                elif (int(header[2]), int(header[3])) != tuple(counts):
                    raise KVTransferError(f"{what}: sender uses {int(header[2])} direct messages "
                                          f"and {int(header[3])} chunks, expected {counts[0]} "
                                          f"and {counts[1]}")
            elif item >= off and refused is None:
                ts = time.perf_counter()
                t_first = ts if t_first is None else t_first
                on_chunk(item - off)
                applied_s += time.perf_counter() - ts
        if refused is not None:
            raise refused
    except KVTransferError:
        if in_place:
            # The daemon's own timeout is the deadline: bounded, and once it is done no
            # receive is left posted into the request's blocks.
            waiter.join(max(0.0, deadline - time.monotonic()) + 5.0)
            if waiter.is_alive():
                log.error("%s: receives into the KV cache still posted after the deadline", what)
        raise
    t_end = time.perf_counter()
    return {"first_chunk_s": (t_first or t_end) - t0, "scatter_s": applied_s,
            "header_s": (t_header - t0) if header is not None else 0.0}
