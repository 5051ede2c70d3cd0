"""`raycluster sim-search`: the highest QPS each candidate cluster serves within the SLOs, by
simulation, and the candidate with the most QPS per GPU (raycluster.sim.search).

  raycluster sim-search --search SEARCH.yaml --workload NAME|FILE.jsonl
                        [--duration S | --num-requests N] [--seed N] [workload options as loadgen]
                        [--horizon S] [--decode-path default|fast|exact] [--jobs J] --out F.json

The workload is rebuilt at every probed QPS from the same options and seed (`--qps` is ignored:
the search sets it). Writes the search's JSON to --out and prints the candidates as a markdown
table, best first. Entry point `main(argv)`.
"""

from __future__ import annotations

import argparse
import json
import sys
from functools import partial
from pathlib import Path

from loadgen.cli import add_image_args, add_workload_args, workload_from_args
from raycluster.sim.cli import add_decode_path_arg


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="raycluster sim-search",
                                 description="Capacity search over simulated cluster configurations")
    ap.add_argument("--search", required=True, help="search YAML (base spec, candidates, grid, slo, qps)")
    ap.add_argument("--horizon", type=float, default=None,
                    help="stop each run at this virtual time (s); a request unfinished by then fails the probe")
    ap.add_argument("--out", required=True, help="search results JSON")
    ap.add_argument("--jobs", type=int, default=1, help="candidates searched at once, in worker processes")
    ap.add_argument("--quiet", action="store_true")
    add_decode_path_arg(ap)
    add_workload_args(ap)
    add_image_args(ap.add_argument_group("images (each candidate's vision tower times them)"))
    return ap


def main(argv: list[str] | None = None) -> int:
    from raycluster.sim.search import expand, load_search, search, table

    args = build_parser().parse_args(argv)
    try:
        spec, base = load_search(args.search)
        expand(spec, base)                  # every candidate's spec checked before any run
    except (OSError, ValueError) as e:
        print(f"raycluster sim-search: bad search file {args.search}: {e}", file=sys.stderr)
        return 2
    workload_from_args(args)                # workload options checked before any run
    if "--qps" in (argv if argv is not None else sys.argv[1:]):
        print("raycluster sim-search: --qps is ignored; the search sets the offered load (the search "
              "file's qps range)", file=sys.stderr)
    say = None if args.quiet else (lambda line: print(line, file=sys.stderr, flush=True))
    from loadgen.images import ImageLoad

    if args.videos:
        print("raycluster sim-search: --videos are not simulated (pictures are: --images)", file=sys.stderr)
        return 2
    images = ImageLoad(args.images, *args.image_size, args.distinct_images) if args.images else None
    if images is not None and any(s.vision is None for _, s in expand(spec, base)):
        print("raycluster sim-search: --images needs a vision tower in every candidate's spec (vision: "
              "clip-vit-l-336 | siglip-so400m-896)", file=sys.stderr)
        return 2
    res = search(spec, base, partial(workload_from_args, args), horizon_s=args.horizon,
                 decode_path=args.decode_path, jobs=max(1, args.jobs), progress=say, images=images)
    res["meta"] = {"argv": list(argv if argv is not None else sys.argv[1:]), "search": args.search,
                   "workload": args.workload, "seed": args.seed, "decode_path": args.decode_path}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=1))
    print(table(res))
    print(f"best: {res['best'] or 'none met the SLOs at qps.min'} (constraints: {'; '.join(res['constraints'])})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
