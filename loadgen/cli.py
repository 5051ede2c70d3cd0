"""The `loadgen` command: run, sweep, report.

Owns argument parsing only. `add_workload_args(parser)` and `workload_from_args(args)` are public
so `raycluster sim` accepts the same workload options. Data enters as argv; `run` writes one
results JSON (metrics.build_results), `sweep` writes {"meta": {"kind": "sweep"}, "runs": [...]},
`report` prints a table (report.py) and optionally writes a PNG (plots.py).

  loadgen run --url URL --workload NAME|FILE.jsonl --qps Q (--duration S | --num-requests N)
              --seed N --out FILE.json [--concurrency C] [--arrival poisson|gamma|constant|trace]
              [--long-fraction F] [--long-tokens MIN:MAX] [--model NAME] [--timeout S]
              [--images K [--image-size WxH] [--distinct-images N]] ...
  loadgen sweep --qps 1,2,4 (same options) --out SWEEP.json
  loadgen report FILE.json [FILE.json ...] [--plot PNG]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path

from loadgen.workloads import PROFILES, WORKLOADS, Workload, make_workload, parse_range, parse_tenants


def add_workload_args(p: argparse.ArgumentParser, qps_type=float) -> None:
    g = p.add_argument_group("workload")
    g.add_argument("--workload", required=True, help=f"one of {', '.join(WORKLOADS)}, or a JSONL trace")
    g.add_argument("--qps", type=qps_type, default=1.0,
                   help="offered rate (requests/s; sessions or applications/s for multiturn, apps)")
    stop = g.add_mutually_exclusive_group()
    stop.add_argument("--duration", type=float, help="arrivals within this many seconds")
    stop.add_argument("--num-requests", type=int, help="number of requests (calls)")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--arrival", choices=["poisson", "gamma", "constant", "trace"], default=None,
                   help="default: poisson, or trace (keep its times) for a JSONL file")
    g.add_argument("--cv", type=float, default=1.0, help="gamma arrivals: coefficient of variation")
    g.add_argument("--profile", choices=list(PROFILES), default="sharegpt", help="chat length profile")
    g.add_argument("--long-fraction", type=float, default=0.05)
    g.add_argument("--long-tokens", type=parse_range, default=(2048, 8192), metavar="MIN:MAX")
    g.add_argument("--max-output-tokens", type=int, default=None, help="clip sampled output lengths")
    g.add_argument("--ttft-slo-ms", type=float, default=2000.0)
    g.add_argument("--tpot-slo-ms", type=float, default=100.0)
    g.add_argument("--long-ttft-ms-per-token", type=float, default=1.0,
                   help="long requests' TTFT SLO = max(--ttft-slo-ms, this * prompt tokens)")
    g.add_argument("--tenants", type=parse_tenants, default=None, metavar="A:4,B:2,C:1",
                   help="tenants workload: name:weight shares of --qps")


def workload_from_args(args: argparse.Namespace, qps: float | None = None) -> Workload:
    is_file = args.workload.endswith(".jsonl") or Path(args.workload).is_file()
    arrival = args.arrival or ("trace" if is_file else "poisson")
    if arrival == "trace" and not is_file:
        raise SystemExit("--arrival trace needs a JSONL trace as --workload")
    if not is_file and args.duration is None and args.num_requests is None:
        raise SystemExit("give --duration S or --num-requests N")
    return make_workload(
        args.workload, seed=args.seed, qps=args.qps if qps is None else qps,
        num_requests=args.num_requests, duration=args.duration, arrival=arrival, cv=args.cv,
        profile=args.profile, long_fraction=args.long_fraction, long_tokens=args.long_tokens,
        max_output_tokens=args.max_output_tokens, ttft_slo_ms=args.ttft_slo_ms,
        tpot_slo_ms=args.tpot_slo_ms, long_ttft_ms_per_token=args.long_ttft_ms_per_token,
        tenants=args.tenants)


def _add_client_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("client")
    g.add_argument("--url", required=True, help="server base URL, e.g. http://127.0.0.1:8000")
    g.add_argument("--model", default=None, help="default: first entry of GET /v1/models")
    g.add_argument("--lora-modules", nargs="+", default=(), metavar="NAME",
                   help="LoRA adapters the server serves: each request names one (picked by its id, the same "
                        "in every run), as vLLM's benchmark --lora-modules")
    g.add_argument("--api-key", default=(os.environ.get("RAYCLUSTER_API_KEY") or "").split(",")[0].strip() or None,
                   help="bearer token for a server that wants one (default: the first key in $RAYCLUSTER_API_KEY)")
    g.add_argument("--concurrency", type=int, default=None,
                   help="closed loop with C requests in flight: requests go in workload order as slots "
                        "free; --qps then only sets how many requests --duration yields")
    g.add_argument("--timeout", type=float, default=300.0, help="per-request timeout (s)")
    g.add_argument("--run-timeout", type=float, default=None,
                   help="whole-run timeout (s); default last arrival + --timeout + 30")
    g.add_argument("--retry-429", action="store_true", help="retry 429/503 after Retry-After")
    g.add_argument("--max-retries", type=int, default=5)
    g.add_argument("--no-extras", action="store_true",
                   help="omit ttft_slo_ms/tpot_slo_ms/priority/tenant/app_id (strict servers)")
    g.add_argument("--prompt-format", choices=["text", "ids"], default="text",
                   help="send prompts as text or as token-id lists")
    g.add_argument("--id-range", type=parse_range, default=(100, 1000), metavar="LO:HI",
                   help="token ids drawn from [LO, HI) with --prompt-format ids")
    g.add_argument("--warmup-s", type=float, default=0.0, help="exclude arrivals in the first S s")
    g.add_argument("--warmup-requests", type=int, default=0, help="exclude the first N arrivals")
    g.add_argument("--save-token-times", action="store_true", help="keep every token time in requests")
    g.add_argument("--quiet", action="store_true", help="no progress bar")
    add_image_args(g)


def add_image_args(g) -> None:
    """The pictures in each request (`loadgen run`, and `raycluster sim`, which draws the same ones)."""
    g.add_argument("--images", type=int, default=0, metavar="K",
                   help="K synthetic pictures in each request: chat messages to /v1/chat/completions "
                        "(an image-text model; --prompt-format text)")
    g.add_argument("--image-size", type=_size, default=(640, 480), metavar="WxH", help="the pictures' size")
    g.add_argument("--distinct-images", type=int, default=64, metavar="N",
                   help="pictures in the pool requests draw from (repeats are prefix-cache hits)")
    g.add_argument("--videos", type=int, default=0, metavar="K",
                   help="K synthetic videos in each request (frame lists, as vLLM takes them; a video model such "
                        "as Qwen2-VL): --video-frames pictures of --image-size each, from a pool of --distinct-images")
    g.add_argument("--video-frames", type=int, default=8, metavar="F", help="pictures in each video")


def _size(text: str) -> tuple[int, int]:
    w, sep, h = text.partition("x")
    if not sep or not w.isdigit() or not h.isdigit() or int(w) < 1 or int(h) < 1:
        raise argparse.ArgumentTypeError(f"expected WIDTHxHEIGHT, got {text!r}")
    return int(w), int(h)


def _run_one(args: argparse.Namespace, qps: float) -> dict:
    from loadgen.client import ClientConfig, run
    from loadgen.images import ImageLoad
    from loadgen.metrics import build_results

    wl = workload_from_args(args, qps)
    cfg = ClientConfig(url=args.url.rstrip("/"), model=args.model, timeout_s=args.timeout,
                       run_timeout_s=args.run_timeout, concurrency=args.concurrency,
                       retry_429=args.retry_429, max_retries=args.max_retries,
                       send_extras=not args.no_extras, prompt_format=args.prompt_format,
                       id_range=args.id_range, keep_token_times=True, progress=not args.quiet,
                       api_key=args.api_key, lora_modules=tuple(args.lora_modules),
                       images=ImageLoad(args.images, *args.image_size, args.distinct_images, args.videos,
                                        args.video_frames))
    if (args.images or args.videos) and cfg.prompt_format == "ids":
        raise SystemExit("loadgen: --images / --videos send chat messages; they need --prompt-format text")
    if cfg.model is None:
        import asyncio
        from loadgen.client import fetch_model
        cfg.model = asyncio.run(fetch_model(cfg.url, headers=cfg.headers()))
    started = time.time()
    records = run(wl, cfg)
    meta = {"source": "loadgen", "url": cfg.url, "model": cfg.model, "workload": wl.name,
            "workload_params": wl.params, "qps": qps, "concurrency": args.concurrency,
            "seed": args.seed, "started_at": started, "wall_s": time.time() - started,
            "prompt_format": cfg.prompt_format, "send_extras": cfg.send_extras,
            "lora_modules": list(cfg.lora_modules), "images": dataclasses.asdict(cfg.images),
            "argv": sys.argv[1:]}
    return build_results(records, meta, warmup_s=args.warmup_s, warmup_requests=args.warmup_requests,
                         keep_token_times=args.save_token_times)


def _write(obj: dict, path: str) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        json.dump(obj, f, indent=1)


def _print_summary(res: dict) -> None:
    from loadgen.report import render_table
    print(render_table([(res["meta"].get("workload", "run"), res)]))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="loadgen", description="Load generator for OpenAI-compatible LLM servers")
    sub = ap.add_subparsers(dest="cmd", required=True)

    p_run = sub.add_parser("run", help="one run against a server; writes a results JSON")
    add_workload_args(p_run)
    _add_client_args(p_run)
    p_run.add_argument("--out", required=True)

    p_sw = sub.add_parser("sweep", help="one run per QPS; writes a combined sweep JSON")
    add_workload_args(p_sw, qps_type=lambda s: [float(x) for x in s.split(",") if x.strip()])
    _add_client_args(p_sw)
    p_sw.add_argument("--out", required=True)

    p_rep = sub.add_parser("report", help="side-by-side table of results files")
    p_rep.add_argument("files", nargs="+")
    p_rep.add_argument("--plot", default=None, metavar="PNG", help="write TTFT CDFs (and SLO vs QPS)")

    p_gen = sub.add_parser("generate", help="write a workload to a JSONL trace (no server)")
    add_workload_args(p_gen)
    p_gen.add_argument("--out", required=True)

    args = ap.parse_args(argv)
    if args.cmd == "run":
        res = _run_one(args, args.qps)
        _write(res, args.out)
        _print_summary(res)
        print(f"wrote {args.out}")
    elif args.cmd == "sweep":
        runs = []
        for q in args.qps:
            print(f"== qps {q}", file=sys.stderr)
            runs.append(_run_one(args, q))
        _write({"meta": {"kind": "sweep", "qps": args.qps, "workload": args.workload,
                         "argv": sys.argv[1:]}, "runs": runs}, args.out)
        from loadgen.report import load_results, render_table
        print(render_table(load_results(args.out)))
        print(f"wrote {args.out}")
    elif args.cmd == "report":
        from loadgen.report import load_results, render_table
        print(render_table([c for f in args.files for c in load_results(f)]))
        if args.plot:
            from loadgen.plots import plot
            print(f"wrote {plot(args.files, args.plot)}")
    elif args.cmd == "generate":
        from loadgen.trace import write_trace
        wl = workload_from_args(args)
        write_trace(wl, args.out)
        print(f"wrote {len(wl)} requests to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
