"""The parallel groups on this machine: KVP (and KVP x TP) decode latency at long context, SPP
prefill time, TP (and SPP x TP) prefill time and decode latency.

    raycluster bench parallel [--model tiny|PATH] [--contexts 8192,32768] [--kvp 2]
        [--prompt 8192] [--chunk 2048] [--spp 2] [--tp 2] [--decode-steps 16] [--repeats 3]
        [--launch threads|ray] [--parts kvp,spp,tp[,spp-tp][,kvp-tp][,kvp-layout][,tp-ep]]
        [--kvp-tokens-per-rank N] --out FILE.json

One request alone per run, greedy. Each configuration runs `--repeats` times, the
configurations alternating within a repeat, so a noisy shared host moves them together; the
report gives medians and ratios against the single-process engine on one thread:

- kvp: TPOT (median decode step after the first token) of a request with `C` prompt tokens, for
  one process on 1 thread, one process on `k` torch threads (the same cores used by intra-op
  parallelism instead), and a KVP group of `k` ranks on 1 thread each.
- spp: time to first token of one `--prompt`-token prompt in `--chunk` chunks, same three
  configurations with an SPP group of `--spp` stages.
- tp: the same prompt's time to first token and then TPOT, same three configurations with a TP
  group of `--tp` ranks.
- spp-tp (only when asked for): the same as tp with an SPP group of `--spp` stages that are each
  a TP group of `--tp` ranks (`--spp` x `--tp` ranks, and as many threads for the one process).
- kvp-tp (only when asked for): the same as kvp with a KVP group of `--kvp` ranks that are each
  a TP group of `--tp` ranks (`--kvp` x `--tp` ranks, and as many threads for the one process).
- tp-ep (only when asked for, on a mixture-of-experts `--model`): the same as tp for one process
  on 1 thread and a TP group of `--tp` ranks with each expert split over the ranks and with the
  experts shared out whole (`enable_expert_parallel`).
- kvp-layout (only when asked for): the same as kvp for one process on 1 thread and a KVP group
  of `--kvp` ranks striped and progressive (`kvp_layout`; `--kvp-tokens-per-rank` tokens of the
  request per rank, default the engine's: one rank's pool / kvp), so a short context's TPOT
  (on one rank when progressive) and a long one's are measured under both layouts side by side.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time

import torch

from raycluster.engine.config import EngineConfig
from raycluster.engine.engine import LLMEngine
from raycluster.model.loader import load_model
from raycluster.model.registry import resolve_model_path
from raycluster.request import SamplingParams


def _engine(model, path: str, launch: str, **cfg) -> LLMEngine:
    from raycluster.parallel.factory import build_runner

    ecfg = EngineConfig(policy="fcfs", packer="token", predictor="none", group_launch=launch, **cfg) \
        .for_model(model.config.dtype)
    torch.set_num_threads(ecfg.num_threads)
    return LLMEngine(ecfg, model, runner=build_runner(ecfg, model, ecfg.torch_dtype(), model_path=path))


def _one_request(engine: LLMEngine, prompt: list[int], decode_steps: int) -> tuple[float, list[float]]:
    """(seconds to the first token, seconds of each later decode step)."""
    engine.add_request("bench", prompt, SamplingParams(max_tokens=decode_steps + 1, ignore_eos=True))
    t0 = time.perf_counter()
    ttft, steps = None, []
    for _ in range(100_000):
        if not engine.has_unfinished():
            break
        t = time.perf_counter()
        res = engine.step()
        if ttft is None and any(o.new_token_ids for o in res.outputs):
            ttft = time.perf_counter() - t0
        elif ttft is not None:
            steps.append(time.perf_counter() - t)
    return ttft, steps


def _configs(kind: str, k: int, group: dict | None = None, name: str | None = None) -> list[tuple[str, dict]]:
    """One process on 1 and on `k` threads, and the group (`group`, default {kind: k}) of `k` ranks."""
    return [("1 process, 1 thread", {"num_threads": 1}),
            (f"1 process, {k} threads", {"num_threads": k}),
            (f"{name or kind + str(k)}, 1 thread per rank", {"num_threads": 1, **(group or {kind: k})})]


def _layout_configs(k: int, tokens_per_rank: int | None) -> list[tuple[str, dict]]:
    """One process on 1 thread, and a KVP group of `k` ranks striped and progressive."""
    cap = {} if tokens_per_rank is None else {"kvp_tokens_per_rank": tokens_per_rank}
    return [("1 process, 1 thread", {"num_threads": 1}),
            (f"kvp{k} striped, 1 thread per rank", {"num_threads": 1, "kvp": k}),
            (f"kvp{k} progressive, 1 thread per rank", {"num_threads": 1, "kvp": k, "kvp_layout": "progressive",
                                                         **cap})]


def _prefill_decode(model, path: str, args, prompt: list[int], configs) -> dict:
    """TTFT and TPOT of `prompt` alone under each configuration, medians over the repeats."""
    samples, decode = {}, {}
    for _ in range(args.repeats):
        for name, cfg in configs:
            eng = _engine(model, path, args.launch, kv_cache_tokens=args.prompt + 4096, chunk_size=args.chunk,
                          max_num_batched_tokens=args.chunk, **cfg)
            try:
                ttft, steps = _one_request(eng, prompt, args.decode_steps)
            finally:
                eng.close()
            samples.setdefault(name, []).append(ttft)
            decode.setdefault(name, []).append(statistics.median(steps))
    ttft = {name: statistics.median(v) for name, v in samples.items()}
    tpot = {name: statistics.median(v) for name, v in decode.items()}
    base, base_d = ttft["1 process, 1 thread"], tpot["1 process, 1 thread"]
    return {"prompt": args.prompt, "chunk": args.chunk, "ttft_s": ttft,
            "tpot_ms": {n: t * 1e3 for n, t in tpot.items()},
            "ttft_speedup_vs_1_thread": {n: base / t for n, t in ttft.items()},
            "tpot_speedup_vs_1_thread": {n: base_d / t for n, t in tpot.items()}}


def _print_prefill_decode(part: str, res: dict) -> None:
    ttft, tpot = res["ttft_s"], res["tpot_ms"]
    up, up_d = res["ttft_speedup_vs_1_thread"], res["tpot_speedup_vs_1_thread"]
    print(f"{part} prompt {res['prompt']}: " + ", ".join(
        f"{n} TTFT {ttft[n]:.2f} s ({up[n]:.2f}x), TPOT {tpot[n]:.1f} ms ({up_d[n]:.2f}x)" for n in ttft), flush=True)


def _tpot_at_contexts(part: str, model, path: str, args, rng, kvp: int, configs) -> list[dict]:
    """TPOT of one request with each of `args.contexts` prompt tokens under each configuration,
    medians over the repeats; a configuration with `kvp` ranks holds 1/kvp of the context per rank."""
    rows = []
    vocab = model.config.vocab_size
    for ctx in args.contexts:
        prompt = [rng.randrange(6, vocab) for _ in range(ctx)]
        per_rank = ctx // kvp + 4096
        samples: dict[str, list[float]] = {}
        for _ in range(args.repeats):
            for name, cfg in configs:
                kv = per_rank if cfg.get("kvp") else ctx + 4096
                eng = _engine(model, path, args.launch, kv_cache_tokens=kv, chunk_size=args.chunk,
                              max_num_batched_tokens=args.chunk, **cfg)
                try:
                    _, steps = _one_request(eng, prompt, args.decode_steps)
                finally:
                    eng.close()
                samples.setdefault(name, []).append(statistics.median(steps))
        tpot = {name: statistics.median(v) for name, v in samples.items()}
        base = tpot["1 process, 1 thread"]
        rows.append({"context": ctx, "tpot_ms": {n: t * 1e3 for n, t in tpot.items()},
                     "speedup_vs_1_thread": {n: base / t for n, t in tpot.items()}})
        print(f"{part} context {ctx}: " + ", ".join(f"{n} {t * 1e3:.1f} ms ({base / t:.2f}x)"
                                                    for n, t in tpot.items()), flush=True)
    return rows


def run(args) -> dict:
    path = str(resolve_model_path(args.model))
    model, _ = load_model(path)
    rng = random.Random(args.seed)
    vocab = model.config.vocab_size
    results: dict = {"meta": {"model": args.model, "launch": args.launch, "repeats": args.repeats,
                              "kvp_tokens_per_rank": args.kvp_tokens_per_rank}}
    longest = max([*args.contexts, args.prompt]) + args.decode_steps + 1
    if longest > model.config.max_model_len:
        raise SystemExit(f"--contexts / --prompt: {longest} tokens with the decode steps exceed the model's "
                         f"context of {model.config.max_model_len}")
    if "kvp" in args.parts:
        results["kvp"] = _tpot_at_contexts("kvp", model, path, args, rng, args.kvp, _configs("kvp", args.kvp))
    if "kvp-tp" in args.parts:
        group = {"kvp": args.kvp, "tp": args.tp}
        results["kvp-tp"] = _tpot_at_contexts("kvp-tp", model, path, args, rng, args.kvp, _configs(
            "kvp-tp", args.kvp * args.tp, group, f"kvp{args.kvp}xtp{args.tp}"))
    if "kvp-layout" in args.parts:
        results["kvp-layout"] = _tpot_at_contexts("kvp-layout", model, path, args, rng, args.kvp,
                                                  _layout_configs(args.kvp, args.kvp_tokens_per_rank))
    if "spp" in args.parts:
        prompt = [rng.randrange(6, vocab) for _ in range(args.prompt)]
        samples = {}
        for _ in range(args.repeats):
            for name, cfg in _configs("spp", args.spp):
                eng = _engine(model, path, args.launch, kv_cache_tokens=args.prompt + 4096, chunk_size=args.chunk,
                              max_num_batched_tokens=args.chunk, **cfg)
                try:
                    ttft, _ = _one_request(eng, prompt, 0)
                finally:
                    eng.close()
                samples.setdefault(name, []).append(ttft)
        ttft = {name: statistics.median(v) for name, v in samples.items()}
        base = ttft["1 process, 1 thread"]
        results["spp"] = {"prompt": args.prompt, "chunk": args.chunk, "ttft_s": ttft,
                          "speedup_vs_1_thread": {n: base / t for n, t in ttft.items()}}
        print(f"spp prompt {args.prompt}: " + ", ".join(f"{n} {t:.2f} s ({base / t:.2f}x)" for n, t in ttft.items()),
              flush=True)
    if "tp" in args.parts:
        prompt = [rng.randrange(6, vocab) for _ in range(args.prompt)]
        results["tp"] = _prefill_decode(model, path, args, prompt, _configs("tp", args.tp))
        _print_prefill_decode("tp", results["tp"])
    if "tp-ep" in args.parts:
        if model.config.moe is None:
            raise SystemExit("--parts tp-ep: expert parallelism needs a mixture-of-experts checkpoint (--model)")
        prompt = [rng.randrange(6, vocab) for _ in range(args.prompt)]
        configs = [("1 process, 1 thread", {"num_threads": 1}),
                   (f"tp{args.tp}, 1 thread per rank", {"num_threads": 1, "tp": args.tp}),
                   (f"tp{args.tp} expert-parallel, 1 thread per rank",
                    {"num_threads": 1, "tp": args.tp, "enable_expert_parallel": True})]
        results["tp-ep"] = _prefill_decode(model, path, args, prompt, configs)
        _print_prefill_decode("tp-ep", results["tp-ep"])
    if "spp-tp" in args.parts:
        prompt = [rng.randrange(6, vocab) for _ in range(args.prompt)]
        group = {"spp": args.spp, "tp": args.tp}
        results["spp-tp"] = _prefill_decode(model, path, args, prompt, _configs(
            "spp-tp", args.spp * args.tp, group, f"spp{args.spp}xtp{args.tp}"))
        _print_prefill_decode("spp-tp", results["spp-tp"])
    return results


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="raycluster bench parallel", description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--contexts", type=lambda s: [int(x) for x in s.split(",")], default=[8192, 32768])
    ap.add_argument("--kvp", type=int, default=2)
    ap.add_argument("--prompt", type=int, default=8192)
    ap.add_argument("--chunk", type=int, default=2048)
    ap.add_argument("--spp", type=int, default=2)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--kvp-tokens-per-rank", type=int, default=None,
                    help="kvp-layout: the progressive layout's tokens of a request per rank (default the engine's)")
    ap.add_argument("--decode-steps", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--launch", choices=["threads", "ray"], default="threads")
    ap.add_argument("--parts", type=lambda s: s.split(","), default=["kvp", "spp", "tp"])
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    if args.launch == "ray":
        import ray
        ray.init(num_cpus=8, include_dashboard=False, _node_ip_address="127.0.0.1",
                 runtime_env={"env_vars": {"OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}})
    threads = torch.get_num_threads()
    try:
        results = run(args)
    finally:
        torch.set_num_threads(threads)      # the configurations set it process-wide
    with open(args.out, "w") as f:
        json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
