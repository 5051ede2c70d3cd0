"""torch.distributed connector: the same code moves KV over gloo (CPU) or NCCL (CUDA).

No global process group and no ranks to hand out: instances come and go (Serve replicas get new
ids on restart), so every (prefill, decode) pair gets its own 2-rank process group, created on
demand by the first pull between them and dropped on any failure.

Each connector hosts a `TCPStore` server on `host` (127.0.0.1 here) and a free port; its
descriptor {"host", "port", "nonce"} travels in every offer's handle (and in
`local_descriptor()`, i.e. `InstanceStats.connector`), so a decode instance can reach a prefill
instance it has never seen. The store is both the rendezvous and the control channel:

  decode D (rank 1 of the pair)                   prefill P (rank 0), server thread on its store
  0. first pull from P: pair id = uuid;
     queue_push("kvq", join pair) ---------------> join: build the pair's group (rank 0)
     build the pair's group (rank 1) <-- rendezvous under prefix "pair/<id>/" -->
  1. buf = [L * k, 2, B, H, D] (pooled); tag = fresh; plan = chunk_plan(L, k, block bytes)
  2. recv(header, tag); recv(buf[chunk i], tag + 1 + i) for every chunk, all posted up front
  3. queue_push("kvq", send rid tag k) ----------> a worker thread: header [offered?, nbytes,
                                                   chunks] on tag; per chunk: gather its blocks
                                                   straight into the (pooled) send buffer, send
                                                   it on tag + 1 + i; wait all (timeout)
  4. a waiter thread waits header, then chunk by chunk; the caller scatters each chunk into the
     destination blocks as soon as it lands (overlapping the next chunk's gather + transfer).

Chunks are equal ranges of the layer-major (layer, block) grid, >= ~1 MiB each and at most
MAX_CHUNKS (many small sends are 4-60x slower); chunks let the sender's gather, the wire and the
receiver's scatter run concurrently instead of in three passes one after another. A refused
offer (released, lease expired, other block count) still completes every posted receive: header
[0, 0, n] and a 1-element message per chunk (gloo completes a receive with a shorter message).
The decode side picks the tag, so a retry never matches a stale send.

Failure, all bounded by the pull's `timeout_s`: an unreachable store (dead prefill process)
fails the connect; a dead peer mid-transfer raises "connection closed" from gloo within ~40 ms;
a silent or frozen one is cut at timeout_s. The decode side makes no blocking store call on its
own thread (TCPStore client reads ignore their timeout when the server process is stopped):
the pair is built in a helper thread, requests are one-way queue_push, and the sender reports
nothing but through the pair (header) itself. Any failure drops the pair on the decode side (and tells P,
best effort), so the next pull builds a fresh one; a gloo wait that expires closes the pair's
connection anyway. After a timeout the receives stay posted for recv_grace_s more in a daemon
thread (a late sender finishes into the abandoned buffer, which is never reused). With NCCL,
tags are ignored and order is per pair, which the per-pair send lock and the drop-on-failure
rule keep.
"""

from __future__ import annotations

import itertools
import json
import logging
import queue
import socket
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from raycluster.kv_transfer.base import KVConnector, KVHandle, KVTransferError, check_compatible

log = logging.getLogger(__name__)

TAG_STRIDE = 64          # tags [tag, tag + TAG_STRIDE) belong to one transfer
MAX_CHUNKS = 8           # header + chunks must fit in one tag stride
MIN_CHUNK_BYTES = 1 << 20
QUEUE = "kvq"            # the prefill side's request queue in its store
SERVER_BLOCK_S = 86400.0  # the server thread blocks on the queue; close() wakes it with "stop"


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


class _Refused(KVTransferError):
    """The sender answered a pull with "not offered"; the pair is fine."""


@dataclass
class _Pair:
    """One side's view of a pair group. Prefill side: `ready` is set once the group exists
    (or failed: pg stays None); sends on it are serialized by `lock`."""
    pair_id: str
    pg: Any = None
    store: Any = None            # decode side: client of the prefill's store
    last_used: float = field(default_factory=time.monotonic)
    ready: threading.Event = field(default_factory=threading.Event)
    lock: threading.Lock = field(default_factory=threading.Lock)


