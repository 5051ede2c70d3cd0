"""`raycluster sim`: run a workload through a simulated cluster and write the loadgen results JSON.

  raycluster sim --cluster SPEC.yaml --workload NAME|FILE.jsonl [--qps Q]
                 [--duration S | --num-requests N] [--seed N] [--policy NAME]
                 [workload options as loadgen] [--images K [--distinct-images N]] [--horizon S]
                 [--decode-path default|fast|exact]
                 --out F.json

Entry point `main(argv)`; also `python -m raycluster.sim.cli ...`.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from loadgen.cli import add_image_args, add_workload_args, workload_from_args
from raycluster.sched.registry import policy_names


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="raycluster sim", description="Discrete-event cluster simulator")
    ap.add_argument("--cluster", required=True, help="cluster spec YAML (gpu, model, policy, slo, pools)")
    ap.add_argument("--policy", choices=policy_names(), default=None, help="override the spec's policy")
    ap.add_argument("--horizon", type=float, default=None,
                    help="stop at this virtual time (s); unfinished requests count as timeouts")
    ap.add_argument("--warmup-s", type=float, default=0.0)
    ap.add_argument("--warmup-requests", type=int, default=0)
    ap.add_argument("--out", required=True, help="results JSON (the loadgen schema)")
    add_decode_path_arg(ap)
    ap.add_argument("--quiet", action="store_true")
    add_workload_args(ap)
    add_image_args(ap.add_argument_group("images (the spec's vision tower times them)"))
    return ap


def add_decode_path_arg(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--decode-path", choices=("default", "fast", "exact"), default="default",
                    help="fast: decodes advance as a group (sim/fastpath.py; same records as exact); "
                         "exact: every step through the scheduler (no decode runs); default: the spec's "
                         "coalesce_decode")


def main(argv: list[str] | None = None) -> int:
    from raycluster.sim.run import simulate, with_decode_path
    from raycluster.sim.spec import load_spec

    args = build_parser().parse_args(argv)
    try:
        spec = load_spec(args.cluster)
        if args.policy:
            spec = spec.model_copy(update={"policy": args.policy})
        spec = with_decode_path(spec, args.decode_path)
    except (OSError, ValueError) as e:
        print(f"raycluster sim: bad cluster spec {args.cluster}: {e}", file=sys.stderr)
        return 2
    from loadgen.images import ImageLoad

    wl = workload_from_args(args)
    images = ImageLoad(args.images, *args.image_size, args.distinct_images)
    if args.videos:
        print("raycluster sim: --videos are not simulated (pictures are: --images)", file=sys.stderr)
        return 2
    if args.images and spec.vision is None:
        print(f"raycluster sim: --images needs a vision tower in {args.cluster} (vision: clip-vit-l-336 | "
              "siglip-so400m-896)", file=sys.stderr)
        return 2
    res = simulate(spec, wl, horizon_s=args.horizon, seed=args.seed, warmup_s=args.warmup_s,
                   warmup_requests=args.warmup_requests, fast_decode=args.decode_path == "fast", images=images,
                   meta={"argv": list(argv if argv is not None else sys.argv[1:]), "cluster_spec": args.cluster})
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=1))
    if not args.quiet:
        s, sim = res["summary"], res["meta"]["sim"]
        fmt = lambda v: "-" if v is None else f"{v:.3f}"  # noqa: E731
        print(f"sim: {s['completed']}/{s['num_requests']} completed, ttft p50/p99 {fmt(s['ttft_p50_s'])}/"
              f"{fmt(s['ttft_p99_s'])} s, tpot p50 {fmt(s['tpot_p50_s'])} s, slo {fmt(s['slo_attainment'])}; "
              f"{sim['events']} events in {sim['wall_s']:.2f} s ({sim['events_per_s']:.0f}/s, "
              f"{sim['sim_s_per_wall_s']:.3g} simulated s per wall s, decodes {sim['decode_path']}), "
              f"virtual {sim['virtual_end_s']:.1f} s -> {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
