"""What serving LoRA adapters costs: one engine, the same requests on the base weights, all on one
adapter, split over two adapters and the base, and over four adapters, side by side.

    raycluster bench lora [--model tiny|PATH] [--num-requests 16] [--max-tokens 64] [--rank 16]
                          [--repeats 3] [--seed S] [--tp N] [--kvp N] [--spp N] --out FILE.json

The adapters are written for the model (`write_tiny_lora`: seeded, rank --rank, on all seven
projections, into a temporary directory) and loaded by the engine as `--lora-modules` would.
Prompts of 64-256 random non-special tokens, greedy, exactly --max-tokens each; the four mixes
run in alternation --repeats times in one process, so the ratios (median time / the base's median)
hold on a noisy machine. `--tp` / `--kvp` / `--spp`: the engine is that group (ranks as threads
of this process), each rank serving its shard of the adapters.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time

import torch

from raycluster.engine.config import EngineConfig
from raycluster.engine.engine import LLMEngine
from raycluster.model.registry import resolve_model_path
from raycluster.model.tiny import write_tiny_lora
from raycluster.request import SamplingParams

ALL_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
MIXES = {"base": (None,), "one adapter": ("a",), "two adapters + base": ("a", "b", None, None),
         "four adapters": ("a", "b", "c", "d")}


def run(args: argparse.Namespace) -> dict:
    path = resolve_model_path(args.model)
    with tempfile.TemporaryDirectory() as tmp:
        mods = [f"{n}={write_tiny_lora(f'{tmp}/{n}', path, seed=s, rank=args.rank, targets=ALL_PROJECTIONS)}"
                for n, s in (("a", 1), ("b", 2), ("c", 3), ("d", 4))]
        eng = LLMEngine.from_config(EngineConfig(model=args.model, policy="fcfs", packer="token", predictor="none",
                                                 kv_cache_tokens=args.kv_tokens, lora_modules=mods, tp=args.tp,
                                                 kvp=args.kvp, spp=args.spp))
        rng = random.Random(args.seed)
        prompts = [[rng.randrange(6, eng.vocab_size) for _ in range(rng.randint(64, 256))]
                   for _ in range(args.num_requests)]
        times: dict[str, list[float]] = {m: [] for m in MIXES}
        try:
            for _ in range(args.repeats):
                for mix, cycle in MIXES.items():
                    sps = [SamplingParams(max_tokens=args.max_tokens, ignore_eos=True,
                                          lora_adapter=cycle[i % len(cycle)]) for i in range(len(prompts))]
                    t0 = time.perf_counter()
                    eng.generate(prompts, sps)
                    times[mix].append(time.perf_counter() - t0)
        finally:
            eng.close()
    base = statistics.median(times["base"])
    return {"model": args.model, "rank": args.rank, "num_requests": args.num_requests, "max_tokens": args.max_tokens,
            "threads": torch.get_num_threads(), "layout": eng.runner.layout,
            "rows": [{"mix": m, "median_s": statistics.median(t), "vs_base": statistics.median(t) / base, "runs_s": t}
                     for m, t in times.items()]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="raycluster bench lora", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="tiny")
    p.add_argument("--num-requests", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--kv-tokens", type=int, default=65536)
    p.add_argument("--seed", type=int, default=0)
    for group in ("tp", "kvp", "spp"):
        p.add_argument(f"--{group}", type=int, default=1, help=f"{group} degree of the engine's group (threads)")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    result = run(args)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    print(f"layout {result['layout']}")
    for r in result["rows"]:
        print(f"{r['mix']:22s} {r['median_s']:.2f} s  {r['vs_base']:.2f}x the base's time")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
