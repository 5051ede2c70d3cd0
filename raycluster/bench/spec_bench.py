"""Speculative decoding (n-gram prompt lookup, a draft model, an EAGLE head) against plain decoding, side by side.

    raycluster bench spec-decode [--model tiny|PATH] [--batch-sizes 1,4,16] [--max-tokens 384]
                                 [--k 3,5] [--repeats 2] [--seed S]
                                 [--draft-model PATH | --draft-layers N]
                                 [--eagle-head PATH | --eagle-steps N] [--eagle-method eagle|eagle3]
                                 [--tp N] --out FILE.json

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

`--draft-model PATH` adds `speculative_method: draft_model` settings (`draft-kK`) with that
checkpoint as the draft; `--draft-layers N` makes the draft from the target itself, its
embeddings, first N layers, final norm and head (a self-speculative, layer-skipping draft, as in
Draft & Verify), written to a temporary directory. `--eagle-head PATH` adds `speculative_method:
eagle` settings (`eagle-kK`; `--eagle-method eagle3`: `eagle3-kK`) with that head; `--eagle-steps
N` first trains one for the target (`raycluster.model.eagle_train`, N steps on its own greedy
output), also in a temporary directory. `--tp N` runs every engine, plain and drafting, as a TP
group of N ranks (threads over gloo; a draft model or EAGLE head runs on the leader).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import statistics
import tempfile
import time

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from raycluster.engine.config import EngineConfig
from raycluster.engine.engine import LLMEngine
from raycluster.model.checkpoint_files import weight_files
from raycluster.model.registry import resolve_model_path
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


def write_first_layers(src: str, dst: str, num_layers: int) -> str:
    """A checkpoint at `dst` holding `src`'s embeddings, first `num_layers` decoder layers, final
    norm and output head (and its tokenizer files): a draft sharing the target's vocabulary."""
    os.makedirs(dst, exist_ok=True)
    with open(os.path.join(src, "config.json")) as f:
        cfg = json.load(f)
    if not 1 <= num_layers < cfg["num_hidden_layers"]:
        raise ValueError(f"--draft-layers: {num_layers} is not in [1, {cfg['num_hidden_layers'] - 1}]")
    cfg["num_hidden_layers"] = num_layers
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    layer = re.compile(r"\.layers\.(\d+)\.")
    kept = {}
    for file in weight_files(src):
        with safe_open(file, framework="pt") as f:
            for name in f.keys():
                m = layer.search(name)
                if m is None or int(m[1]) < num_layers:
                    kept[name] = f.get_tensor(name)
    save_file(kept, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    for name in os.listdir(src):
        if name.startswith("tokenizer") or name in ("generation_config.json", "special_tokens_map.json"):
            shutil.copy(os.path.join(src, name), dst)
    return dst


def run(args: argparse.Namespace, draft: str | None = None, eagle: str | None = None) -> dict:
    torch.manual_seed(args.seed)
    base = dict(model=args.model, policy="fcfs", packer="token", predictor="none", kv_cache_tokens=args.kv_tokens,
                max_num_seqs=max(args.batch_sizes), tp=args.tp)
    plain = LLMEngine.from_config(EngineConfig(**base))
    drafting = {f"ngram-k{k}": LLMEngine.from_config(EngineConfig(**base, speculative_method="ngram",
                                                                  num_speculative_tokens=k)) for k in args.k}
    if draft is not None:
        drafting.update({f"draft-k{k}": LLMEngine.from_config(EngineConfig(
            **base, speculative_method="draft_model", speculative_model=draft, num_speculative_tokens=k))
            for k in args.k})
    if eagle is not None:
        method = args.eagle_method
        drafting.update({f"{method}-k{k}": LLMEngine.from_config(EngineConfig(
            **base, speculative_method=method, speculative_model=eagle, num_speculative_tokens=k))
            for k in args.k})
    try:
        rows = _rows(args, plain, drafting)
    finally:
        for eng in (plain, *drafting.values()):
            eng.close()
    return {"model": args.model, "draft": args.draft_model or (f"first {args.draft_layers} layers"
                                                               if args.draft_layers else None),
            "eagle": args.eagle_head or (f"trained {args.eagle_steps} steps" if args.eagle_steps else None),
            "eagle_method": args.eagle_method, "tp": args.tp,
            "max_tokens": args.max_tokens, "repeats": args.repeats, "seed": args.seed,
            "threads": torch.get_num_threads(), "rows": rows}


def _rows(args: argparse.Namespace, plain: LLMEngine, drafting: dict[str, LLMEngine]) -> list[dict]:
    """Each batch size's settings, run in alternation (see the module docstring)."""
    rows = []
    for bs in args.batch_sizes:
        prompts = _prompts(bs, plain.vocab_size, args.seed + bs)
        runs: dict[str, list[dict]] = {"plain": [], **{name: [] for name in drafting}}
        for _ in range(args.repeats):
            runs["plain"].append(_run(plain, prompts, args.max_tokens))
            for name, eng in drafting.items():
                runs[name].append(_run(eng, prompts, args.max_tokens))
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
    return rows


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
    p.add_argument("--tp", type=int, default=1, help="every engine a TP group of this many ranks (threads)")
    drafts = p.add_mutually_exclusive_group()
    drafts.add_argument("--draft-model", default=None, help="also draft with this checkpoint (draft_model)")
    drafts.add_argument("--draft-layers", type=int, default=None,
                        help="also draft with the target's first N layers (draft_model)")
    heads = p.add_mutually_exclusive_group()
    heads.add_argument("--eagle-head", default=None, help="also draft with this EAGLE head (eagle)")
    heads.add_argument("--eagle-steps", type=int, default=None,
                       help="also draft with an EAGLE head trained for N steps on the target's output (eagle)")
    p.add_argument("--eagle-method", choices=("eagle", "eagle3"), default="eagle",
                   help="the kind of EAGLE head (--eagle-head / --eagle-steps)")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        draft = args.draft_model
        if args.draft_layers:
            draft = write_first_layers(resolve_model_path(args.model), os.path.join(tmp, "draft"), args.draft_layers)
        eagle = args.eagle_head
        if args.eagle_steps:
            from raycluster.model.eagle_train import train_eagle_head
            eagle = os.path.join(tmp, "eagle")
            print("trained EAGLE head:", train_eagle_head(resolve_model_path(args.model), eagle, args.eagle_steps,
                                                          method=args.eagle_method))
        result = run(args, draft, eagle)
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
