"""What a quantized checkpoint buys and costs on this machine: one dense checkpoint quantized by
each scheme, against itself dense, side by side in one process.

    raycluster bench quant [--model tiny|PATH] [--schemes w4a16,w8a16,fp8] [--group-size 128]
                           [--dtype bfloat16] [--decode-batches 1,4,16,64] [--kv-len 256]
                           [--prefill-tokens 512,2048] [--rounds 2] [--threads 1] --out FILE.json

Each scheme is written with `raycluster quantize` (round to nearest, into a temporary directory)
and loaded twice: with its quantized kernels and dequantized at load (`quant_kernels`), beside
the dense original. Per configuration: the weight bytes its layers hold, a decode step's time
for each batch (requests of --kv-len prompt tokens; engine_bench's pure-decode step), a
prompt's prefill time, unchunked (its first token), and how close its logits are to the dense
model's on one fixed prompt (largest difference relative to the largest logit, share of
positions whose top token agrees). The configurations run in turn --rounds times, and each
time is reported as a median with its ratio to the dense model's median, so ratios hold on a
noisy host.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile

import torch

from raycluster.bench.engine_bench import bench_decode, bench_prefill
from raycluster.bench.model_facts import model_facts
from raycluster.model.loader import load_model
from raycluster.model.quant.linear import QuantLinear
from raycluster.model.quant.write import SCHEMES, quantize_checkpoint
from raycluster.model.registry import resolve_model_path


def _logits(model, ids: list[int]) -> torch.Tensor:
    from kernels.metadata import AttentionMetadata

    n, bs = len(ids), 16
    table = list(range(-(-n // bs)))
    cache = torch.zeros(model.kv_cache_shape(len(table), bs), dtype=model.model.norm.weight.dtype)
    slots = torch.tensor([table[p // bs] * bs + p % bs for p in range(n)])
    meta = AttentionMetadata(n, 0, [n], [n], [table], [], [], slots, bs)
    return model.compute_logits(model(torch.tensor(ids), torch.arange(n), cache, meta)).float()


def _configs(path: str, tmp: str, schemes: list[str], group: int) -> list[tuple[str, str, str]]:
    """(label, checkpoint, quant_kernels) of the dense model and of each scheme both ways (FP8,
    which no kernel here takes, one way: dequantized)."""
    out = [("dense", path, "auto")]
    for scheme in schemes:
        dst = f"{tmp}/{scheme}"
        qc = quantize_checkpoint(path, dst, scheme, group)
        if qc.integer:
            out.append((f"{scheme} quantized kernels", dst, "quantized"))
        out.append((f"{scheme} dequantized at load", dst, "dense"))
    return out


def run(args: argparse.Namespace) -> dict:
    torch.set_num_threads(args.threads)
    path = str(resolve_model_path(args.model))
    dtype = getattr(torch, args.dtype)
    with tempfile.TemporaryDirectory() as tmp:
        configs = _configs(path, tmp, args.schemes, args.group_size)
        models = {label: load_model(ckpt, dtype=dtype, quant_kernels=kernels)[0] for label, ckpt, kernels in configs}
        dense = models["dense"]
        rng = random.Random(args.seed)
        prompt = [rng.randrange(6, dense.config.vocab_size) for _ in range(256)]
        ref = _logits(dense, prompt)
        rows = {}
        for label, model in models.items():
            facts = model_facts(model)
            got = _logits(model, prompt)
            rows[label] = {"config": label, "weight_bytes": facts["decode_weight_bytes"],
                           "matmuls": sorted({type(m.matmul).__name__ for m in model.modules()
                                              if isinstance(m, QuantLinear)}),
                           "logit_max_rel_diff": float((got - ref).abs().max() / ref.abs().max()),
                           "top1_agreement": float((got.argmax(-1) == ref.argmax(-1)).float().mean()),
                           "decode_ms": {b: [] for b in args.decode_batches},
                           "prefill_ms": {t: [] for t in args.prefill_tokens}}
        for _ in range(args.rounds):
            for label, model in models.items():
                facts = model_facts(model)
                row = rows[label]
                for b in args.decode_batches:
                    row["decode_ms"][b].append(bench_decode(model, facts, b, args.kv_len, args.threads, args.steps,
                                                            1e10)["step_ms"])
                for t in args.prefill_tokens:
                    row["prefill_ms"][t].append(bench_prefill(model, facts, t, args.threads, 1e11, chunked=False,
                                                              reps=1)["time_ms"])
    base = {key: {k: statistics.median(v) for k, v in rows["dense"][key].items()} for key in ("decode_ms", "prefill_ms")}
    for row in rows.values():
        for key in ("decode_ms", "prefill_ms"):
            row[key] = {k: {"median": statistics.median(v), "runs": v, "vs_dense": statistics.median(v) / base[key][k]}
                        for k, v in row[key].items()}
        row["weight_bytes_vs_dense"] = row["weight_bytes"] / rows["dense"]["weight_bytes"]
    return {"model": args.model, "dtype": args.dtype, "threads": args.threads, "group_size": args.group_size,
            "kv_len": args.kv_len, "rounds": args.rounds, "rows": list(rows.values())}


def table(result: dict) -> str:
    rows = result["rows"]
    batches = list(rows[0]["decode_ms"])
    tokens = list(rows[0]["prefill_ms"])
    head = (f"{'config':34s}{'weights':>9s}{'top1':>6s}{'max diff':>9s}"
            + "".join(f"{'dec ' + str(b):>14s}" for b in batches) + "".join(f"{'pre ' + str(t):>15s}" for t in tokens))
    lines = [head]
    for r in rows:
        cells = [f"{r['config']:34s}{r['weight_bytes_vs_dense']:>8.2f}x{r['top1_agreement']:>6.2f}"
                 f"{r['logit_max_rel_diff']:>9.3f}"]
        cells += [f"{r['decode_ms'][b]['median']:>7.1f} {r['decode_ms'][b]['vs_dense']:>5.2f}x" for b in batches]
        cells += [f"{r['prefill_ms'][t]['median']:>8.0f} {r['prefill_ms'][t]['vs_dense']:>5.2f}x" for t in tokens]
        lines.append("".join(cells))
    return "\n".join(lines)


def _ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="raycluster bench quant", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="tiny", help="a dense checkpoint: 'tiny' or a directory")
    p.add_argument("--schemes", type=lambda s: s.split(","), default=["w4a16", "w8a16", "fp8"],
                   help=f"comma-separated, of {', '.join(SCHEMES)}")
    p.add_argument("--group-size", type=int, default=128)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--decode-batches", type=_ints, default=[1, 4, 16, 64])
    p.add_argument("--kv-len", type=int, default=256)
    p.add_argument("--prefill-tokens", type=_ints, default=[512, 2048])
    p.add_argument("--steps", type=int, default=8, help="decode steps timed per batch (median)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    bad = [s for s in args.schemes if s not in SCHEMES]
    if bad:
        p.error(f"--schemes: {', '.join(bad)} not of {', '.join(SCHEMES)}")
    result = run(args)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    print(table(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
