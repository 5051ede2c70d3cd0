"""KV transfer pieces that need no Ray: leases on a virtual clock, exact gather/scatter, layout
checks, the fallback policy, nixl descriptors (pure numpy), and a real NIXL READ between two
agents in this process (skipped without the nixl extra)."""

import dataclasses
import importlib.util
import time

import numpy as np
import pytest
import torch

from raycluster.clock import VirtualClock
from raycluster.kv_transfer import (KVConnector, KVLayoutError, KVTransferError, LeaseTable,
                                    gather_blocks, make_connector, pull_with_fallback,
                                    scatter_blocks)
from raycluster.kv_transfer.descs import block_runs, paired_descs

L, N, B, H, D = 4, 64, 16, 2, 32
HAVE_NIXL = importlib.util.find_spec("nixl") is not None


def kv(seed=0, n=N, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return torch.randn((L, n, 2, B, H, D), generator=g).to(dtype)


class FakeConnector(KVConnector):
    """Copies straight from a source connector's tensor; fails on demand."""
    name = "fake"

    def __init__(self, kv_cache, instance_id, fail=False, **kw):
        super().__init__(kv_cache, instance_id, **kw)
        self.fail, self.peer = fail, None

    def pull(self, handle, dst_block_ids, timeout_s):
        if self.fail:
            raise KVTransferError("boom")
        scatter_blocks(self.kv_cache, dst_block_ids,
                       gather_blocks(self.peer.kv_cache, handle.src_block_ids))


def test_lease_table_virtual_clock():
    clock = VirtualClock()
    t = LeaseTable(5.0, clock)
    t.add("a")
    clock.advance(2)
    t.add("b")
    assert t.expired() == []
    clock.advance(3)                       # a's deadline (5.0) reached
    assert t.expired() == ["a"] and "a" not in t and "b" in t
    t.renew("b")                           # b now lives until 10.0
    clock.advance(4.9)
    assert t.expired() == []
    assert t.expired(now=100.0) == ["b"] and len(t) == 0
    t.add("c")
    assert t.remove("c") and not t.remove("c")
    with pytest.raises(ValueError):
        LeaseTable(0)


def test_lease_expiry_order_and_duplicates():
    clock = VirtualClock()
    t = LeaseTable(1.0, clock)
    for i, r in enumerate(["x", "y", "z"]):
        t.add(r, now=float(3 - i))
    assert t.expired(now=10) == ["z", "y", "x"]
    t.add("x")
    with pytest.raises(ValueError):
        t.add("x")


def test_gather_scatter_exact():
    src, dst = kv(1), kv(2)
    before = dst.clone()
    sb, db = [7, 3, 40, 41, 0], [10, 11, 12, 60, 5]
    g = gather_blocks(src, sb)
    assert g.shape == (L, 5, 2, B, H, D) and g.is_contiguous()
    scatter_blocks(dst, db, g)
    assert torch.equal(dst[:, db], src[:, sb])
    others = [b for b in range(N) if b not in db]
    assert torch.equal(dst[:, others], before[:, others])


def test_connector_bookkeeping_and_expiry():
    clock = VirtualClock()
    src = FakeConnector(kv(1), "prefill-0", lease_s=10, clock=clock)
    dst = FakeConnector(kv(2), "decode-0", lease_s=10, clock=clock)
    dst.peer = src
    h = src.offer("r1", [5, 9, 2], num_tokens=40)
    assert (h.src_instance, h.src_block_ids, h.num_tokens) == ("prefill-0", [5, 9, 2], 40)
    assert h.block_shape == (L, 2, B, H, D) and h.dtype == "float32"
    assert h.nbytes == 3 * L * 2 * B * H * D * 4
    with pytest.raises(ValueError):
        src.offer("r1", [1], 1)
    with pytest.raises(ValueError):
        src.offer("r2", [N], 1)
    assert pull_with_fallback(dst, h, [0, 1, 2], timeout_s=1.0)
    assert torch.equal(dst.kv_cache[:, [0, 1, 2]], src.kv_cache[:, [5, 9, 2]])
    assert src.release("r1") and not src.release("r1")
    src.offer("r3", [1], 16)
    clock.advance(10)
    assert src.expire() == ["r3"] and src.offered("r3") is None


def test_fallback_policy():
    src = FakeConnector(kv(1), "p")
    bad = FakeConnector(kv(2), "d", fail=True)
    h = src.offer("r", [1, 2], 20)
    assert pull_with_fallback(bad, h, [3, 4], 1.0, on_failure="recompute") is False
    with pytest.raises(KVTransferError):
        pull_with_fallback(bad, h, [3, 4], 1.0, on_failure="fail")
    with pytest.raises(ValueError):
        pull_with_fallback(bad, h, [3, 4], 1.0, on_failure="retry")


def test_layout_mismatch_is_a_clear_error():
    from raycluster.kv_transfer.base import check_compatible
    h = FakeConnector(kv(1), "p").offer("r", [1, 2], 20)
    with pytest.raises(KVLayoutError, match="layout mismatch"):
        check_compatible(torch.zeros(L, N, 2, B, H, D * 2), h, [0, 1])
    with pytest.raises(KVLayoutError, match="layout mismatch"):
        check_compatible(kv(0, dtype=torch.float16), h, [0, 1])
    with pytest.raises(KVLayoutError, match="2 source blocks"):
        check_compatible(kv(0), h, [0])
    with pytest.raises(KVLayoutError):
        check_compatible(kv(0, n=8), h, [0, 8])
    check_compatible(kv(0, n=8), h, [0, 7])   # a smaller pool is fine
    with pytest.raises(ValueError, match="unknown KV connector"):
        make_connector("carrier_pigeon", kv(0))


def test_block_runs_and_descs():
    runs = block_runs([4, 5, 6, 9, 10, 3], [0, 1, 2, 7, 20, 21])
    assert runs.tolist() == [[4, 0, 3], [9, 7, 1], [10, 20, 1], [3, 21, 1]]
    bb = 2 * B * H * D * 4
    src = {"base": 1 << 40, "num_blocks": 64, "devid": 0}
    dst = {"base": 1 << 20, "num_blocks": 32, "devid": 1}
    s, d = paired_descs(src, dst, L, bb, [4, 5, 6, 9], [0, 1, 2, 7])
    assert s.dtype == np.uint64 and s.shape == d.shape == (2 * L, 3)
    assert (s[:, 1] == d[:, 1]).all()
    for l in range(L):
        assert s[2 * l].tolist() == [(1 << 40) + (l * 64 + 4) * bb, 3 * bb, 0]
        assert d[2 * l + 1].tolist() == [(1 << 20) + (l * 32 + 7) * bb, bb, 1]


def test_descs_match_tensor_addresses():
    t = kv(0)
    bb = t[0, 0].numel() * t.element_size()
    lay = {"base": t.data_ptr(), "num_blocks": N, "devid": 0}
    s, _ = paired_descs(lay, lay, L, bb, [3, 17], [0, 1])
    got = [int(a) for a in s[:, 0]]
    want = [t[l, b].data_ptr() for l in range(L) for b in (3, 17)]
    assert got == want


@pytest.mark.skipif(not HAVE_NIXL, reason="nixl extra not installed")
def test_nixl_read_between_two_agents_in_process():
    src_kv, dst_kv = kv(1), kv(2)
    before = dst_kv.clone()
    src = make_connector("nixl", src_kv, "prefill-0", lease_s=5)
    dst = make_connector("nixl", dst_kv, "decode-0", lease_s=5)
    try:
        sb, db = [9, 10, 11, 3, 50], [0, 1, 2, 40, 63]
        h = src.offer("r1", sb, num_tokens=70)
        dst.pull(h, db, timeout_s=10)
        assert torch.equal(dst_kv[:, db], src_kv[:, sb])
        others = [b for b in range(N) if b not in db]
        assert torch.equal(dst_kv[:, others], before[:, others])
        # Second request reuses the cached peer.
        h2 = src.offer("r2", [60], num_tokens=3)
        dst.pull(h2, [30], timeout_s=10)
        assert torch.equal(dst_kv[:, 30], src_kv[:, 60])
        assert src.release("r1") and src.release("r2")
        with pytest.raises(KVLayoutError):
            dst.pull(h, [0, 1], timeout_s=1)
    finally:
        src.close()
        dst.close()


class _SlowReads:
    """A connector's real NIXL agent whose READs look in progress until `done_at` (None: for
    ever); records the state checks, releases and forgotten peers in order."""

    def __init__(self, agent, done_at):
        self._agent, self.done_at, self.calls = agent, done_at, []

    def __getattr__(self, name):
        return getattr(self._agent, name)

    def transfer(self, xfer):
        self._agent.transfer(xfer)
        return "PROC"

    def check_xfer_state(self, xfer):
        state = self._agent.check_xfer_state(xfer)
        if self.done_at is None or time.monotonic() < self.done_at:
            state = "PROC"
        if not self.calls or self.calls[-1] != state:
            self.calls.append(state)
        return state

    def release_xfer_handle(self, xfer):
        self.calls.append("release")
        return self._agent.release_xfer_handle(xfer)

    def remove_remote_agent(self, name):
        self.calls.append("forget")
        return self._agent.remove_remote_agent(name)


@pytest.mark.skipif(not HAVE_NIXL, reason="nixl extra not installed")
def test_an_idle_nixl_connector_leaves_the_cpu_alone_and_still_answers_a_first_read():
    """NIXL's own progress thread spins (a whole core per instance); ours wakes every
    progress_s. The source here makes no call at all after offering, so the READ's connection
    wireup is answered only by the progress loop."""
    src = make_connector("nixl", kv(1), "prefill-0", lease_s=5)
    dst_kv = kv(2)
    dst = make_connector("nixl", dst_kv, "decode-0", lease_s=5)
    try:
        c0, w0 = time.process_time(), time.monotonic()
        time.sleep(1.0)
        busy = (time.process_time() - c0) / (time.monotonic() - w0)
        assert busy < 0.3, f"two idle connectors used {busy:.2f} of a core"   # ~0.04 here; 2.0 spinning
        h = src.offer("r1", [5, 6], num_tokens=20)
        dst.pull(h, [1, 2], timeout_s=10)
        assert torch.equal(dst_kv[:, [1, 2]], src.kv_cache[:, [5, 6]])
    finally:
        src.close()
        dst.close()


@pytest.mark.skipif(not HAVE_NIXL, reason="nixl extra not installed")
def test_nixl_timed_out_read_is_released_only_once_it_has_ended():
    """The blocks of a timed-out pull go back to the engine (recompute / free): the READ must have
    ended first. One that ends within drain_s is released, then its peer forgotten; one that
    never ends is not released, and the failure is not one to recompute after."""
    from raycluster.kv_transfer import KVTransferUnquiesced
    src = make_connector("nixl", kv(1), "prefill-0", lease_s=5)
    dst = make_connector("nixl", kv(2), "decode-0", lease_s=5, drain_s=5.0)
    agent = dst.agent
    try:
        h = src.offer("r1", [3, 4], num_tokens=20)
        dst.agent = slow = _SlowReads(agent, time.monotonic() + 0.5)
        with pytest.raises(KVTransferError, match="timed out"):
            dst.pull(h, [7, 8], timeout_s=0.2)
        assert slow.calls == ["PROC", "DONE", "release", "forget"]
        assert torch.equal(dst.kv_cache[:, [7, 8]], src.kv_cache[:, [3, 4]])   # it did land, late

        dst.drain_s = 0.3
        dst.agent = stuck = _SlowReads(agent, None)
        t0 = time.monotonic()
        with pytest.raises(KVTransferUnquiesced, match="may still be written"):
            pull_with_fallback(dst, h, [9, 10], timeout_s=0.2)
        assert 0.5 <= time.monotonic() - t0 < 5
        assert stuck.calls == ["PROC"] and len(dst._unquiesced) == 1
    finally:
        dst.agent = agent
        for xfer in dst._unquiesced:        # it did finish underneath: free it before closing
            agent.release_xfer_handle(xfer)
        src.close()
        dst.close()


def test_torch_dist_chunk_plan():
    from raycluster.kv_transfer.torch_dist_connector import TAG_STRIDE
    from raycluster.kv_transfer.transfer_plan import (MAX_CHUNKS, MAX_DIRECT_MSGS, chunk_plan,
                                                      segments as _segments)
    assert 1 + MAX_CHUNKS + MAX_DIRECT_MSGS <= TAG_STRIDE
    bb = 8 << 10
    for layers in (1, 4, 7, 32, 80):
        for k in (1, 3, 128, 1024):
            plan = chunk_plan(layers, k, bb)
            assert plan[0][0] == 0 and plan[-1][1] == layers * k
            assert all(a < b for a, b in plan)
            assert all(plan[i][1] == plan[i + 1][0] for i in range(len(plan) - 1))
            assert 1 <= len(plan) <= MAX_CHUNKS
            if len(plan) > 1:   # only split when every chunk keeps >= ~min bytes
                assert min(b - a for a, b in plan) * bb >= (1 << 20) // 2
            # segments tile each chunk exactly, layer by layer
            cells = [l * k + j for a, b in plan for l, j0, j1 in _segments(a, b, k)
                     for j in range(j0, j1)]
            assert cells == list(range(layers * k))
    assert chunk_plan(4, 1024, bb) == [(i * 512, (i + 1) * 512) for i in range(8)]
    assert chunk_plan(4, 1, bb) == [(0, 4)]
    assert chunk_plan(4, 0, bb) == []


def test_torch_dist_buffer_pool_reuses_and_bounds():
    from raycluster.kv_transfer.torch_dist_wire import BufferPool
    pool = BufferPool(keep=2)
    a = pool.take(100, torch.float32, torch.device("cpu"))
    pool.give(a)
    assert pool.take(50, torch.float32, torch.device("cpu")) is a      # big enough: reused
    b = pool.take(10, torch.float16, torch.device("cpu"))
    assert b is not a and b.dtype == torch.float16
    for t in (a, b, torch.empty(7), torch.empty(9)):
        pool.give(t)
    assert len(pool._free) == 2


def test_object_store_src_runs():
    from raycluster.kv_transfer.object_store_connector import src_runs
    assert src_runs([]) == []
    assert src_runs([4, 5, 6, 9, 10, 3]) == [(0, 3), (3, 2), (5, 1)]
    assert src_runs(list(range(10, 20))) == [(0, 10)]


def test_bench_layouts_are_valid_block_ids():
    from raycluster.bench.kv_transfer_bench import _layout_pair
    rng = np.random.default_rng(0)
    for layout in ("allocator", "queue", "fresh", "runs16", "scattered"):
        for k in (8, 128):
            src, dst = _layout_pair(rng, 2 * k + 16, k, layout)
            for ids in (src, dst):
                assert len(ids) == k == len(set(ids)) and all(0 <= b < 2 * k + 16 for b in ids)
    with pytest.raises(ValueError, match="layout"):
        _layout_pair(rng, 64, 8, "striped")


def test_torch_dist_pair_in_process_bit_exact_refusal_and_unreachable_peer(monkeypatch):
    """Two torch_dist connectors in one process (no global process group): the pair is built
    on the first pull, scattered blocks land exactly, a refusal keeps the pair, the store
    listens on 127.0.0.1 only, and an unreachable peer fails within the timeout."""
    import socket

    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    a, b = kv(1), kv(2)
    before = b.clone()
    src = make_connector("torch_dist", a, "pre", min_chunk_bytes=1 << 16)
    dst = make_connector("torch_dist", b, "dec", connect_timeout_s=0.5, min_chunk_bytes=1 << 16)
    try:
        d = src.local_descriptor()
        assert d["host"] == "127.0.0.1" and d["port"] > 0
        with socket.socket() as s:   # bound to 127.0.0.1 only: another address may take the port
            s.bind(("127.0.0.2", d["port"]))
        sb, db = [5, 6, 7, 30, 2, 63, 40], [0, 1, 10, 11, 12, 50, 33]
        h = src.offer("r1", sb, 7 * B)
        assert h.extra == d
        dst.pull(h, db, timeout_s=20)
        assert torch.equal(b[:, db], a[:, sb])
        others = [i for i in range(N) if i not in db]
        assert torch.equal(b[:, others], before[:, others])
        assert dst.last_pull_stats["chunks"] == 3
        assert src.release("r1")
        with pytest.raises(KVTransferError, match="not offered"):
            dst.pull(h, db, timeout_s=10)
        h2 = src.offer("r2", list(range(20)), 20 * B)
        dst.pull(h2, list(range(40, 60)), timeout_s=20)      # same pair after the refusal
        assert torch.equal(b[:, 40:60], a[:, :20]) and len(dst._peers) == 1
        assert pull_with_fallback(dst, h2, list(range(40, 60)), 10)
        assert {k: dst.pull_counts[k] for k in ("ok", "failed", "blocks")} == {"ok": 1, "failed": 0, "blocks": 20}
        assert dst.pull_counts["seconds"] > 0
        gone = dict(h2.extra, port=d["port"] + 1 if d["port"] < 65535 else d["port"] - 1)
        h2.extra = gone
        t0 = time.monotonic()
        assert not pull_with_fallback(dst, h2, list(range(40, 60)), 5.0)
        assert not pull_with_fallback(dst, h2, list(range(40, 60)), 5.0)   # remembered as gone
        assert time.monotonic() - t0 < 1.0 and dst.pull_counts["failed"] == 2
    finally:
        dst.close()
        src.close()


def test_torch_dist_idle_pairs_are_rebuilt(monkeypatch):
    """A pair idle past half of pair_idle_s is rebuilt by the decode side before use (the
    prefill side sweeps pairs idle past pair_idle_s), and the transfer still lands exactly."""
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    a, b = kv(3), kv(4)
    src = make_connector("torch_dist", a, "pre", pair_idle_s=0.4)
    dst = make_connector("torch_dist", b, "dec", pair_idle_s=0.4)
    try:
        h = src.offer("r1", [1, 2], 2 * B)
        dst.pull(h, [3, 4], timeout_s=20)
        first = next(iter(dst._peers.values())).pair_id
        time.sleep(0.5)
        h2 = src.offer("r2", [5], B)
        dst.pull(h2, [6], timeout_s=20)
        assert next(iter(dst._peers.values())).pair_id != first
        assert torch.equal(b[:, [3, 4, 6]], a[:, [1, 2, 5]])
        time.sleep(0.2)
        assert first not in src._served
    finally:
        dst.close()
        src.close()


def test_torch_dist_direct_runs_land_in_place_and_refusal_waits_for_fillers(monkeypatch):
    """Runs consecutive on both sides move as one message per layer straight into the KV
    cache, the rest is staged; a refusal with in-place receives posted returns only after the
    sender's fillers landed (nothing arrives later) and leaves the pair usable."""
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    a, b = kv(5), kv(6)
    before = b.clone()
    src = make_connector("torch_dist", a, "pre", min_chunk_bytes=1 << 16)
    dst = make_connector("torch_dist", b, "dec", min_chunk_bytes=1 << 16, min_direct_bytes=32 << 10)
    try:
        sb = list(range(10, 22)) + [3, 40, 41] + list(range(50, 56))
        db = list(range(30, 42)) + [0, 7, 8] + list(range(20, 26))
        h = src.offer("r1", sb, len(sb) * B)
        dst.pull(h, db, timeout_s=20)
        assert torch.equal(b[:, db], a[:, sb])
        others = [i for i in range(N) if i not in db]
        assert torch.equal(b[:, others], before[:, others])
        st = dst.last_pull_stats
        assert (st["direct_msgs"], st["staged_blocks"], st["chunks"]) == (2 * L, 3, 1)
        deadline = time.monotonic() + 5      # the sender records its stats after its own waits
        while "direct_msgs" not in src.last_send_stats and time.monotonic() < deadline:
            time.sleep(0.01)
        assert src.last_send_stats["direct_msgs"] == 2 * L
        # refused: the offer is gone; fillers answer the in-place receives before pull returns
        assert src.release("r1")
        with pytest.raises(KVTransferError, match="not offered"):
            dst.pull(h, db, timeout_s=10)
        snapshot = b.clone()
        time.sleep(0.2)
        assert torch.equal(b, snapshot)                          # nothing lands after the return
        assert torch.equal(b[:, others], before[:, others])
        h2 = src.offer("r2", list(range(12)), 12 * B)
        dst.pull(h2, list(range(30, 42)), timeout_s=20)         # same pair, all direct
        assert torch.equal(b[:, 30:42], a[:, :12]) and len(dst._peers) == 1
        assert dst.last_pull_stats["staged_blocks"] == 0
        # everything staged when the receiver allows no direct messages
        dst.max_direct_msgs = 0
        dst.pull(h2, list(range(44, 56)), timeout_s=20)
        assert torch.equal(b[:, 44:56], a[:, :12]) and dst.last_pull_stats["direct_msgs"] == 0
        # a receiver holding the first 5 blocks (its prefix cache) pulls the other 7 only
        dst.max_direct_msgs = 256
        dst.pull(dataclasses.replace(h2, skip_blocks=5), list(range(56, 63)), timeout_s=20)
        assert torch.equal(b[:, 56:63], a[:, 5:12]) and dst.last_pull_stats["staged_blocks"] == 0
        assert torch.equal(b[:, 44:56], a[:, :12])
    finally:
        dst.close()
        src.close()
