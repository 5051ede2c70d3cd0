"""Speculative decoding (n-gram prompt lookup) against plain decoding, side by side.

    raycluster bench spec-decode [--model tiny|PATH] [--batch-sizes 1,4,16] [--max-tokens 384]
                                 [--k 3,5] [--repeats 2] [--seed S] --out FILE.json

For each batch size, the same seeded requests (random prompts of 16-128 non-special tokens,
greedy, every request generates exactly --max-tokens) run to completion on one engine without
drafts and on one with `speculative_method: ngram` for each --k, in alternation --repeats times,
in one process on the same threads, so the ratios hold on a noisy machine. Reported per setting:
median wall time, output tokens/s, engine steps, drafted and accepted tokens (acceptance =
accepted / drafted; tokens per step), the speed-up (plain time / drafting time, paired by
repeat), and whether every request's tokens equal the plain run's (greedy: they must).

What it shows depends on how often the model repeats its own context: a checkpoint that copies
(code edits, summaries quoting their source) accepts many drafts; random tiny weights accept
few until their greedy outputs fall into cycles, a few hundred tokens in.
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

FIRST_NORMAL_TOKEN = 6      # the tiny tokenizer's special tokens are 0..5


def _prompts(n: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(FIRST_NORMAL_TOKEN, vocab) for _ in range(rng.randint(16, 128))] for _ in range(n)]


def _run(engine: LLMEngine, prompts: list[list[int]], max_tokens: int) -> dict:
    sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    reqs = [engine.add_request(f"b{i}-{time.monotonic_ns()}", p, sp) for i, p in enumerate(prompts)]
    steps = drafts = accepted = 0
    t0 = time.perf_counter()
    while engine.has_unfinished():
        res = engine.step()
        steps += 1
        drafts += res.num_draft_tokens
        accepted += res.num_accepted_tokens
    wall = time.perf_counter() - t0
    return {"wall_s": wall, "steps": steps, "drafts": drafts, "accepted": accepted,
            "tokens": [r.output_token_ids for r in reqs]}


def run(args: argparse.Namespace) -> dict:
    torch.manual_seed(args.seed)
    base = dict(model=args.model, policy="fcfs", packer="token", predictor="none", kv_cache_tokens=args.kv_tokens,
                max_num_seqs=max(args.batch_sizes))
    plain = LLMEngine.from_config(EngineConfig(**base))
    drafting = {k: LLMEngine.from_config(EngineConfig(**base, speculative_method="ngram", num_speculative_tokens=k))
                for k in args.k}
    rows = []
    for bs in args.batch_sizes:
        prompts = _prompts(bs, plain.vocab_size, args.seed + bs)
        runs: dict[str, list[dict]] = {"plain": [], **{f"ngram-k{k}": [] for k in args.k}}
        for _ in range(args.repeats):
            runs["plain"].append(_run(plain, prompts, args.max_tokens))
            for k, eng in drafting.items():
                runs[f"ngram-k{k}"].append(_run(eng, prompts, args.max_tokens))
        want = runs["plain"][0]["tokens"]
        out_tokens = bs * args.max_tokens
        for name, rs in runs.items():
            wall = statistics.median(r["wall_s"] for r in rs)
            drafts, accepted = rs[0]["drafts"], rs[0]["accepted"]
            rows.append({
                "batch_size": bs, "setting": name, "wall_s": wall, "tok_per_s": out_tokens / wall,
                "steps": rs[0]["steps"], "tokens_per_step": out_tokens / rs[0]["steps"] / bs,
                "drafts": drafts, "accepted": accepted,
                "acceptance": accepted / drafts if drafts else None,
                "speedup": statistics.median(p["wall_s"] / r["wall_s"] for p, r in zip(runs["plain"], rs)),
                "same_tokens": all(r["tokens"] == want for r in rs)})
    return {"model": args.model, "max_tokens": args.max_tokens, "repeats": args.repeats, "seed": args.seed,
            "threads": torch.get_num_threads(), "rows": rows}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="raycluster bench spec-decode", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="tiny")
    p.add_argument("--batch-sizes", type=lambda s: [int(x) for x in s.split(",")], default=[1, 4, 16])
    p.add_argument("--max-tokens", type=int, default=384)
    p.add_argument("--k", type=lambda s: [int(x) for x in s.split(",")], default=[3, 5])
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--kv-tokens", type=int, default=65536)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    result = run(args)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    print(f"{'batch':>5s} {'setting':10s} {'wall s':>7s} {'tok/s':>8s} {'steps':>6s} {'tok/step':>8s} "
          f"{'accept':>7s} {'speedup':>7s} same")
    for r in result["rows"]:
        acc = f"{r['acceptance']:.0%}" if r["acceptance"] is not None else "-"
        print(f"{r['batch_size']:5d} {r['setting']:10s} {r['wall_s']:7.2f} {r['tok_per_s']:8.1f} {r['steps']:6d} "
              f"{r['tokens_per_step']:8.2f} {acc:>7s} {r['speedup']:6.2f}x {r['same_tokens']}")
    return 0 if all(r["same_tokens"] for r in result["rows"]) else 1


if __name__ == "__main__":
    raise SystemExit(main())
