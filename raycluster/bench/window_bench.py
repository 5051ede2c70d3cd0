"""Sliding-window attention against full attention in the torch backend, side by side.

    raycluster bench window [--context 8192] [--window 1024] [--decodes 16] [--chunk 512]
                            [--heads 8] [--kv-heads 2] [--head-dim 64] [--block-size 16]
                            [--repeats 10] [--threads 1] [--softcap CAP] [--attention-chunk C]
                            --out FILE.json

Over one paged cache of random K/V (`--decodes` requests of `--context` tokens each), three
attention calls as one layer of a step makes them, each timed with and without `--window` in
alternation (median of `--repeats`): a decode row per request; one prefill chunk of `--chunk`
tokens ending at the context; the whole context prefilled as one chunk. The windowed calls read
only the blocks their windows cover, so their cost follows the window, not the context. Every
windowed output is also checked against the dense reference formula with the window's mask.
With `--softcap` (Gemma 2's attention cap) the windowed calls cap their scores too, and full
attention is timed a second time with the cap: `cap_cost` is what capping costs (capped scores
take the unfused paths). With `--attention-chunk C` the local calls attend within C-token
chunks (Llama 4's chunked attention) instead of under the window, checked against the reference
with the chunks' mask.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from kernels.metadata import AttentionMetadata
from kernels.reference import reference_attention
from kernels.torch_backend import Workspace, paged_decode_attention, paged_prefill_attention, write_kv


def _setup(args: argparse.Namespace, g: torch.Generator):
    bs, n = args.block_size, args.decodes
    per = -(-args.context // bs)
    cache = torch.zeros(n * per, 2, bs, args.kv_heads, args.head_dim)
    perm = torch.randperm(n * per, generator=g).tolist()
    tables = [perm[i * per:(i + 1) * per] for i in range(n)]
    ks = [torch.randn(args.context, args.kv_heads, args.head_dim, generator=g) for _ in range(n)]
    vs = [torch.randn(args.context, args.kv_heads, args.head_dim, generator=g) for _ in range(n)]
    for t, k, v in zip(tables, ks, vs):
        slots = torch.tensor([t[p // bs] * bs + p % bs for p in range(args.context)])
        write_kv(cache, k, v, slots)
    return cache, tables, ks, vs


def _time(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _cases(args: argparse.Namespace, cache, tables, ks, vs, g: torch.Generator, ws: Workspace) -> list:
    """(name, attend(window) -> out, the reference out under the window) per timed call."""
    bs, ctx, scale = args.block_size, args.context, args.head_dim ** -0.5
    decode = AttentionMetadata(0, args.decodes, [], [], [], [ctx] * args.decodes, tables,
                               torch.zeros(args.decodes, dtype=torch.long), bs)
    q_dec = torch.randn(args.decodes, args.heads, args.head_dim, generator=g)

    def attend_decode(local, cap=None):
        return paged_decode_attention(q_dec, cache, decode, scale, return_lse=False, workspace=ws, softcap=cap,
                                      **local)[0]

    def ref_decode():
        return torch.cat([reference_attention(q_dec[i:i + 1], ks[i], vs[i], scale, softcap=args.softcap,
                                              **_local(args))[0] for i in range(args.decodes)])

    cases = [("decode", attend_decode, ref_decode)]
    for name, n in (("prefill_chunk", args.chunk), ("prefill_whole", ctx)):
        meta = AttentionMetadata(n, 0, [n], [ctx], [tables[0]], [], [], torch.zeros(0, dtype=torch.long), bs)
        q = torch.randn(n, args.heads, args.head_dim, generator=g)

        def attend(local, cap=None, meta=meta, q=q, n=n):
            return paged_prefill_attention(q, cache, meta, scale, k=ks[0][ctx - n:], v=vs[0][ctx - n:],
                                           return_lse=False, workspace=ws, softcap=cap, **local)[0]

        def ref(q=q):
            return reference_attention(q, ks[0], vs[0], scale, softcap=args.softcap, **_local(args))[0]

        cases.append((name, attend, ref))
    return cases


def _local(args: argparse.Namespace) -> dict:
    """The local calls' attention option: the chunk when one is given, else the window."""
    return {"chunk": args.attention_chunk} if args.attention_chunk else {"window": args.window}


def run(args: argparse.Namespace) -> dict:
    if not (args.attention_chunk or 1 <= args.window < args.context) or not 1 <= args.chunk <= args.context:
        raise SystemExit("raycluster bench window: need 1 <= --window < --context and 1 <= --chunk <= --context")
    if args.softcap is not None and args.softcap <= 0:
        raise SystemExit("raycluster bench window: --softcap must be positive")
    if args.attention_chunk is not None and not 1 <= args.attention_chunk < args.context:
        raise SystemExit("raycluster bench window: need 1 <= --attention-chunk < --context")
    cap = args.softcap
    g = torch.Generator().manual_seed(0)
    cache, tables, ks, vs = _setup(args, g)
    rows = []
    for name, attend, ref in _cases(args, cache, tables, ks, vs, g, Workspace()):
        half = max(1, args.repeats // 2)
        fulls, wins, capped = [], [], []
        for _ in range(2):          # two alternating halves: drift on a shared host moves both
            fulls.append(_time(lambda: attend({}), half))
            wins.append(_time(lambda: attend(_local(args), cap), half))
            if cap is not None:
                capped.append(_time(lambda: attend({}, cap), half))
        full, windowed = statistics.median(fulls), statistics.median(wins)
        err = float((attend(_local(args), cap) - ref()).abs().max())
        row = {"call": name, "full_ms": full * 1e3, "window_ms": windowed * 1e3, "speedup": full / windowed,
               "max_abs_err_vs_reference": err}
        if cap is not None:
            row.update(capped_full_ms=statistics.median(capped) * 1e3, cap_cost=statistics.median(capped) / full)
        rows.append(row)
    return {"context": args.context, "window": None if args.attention_chunk else args.window,
            "attention_chunk": args.attention_chunk, "softcap": cap, "decodes": args.decodes, "chunk": args.chunk,
            "heads": args.heads, "kv_heads": args.kv_heads, "head_dim": args.head_dim,
            "block_size": args.block_size, "threads": torch.get_num_threads(), "rows": rows}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="raycluster bench window", description=__doc__.split("\n\n")[0])
    p.add_argument("--context", type=int, default=8192)
    p.add_argument("--window", type=int, default=1024)
    p.add_argument("--decodes", type=int, default=16)
    p.add_argument("--chunk", type=int, default=512)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--softcap", type=float, default=None)
    p.add_argument("--attention-chunk", type=int, default=None)
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    result = run(args)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    local = f"attention chunk {args.attention_chunk}" if args.attention_chunk else f"window {args.window}"
    print(f"context {args.context}, {local}" + (f", soft cap {args.softcap}:" if args.softcap else ":"))
    print(f"{'call':14s} {'full ms':>9s} {'window ms':>10s} {'speed-up':>9s} {'max err':>9s}"
          + (f" {'capped full ms':>15s} {'cap cost':>9s}" if args.softcap else ""))
    for r in result["rows"]:
        print(f"{r['call']:14s} {r['full_ms']:9.2f} {r['window_ms']:10.2f} {r['speedup']:8.1f}x "
              f"{r['max_abs_err_vs_reference']:9.1e}"
              + (f" {r['capped_full_ms']:15.2f} {r['cap_cost']:8.2f}x" if args.softcap else ""))
    return 0 if all(r["max_abs_err_vs_reference"] < 1e-3 for r in result["rows"]) else 1


if __name__ == "__main__":
    raise SystemExit(main())
