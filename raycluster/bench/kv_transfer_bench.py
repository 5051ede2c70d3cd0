"""KV handoff bandwidth per connector vs the same transport moving the same bytes as one
contiguous buffer, in one run: `python -m raycluster.bench.kv_transfer_bench --out FILE.json`.

Two `KVEndpoint` actors per connector (prefill, decode) hold a KV tensor shaped like the tiny
model's (L=4, Hkv=2, D=32, fp32, block 16 tokens: 4 KiB per token). A handoff moves a request's
scattered blocks (random source and destination ids): time = offer (prefill side, measured in
the actor) + pull (decode side). The raw baseline moves `bytes` from one contiguous region:
nixl READ of one descriptor; gloo irecv + Ray-triggered isend of a preallocated buffer (the
handoff's control path without gather/scatter); ray.put + ray.get (zero-copy). Reported:
median of `--repeats` runs, GB/s, and handoff/raw ratio (target >= 0.7).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import shutil
import socket
import statistics
import tempfile
import time
import uuid

import numpy as np

L, B, H, D = 4, 16, 2, 32
BYTES_PER_TOKEN = L * 2 * H * D * 4


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _pair(ray, name: str, num_blocks: int):
    from raycluster.kv_transfer.endpoint import KVEndpoint
    Actor = ray.remote(num_cpus=1)(KVEndpoint)
    tag, port = uuid.uuid4().hex[:6], _free_port()
    actors = []
    for rank, role in enumerate(["prefill", "decode"]):
        opts = {"lease_s": 600.0}
        if name == "torch_dist":
            opts.update(rank=rank, world_size=2, store_port=port, init_timeout_s=60)
        iid = f"bench-{role}-{name}-{tag}"
        actors.append(Actor.options(name=iid).remote(name, iid, (L, num_blocks, 2, B, H, D),
                                                     seed=rank, **opts))
    ray.get([a.setup.remote() for a in actors], timeout=120)
    return actors


def _handoff(ray, pre, dec, rid: str, src: list[int], dst: list[int], timeout_s: float) -> float:
    h, offer_s = ray.get(pre.timed_offer.remote(rid, src, len(src) * B), timeout=timeout_s)
    res = ray.get(dec.pull.remote(h, dst, timeout_s), timeout=timeout_s + 10)
    if not res["ok"]:
        raise RuntimeError(f"handoff failed: {res}")
    ray.get(pre.release.remote(rid), timeout=timeout_s)
    return offer_s + res["seconds"]


def _raw(ray, name: str, pre, dec, nbytes: int, extra: dict, tag: int, timeout_s: float) -> float:
    if name == "nixl":
        return ray.get(dec.raw_nixl_pull.remote(extra, nbytes, timeout_s), timeout=timeout_s + 10)
    if name == "torch_dist":
        return ray.get(dec.raw_recv.remote(pre, 0, 1, nbytes, tag, timeout_s),
                       timeout=timeout_s + 10)
    refs, put_s = ray.get(pre.raw_put.remote(nbytes), timeout=timeout_s)
    return put_s + ray.get(dec.raw_get.remote(refs, timeout_s), timeout=timeout_s + 10)


def _pick(rng, num_blocks: int, k: int, layout: str, run: int = 16) -> list[int]:
    """k distinct block ids: uniformly scattered (fragmented pool, worst case) or as runs of
    `run` consecutive ids in random order (what a lightly fragmented allocator hands out)."""
    if layout == "scattered":
        return rng.choice(num_blocks, k, replace=False).tolist()
    chunks = rng.permutation(num_blocks // run)[: -(-k // run)]
    return [int(c) * run + j for c in chunks for j in range(run)][:k]


def run(connectors: list[str], token_counts: list[int], repeats: int, timeout_s: float,
        layouts: tuple[str, ...] = ("scattered", "runs16")) -> dict:
    import ray
    max_blocks = max(-(-t // B) for t in token_counts)
    num_blocks = 2 * max_blocks + 16
    rng = np.random.default_rng(0)
    results = []
    for name in connectors:
        pre, dec = _pair(ray, name, num_blocks)
        try:
            warm = _handoff(ray, pre, dec, "warm", [0, 1], [2, 3], timeout_s)  # connect, add peer
            h = ray.get(pre.offer.remote("extra", [0], B), timeout=timeout_s)
            extra = h.extra if name == "nixl" else {}
            raw_tag = 1_000_001                      # odd, far above the connector's tags
            for layout, tokens in [(lay, t) for t in token_counts for lay in layouts]:
                k = -(-tokens // B)
                nbytes = k * L * 2 * B * H * D * 4
                hs, rs = [], []
                for i in range(repeats):
                    src = _pick(rng, num_blocks, k, layout)
                    dst = _pick(rng, num_blocks, k, layout)
                    hs.append(_handoff(ray, pre, dec, f"r{layout}{tokens}-{i}", src, dst,
                                       timeout_s))
                    rs.append(_raw(ray, name, pre, dec, nbytes, extra, raw_tag, timeout_s))
                    raw_tag += 2
                h_s, r_s = statistics.median(hs), statistics.median(rs)
                row = {"connector": name, "layout": layout, "tokens": tokens, "blocks": k, "bytes": nbytes,
                       "handoff_s": h_s, "raw_s": r_s, "handoff_GBps": nbytes / h_s / 1e9,
                       "raw_GBps": nbytes / r_s / 1e9, "ratio": r_s / h_s,
                       "handoff_all_s": hs, "raw_all_s": rs, "warmup_s": warm}
                results.append(row)
                print(f"{name:13s} {layout:9s} {tokens:6d} tok {nbytes / 2**20:7.1f} MiB  handoff "
                      f"{row['handoff_GBps']:6.2f} GB/s ({h_s * 1e3:7.2f} ms)  raw "
                      f"{row['raw_GBps']:6.2f} GB/s ({r_s * 1e3:7.2f} ms)  ratio {row['ratio']:.2f}",
                      flush=True)
        finally:
            for a in (pre, dec):
                ray.kill(a)
    return {"kv_shape_per_block": [L, 2, B, H, D], "dtype": "float32",
            "bytes_per_token": BYTES_PER_TOKEN, "repeats": repeats, "results": results}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--connectors", default="nixl,torch_dist,object_store")
    ap.add_argument("--tokens", default="2048,16384")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--timeout-s", type=float, default=60.0)
    args = ap.parse_args(argv)
    names = [c for c in args.connectors.split(",") if c]
    if "nixl" in names and importlib.util.find_spec("nixl") is None:
        print("nixl not installed; skipping it")
        names.remove("nixl")
    import ray
    temp_dir = tempfile.mkdtemp(prefix="rckv", dir="/tmp")
    env = {"OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo", "UCX_NET_DEVICES": "lo",
           "NIXL_LOG_LEVEL": "WARN"}
    ray.init(num_cpus=4, include_dashboard=False, _temp_dir=temp_dir,
             _node_ip_address="127.0.0.1", runtime_env={"env_vars": env})
    try:
        t0 = time.time()
        out = run(names, [int(t) for t in args.tokens.split(",")], args.repeats, args.timeout_s)
        out["wall_s"] = time.time() - t0
    finally:
        ray.shutdown()
        shutil.rmtree(temp_dir, ignore_errors=True)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
