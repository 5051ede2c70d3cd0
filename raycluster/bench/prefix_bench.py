"""Prefix caching on one engine: requests sharing a long system prompt, cache off vs on.

    raycluster bench prefix [--model tiny|PATH] [--shared 1024] [--unique 32] [--num-requests 24]
                            [--max-tokens 8] [--rounds 3] [--threads 1] --out FILE.json

Every request is the same `--shared` tokens followed by `--unique` tokens of its own (seeded
random ids), greedy, exactly `--max-tokens` output tokens. Two phases per engine:
- sequential: one request at a time (TTFT = time to its first token);
- burst: all requests added at once, stepped to completion (makespan).
The engines with the cache off and on are built once and measured in alternating rounds in this
process, so a noisy shared machine moves both alike; the ratios are the figures to quote. The
run also checks that both engines produced the same tokens.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import torch

from raycluster.engine.config import EngineConfig
from raycluster.engine.engine import LLMEngine
from raycluster.request import SamplingParams

FIRST_NORMAL_TOKEN = 6


def _prompts(n: int, shared: int, unique: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    head = [rng.randrange(FIRST_NORMAL_TOKEN, vocab) for _ in range(shared)]
    return [head + [rng.randrange(FIRST_NORMAL_TOKEN, vocab) for _ in range(unique)] for _ in range(n)]


def _sequential(eng: LLMEngine, prompts: list[list[int]], sp: SamplingParams, tag: str) -> tuple[list[float], list]:
    ttfts, outs = [], []
    for i, p in enumerate(prompts):
        t0 = time.perf_counter()
        req = eng.add_request(f"{tag}-s{i}", p, sp)
        ttft = None
        while eng.has_unfinished():
            eng.step()
            if ttft is None and req.output_token_ids:
                ttft = time.perf_counter() - t0
        ttfts.append(ttft)
        outs.append(list(req.output_token_ids))
    return ttfts, outs


def _burst(eng: LLMEngine, prompts: list[list[int]], sp: SamplingParams, tag: str) -> tuple[float, list]:
    t0 = time.perf_counter()
    reqs = [eng.add_request(f"{tag}-b{i}", p, sp) for i, p in enumerate(prompts)]
    while eng.has_unfinished():
        eng.step()
    return time.perf_counter() - t0, [list(r.output_token_ids) for r in reqs]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="raycluster bench prefix", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--shared", type=int, default=1024, help="tokens every prompt starts with")
    ap.add_argument("--unique", type=int, default=32, help="tokens of each prompt's own")
    ap.add_argument("--num-requests", type=int, default=24)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    engines = {}
    for caching in (False, True):
        cfg = EngineConfig(model=args.model, policy="fcfs", packer="token", chunk_size=512,
                           enable_prefix_caching=caching, num_threads=args.threads, predictor="none")
        engines[caching] = LLMEngine.from_config(cfg)
    vocab = engines[False].vocab_size
    sp = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
    ttft = {False: [], True: []}
    makespan = {False: [], True: []}
    outputs: dict[bool, list] = {}
    for rnd in range(args.rounds):
        # Fresh prompts per round: a round's first request always misses, like a new system prompt.
        prompts = _prompts(args.num_requests, args.shared, args.unique, vocab, args.seed + rnd)
        order = (False, True) if rnd % 2 == 0 else (True, False)
        for caching in order:
            t, seq_out = _sequential(engines[caching], prompts, sp, f"r{rnd}")
            ttft[caching] += t
            # The burst gets other prompts (seed + 1000): it starts from its own first miss.
            m, burst_out = _burst(engines[caching], _prompts(args.num_requests, args.shared, args.unique, vocab,
                                                             args.seed + 1000 + rnd), sp, f"r{rnd}")
            makespan[caching].append(m)
            outputs.setdefault(caching, []).append(seq_out + burst_out)
    kv = engines[True].kv
    res = {
        "config": vars(args),
        "same_tokens": outputs[False] == outputs[True],
        "ttft_p50_ms": {"off": 1e3 * statistics.median(ttft[False]), "on": 1e3 * statistics.median(ttft[True])},
        "burst_makespan_s": {"off": statistics.median(makespan[False]), "on": statistics.median(makespan[True])},
        "hit_rate": kv.hit_rate(),
    }
    res["ttft_p50_speedup"] = res["ttft_p50_ms"]["off"] / res["ttft_p50_ms"]["on"]
    res["burst_speedup"] = res["burst_makespan_s"]["off"] / res["burst_makespan_s"]["on"]
    with open(args.out, "w") as f:
        json.dump(res, f, indent=2)
    print(json.dumps({k: v for k, v in res.items() if k != "config"}, indent=2))
    return 0 if res["same_tokens"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
