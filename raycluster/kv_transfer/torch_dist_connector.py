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
  1. plan = plan_transfer(src ids after skip_blocks, dst ids): runs consecutive on both sides and >= ~1 MiB per
     layer go direct (one message per layer, in place); the rest is staged through a pooled
     buffer [L * k', 2, B, H, D] in chunks (`transfer_plan.py`); tag = fresh
  2. queue_push("kvq", send rid tag k crc skip plan) -> a worker thread checks the plan names the
     recv(header, tag); recv(kv[l, run], ...) for     offer it holds (count + checksum), sends
     each direct message; recv(buf[chunk i], ...);    header [offered?, nbytes, direct, chunks],
     all posted up front                              then each direct run straight from its
                                                      KV tensor, then per chunk: gather its
                                                      blocks into the send buffer and send it
  3. a waiter thread waits header, then message by message; the caller scatters each staged
     chunk into the destination blocks as soon as it lands (overlapping the next chunk's
     gather + transfer). Tags: header on tag, direct message j on tag + 1 + j, chunk i after.

Chunks are equal ranges of the staged (layer, block) grid, >= ~1 MiB each and at most
MAX_CHUNKS (many small sends are 4-60x slower); chunks let the sender's gather, the wire and the
receiver's scatter run concurrently instead of in three passes one after another. A refused
offer (released, lease expired, other blocks) still completes every posted receive: header
[0, 0, ...] and a 1-element message each (gloo completes a receive with a shorter message).
The decode side picks the tag, so a retry never matches a stale send.

Failure, all bounded by the pull's `timeout_s`: an unreachable store (dead prefill process)
fails the connect; a dead peer mid-transfer raises "connection closed" from gloo within ~40 ms;
a silent or frozen one is cut at timeout_s. The decode side makes no blocking store call on its
own thread (TCPStore client reads ignore their timeout when the server process is stopped):
the pair is built in a helper thread, requests are one-way queue_push, and the sender reports
nothing but through the pair (header) itself. Any failure drops the pair on the decode side (and
tells P, best effort), so the next pull builds a fresh one; an expired gloo wait closes it anyway. After a timeout, staged receives stay posted for recv_grace_s more in a daemon
thread (a late sender finishes into the abandoned buffer, which is never reused); a transfer
with in-place receives does not return before its receives completed or the connection closed
(`torch_dist_wire.wait_receives`), so nothing lands in blocks the engine reused. With NCCL,
tags are ignored and order is per pair, which the per-pair send lock and the drop-on-failure
rule keep.
"""

from __future__ import annotations

import itertools
import json
import logging
import socket
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from kernels.rowcopy import index_copy
from raycluster.kv_transfer.base import KVConnector, KVHandle, KVTransferError, check_compatible
from raycluster.kv_transfer.torch_dist_wire import (BufferPool, Pair, kv_rows, pair_group, staging_view,
                                                    wait_receives)
from raycluster.kv_transfer.transfer_plan import (MAX_CHUNKS, MAX_DIRECT_MSGS, MIN_CHUNK_BYTES,
                                                  MIN_DIRECT_BYTES, TransferPlan, ids_checksum,
                                                  plan_transfer)

log = logging.getLogger(__name__)

TAG_STRIDE = 512         # tags [tag, tag + TAG_STRIDE) belong to one transfer
MAX_TAG_SLOTS = (1 << 30) // TAG_STRIDE    # tags stay well inside gloo's 32 bits
QUEUE = "kvq"            # the prefill side's request queue in its store
SERVER_BLOCK_S = 86400.0  # the server thread blocks on the queue; close() wakes it with "stop"


class _Refused(KVTransferError):
    """The sender answered a pull with "not offered"; the pair is fine."""


class TorchDistConnector(KVConnector):
    name = "torch_dist"

    def __init__(self, kv_cache: torch.Tensor, instance_id: str, host: str = "127.0.0.1",
                 lease_s: float = 30.0, clock=None, recv_grace_s: float = 60.0,
                 max_chunks: int = MAX_CHUNKS, min_chunk_bytes: int = MIN_CHUNK_BYTES,
                 min_direct_bytes: int = MIN_DIRECT_BYTES, max_direct_msgs: int = MAX_DIRECT_MSGS,
                 send_workers: int = 4, store_timeout_s: float = 30.0,
                 connect_timeout_s: float = 3.0, pair_idle_s: float = 600.0) -> None:
        super().__init__(kv_cache, instance_id, lease_s, clock)
        if max_chunks < 1 or max_direct_msgs < 0 or 1 + max_chunks + max_direct_msgs > TAG_STRIDE:
            raise ValueError(f"need max_chunks >= 1, max_direct_msgs >= 0 and 1 + max_chunks + "
                             f"max_direct_msgs <= {TAG_STRIDE}, got {max_chunks}, {max_direct_msgs}")
        self.host = host
        self.connect_timeout_s = connect_timeout_s
        self.pair_idle_s = pair_idle_s   # a pair unused this long is dropped (both sides)
        self.recv_grace_s = recv_grace_s
        self.max_chunks, self.min_chunk_bytes = max_chunks, min_chunk_bytes
        # Bytes received in place land in the KV cache from gloo's thread; CUDA (NCCL) keeps
        # staging: a device copy is cheap there and a pending NCCL receive cannot be cut.
        self.min_direct_bytes = min_direct_bytes
        self.max_direct_msgs = 0 if kv_cache.is_cuda else max_direct_msgs
        self.block_bytes = kv_cache[0, 0].numel() * kv_cache.element_size()
        self.cuda = kv_cache.is_cuda
        self._tags = itertools.count(1)
        self._send_pool, self._recv_pool = BufferPool(), BufferPool()
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
        self._served: dict[str, Pair] = {}
        self._tls = threading.local()
        self._pool = ThreadPoolExecutor(send_workers, thread_name_prefix=f"kv-send-{instance_id}")
        self._closed = False
        self._server = threading.Thread(target=self._serve, name=f"kv-server-{instance_id}",
                                        daemon=True)
        self._server.start()
        # decode side: pairs we opened, by the prefill's (host, port, nonce)
        self._peers: dict[tuple, Pair] = {}
        self._gone: dict[tuple, float] = {}     # incarnations whose store refused a connect
        # Where the last transfer's time went (seconds), for benchmarks and logs.
        self.last_send_stats: dict[str, float] = {}
        self.last_pull_stats: dict[str, float] = {}

    def local_descriptor(self) -> dict[str, Any]:
        return dict(self._descriptor)

    def _offer_extra(self, handle: KVHandle) -> dict[str, Any]:
        return dict(self._descriptor)

    def plan_for(self, src_ids: list[int], dst_ids: list[int]) -> TransferPlan:
        return plan_transfer(src_ids, dst_ids, self.kv_cache.shape[0], self.block_bytes,
                             min_direct_bytes=self.min_direct_bytes,
                             max_direct_msgs=self.max_direct_msgs, max_chunks=self.max_chunks,
                             min_chunk_bytes=self.min_chunk_bytes)

    def _next_tag(self) -> int:
        return TAG_STRIDE * (next(self._tags) % MAX_TAG_SLOTS + 1)

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
            pair = self._served[pid] = Pair(pid)
            self._pool.submit(self._join, pair, float(msg.get("timeout", 30.0)))
        elif op == "close":
            self._served.pop(pid, None)
        elif op in ("send", "raw"):
            self._pool.submit(self._send_job, msg)
        else:
            log.warning("%s: kv server: unknown message %r", self.instance_id, msg)

    def _join(self, pair: Pair, timeout_s: float) -> None:
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
                                     int(msg["crc"]), TransferPlan.from_wire(msg["plan"]),
                                     int(msg.get("skip", 0)))
        except _Refused:
            return       # every posted receive was answered: the pair stays healthy
        except Exception as e:
            # The receiver's receives fail (closed pair) or time out; this pair is done.
            log.warning("%s: kv send on pair %s failed: %s", self.instance_id, pid, e)
            self._served.pop(pid, None)

    def send_blocks(self, pg, request_id: str, tag: int, timeout_s: float, num_blocks: int,
                    crc: int, plan: TransferPlan, skip: int = 0) -> int:
        """Send a header (ok?, nbytes, direct messages, chunks) on `tag`, then the receiver's
        `plan`: direct run j of layer l straight from the KV tensor on tag + 1 + j (layer-major),
        then staged chunk i, gathered into the send buffer just before its send, on
        tag + 1 + plan.num_direct_msgs + i. The plan is used only if it names the offer held
        here (block count and checksum) and moves as many blocks as it holds after the first
        `skip` (those the receiver has cached); otherwise every posted receive is answered (header
        [0, 0, ...] + one element per message) so the pair stays healthy. Returns the bytes
        sent."""
        kv = self.kv_cache
        with self._lock:
            blocks = self.offered(request_id)
            moved = len(plan.gather_src) + sum(n for _, _, n in plan.direct)
            if blocks is not None and (num_blocks != len(blocks) or crc != ids_checksum(blocks)
                                       or not 0 <= skip <= len(blocks) or moved != len(blocks) - skip):
                blocks = None  # the receiver expects another layout: refuse rather than misplace
            if blocks is not None:
                blocks = blocks[skip:]
                self._sending[request_id] = self._sending.get(request_id, 0) + 1
                self.leases.renew(request_id)  # a transfer in flight must not lose its blocks
        nbytes = 0 if blocks is None else len(blocks) * kv.shape[0] * self.block_bytes
        header = torch.tensor([int(blocks is not None), nbytes, plan.num_direct_msgs,
                               len(plan.chunks)], dtype=torch.int64, device=kv.device)
        flat = None
        works = []
        t = timedelta(seconds=timeout_s)
        try:
            works.append(pg.send([header], 1, tag))
            if blocks is None:
                filler = torch.zeros(1, dtype=kv.dtype, device=kv.device)
                works.extend(pg.send([filler], 1, tag + 1 + i) for i in range(plan.num_msgs))
            else:
                t0 = time.perf_counter()
                # Direct runs first: no CPU work here, so the wire starts at once; the blocks
                # stay allocated until every send is waited for (`_sending` holds the lease).
                for j, (l, s0, _, n) in enumerate(plan.direct_msgs()):
                    works.append(pg.send([kv[l, s0:s0 + n]], 1, tag + 1 + j))
                off = 1 + plan.num_direct_msgs
                if plan.chunks:
                    flat, buf = staging_view(self._send_pool, kv, len(plan.gather_src))
                    rows, fidx = kv_rows(kv, torch.as_tensor(plan.gather_src, dtype=torch.long, device=kv.device))
                    for i, (a, b) in enumerate(plan.chunks):
                        # one row-wise index_select over the [L * N, block] view: the fastest gather
                        torch.index_select(rows, 0, fidx[a:b], out=buf[a:b].view(b - a, -1))
                        works.append(pg.send([buf[a:b]], 1, tag + off + i))
                t1 = time.perf_counter()
            for w in works:
                w.wait(t)
            if blocks is not None:
                self.last_send_stats = {"gather_s": t1 - t0, "drain_s": time.perf_counter() - t1,
                                        "chunks": len(plan.chunks),
                                        "direct_msgs": plan.num_direct_msgs}
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
    def _peer(self, x: dict, deadline: float) -> Pair:
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

    def _build_pair(self, x: dict, deadline: float) -> Pair:
        left = max(0.05, deadline - time.monotonic())
        # The connect retries until its timeout: a dead prefill process refuses at once, so
        # do not spend the whole budget on it.
        store = dist.TCPStore(x["host"], int(x["port"]), is_master=False,
                              timeout=timedelta(seconds=min(left, self.connect_timeout_s)))
        store.set_timeout(timedelta(seconds=max(0.05, deadline - time.monotonic())))
        pair = Pair(uuid.uuid4().hex[:16], store=store)
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
        plan = self.plan_for(handle.pull_block_ids, dst_block_ids)
        flat = buf = None
        if plan.chunks:
            flat, buf = staging_view(self._recv_pool, self.kv_cache, len(plan.gather_dst))
        header = torch.zeros(4, dtype=torch.int64, device=kv.device)
        tag = self._next_tag()   # header on tag, then direct messages, then staged chunks
        what = f"recv of {handle.request_id!r} from {x['host']}:{x['port']}"
        works = []
        try:
            # Request first, then post the receives: a gloo send waits for the receiver's
            # "ready" notice of its slot, so order does not matter, and posting (~0.1-0.3 ms per
            # receive here) overlaps the sender's dispatch and first gather instead of preceding it.
            pair.store.queue_push(QUEUE, json.dumps(
                {"op": "send", "pair": pair.pair_id, "rid": handle.request_id, "tag": tag,
                 "k": len(handle.src_block_ids), "crc": ids_checksum(handle.src_block_ids),
                 "skip": handle.skip_blocks,
                 "plan": plan.to_wire(), "timeout": max(0.05, deadline - time.monotonic())}))
            works.append(pair.pg.recv([header], 0, tag))
            works += [pair.pg.recv([kv[l, d:d + n]], 0, tag + 1 + j)
                      for j, (l, _, d, n) in enumerate(plan.direct_msgs())]
            off = 1 + plan.num_direct_msgs
            works += [pair.pg.recv([buf[a:b]], 0, tag + off + i) for i, (a, b) in enumerate(plan.chunks)]
        except Exception as e:  # dead pair, dead store, ...
            if plan.direct and works:
                self._drop_peer(x)   # receives into the KV cache are posted: close the pair now
            raise KVTransferError(f"{what}: could not start: {type(e).__name__}: {e}") from e
        t_posted = time.perf_counter()
        wait_stats = wait_receives(
            works, tag=tag, timeout_s=timeout_s, deadline=deadline, recv_grace_s=self.recv_grace_s,
            what=what, header=header, counts=(plan.num_direct_msgs, len(plan.chunks)),
            on_chunk=self._scatter_fn(list(plan.gather_dst), buf, plan.chunks),
            in_place=bool(plan.direct))
        if flat is not None:
            self._recv_pool.give(flat)   # only a fully received buffer is reused
        t_end = time.perf_counter()
        self.last_pull_stats = {**wait_stats, "pair_s": t_pair - t_start,
                                "post_s": t_posted - t_pair, "total_s": t_end - t_start,
                                "chunks": len(plan.chunks), "direct_msgs": plan.num_direct_msgs,
                                "staged_blocks": len(plan.gather_dst)}

    def _scatter_fn(self, dst_block_ids: list[int], buf: torch.Tensor | None,
                    chunks: tuple[tuple[int, int], ...]):
        if not chunks:
            return lambda i: None
        kv = self.kv_cache
        rows, fidx = kv_rows(kv, torch.as_tensor(dst_block_ids, dtype=torch.long, device=kv.device))

        def scatter(i: int) -> None:
            a, b = chunks[i]
            index_copy(rows, 0, fidx[a:b], buf[a:b].view(b - a, -1))
        return scatter

    def raw_pull(self, descriptor: dict, nbytes: int, timeout_s: float) -> float:
        """Benchmark baseline: the same control path as pull (pair, receive posted, request
        through the prefill's store queue) moving the prefill's first nbytes as one message into
        a reused buffer, with no gather, no scatter and no chunking. Returns seconds."""
        t0 = time.perf_counter()
        deadline = time.monotonic() + timeout_s
        pair = self._peer(descriptor, deadline)
        numel = nbytes // self.kv_cache.element_size()
        buf = self._recv_pool.take(numel, self.kv_cache.dtype, self.kv_cache.device)
        tag = self._next_tag()
        pair.store.queue_push(QUEUE, json.dumps({"op": "raw", "pair": pair.pair_id, "tag": tag,
                                                 "nbytes": nbytes, "timeout": timeout_s}))
        works = [pair.pg.recv([buf[:numel]], 0, tag)]
        wait_receives(works, tag=tag, timeout_s=timeout_s, deadline=deadline,
                      recv_grace_s=self.recv_grace_s, what="raw recv", header=None, counts=(0, 1),
                      on_chunk=lambda i: None)
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
