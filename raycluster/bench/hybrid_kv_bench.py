"""One engine with the hybrid KV cache (a block table per layer group, the sliding groups giving
back blocks that leave their window) against the same engine with one table for every layer,
side by side on the same KV memory.

    raycluster bench hybrid-kv [--arch GptOssForCausalLM] [--layers 4] [--window 128] [--full-every N]
                               [--requests 16] [--prompt 600] [--output 200] [--kv-tokens 2048]
                               [--block-size 16] [--chunk 256] [--rounds 2] [--threads 1]
                               --out FILE.json

A tiny checkpoint of `--arch` (a family mixing sliding and full layers: gpt-oss alternates them,
Gemma 2 / 3, Cohere 2 ...) with `--window` (and with `--full-every N` every N-th layer full, the
rest sliding: Gemma 3's N is 6; default the family's own pattern), `--requests` prompts of `--prompt` random tokens each
generating `--output` tokens greedily (ignore_eos), all submitted at once to an engine whose KV
holds `--kv-tokens` tokens of every layer (fcfs, the token packer, `--chunk`-token chunks). Each
round runs both engines, alternating which goes first; per run: wall time, engine steps,
preemptions, the most requests decoding in one step, and the tokens (which must be equal).
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
from raycluster.model.loader import load_model
from raycluster.model.tiny import write_tiny_model
from raycluster.request import SamplingParams


def _run(model, args: argparse.Namespace, hybrid: bool, prompts: list[list[int]]) -> tuple[dict, list]:
    eng = LLMEngine(EngineConfig(kv_cache_tokens=args.kv_tokens, block_size=args.block_size, policy="fcfs",
                                 packer="token", chunk_size=args.chunk, predictor="none", num_threads=args.threads,
                                 disable_hybrid_kv_cache_manager=not hybrid), model)
    sp = SamplingParams(max_tokens=args.output, ignore_eos=True)
    reqs = [eng.add_request(f"r{i}", p, sp) for i, p in enumerate(prompts)]
    steps = most = 0
    t0 = time.perf_counter()
    while eng.has_unfinished() and steps < 100_000:
        eng.step()
        steps += 1
        most = max(most, len(eng.scheduler.decoding))
    wall = time.perf_counter() - t0
    eng.kv.check()
    return {"wall_s": wall, "steps": steps, "preemptions": eng.scheduler.preempted_total,
            "peak_decoding": most, "pool_blocks": eng.kv.num_blocks,
            "kv_groups": eng.kv.groups.num_groups if eng.kv.groups else 1}, [r.output_token_ids for r in reqs]


def run(args: argparse.Namespace) -> dict:
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        types = {} if args.full_every is None else {"layer_types": [
            "full_attention" if (i + 1) % args.full_every == 0 else "sliding_attention" for i in range(args.layers)]}
        path = write_tiny_model(tmp, seed=0, architectures=[args.arch], num_hidden_layers=args.layers,
                                sliding_window=args.window, max_position_embeddings=32768, **types)
        model = load_model(path)[0]
    rng = random.Random(0)
    prompts = [[rng.randrange(6, model.config.vocab_size) for _ in range(args.prompt)] for _ in range(args.requests)]
    rounds = []
    for r in range(args.rounds):
        order = (True, False) if r % 2 == 0 else (False, True)
        got = {}
        for hybrid in order:
            got[hybrid] = _run(model, args, hybrid, prompts)
        if got[True][1] != got[False][1]:
            raise AssertionError("the hybrid cache changed the tokens")
        rounds.append({"hybrid": got[True][0], "one_table": got[False][0]})
    med = {k: {m: statistics.median(r[k][m] for r in rounds) for m in rounds[0][k]} for k in ("hybrid", "one_table")}
    return {"args": vars(args), "rounds": rounds, "median": med,
            "wall_ratio_one_table_over_hybrid": med["one_table"]["wall_s"] / med["hybrid"]["wall_s"]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="raycluster bench hybrid-kv", description=__doc__.split("\n\n")[0])
    p.add_argument("--arch", default="GptOssForCausalLM")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--window", type=int, default=128)
    p.add_argument("--full-every", type=int, default=None)
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--prompt", type=int, default=600)
    p.add_argument("--output", type=int, default=200)
    p.add_argument("--kv-tokens", type=int, default=2048)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--chunk", type=int, default=256)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    result = run(args)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    for r in result["rounds"]:
        print(" | ".join(f"{k}: {v['wall_s']:.2f} s, {v['steps']} steps, {v['preemptions']} preempted, "
                         f"{v['peak_decoding']} decoding at most" for k, v in r.items()))
    print(f"one table / hybrid wall: {result['wall_ratio_one_table_over_hybrid']:.2f}x")
    return 0
