"""NIXL (UCX) connector: the decode side READs exactly the request's blocks out of the prefill
side's KV tensor, one-sided; the prefill process does no work per transfer.

Owns one `nixl_agent` per process (creating one costs ~0.5 s) and the registration of the whole
KV tensor, done once at construction (host memory here, GPU memory on CUDA; NIXL picks DRAM or
VRAM from the tensor). The offer's handle carries the agent name, its metadata (~1 KB, so a
decode instance can reach a prefill instance it has never seen) and the tensor's base address
and strides; the decode side adds each remote agent once and caches it by name. Agent names
carry a random suffix, so a restarted instance is a new peer with fresh metadata.

Descriptors are built in numpy (Nx3 uint64 addr/len/devid, ~200x faster than tensor lists) by
`descs.paired_descs`, which also merges runs of consecutive blocks that are consecutive on both sides.
Failure: a dead peer raises from transfer()/check_xfer_state() within ~1 s; a transfer still
running at timeout_s is given `drain_s` more to end (done or failed) before its handle is
released, because the destination blocks go back to the engine, which recomputes into them or
frees them. Either way the peer is then forgotten (re-added from the next handle) and
KVTransferError is raised. A READ still running after that cannot be stopped safely (releasing a
handle cancels UCX requests, not a NIC's RDMA in flight): `KVTransferUnquiesced` is raised
instead, and the instance fails closed (raycluster.cluster.instance).
"""

from __future__ import annotations

import os
import threading
import time
import uuid
from typing import Any

import torch

from raycluster.kv_transfer.base import (KVConnector, KVHandle, KVTransferError, KVTransferUnquiesced,
                                         check_compatible)
from raycluster.kv_transfer.descs import paired_descs

os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")  # its INFO logs are per agent and per peer
try:
    from nixl._api import nixl_agent, nixl_agent_config, nixl_thread_sync_t
except ImportError as e:  # pragma: no cover - depends on the optional extra
    raise ImportError("the 'nixl' KV connector needs the nixl package: pip install 'raycluster[nixl]'"
                      f" (import failed: {e})") from e


