"""KV handoff between two Ray actors with each connector: exact bytes into exactly the
destination blocks, KVTransferError within the timeout from a killed or stuck source, and leases
that free unpulled offers. Three actors per connector (prefill, decode, a victim prefill);
everything on 127.0.0.1."""

import importlib.util
import time
import uuid

import numpy as np
import pytest

pytestmark = [pytest.mark.ray, pytest.mark.timeout(120)]

L, N, B, H, D = 4, 64, 16, 2, 32
SHAPE = (L, N, 2, B, H, D)
CONNECTORS = ["object_store", "torch_dist",
              pytest.param("nixl", marks=pytest.mark.skipif(
                  importlib.util.find_spec("nixl") is None, reason="nixl extra not installed"))]


@pytest.fixture(scope="module", params=CONNECTORS)
def trio(request, ray_cluster):
    """(name, prefill, decode, victim) actors around one connector type, lease 2 s."""
    import ray
    from raycluster.kv_transfer.endpoint import KVEndpoint

    name = request.param
    tag = uuid.uuid4().hex[:6]
    Actor = ray.remote(num_cpus=1)(KVEndpoint)
    actors = []
    for seed, role in enumerate(["prefill", "decode", "victim"]):
        iid = f"{role}-{name}-{tag}"
        opts = {"lease_s": 2.0}
        if name == "torch_dist":
            # 64 KiB chunks: a 7-block request (224 KiB) already moves as 3 pipelined chunks;
            # runs of 2+ blocks (16 KiB per layer) go in place, so failures cover both paths.
            opts.update(min_chunk_bytes=1 << 16, recv_grace_s=5.0, min_direct_bytes=16 << 10)
        if name == "object_store":
            opts.update(max_pieces=32)   # both offer paths: views (few runs), gather (many)
        actors.append(Actor.options(name=iid, max_restarts=0).remote(
            name, iid, SHAPE, seed=seed + 1, **opts))
    ray.get([a.setup.remote() for a in actors], timeout=60)
    yield (name, *actors)
    for a in actors:
        ray.kill(a)


def test_scattered_blocks_move_bit_exact(trio):
    import ray
    name, pre, dec, _ = trio
    src_blocks = [5, 6, 7, 30, 2, 63, 40]     # scattered, with one consecutive run
    dst_blocks = [0, 1, 10, 11, 12, 50, 33]
    before = ray.get(dec.blocks.remote(), timeout=30)
    src = ray.get(pre.blocks.remote(src_blocks), timeout=30)
    h = ray.get(pre.offer.remote("req-a", src_blocks, 7 * B - 3), timeout=30)
    assert h.src_block_ids == src_blocks and h.num_tokens == 7 * B - 3
    res = ray.get(dec.pull.remote(h, dst_blocks, 20.0), timeout=40)
    assert res["ok"], res
    after = ray.get(dec.blocks.remote(), timeout=30)
    assert np.array_equal(after[:, dst_blocks].view(np.uint32), src.view(np.uint32))
    others = [b for b in range(N) if b not in dst_blocks]
    assert np.array_equal(after[:, others].view(np.uint32), before[:, others].view(np.uint32))
    assert ray.get(pre.release.remote("req-a"), timeout=30) is True
    # A second request on the now-warm path, then a layout error for mismatched block counts.
    h2 = ray.get(pre.offer.remote("req-b", [9], 3), timeout=30)
    assert ray.get(dec.pull.remote(h2, [20], 20.0), timeout=40)["ok"]
    bad = ray.get(dec.pull.remote(h2, [20, 21], 20.0), timeout=40)
    assert not bad["ok"] and bad["error"] == "KVLayoutError"
    ray.get(pre.release.remote("req-b"), timeout=30)


