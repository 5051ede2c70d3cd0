"""`KVEndpoint`: a minimal engine-shaped Ray actor body holding a random KV tensor and one
connector, used by the Ray tests and the benchmark (a real engine wires the same calls).

Data enters as method arguments (block ids, `KVHandle`s) and leaves as handles, timing dicts
and numpy copies of blocks. `raw_*` methods move one contiguous region with the same transport,
as the benchmark's baseline. All waits take a
timeout; failures come back as {"ok": False, "error": ...} instead of raising through Ray.
"""

from __future__ import annotations

import resource
import time
from typing import Any

import numpy as np
import torch

from kernels.rowcopy import numpy_bits
from raycluster.kv_transfer import KVHandle, make_connector


class KVEndpoint:
    def __init__(self, connector: str, instance_id: str, kv_shape: tuple[int, ...], seed: int,
                 dtype: str = "float32", **opts: Any) -> None:
        torch.set_num_threads(1)
        g = torch.Generator().manual_seed(seed)
        self.kv = torch.randn(kv_shape, generator=g).to(getattr(torch, dtype))
        self.connector_name, self.instance_id, self.opts = connector, instance_id, opts
        self.conn = None

    def setup(self) -> Any:
        """Build the connector; returns its descriptor."""
        self.conn = make_connector(self.connector_name, self.kv, self.instance_id, **self.opts)
        return self.conn.local_descriptor()

    def offer(self, request_id: str, block_ids: list[int], num_tokens: int) -> KVHandle:
        return self.conn.offer(request_id, block_ids, num_tokens)

    def timed_offer(self, request_id: str, block_ids: list[int], num_tokens: int):
        f0 = _minor_faults()
        t0 = time.perf_counter()
        h = self.conn.offer(request_id, block_ids, num_tokens)
        dt = time.perf_counter() - t0
        self.offer_faults = _minor_faults() - f0
        return h, dt

    def pull(self, handle: KVHandle, dst_block_ids: list[int], timeout_s: float) -> dict:
        f0 = _minor_faults()
        t0 = time.perf_counter()
        try:
            self.conn.pull(handle, dst_block_ids, timeout_s)
            dt = time.perf_counter() - t0
            return {"ok": True, "seconds": dt,
                    "stats": {**getattr(self.conn, "last_pull_stats", {}),
                              "pull_faults": _minor_faults() - f0}}
        except Exception as e:
            return {"ok": False, "seconds": time.perf_counter() - t0,
                    "error": type(e).__name__, "msg": str(e)}

    def release(self, request_id: str) -> bool:
        return self.conn.release(request_id)

    def send_stats(self) -> dict:
        return {**getattr(self.conn, "last_send_stats", {}),
                "offer_faults": getattr(self, "offer_faults", 0)}

    def expire(self, now: float | None = None) -> list[str]:
        return self.conn.expire(now)

    def blocks(self, block_ids: list[int] | None = None) -> np.ndarray:
        """A copy of the blocks' bits (integers of the KV dtype's width: numpy has no bf16)."""
        t = self.kv if block_ids is None else self.kv[:, block_ids]
        return numpy_bits(t.contiguous()).copy()

    def sleep(self, seconds: float) -> None:
        time.sleep(seconds)

    def pid(self) -> int:
        import os
        return os.getpid()

    # -- raw baselines: one contiguous region of `nbytes`, same transport --------------------
    def raw_nixl_pull(self, src_extra: dict, nbytes: int, timeout_s: float) -> float:
        """READ one region [src base, +nbytes) into [own base, +nbytes); returns seconds."""
        c = self.conn
        t0 = time.perf_counter()
        if src_extra["agent"] not in c._peers:
            c.add_peer(src_extra["md"])
        rem = np.array([[src_extra["base"], nbytes, src_extra["devid"]]], dtype=np.uint64)
        loc = np.array([[self.kv.data_ptr(), nbytes, 0]], dtype=np.uint64)
        h = c.agent.initialize_xfer("READ", c.agent.get_xfer_descs(loc, c.mem_type),
                                    c.agent.get_xfer_descs(rem, c.mem_type), src_extra["agent"])
        state, _ = c.wait_xfer(h, time.monotonic() + timeout_s)   # the connector's own polling
        c.agent.release_xfer_handle(h)
        if state != "DONE":
            raise RuntimeError(f"raw nixl READ: {state}")
        return time.perf_counter() - t0

    def raw_torch_dist_pull(self, src_descriptor: dict, nbytes: int, timeout_s: float) -> float:
        """The connector's own control path (pair, posted receive, request through the source's
        store queue) moving one contiguous region into a reused buffer: no gather/scatter."""
        return self.conn.raw_pull(src_descriptor, nbytes, timeout_s)

    def raw_put(self, nbytes: int):
        import ray
        arr = self.kv.view(-1)[: nbytes // self.kv.element_size()].numpy()
        f0 = _minor_faults()
        t0 = time.perf_counter()
        ref = ray.put(arr)
        dt = time.perf_counter() - t0
        self.raw_put_faults = _minor_faults() - f0
        self._raw_ref = ref  # keep the object alive until the next raw_put
        return [ref], dt     # wrapped in a list so Ray passes the ref, not its value

    def raw_get(self, refs: list, timeout_s: float, copy_into: bool = False):
        """Seconds of a zero-copy get; with copy_into, (get seconds, seconds to copy the bytes
        into a reused buffer of this process, as a pull must land them in its KV cache)."""
        import ray
        f0 = _minor_faults()
        t0 = time.perf_counter()
        arr = ray.get(refs[0], timeout=timeout_s)
        dt = time.perf_counter() - t0
        if not copy_into:
            del arr
            return dt
        dst = self._raw_buf(arr.nbytes)
        t1 = time.perf_counter()
        np.copyto(dst.numpy()[: arr.size], arr)
        dt_copy = time.perf_counter() - t1
        self.raw_get_faults = _minor_faults() - f0
        del arr
        return dt, dt_copy

    def touch_object_store(self, total_bytes: int, chunk_bytes: int = 64 << 20) -> int:
        """Write `total_bytes` of objects into the object store at once, then drop them: this
        process has then mapped those pages of the store's shared memory, as a long-running
        instance has after its puts and gets cycled through them. Returns the faults paid."""
        import ray
        f0 = _minor_faults()
        refs = [ray.put(np.ones(chunk_bytes // 8, dtype=np.float64))
                for _ in range(max(1, total_bytes // chunk_bytes))]
        del refs
        return _minor_faults() - f0

    def raw_faults(self) -> dict:
        return {"put": getattr(self, "raw_put_faults", 0), "get": getattr(self, "raw_get_faults", 0)}

    def memcpy_s(self, nbytes: int) -> float:
        """Seconds of one single-thread copy of nbytes between two reused buffers (the cost of
        one extra pass over the data: a gather or a scatter of long runs)."""
        n = nbytes // self.kv.element_size()
        if getattr(self, "_cpbuf", None) is None or self._cpbuf.numel() < n:
            self._cpbuf = torch.zeros(n, dtype=self.kv.dtype)
        src = self._raw_buf(nbytes)
        t0 = time.perf_counter()
        self._cpbuf[:n].copy_(src)
        return time.perf_counter() - t0

    def _raw_buf(self, nbytes: int) -> torch.Tensor:
        n = nbytes // self.kv.element_size()
        if getattr(self, "_rawbuf", None) is None or self._rawbuf.numel() < n:
            self._rawbuf = torch.zeros(n, dtype=self.kv.dtype)   # faulted in once
        return self._rawbuf[:n]


def _minor_faults() -> int:
    """This process's minor page faults so far: first touches of shared memory (the object
    store's pages) show up here, and cost ~2 us per 4 KiB page."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
