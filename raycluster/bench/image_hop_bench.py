"""What an image costs the cluster's router, side by side in one run: a request's `RequestMeta`
carried through a stand-in router actor (submitted by the gateway, taken by an instance's poll)
with its pixels inside, as before, against with a handle to them in Ray's object store (the
gateway's `share_images` = ray.put, the instance's `fetch_images` = ray.get), as now.

    raycluster bench image-hop [--repeats 30] [--concurrent 16] --out FILE.json

Pixel sizes are the processors' outputs for one image: llava-1.5 (3 x 336 x 336 floats, 1.4 MB),
llava-v1.6 at its largest grid (5 tiles, 6.8 MB) and Qwen2-VL for a 1280 x 960 photo (4800
patches of 1176 floats, 22.6 MB). Per case: the median time of one request's whole hop (put,
submit, take, fetch), and the router's throughput bound: `--concurrent` requests submitted at
once and taken back, over the router's wall time (the actor runs one call at a time, so its
share per request is what limits the cluster's image request rate).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time

import torch

from raycluster.cluster.messages import RequestMeta
from raycluster.request import ImageInput, SamplingParams

SIZES = {"llava-1.5": (3, 336, 336), "llava-v1.6": (5, 3, 336, 336), "qwen2-vl 1280x960": (4800, 1176)}


def _meta(rid: str, pixels) -> RequestMeta:
    image = ImageInput(offset=5, length=576, pixel_values=pixels, digest=b"d" * 32, size=(960, 1280))
    return RequestMeta(rid, "gw", list(range(600)), SamplingParams(max_tokens=1, images=[image]))


def run(args: argparse.Namespace) -> dict:
    import ray

    @ray.remote(num_cpus=0)
    class Router:
        """Holds metas from submit to take: the router's part of a request's path."""

        def __init__(self):
            self.held = {}

        def submit(self, meta):
            self.held[meta.request_id] = meta
            return True

        def take(self, rid):
            return self.held.pop(rid)

    own = not ray.is_initialized()
    if own:
        ray.init(num_cpus=4, include_dashboard=False, _temp_dir=tempfile.mkdtemp(prefix="rayhop"),
                 logging_level="ERROR")
    try:
        router = Router.remote()
        ray.get(router.submit.remote(_meta("warm", None)))
        out = {}
        for name, shape in SIZES.items():
            pixels = torch.randn(*shape)
            case = {}
            for mode in ("pixels", "handle"):
                def hop(rid: str):
                    px = pixels if mode == "pixels" else ray.put(pixels)
                    ray.get(router.submit.remote(_meta(rid, px)))
                    got = ray.get(router.take.remote(rid)).sampling.images[0].pixel_values
                    return got if mode == "pixels" else ray.get(got)
                times = []
                for i in range(args.repeats):
                    t0 = time.perf_counter()
                    got = hop(f"{mode}{i}")
                    times.append(time.perf_counter() - t0)
                assert torch.equal(got, pixels)
                t0 = time.perf_counter()
                metas = [_meta(f"c{mode}{i}", pixels if mode == "pixels" else ray.put(pixels))
                         for i in range(args.concurrent)]
                sent = time.perf_counter()
                ray.get([router.submit.remote(m) for m in metas])
                taken = ray.get([router.take.remote(m.request_id) for m in metas])
                router_s = time.perf_counter() - sent
                if mode == "handle":
                    ray.get([m.sampling.images[0].pixel_values for m in taken])
                case[mode] = {"hop_median_s": statistics.median(times), "router_s_per_request": router_s / args.concurrent,
                              "total_s_per_request": (time.perf_counter() - t0) / args.concurrent}
            case["mb"] = pixels.numel() * 4 / 1e6
            case["hop_ratio_handle_over_pixels"] = case["handle"]["hop_median_s"] / case["pixels"]["hop_median_s"]
            case["router_ratio_handle_over_pixels"] = (case["handle"]["router_s_per_request"]
                                                       / case["pixels"]["router_s_per_request"])
            out[name] = case
        return {"args": vars(args), "cases": out}
    finally:
        if own:
            ray.shutdown()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="raycluster bench image-hop", description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--concurrent", type=int, default=16)
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    res = run(args)
    with open(args.out, "w") as f:
        json.dump(res, f, indent=2)
    for name, c in res["cases"].items():
        print(f"{name} ({c['mb']:.1f} MB): one hop {c['pixels']['hop_median_s'] * 1e3:.1f} ms with pixels, "
              f"{c['handle']['hop_median_s'] * 1e3:.1f} ms with a handle ({c['hop_ratio_handle_over_pixels']:.2f}x); "
              f"router time per request {c['pixels']['router_s_per_request'] * 1e3:.1f} vs "
              f"{c['handle']['router_s_per_request'] * 1e3:.1f} ms ({c['router_ratio_handle_over_pixels']:.2f}x)")
    return 0