def test_stuck_source_times_out(trio):
    """torch_dist needs the source's help: a frozen source (SIGSTOP: its store and sender
    threads stop too) means a timeout, not a hang; once it runs again, a fresh pair works."""
    import os
    import signal

    import ray
    name, pre, dec, _ = trio
    if name != "torch_dist":
        pytest.skip("one-sided connectors need no work from the source")
    warm = ray.get(pre.offer.remote("req-warm", [8, 9], 20), timeout=30)
    assert ray.get(dec.pull.remote(warm, [10, 11], 20.0), timeout=40)["ok"]   # the pair exists
    assert ray.get(pre.release.remote("req-warm"), timeout=30) is True
    h = ray.get(pre.offer.remote("req-stuck", [1, 2], 20), timeout=30)
    pid = ray.get(pre.pid.remote(), timeout=30)
    untouched = ray.get(dec.blocks.remote([3, 4]), timeout=30)
    os.kill(pid, signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        res = ray.get(dec.pull.remote(h, [3, 4], 1.0), timeout=30)   # a run: received in place
        elapsed = time.monotonic() - t0
    finally:
        os.kill(pid, signal.SIGCONT)
    assert not res["ok"] and res["error"] == "KVTransferError" and "timed out" in res["msg"], res
    assert elapsed < 3.5, elapsed
    # The source runs again and works off the old request: nothing may land in blocks the
    # decode side gave up on (the engine may have handed them to another request).
    time.sleep(1.5)
    late = ray.get(dec.blocks.remote([3, 4]), timeout=30)
    assert np.array_equal(late.view(np.uint32), untouched.view(np.uint32))
    src = ray.get(pre.blocks.remote([1, 2]), timeout=30)
    res = ray.get(dec.pull.remote(h, [3, 4], 20.0), timeout=40)
    assert res["ok"], res
    got = ray.get(dec.blocks.remote([3, 4]), timeout=30)
    assert np.array_equal(got.view(np.uint32), src.view(np.uint32))
    ray.get(pre.release.remote("req-stuck"), timeout=30)


def test_lease_frees_unpulled_offers(trio):
    import ray
    name, pre, dec, _ = trio
    ray.get(pre.offer.remote("req-old", [11, 12], 20), timeout=30)
    h_new = ray.get(pre.offer.remote("req-new", [13], 10), timeout=30)
    assert ray.get(pre.expire.remote(), timeout=30) == []
    time.sleep(2.2)                             # lease_s = 2
    assert sorted(ray.get(pre.expire.remote(), timeout=30)) == ["req-new", "req-old"]
    # The decode side confirms by release(); False tells it the lease was gone, so whatever it
    # read may be stale (nixl reads in place) and it must recompute instead of admitting.
    res = ray.get(dec.pull.remote(h_new, [14], 5.0), timeout=30)
    if name == "torch_dist":
        assert not res["ok"] and "not offered" in res["msg"]   # the sender refuses
    assert ray.get(pre.release.remote("req-new"), timeout=30) is False


def test_killed_source_raises_within_timeout(trio):
    import ray
    name, _, dec, victim = trio
    # A warm path first (torch_dist: the pair exists when the source dies).
    h = ray.get(victim.offer.remote("req-alive", [7, 8], 20), timeout=30)
    assert ray.get(dec.pull.remote(h, [9, 10], 20.0), timeout=40)["ok"]
    h = ray.get(victim.offer.remote("req-dead", [1, 2, 3], 40), timeout=30)
    src = ray.get(victim.blocks.remote([1, 2, 3]), timeout=30)
    ray.kill(victim, no_restart=True)
    time.sleep(0.5)                            # let the process actually die
    t0 = time.monotonic()
    res = ray.get(dec.pull.remote(h, [4, 5, 6], 5.0), timeout=30)
    elapsed = time.monotonic() - t0
    assert elapsed < 7.0, elapsed
    if name == "object_store" and res["ok"]:
        # The offer is an immutable copy that may outlive its owner in this node's store:
        # then the pull legitimately succeeds, and must deliver the right bytes.
        got = ray.get(dec.blocks.remote([4, 5, 6]), timeout=30)
        assert np.array_equal(got.view(np.uint32), src.view(np.uint32))
        return
    assert not res["ok"] and res["error"] == "KVTransferError", res


def _offer_pull_and_check(pre, dec, rid: str, sb: list[int], db: list[int], skip: int = 0):
    """Offer `sb` on the prefill actor, pull all but its first `skip` blocks into `db`, and check
    they land bit-exact there and nothing else changes; the offer is released. Returns the handle
    pulled."""
    import dataclasses

    import ray
    before = ray.get(dec.blocks.remote(), timeout=30)
    src = ray.get(pre.blocks.remote(sb[skip:]), timeout=30)
    h = ray.get(pre.offer.remote(rid, sb, len(sb) * B), timeout=30)
    h = dataclasses.replace(h, skip_blocks=skip)
    res = ray.get(dec.pull.remote(h, db, 20.0), timeout=40)
    assert res["ok"], res
    after = ray.get(dec.blocks.remote(), timeout=30)
    assert np.array_equal(after[:, db].view(np.uint32), src.view(np.uint32))
    others = [b for b in range(N) if b not in db]
    assert np.array_equal(after[:, others].view(np.uint32), before[:, others].view(np.uint32))
    assert ray.get(pre.release.remote(rid), timeout=30) is True
    return h


def test_runs_and_scattered_layouts_bit_exact_and_pair_survives_refusal(trio):
    """Long runs (object_store puts views, nixl merges descriptors) and a fragmented layout
    (object_store gathers: > max_pieces runs), runs split on the destination side; for
    torch_dist a refused pull with chunk receives posted must leave the pair usable."""
    import ray
    name, pre, dec, _ = trio
    cases = [(list(range(20, 40)) + [3], [50, 51, 52] + list(range(5, 22)) + [60]),
             ([int(b) for b in np.random.default_rng(1).choice(N, 24, replace=False)],
              list(range(30, 54)))]
    for i, (sb, db) in enumerate(cases):
        _offer_pull_and_check(pre, dec, f"req-lay{i}", sb, db)
    if name != "torch_dist":
        return
    h = ray.get(pre.offer.remote("req-gone", list(range(8)), 8 * B), timeout=30)
    ray.get(pre.release.remote("req-gone"), timeout=30)
    res = ray.get(dec.pull.remote(h, list(range(40, 48)), 5.0), timeout=30)
    assert not res["ok"] and "not offered" in res["msg"], res
    h = ray.get(pre.offer.remote("req-after", list(range(8)), 8 * B), timeout=30)
    src = ray.get(pre.blocks.remote(list(range(8))), timeout=30)
    assert ray.get(dec.pull.remote(h, list(range(40, 48)), 10.0), timeout=30)["ok"]
    got = ray.get(dec.blocks.remote(list(range(40, 48))), timeout=30)
    assert np.array_equal(got.view(np.uint32), src.view(np.uint32))
    ray.get(pre.release.remote("req-after"), timeout=30)


def test_a_pull_skipping_cached_leading_blocks_moves_only_the_rest(trio):
    """A decode side whose prefix cache holds a request's first blocks pulls only the others
    (`skip_blocks`): they land exactly in its blocks for the rest, no other block changes. The
    skip cuts through a run (object_store's per-run views, nixl's merged descriptors, a
    torch_dist direct run) and through a fragmented layout (object_store's gather path)."""
    import dataclasses

    import ray
    name, pre, dec, _ = trio
    frag = [int(b) for b in np.random.default_rng(2).choice(N, 24, replace=False)]
    cases = [(list(range(20, 40)) + [3], 5, [50, 51, 52] + list(range(5, 18)))]
    cases.append((frag, 9, list(range(30, 45))))
    for i, (sb, skip, db) in enumerate(cases):
        h = _offer_pull_and_check(pre, dec, f"req-skip{i}", sb, db, skip)
        assert h.pull_block_ids == sb[skip:] and h.nbytes == len(db) * L * 2 * B * H * D * 4
    h = ray.get(pre.offer.remote("req-skipbad", [1, 2], 2 * B), timeout=30)
    bad = ray.get(dec.pull.remote(dataclasses.replace(h, skip_blocks=1), [20, 21], 20.0), timeout=40)
    assert not bad["ok"] and bad["error"] == "KVLayoutError"
    ray.get(pre.release.remote("req-skipbad"), timeout=30)


@pytest.mark.parametrize("name", CONNECTORS)
def test_bfloat16_kv_moves_bit_exact(name, ray_cluster):
    """A bf16 KV cache (a bf16 checkpoint on CPU): numpy has no bf16, so the object store puts
    and gets its bits as int16, and every connector must land the same bits."""
    import ray
    from raycluster.kv_transfer.endpoint import KVEndpoint

    Actor = ray.remote(num_cpus=1)(KVEndpoint)
    tag = uuid.uuid4().hex[:6]
    opts = {"object_store": {"max_pieces": 32}}.get(name, {})
    pre, dec = (Actor.options(name=f"bf16-{role}-{name}-{tag}", max_restarts=0).remote(
        name, f"bf16-{role}-{name}-{tag}", SHAPE, seed=seed, dtype="bfloat16", lease_s=10.0, **opts)
        for seed, role in enumerate(["prefill", "decode"]))
    try:
        ray.get([a.setup.remote() for a in (pre, dec)], timeout=60)
        frag = [int(b) for b in np.random.default_rng(3).choice(N, 40, replace=False)]
        for i, (sb, db) in enumerate([(list(range(10, 30)), list(range(40, 60))),   # one run
                                      (frag, list(range(N - 40, N)))]):            # fragmented
            src = ray.get(pre.blocks.remote(sb), timeout=30)
            assert src.dtype == np.int16
            h = ray.get(pre.offer.remote(f"bf{i}", sb, len(sb) * B), timeout=30)
            res = ray.get(dec.pull.remote(h, db, 20.0), timeout=40)
            assert res["ok"], res
            assert np.array_equal(ray.get(dec.blocks.remote(db), timeout=30), src)
            ray.get(pre.release.remote(f"bf{i}"), timeout=30)
    finally:
        for a in (pre, dec):
            ray.kill(a)


def test_object_store_cuts_long_runs_into_pieces_of_at_most_1_mib(ray_cluster):
    """Ray copies a buffer over 1 MiB with threads it starts per copy (3x slower here), so the
    offer cuts each run into views of <= 1 MiB; they land bit-exact, skip cutting through one."""
    import dataclasses

    import ray
    from raycluster.kv_transfer.endpoint import KVEndpoint
    from raycluster.kv_transfer.object_store_connector import PIECE_BYTES

    shape = (2, 32, 2, 16, 8, 128)                  # 128 KiB per block and layer (fp32)
    per_piece = PIECE_BYTES // (2 * 16 * 8 * 128 * 4)
    Actor = ray.remote(num_cpus=1)(KVEndpoint)
    tag = uuid.uuid4().hex[:6]
    pre, dec = (Actor.options(name=f"big-{role}-{tag}", max_restarts=0).remote(
        "object_store", f"big-{role}-{tag}", shape, seed=seed, lease_s=10.0)
        for seed, role in enumerate(["prefill", "decode"]))
    try:
        ray.get([a.setup.remote() for a in (pre, dec)], timeout=60)
        src = list(range(2, 22)) + [25, 26]          # a 20-block run (2.5 MiB per layer) and a 2-block one
        h = ray.get(pre.offer.remote("big", src, len(src) * 16), timeout=30)
        assert per_piece == 8 and h.extra["runs"] == [(0, 8), (8, 8), (16, 4), (20, 2)]
        for i, (skip, dst) in enumerate([(0, list(range(5, 27))), (11, list(range(0, 11)))]):
            res = ray.get(dec.pull.remote(dataclasses.replace(h, skip_blocks=skip), dst, 20.0),
                          timeout=40)
            assert res["ok"], res
            assert np.array_equal(ray.get(dec.blocks.remote(dst), timeout=30),
                                  ray.get(pre.blocks.remote(src[skip:]), timeout=30))
        ray.get(pre.release.remote("big"), timeout=30)
    finally:
        for a in (pre, dec):
            ray.kill(a)