class NixlConnector(KVConnector):
    name = "nixl"

    def __init__(self, kv_cache: torch.Tensor, instance_id: str, lease_s: float = 30.0,
                 clock=None, backends: tuple[str, ...] = ("UCX",), poll_s: float = 2e-4,
                 spin_s: float = 0.0, drain_s: float = 10.0, progress_s: float = 1e-3) -> None:
        super().__init__(kv_cache, instance_id, lease_s, clock)
        self.agent_name = f"{instance_id}-{uuid.uuid4().hex[:8]}"
        # NIXL's own progress thread polls without pause (the Python API fixes its delay at 0):
        # a whole core per instance, which on a small host slowed every engine several-fold
        # (decode TPOT P50 75-89 ms vs 14 ms with the object store). So no NIXL thread, calls
        # serialised inside NIXL (STRICT), and `_progress_loop` drives the UCX worker every
        # `progress_s`: what a READ needs from its target (connection wireup; over TCP the data
        # too; cma reads need none).
        self.agent = nixl_agent(self.agent_name, nixl_agent_config(
            backends=list(backends), enable_prog_thread=False,
            sync_mode=nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT))
        self.mem_type = "DRAM" if kv_cache.get_device() == -1 else "VRAM"
        self._reg = self.agent.register_memory(kv_cache)
        self._layout = {"base": kv_cache.data_ptr(), "num_blocks": kv_cache.shape[1],
                        "devid": max(kv_cache.get_device(), 0)}
        self.block_bytes = kv_cache[0, 0].numel() * kv_cache.element_size()
        # Snapshot taken after registration: peers must see the registered KV region.
        self._md = self.agent.get_agent_metadata()
        self._peers: set[str] = set()
        self.poll_s, self.spin_s, self.drain_s = poll_s, spin_s, drain_s
        self._unquiesced: list = []     # handles of READs that could not be stopped (never released)
        self.last_pull_stats: dict[str, float] = {}   # where the last pull's time went (s)
        self.progress_s = progress_s
        self._stop_progress = threading.Event()
        self._progress_thread = threading.Thread(target=self._progress_loop, daemon=True,
                                                 name=f"{instance_id}-nixl-progress")
        self._progress_thread.start()

    def _progress_loop(self) -> None:
        while not self._stop_progress.wait(self.progress_s):
            try:
                self.agent.get_new_notifs()     # progresses the worker (none are sent)
            except Exception:                   # a closing agent: the loop ends with it
                if self._stop_progress.is_set():
                    return

    def local_descriptor(self) -> bytes:
        return self._md

    def add_peer(self, metadata: bytes) -> str:
        name = self.agent.add_remote_agent(metadata)
        name = name.decode() if isinstance(name, bytes) else name
        self._peers.add(name)
        return name

    def _offer_extra(self, handle: KVHandle) -> dict[str, Any]:
        return {"agent": self.agent_name, "md": self._md, **self._layout}

    def _forget(self, name: str) -> None:
        if name in self._peers:
            self._peers.discard(name)
            try:
                self.agent.remove_remote_agent(name)
            except Exception:  # already gone / never connected: nothing to undo
                pass

    def pull(self, handle: KVHandle, dst_block_ids: list[int], timeout_s: float) -> None:
        check_compatible(self.kv_cache, handle, dst_block_ids)
        x = handle.extra
        peer = x["agent"]
        deadline = time.monotonic() + timeout_s
        xfer = None
        failed = False
        t0 = time.perf_counter()
        try:
            if peer not in self._peers:
                self.add_peer(x["md"])
            src, dst = paired_descs(x, self._layout, self.kv_cache.shape[0], self.block_bytes,
                                    handle.pull_block_ids, dst_block_ids)
            local = self.agent.get_xfer_descs(dst, self.mem_type)
            remote = self.agent.get_xfer_descs(src, self.mem_type)
            t1 = time.perf_counter()
            # No notification message: with one, the READ completes only once the prefill
            # process's UCX worker has taken it, and a busy prefill host delays that by a
            # scheduler tick or more (4-24 ms seen vs 0.1 ms). The prefill side learns of the
            # read from the router's release, which it needs anyway.
            xfer = self.agent.initialize_xfer("READ", local, remote, peer)
            t2 = time.perf_counter()
            state, polls = self.wait_xfer(xfer, deadline)
            if state == "PROC":
                # The READ may still write into dst_block_ids: they go back to the caller (to
                # recompute into, or to free) only once it has ended, done or failed.
                state, _ = self._poll(xfer, "PROC", time.monotonic() + self.drain_s)
                if state == "PROC":
                    # Releasing the handle cancels UCX requests, not an RDMA READ the NIC has
                    # started, so the handle is kept and the caller must fail closed.
                    self._unquiesced.append(xfer)
                    xfer = None
                    raise KVTransferUnquiesced(
                        f"nixl READ of {handle.request_id!r} from {peer} still running "
                        f"{timeout_s + self.drain_s:.1f}s after it started; blocks {list(dst_block_ids)} may "
                        "still be written")
                raise KVTransferError(f"nixl READ of {handle.request_id!r} from {peer} "
                                      f"timed out after {timeout_s}s")
            if state != "DONE":
                raise KVTransferError(f"nixl READ of {handle.request_id!r} from {peer}: {state}")
            self.last_pull_stats = {"descs_s": t1 - t0, "init_s": t2 - t1,
                                    "xfer_s": time.perf_counter() - t2, "descs": len(src),
                                    "polls": polls}
        except KVTransferError:
            failed = True
            raise
        except KVTransferUnquiesced:
            raise
        except Exception as e:  # nixlRemoteDisconnectError and friends come from the bindings
            failed = True
            raise KVTransferError(f"nixl READ of {handle.request_id!r} from {peer} failed: "
                                  f"{type(e).__name__}: {e}") from e
        finally:
            if xfer is not None:
                t3 = time.perf_counter()
                try:
                    self.agent.release_xfer_handle(xfer)
                except Exception:  # an aborted/in-flight handle may refuse; nothing else to do
                    pass
                self.last_pull_stats["release_s"] = time.perf_counter() - t3
                self.last_pull_stats["total_s"] = time.perf_counter() - t0
            if failed:
                # After the release: forgetting the peer first would leave NIXL a handle whose
                # remote is gone (its status check then frees the handle under us).
                self._forget(peer)

    def wait_xfer(self, xfer, deadline: float) -> tuple[str, int]:
        """Start a prepared transfer and poll it until it leaves "PROC" or the deadline passes;
        returns (state, polls)."""
        return self._poll(xfer, self.agent.transfer(xfer), deadline)

    def _poll(self, xfer, state: str, deadline: float) -> tuple[str, int]:
        """Poll a started transfer until it leaves "PROC" or the deadline passes. Spins for the
        first `spin_s` (a sleep costs 0.1-1 ms on a busy host, longer than many whole
        transfers), then sleeps poll_s between checks."""
        polls = 0
        spin_until = time.monotonic() + self.spin_s
        while state == "PROC":
            now = time.monotonic()
            if now > deadline:
                break
            if now > spin_until:
                time.sleep(self.poll_s)
            state = self.agent.check_xfer_state(xfer)
            polls += 1
        return state, polls

    def close(self) -> None:
        super().close()
        self._stop_progress.set()
        self._progress_thread.join(timeout=5)
        for p in list(self._peers):
            self._forget(p)
        try:
            self.agent.deregister_memory(self._reg)
        except Exception:
            pass