class TorchDistConnector(KVConnector):
    name = "torch_dist"

    def __init__(self, kv_cache: torch.Tensor, instance_id: str, host: str = "127.0.0.1",
                 lease_s: float = 30.0, clock=None, recv_grace_s: float = 60.0,
                 max_chunks: int = MAX_CHUNKS, min_chunk_bytes: int = MIN_CHUNK_BYTES,
                 send_workers: int = 4, store_timeout_s: float = 30.0,
                 connect_timeout_s: float = 3.0, pair_idle_s: float = 600.0) -> None:
        super().__init__(kv_cache, instance_id, lease_s, clock)
        if not 1 <= max_chunks < TAG_STRIDE:
            raise ValueError(f"max_chunks must be in [1, {TAG_STRIDE - 1}], got {max_chunks}")
        self.host = host
        self.connect_timeout_s = connect_timeout_s
        self.pair_idle_s = pair_idle_s   # a pair unused this long is dropped (both sides)
        self.recv_grace_s = recv_grace_s
        self.max_chunks, self.min_chunk_bytes = max_chunks, min_chunk_bytes
        self.block_bytes = kv_cache[0, 0].numel() * kv_cache.element_size()
        self.cuda = kv_cache.is_cuda
        self._tags = itertools.count(1)
        self._send_pool, self._recv_pool = _BufferPool(), _BufferPool()
        self._lock = threading.Lock()
        self._sending: dict[str, int] = {}      # request id -> sends in flight (lease guard)
        # prefill side: our store (server) and the pairs decode instances opened with us
        # Bind the listening socket ourselves: TCPStore would listen on every interface.
        sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
        sock.bind((host, 0))
        sock.listen(128)
        port = sock.getsockname()[1]
        self._store = dist.TCPStore(host, port, is_master=True, wait_for_workers=False,
                                    timeout=timedelta(seconds=store_timeout_s),
                                    master_listen_fd=sock.detach())
        self.nonce = uuid.uuid4().hex[:12]
        self._descriptor = {"host": host, "port": int(self._store.port), "nonce": self.nonce}
        self._served: dict[str, _Pair] = {}
        self._tls = threading.local()
        self._pool = ThreadPoolExecutor(send_workers, thread_name_prefix=f"kv-send-{instance_id}")
        self._closed = False
        self._server = threading.Thread(target=self._serve, name=f"kv-server-{instance_id}",
                                        daemon=True)
        self._server.start()
        # decode side: pairs we opened, by the prefill's (host, port, nonce)
        self._peers: dict[tuple, _Pair] = {}
        self._gone: dict[tuple, float] = {}     # incarnations whose store refused a connect
        # Where the last transfer's time went (seconds), for benchmarks and logs.
        self.last_send_stats: dict[str, float] = {}
        self.last_pull_stats: dict[str, float] = {}

    def local_descriptor(self) -> dict[str, Any]:
        return dict(self._descriptor)

    def _offer_extra(self, handle: KVHandle) -> dict[str, Any]:
        return dict(self._descriptor)

    def _plan(self, num_blocks: int, max_chunks: int | None = None,
              min_chunk_bytes: int | None = None) -> list[tuple[int, int]]:
        if num_blocks <= 0:
            return [(0, 0)]
        return chunk_plan(self.kv_cache.shape[0], num_blocks, self.block_bytes,
                          max_chunks or self.max_chunks, min_chunk_bytes or self.min_chunk_bytes)

    def _staging(self, pool: _BufferPool, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        kv = self.kv_cache
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

    # -- prefill side: the server ------------------------------------------------------------
    def _client(self):
        """This thread's own connection to our store (a store object is not shared across
        threads)."""
        c = getattr(self._tls, "store", None)
        if c is None:
            c = self._tls.store = self._store.clone()
        return c

    def _serve(self) -> None:
        store = self._store.clone()
        store.set_timeout(timedelta(seconds=SERVER_BLOCK_S))
        while not self._closed:
            try:
                msg = json.loads(store.queue_pop(QUEUE, True))
            except Exception as e:  # store gone (closing), timeout after a day: keep going
                if self._closed:
                    return
                log.warning("%s: kv server: %s", self.instance_id, e)
                time.sleep(0.1)
                continue
            if msg.get("op") == "stop":
                return
            try:
                self._handle(msg)
            except Exception:   # never let one bad message stop the server
                log.exception("%s: kv server: message %r", self.instance_id, msg)

    def _handle(self, msg: dict) -> None:
        op, pid, now = msg.get("op"), str(msg.get("pair", "")), time.monotonic()
        # list(): a C-level copy, safe while send workers pop failed pairs concurrently
        for old in [k for k, p in list(self._served.items())
                    if now - p.last_used > self.pair_idle_s and k != pid and not p.lock.locked()]:
            self._served.pop(old, None)      # e.g. a decode instance that went away
        pair = self._served.get(pid)
        if pair is not None:
            pair.last_used = now
        if op == "join":
            pair = self._served[pid] = _Pair(pid)
            self._pool.submit(self._join, pair, float(msg.get("timeout", 30.0)))
        elif op == "close":
            self._served.pop(pid, None)
        elif op in ("send", "raw"):
            self._pool.submit(self._send_job, msg)
        else:
            log.warning("%s: kv server: unknown message %r", self.instance_id, msg)

    def _join(self, pair: _Pair, timeout_s: float) -> None:
        try:
            prefix = dist.PrefixStore(f"pair/{pair.pair_id}/", self._client())
            pair.pg = pair_group(prefix, 0, self.host, timeout_s, self.cuda)
        except Exception as e:
            log.warning("%s: pair %s not built: %s", self.instance_id, pair.pair_id, e)
            self._served.pop(pair.pair_id, None)
        finally:
            pair.ready.set()

    def _send_job(self, msg: dict) -> None:
        pid, tag, timeout_s = str(msg["pair"]), int(msg["tag"]), float(msg["timeout"])
        pair = self._served.get(pid)
        try:
            if pair is None or not pair.ready.wait(timeout_s) or pair.pg is None:
                raise KVTransferError(f"no pair {pid} here (sender restarted or pair failed)")
            with pair.lock:
                if msg["op"] == "raw":
                    self._send_raw(pair.pg, int(msg["nbytes"]), tag, timeout_s)
                else:
                    self.send_blocks(pair.pg, str(msg["rid"]), tag, timeout_s, int(msg["k"]),
                                     msg.get("chunking"))
        except _Refused:
            return       # every posted receive was answered: the pair stays healthy
        except Exception as e:
            # The receiver's receives fail (closed pair) or time out; this pair is done.
            log.warning("%s: kv send on pair %s failed: %s", self.instance_id, pid, e)
            self._served.pop(pid, None)

    def send_blocks(self, pg, request_id: str, tag: int, timeout_s: float, num_blocks: int,
                    chunking: tuple[int, int] | None = None) -> int:
        """Send a header (ok?, nbytes, chunks) on `tag`, then the offered blocks in layer chunks
        on tag + 1 + i, each gathered straight into the send buffer just before its send.
        `num_blocks` is the receiver's block count and `chunking` its (max_chunks,
        min_chunk_bytes): together they give the receiver's chunk plan; a refusal answers
        every posted receive (header [0, 0, n] + one element per chunk) so the pair stays
        healthy. Returns the bytes sent."""
        kv = self.kv_cache
        with self._lock:
            blocks = self.offered(request_id)
            if blocks is not None and num_blocks != len(blocks):
                blocks = None  # the receiver expects another layout: refuse rather than misplace
            if blocks is not None:
                self._sending[request_id] = self._sending.get(request_id, 0) + 1
                self.leases.renew(request_id)  # a transfer in flight must not lose its blocks
        plan = self._plan(len(blocks) if blocks is not None else num_blocks, *(chunking or ()))
        nbytes = 0 if blocks is None else len(blocks) * kv.shape[0] * self.block_bytes
        header = torch.tensor([int(blocks is not None), nbytes, len(plan)], dtype=torch.int64,
                              device=kv.device)
        flat = None
        works = []
        t = timedelta(seconds=timeout_s)
        try:
            works.append(pg.send([header], 1, tag))
            if blocks is None:
                filler = torch.zeros(1, dtype=kv.dtype, device=kv.device)
                works.extend(pg.send([filler], 1, tag + 1 + i) for i in range(len(plan)))
            else:
                flat, buf = self._staging(self._send_pool, len(blocks))
                idx = torch.as_tensor(blocks, dtype=torch.long, device=kv.device)
                t0 = time.perf_counter()
                rows, fidx = self._rows(idx)
                for i, (a, b) in enumerate(plan):
                    # one row-wise index_select over the [L * N, block] view: the fastest gather
                    torch.index_select(rows, 0, fidx[a:b], out=buf[a:b].view(b - a, -1))
                    works.append(pg.send([buf[a:b]], 1, tag + 1 + i))
                t1 = time.perf_counter()
            for w in works:
                w.wait(t)
            if blocks is not None:
                self.last_send_stats = {"gather_s": t1 - t0, "drain_s": time.perf_counter() - t1,
                                        "chunks": len(plan)}
        except Exception as e:
            flat = None  # may still be read by a half-done send: never reuse it
            raise KVTransferError(f"send of {request_id!r} on tag {tag} failed: {e}") from e
        finally:
            if flat is not None:
                self._send_pool.give(flat)
            if blocks is not None:
                with self._lock:
                    n = self._sending.pop(request_id, 1) - 1
                    if n > 0:
                        self._sending[request_id] = n
        if blocks is None:
            raise _Refused(f"{request_id!r} is not offered here (released or lease expired)")
        return nbytes

    def _send_raw(self, pg, nbytes: int, tag: int, timeout_s: float) -> None:
        """Benchmark baseline: the first nbytes of the KV tensor as one message."""
        buf = self.kv_cache.view(-1)[: nbytes // self.kv_cache.element_size()]
        pg.send([buf], 1, tag).wait(timedelta(seconds=timeout_s))

    def expire(self, now: float | None = None) -> list[str]:
        with self._lock:
            for rid in self._sending:       # being sent right now: not expired yet
                self.leases.renew(rid, now)
            return super().expire(now)

    # -- decode side -------------------------------------------------------------------------
    def _peer(self, x: dict, deadline: float) -> _Pair:
        """The pair with the prefill instance `x` describes, built on first use. TCPStore
        client calls to a frozen (SIGSTOPped, swapping) peer ignore their timeouts, so the
        building runs in a helper thread and this one gives up at the deadline."""
        key = (x["host"], int(x["port"]), x["nonce"])
        now = time.monotonic()
        with self._lock:
            pair = self._peers.get(key)
            idle = [k for k, p in self._peers.items()
                    if k != key and now - p.last_used > self.pair_idle_s]
        for k in idle:   # e.g. a prefill instance that went away: nobody names it any more
            self._drop_peer({"host": k[0], "port": k[1], "nonce": k[2]})
        if pair is not None and now - pair.last_used > self.pair_idle_s / 2:
            self._drop_peer(x)   # the prefill side may have swept it: build a fresh one
            pair = None
        if pair is not None:
            pair.last_used = now
            return pair
        where = f"{x['host']}:{x['port']}"
        if key in self._gone:
            raise KVTransferError(f"no pair with {where}: that instance is gone")
        # A plain connect first: a dead prefill process refuses at once, while the TCPStore
        # client would retry until its timeout (and log a stack trace per try).
        try:
            socket.create_connection((x["host"], int(x["port"])),
                                     timeout=max(0.05, min(1.0, deadline - now))).close()
        except ConnectionRefusedError as e:
            self._gone[key] = now
            while len(self._gone) > 256:
                self._gone.pop(next(iter(self._gone)))
            raise KVTransferError(f"no pair with {where}: connection refused (instance gone)") \
                from e
        except OSError as e:
            raise KVTransferError(f"no pair with {where}: {type(e).__name__}: {e}") from e
        box: dict[str, Any] = {}

        def build() -> None:
            try:
                box["pair"] = self._build_pair(x, deadline)
            except BaseException as e:  # noqa: BLE001 - handed to the caller below
                box["err"] = e

        th = threading.Thread(target=build, name="kv-pair-build", daemon=True)
        th.start()
        th.join(max(0.0, deadline - time.monotonic()))
        if th.is_alive():
            raise KVTransferError(f"no pair with {where}: timed out")
        if "err" in box:
            e = box["err"]
            raise KVTransferError(f"no pair with {where}: {type(e).__name__}: {e}") from e
        pair = box["pair"]
        with self._lock:
            self._peers[key] = pair
        return pair

    def _build_pair(self, x: dict, deadline: float) -> _Pair:
        left = max(0.05, deadline - time.monotonic())
        # The connect retries until its timeout: a dead prefill process refuses at once, so
        # do not spend the whole budget on it.
        store = dist.TCPStore(x["host"], int(x["port"]), is_master=False,
                              timeout=timedelta(seconds=min(left, self.connect_timeout_s)))
        store.set_timeout(timedelta(seconds=max(0.05, deadline - time.monotonic())))
        pair = _Pair(uuid.uuid4().hex[:16], store=store)
        store.queue_push(QUEUE, json.dumps({"op": "join", "pair": pair.pair_id, "timeout": left}))
        prefix = dist.PrefixStore(f"pair/{pair.pair_id}/", store)
        pair.pg = pair_group(prefix, 1, self.host, max(0.05, deadline - time.monotonic()),
                             self.cuda)
        return pair

    def _drop_peer(self, x: dict) -> threading.Thread | None:
        key = (x["host"], int(x["port"]), x["nonce"])
        with self._lock:
            pair = self._peers.pop(key, None)
        if pair is not None:
            def tell() -> None:   # off this thread: a stopped peer must not stall the caller
                try:
                    pair.store.set_timeout(timedelta(seconds=5))
                    pair.store.queue_push(QUEUE, json.dumps({"op": "close", "pair": pair.pair_id}))
                except Exception:   # the prefill side is gone: nothing to tell
                    pass
            th = threading.Thread(target=tell, name="kv-pair-close", daemon=True)
            th.start()
            return th
        return None

    def pull(self, handle: KVHandle, dst_block_ids: list[int], timeout_s: float) -> None:
        check_compatible(self.kv_cache, handle, dst_block_ids)
        x = handle.extra
        deadline = time.monotonic() + timeout_s
        try:
            self._pull(handle, dst_block_ids, timeout_s, deadline)
        except KVTransferError as e:
            if "not offered" not in str(e):      # a refusal leaves the pair healthy
                self._drop_peer(x)
            raise

    def _pull(self, handle: KVHandle, dst_block_ids: list[int], timeout_s: float,
              deadline: float) -> None:
        t_start = time.perf_counter()
        x = handle.extra
        pair = self._peer(x, deadline)
        t_pair = time.perf_counter()
        kv = self.kv_cache
        k = len(dst_block_ids)
        plan = self._plan(k)
        flat, buf = self._staging(self._recv_pool, k)
        header = torch.zeros(3, dtype=torch.int64, device=kv.device)
        tag = TAG_STRIDE * next(self._tags)   # header on tag, chunk i on tag + 1 + i
        what = f"recv of {handle.request_id!r} from {x['host']}:{x['port']}"
        try:
            # Request first, then post the receives: a gloo send waits for the receiver's
            # "ready" notice of its slot, so order does not matter, and posting (~0.1-0.3 ms per
            # receive here) overlaps the sender's dispatch and first gather instead of preceding it.
            pair.store.queue_push(QUEUE, json.dumps(
                {"op": "send", "pair": pair.pair_id, "rid": handle.request_id, "tag": tag,
                 "k": k, "chunking": [self.max_chunks, self.min_chunk_bytes],
                 "timeout": max(0.05, deadline - time.monotonic())}))
            works = [pair.pg.recv([header], 0, tag)]
            works += [pair.pg.recv([buf[a:b]], 0, tag + 1 + i) for i, (a, b) in enumerate(plan)]
        except Exception as e:  # dead pair, dead store, ...
            raise KVTransferError(f"{what}: could not start: {type(e).__name__}: {e}") from e
        t_posted = time.perf_counter()
        self._wait_chunks(pair, works, tag, timeout_s, deadline, what, header, plan,
                          on_chunk=self._scatter_fn(dst_block_ids, buf))
        self._recv_pool.give(flat)   # only a fully received buffer is reused
        t_end = time.perf_counter()
        self.last_pull_stats = {**self._wait_stats, "pair_s": t_pair - t_start,
                                "post_s": t_posted - t_pair,
                                "total_s": t_end - t_start, "chunks": len(plan)}

    def _scatter_fn(self, dst_block_ids: list[int], buf: torch.Tensor):
        kv = self.kv_cache
        rows, fidx = self._rows(torch.as_tensor(dst_block_ids, dtype=torch.long, device=kv.device))

        def scatter(a: int, b: int) -> None:
            rows.index_copy_(0, fidx[a:b], buf[a:b].view(b - a, -1))
        return scatter

    def _wait_chunks(self, pair: _Pair, works: list, tag: int, timeout_s: float, deadline: float,
                     what: str, header: torch.Tensor | None, plan: list, on_chunk) -> None:
        """Wait for `works` (header first when `header` is given, then one per plan chunk),
        calling on_chunk(a, b) as each chunk lands. gloo's is_completed() stays False until
        someone waits, and a wait that times out closes the pair's connection; so one daemon
        thread waits with timeout_s + recv_grace_s (a late sender finishes into the abandoned
        buffer) and reports each completed receive, while this thread applies chunks, gives up
        at timeout_s and polls the sender's failure key. Only this thread touches the KV cache."""
        landed: queue.Queue = queue.Queue()
        long_wait = timedelta(seconds=timeout_s + self.recv_grace_s)

        def _wait() -> None:
            for i, w in enumerate(works):
                try:
                    w.wait(long_wait)
                except BaseException as e:  # noqa: BLE001 - handed to the caller below
                    landed.put(e)
                    return
                landed.put(i)

        threading.Thread(target=_wait, name=f"kv-recv-{tag}", daemon=True).start()
        off = 1 if header is not None else 0
        got, t0, t_first, applied_s, t_header = 0, time.perf_counter(), None, 0.0, 0.0
        while got < len(works):
            try:
                item = landed.get(timeout=max(0.0, min(0.05, deadline - time.monotonic())))
            except queue.Empty:
                if time.monotonic() >= deadline:
                    raise KVTransferError(f"{what} timed out after {timeout_s}s")
                continue
            if isinstance(item, BaseException):
                msg = "timed out" if "imeout" in str(item) else "failed"
                raise KVTransferError(f"{what} {msg} after {timeout_s}s: {item}") from item
            if header is not None and item == 0:
                t_header = time.perf_counter()
                if int(header[0]) != 1:
                    # The chunk receives complete with the sender's one-element fillers.
                    raise KVTransferError(f"{what}: sender refused: not offered (released or "
                                          "lease expired)")
                if int(header[2]) != len(plan):
                    raise KVTransferError(f"{what}: sender uses {int(header[2])} chunks, expected "
                                          f"{len(plan)}")
            elif item >= off:
                a, b = plan[item - off]
                ts = time.perf_counter()
                t_first = ts if t_first is None else t_first
                on_chunk(a, b)
                applied_s += time.perf_counter() - ts
            got += 1
        t_end = time.perf_counter()
        self._wait_stats = {"first_chunk_s": (t_first or t_end) - t0, "scatter_s": applied_s,
                            "header_s": (t_header - t0) if header is not None else 0.0}

    def raw_pull(self, descriptor: dict, nbytes: int, timeout_s: float) -> float:
        """Benchmark baseline: the same control path as pull (pair, receive posted, request
        through the prefill's store queue) moving the prefill's first nbytes as one message into
        a reused buffer, with no gather, no scatter and no chunking. Returns seconds."""
        t0 = time.perf_counter()
        deadline = time.monotonic() + timeout_s
        pair = self._peer(descriptor, deadline)
        numel = nbytes // self.kv_cache.element_size()
        buf = self._recv_pool.take(numel, self.kv_cache.dtype, self.kv_cache.device)
        tag = TAG_STRIDE * next(self._tags)
        pair.store.queue_push(QUEUE, json.dumps({"op": "raw", "pair": pair.pair_id, "tag": tag,
                                                 "nbytes": nbytes, "timeout": timeout_s}))
        works = [pair.pg.recv([buf[:numel]], 0, tag)]
        self._wait_chunks(pair, works, tag, timeout_s, deadline, "raw recv", None, [(0, 0)],
                          on_chunk=lambda a, b: None)
        dt = time.perf_counter() - t0
        self._recv_pool.give(buf)
        return dt

    def close(self) -> None:
        super().close()
        tells = [self._drop_peer({"host": key[0], "port": key[1], "nonce": key[2]})
                 for key in list(self._peers)]
        for th in tells:
            if th is not None:
                th.join(2.0)
        if not self._closed:
            self._closed = True
            try:
                self._client().queue_push(QUEUE, json.dumps({"op": "stop"}))
            except Exception:
                pass
            self._server.join(2.0)
            self._pool.shutdown(wait=False, cancel_futures=True)
