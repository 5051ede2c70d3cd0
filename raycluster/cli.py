"""The `raycluster` command line.

  raycluster up [--app deployments/NAME.yaml] [--model tiny|PATH] [--policy NAME] [--host H]
                [--port P] [--address RAY_ADDRESS] [--detach] [--no-direct-ingress | --haproxy]
  raycluster down
  raycluster status [--json]
  raycluster scale POOL N [--timeout S]
  raycluster apply [--app F] [--model ...] [--policy ...] [--timeout S]
  raycluster engine-server [--model ...] [--policy ...]     (one engine, no Ray)
  raycluster tiny-model PATH
  raycluster quantize SRC DST --scheme w4a16|w4a16-asym|w8a16|w8a8|fp8|fp8-block|gptq|awq [--group-size G]
  raycluster sim --cluster SPEC.yaml --workload NAME|FILE.jsonl ... --out F.json
  raycluster sim-search --search SEARCH.yaml --workload NAME|FILE.jsonl ... --out F.json
  raycluster bench engine|convoy|policy|profile|kv-transfer|parallel|prefix|guided|images|image-hop ...

`up` runs the cluster (Ray Serve gateway, router, engine pools) on a new local Ray cluster or
the one at `--address`; `--detach` starts it in the background, records its PID under the cache
directory and returns once /health answers; `down` stops it; `status` asks the gateway;
`scale` resizes one pool of the running cluster (the others keep running untouched); a pool
with `autoscaling` is refused (Serve's autoscaler sizes it); `apply` re-applies the running
application with other args (those of `--app F`, or the running ones, and the flags), as
`serve deploy` does: the router takes them in place and Serve replaces the replicas.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from raycluster.cli_state import cluster_file, pid_file
from raycluster.cli_status import cmd_status
from raycluster.engine_flags import add_engine_flags, check_overrides, engine_overrides
from raycluster.server.auth import API_KEY_ENV
from raycluster.server.reasoning import REASONING_PARSERS
from raycluster.server.tool_parsers import TOOL_PARSERS


def _serve(args: argparse.Namespace) -> int:
    if args.cmd == "engine-server":
        from raycluster.cli_engine_server import serve_engine

        return serve_engine(args)
    from deployments.launcher import serve_cluster

    return serve_cluster(args.app, args.model, args.policy, args.host, args.port, address=args.address,
                         dashboard=not args.no_dashboard, direct_ingress=not args.no_direct_ingress,
                         state_file=cluster_file(), prefix_caching=args.enable_prefix_caching,
                         tool_call_parser=args.tool_call_parser, haproxy=args.haproxy,
                         served_model_name=args.served_model_name, engine=engine_overrides(args))


def detach_command(args: argparse.Namespace) -> list[str]:
    """The command `up --detach` (or `engine-server --detach`) runs in the background: the same
    subcommand with every option given, but --detach."""
    cmd = [sys.executable, "-m", "raycluster.cli", args.cmd, "--host", args.host, "--port", str(args.port)]
    for flag in ("model", "policy", "app", "address", "threads", "tool_call_parser", "log_stats_interval",
                 "generation_config", "reasoning_parser", "chat_template", "speculative_config",
                 "lora_resolver_max_loaded", "allowed_local_media_path"):
        if getattr(args, flag, None) is not None:
            cmd += ["--" + flag.replace("_", "-"), str(getattr(args, flag))]
    if getattr(args, "served_model_name", None):
        cmd += ["--served-model-name", *args.served_model_name]
    if getattr(args, "enable_mm_embeds", False):
        cmd.append("--enable-mm-embeds")
    if getattr(args, "limit_mm_per_prompt", None) is not None:
        cmd += ["--limit-mm-per-prompt", json.dumps(args.limit_mm_per_prompt)]
    for name, value in engine_overrides(args).items():
        flag = "--" + name.replace("_", "-")
        if isinstance(value, bool):
            cmd.append(flag if value else "--no-" + flag[2:])
        elif isinstance(value, list):
            cmd += [flag, *value]
        else:
            cmd += [flag, "none" if value is None else str(value)]
    for flag in ("no_dashboard", "no_direct_ingress", "haproxy", "enable_log_requests"):
        if getattr(args, flag, False):
            cmd.append("--" + flag.replace("_", "-"))
    if getattr(args, "enable_prefix_caching", None) is not None:
        cmd.append("--enable-prefix-caching" if args.enable_prefix_caching else "--no-enable-prefix-caching")
    return cmd


def cmd_up(args: argparse.Namespace) -> int:
    if getattr(args, "api_key", None):
        # In the environment, not on a command line or in a config: the engine server reads it
        # there, Ray processes started from here inherit it (the gateway replicas read it), and so
        # does the process `--detach` starts.
        os.environ[API_KEY_ENV] = args.api_key
        if getattr(args, "address", None):
            print(f"raycluster: --api-key with --address: the gateway replicas read {API_KEY_ENV} from their "
                  "nodes' environment; start the cluster's nodes with it set", file=sys.stderr)
    if not args.detach:
        return _serve(args)
    pf = pid_file()
    if pf.exists():
        info = json.loads(pf.read_text())
        if _alive(info["pid"]):
            print(f"raycluster: already running (pid {info['pid']}, {info['url']}); run `raycluster down` first")
            return 1
    pf.parent.mkdir(parents=True, exist_ok=True)
    log = pf.parent / "up.log"
    cmd = detach_command(args)
    with open(log, "ab") as fh:
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://{args.host}:{args.port}"
    pf.write_text(json.dumps({"pid": proc.pid, "url": url, "log": str(log)}))
    from deployments.launcher import wait_healthy

    if not wait_healthy(url + "/health", args.timeout, alive=lambda: proc.poll() is None):
        print(f"raycluster: server did not become healthy; see {log}", file=sys.stderr)
        _stop(proc.pid)
        pf.unlink(missing_ok=True)
        return 1
    print(f"raycluster: up at {url} (pid {proc.pid}, log {log})")
    return 0


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except OSError:
        return False


def _stop(pid: int, timeout: float = 60.0) -> None:
    try:
        os.killpg(pid, signal.SIGTERM)
    except OSError:
        return
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and _alive(pid):
        time.sleep(0.1)
    if _alive(pid):
        os.killpg(pid, signal.SIGKILL)


def cmd_down(args: argparse.Namespace) -> int:
    pf = pid_file()
    if not pf.exists():
        print("raycluster: nothing is running")
        return 0
    info = json.loads(pf.read_text())
    _stop(info["pid"])
    pf.unlink(missing_ok=True)
    print(f"raycluster: stopped pid {info['pid']}")
    return 0


def _join_recorded_cluster() -> dict | None:
    """Connect this process to the cluster a running `up` recorded; its record, or None (said why)."""
    cf = cluster_file()
    if not cf.exists():
        print("raycluster: no running cluster found (start one with `raycluster up`)", file=sys.stderr)
        return None
    info = json.loads(cf.read_text())
    if (os.environ.get("RAY_AUTH_TOKEN") or os.environ.get("RAY_AUTH_TOKEN_PATH")
            or (Path.home() / ".ray" / "auth_token").exists()):
        # Ray 2.60 turns token auth on for clusters it starts; a client joining by address
        # must ask for it (the token itself is read from the same places). Read at import.
        os.environ.setdefault("RAY_AUTH_MODE", "token")
    import ray

    ray.init(address=info["address"], namespace=info["namespace"], logging_level="ERROR",
             log_to_driver=False)
    return info


def cmd_scale(args: argparse.Namespace) -> int:
    """Resize pool POOL to N instances on the cluster a running `up` recorded."""
    info = _join_recorded_cluster()
    if info is None:
        return 1
    import ray

    from deployments import scaling

    try:
        try:
            scaling.scale(info["app"], args.pool, args.n, info.get("http"))
        except (ValueError, LookupError) as e:
            print(f"raycluster scale: {e}", file=sys.stderr)
            return 2
        print(f"raycluster: pool {args.pool} -> {args.n} instance(s); waiting for the replicas ...", flush=True)
        if not scaling.wait_replicas(info["app"], args.pool, args.n, args.timeout):
            print(f"raycluster: pool {args.pool} did not reach {args.n} running replicas within "
                  f"{args.timeout:.0f} s; `raycluster status` shows where it is", file=sys.stderr)
            return 1
        print(f"raycluster: pool {args.pool} has {args.n} running instance(s)")
        return 0
    finally:
        ray.shutdown()


def cmd_apply(args: argparse.Namespace) -> int:
    """Re-apply the running cluster's application with other args, in place (as `serve deploy`)."""
    from pydantic import ValidationError

    from deployments.launcher import load_app_spec, override_args
    from raycluster.cluster.config import ClusterConfig

    try:
        base = load_app_spec(args.app)["args"] if args.app else None
    except (FileNotFoundError, ValueError) as e:
        print(f"raycluster apply: {e}", file=sys.stderr)
        return 2
    info = _join_recorded_cluster()
    if info is None:
        return 1
    import ray

    from deployments import scaling

    try:
        try:
            app = scaling.deployed_app(info["app"])
        except LookupError as e:
            print(f"raycluster apply: {e}", file=sys.stderr)
            return 2
        new_args = override_args(base if base is not None else app.get("args") or {}, args.model, args.policy,
                                 args.enable_prefix_caching, args.tool_call_parser,
                                 served_model_name=args.served_model_name, engine=engine_overrides(args))
        try:
            ClusterConfig(**new_args)           # refuse a bad config before the controller sees it
        except ValidationError as e:
            print(f"raycluster apply: invalid app args: {e}", file=sys.stderr)
            return 2
        if new_args == app.get("args"):
            print("raycluster: nothing to change")
            return 0
        new_app = scaling.applied(app, new_args, replace=base is not None)
        scaling.deploy(new_app, info.get("http"))
        print("raycluster: applied; waiting for the application ...", flush=True)
        status = scaling.wait_applied(info["app"], new_app, args.timeout)
        if status != "RUNNING":
            print(f"raycluster: the application is {status} after {args.timeout:.0f} s; `raycluster status` "
                  "and the Serve logs say why", file=sys.stderr)
            return 1
        print(f"raycluster: running the new config (policy {new_args.get('policy', 'lars')})")
        return 0
    finally:
        ray.shutdown()


def cmd_tiny_model(args: argparse.Namespace) -> int:
    from raycluster.model.tiny import write_tiny_model

    write_tiny_model(args.path, seed=args.seed)
    print(f"raycluster: wrote tiny model to {args.path}")
    return 0


def cmd_quantize(args: argparse.Namespace) -> int:
    from raycluster.model.quant.write import quantize_checkpoint
    from raycluster.model.registry import resolve_model_path

    try:
        qc = quantize_checkpoint(str(resolve_model_path(args.src)), args.dst, args.scheme, args.group_size)
    except (ValueError, FileNotFoundError) as e:
        print(f"raycluster quantize: {e}", file=sys.stderr)
        return 2
    print(f"raycluster: wrote {args.dst} ({qc.method}, {qc.layout}, {qc.bits} bits by {qc.strategy})")
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    import importlib

    benches = {"engine": "engine_bench", "convoy": "convoy_bench", "policy": "policy_bench",
               "profile": "profile_bench", "kv-transfer": "kv_transfer_bench",
               "parallel": "parallel_bench", "prefix": "prefix_bench", "guided": "guided_bench",
               "spec-decode": "spec_bench", "lora": "lora_bench", "window": "window_bench",
               "quant": "quant_bench", "encoder": "encoder_bench", "hybrid-kv": "hybrid_kv_bench",
               "images": "image_bench", "image-hop": "image_hop_bench"}
    if not args.rest or args.rest[0] not in benches:
        print(f"raycluster bench: choose one of {', '.join(benches)}", file=sys.stderr)
        return 2
    mod = importlib.import_module(f"raycluster.bench.{benches[args.rest[0]]}")
    return mod.main(args.rest[1:]) or 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="raycluster", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)

    up = sub.add_parser("up", help="run the cluster (Ray Serve) and serve the model over HTTP")
    up.add_argument("--app", default=None, help="Serve config YAML (default: deployments/local.yaml)")
    up.add_argument("--model", default=None, help="'tiny' (embedded default) or a checkpoint directory")
    up.add_argument("--policy", default=None, help="scheduling policy name (default: the app's, lars)")
    up.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                    help="names the API answers to (vLLM's); responses give the request's, else the first. "
                         "Default: 'tiny' or the checkpoint directory's name")
    up.add_argument("--address", default=None, help="join this Ray cluster instead of starting one")
    up.add_argument("--no-dashboard", action="store_true", help="do not start the Ray dashboard")
    up.add_argument("--no-direct-ingress", action="store_true",
                    help="serve only through Serve's proxy (no per-replica gateway ports)")
    up.add_argument("--haproxy", action="store_true",
                    help="HAProxy instead of Serve's Python proxy on --port (Ray's high-throughput ingress; a "
                         "cluster `up` starts only). Its stats and metrics listeners bind every interface")
    up.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=None,
                    help="every instance reuses (or, with --no-..., does not reuse) the KV of prompt prefixes "
                         "it computed before; default: the app's engine options (on in deployments/*.yaml)")
    up.add_argument("--host", default="127.0.0.1")
    up.add_argument("--port", type=int, default=8000)
    up.add_argument("--detach", action="store_true", help="run in the background; stop with `down`")
    up.add_argument("--tool-call-parser", default=None, choices=sorted(TOOL_PARSERS),
                    help="the model's tool-call syntax, which tool_choice 'auto' needs (vLLM's --tool-call-parser)")
    up.add_argument("--api-key", default=None, help=f"require this bearer token on the API (default: ${API_KEY_ENV}, "
                    "comma-separated keys; /health and /metrics stay open)")
    up.add_argument("--timeout", type=float, default=900.0, help="seconds to wait for health with --detach")
    add_engine_flags(up, skip=("model", "policy", "enable_prefix_caching", "num_threads"))
    up.set_defaults(fn=cmd_up)

    es = sub.add_parser("engine-server", help="serve one engine in this process (no Ray)")
    es.add_argument("--model", default="tiny")
    es.add_argument("--policy", default="lars")
    es.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                    help="names the API answers to (vLLM's); responses give the request's, else the first. "
                         "Default: 'tiny' or the checkpoint directory's name")
    es.add_argument("--host", default="127.0.0.1")
    es.add_argument("--port", type=int, default=8000)
    es.add_argument("--threads", type=int, default=None, help="torch threads of the engine")
    es.add_argument("--chat-template", default=None, metavar="TEMPLATE",
                    help="a Jinja chat template (its text, or a file) instead of the checkpoint's (vLLM's)")
    es.add_argument("--max-stored-responses", type=int, default=1000,
                    help="Responses API: keep this many responses for GET and previous_response_id, the least "
                         "recently used dropped past it (0: store none)")
    es.add_argument("--reasoning-parser", default=None, choices=sorted(REASONING_PARSERS),
                    help="chat replies carry the model's thinking as reasoning_content (vLLM's)")
    es.add_argument("--limit-mm-per-prompt", type=json.loads, default=None, metavar="JSON",
                    help='the most images and videos a request may carry, as vLLM\'s: \'{"image": 4, "video": 1}\' '
                         '(defaults 16 and 2)')
    es.add_argument("--enable-mm-embeds", action="store_true",
                    help="chat messages may give images as precomputed embeddings (image_embeds parts, vLLM's; "
                         "only for trusted clients)")
    es.add_argument("--allowed-local-media-path", default=None, metavar="DIR",
                    help="file: image URLs may read files under DIR (vLLM's; default: refused)")
    es.add_argument("--enable-log-requests", action="store_true",
                    help="log a line per request received (sampling parameters, not the prompt) and per choice "
                         "ended (vLLM's)")
    es.add_argument("--generation-config", choices=("auto", "vllm"), default="auto",
                    help="vLLM's: 'auto' applies the default sampling parameters of the checkpoint's "
                         "generation_config.json to fields a request leaves out; 'vllm' uses the API's own")
    es.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                    help="reuse the KV of prompt prefixes computed before (default on, as in vLLM)")
    es.add_argument("--detach", action="store_true", help="run in the background; stop with `down`")
    es.add_argument("--tool-call-parser", default=None, choices=sorted(TOOL_PARSERS),
                    help="the model's tool-call syntax, which tool_choice 'auto' needs (vLLM's --tool-call-parser)")
    es.add_argument("--api-key", default=None, help=f"require this bearer token on the API (default: ${API_KEY_ENV})")
    es.add_argument("--log-stats-interval", type=float, default=10.0, metavar="S",
                    help="log a line of throughput, requests and KV usage every S seconds while busy (0: never)")
    es.add_argument("--lora-resolver-max-loaded", type=int, default=None, metavar="N",
                    help="with VLLM_LORA_RESOLVER_CACHE_DIR: keep at most N adapters loaded on first use, "
                         "unloading the least recently named one before another")
    es.add_argument("--timeout", type=float, default=300.0)
    add_engine_flags(es, skip=("model", "policy", "enable_prefix_caching", "num_threads"))
    es.set_defaults(fn=cmd_up)

    st = sub.add_parser("status", help="pools, instances, queues and KV usage of the running cluster")
    st.add_argument("--url", default=None, help="gateway URL (default: the one `up --detach` recorded)")
    st.add_argument("--json", action="store_true")
    st.set_defaults(fn=cmd_status)

    sc = sub.add_parser("scale", help="resize one pool of the running cluster")
    sc.add_argument("pool", help="pool role: mixed | prefill-short | prefill-long | decode")
    sc.add_argument("n", type=int, help="instances the pool should have")
    sc.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for the replicas")
    sc.set_defaults(fn=cmd_scale)

    ap = sub.add_parser("apply", help="re-apply the running cluster's app with other args, in place (serve deploy)")
    ap.add_argument("--app", default=None, help="Serve config YAML whose args replace the running ones "
                    "(default: the running args, resized pools included)")
    ap.add_argument("--model", default=None)
    ap.add_argument("--policy", default=None, help="scheduling policy name")
    ap.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                    help="names the API answers to (vLLM's); responses give the request's, else the first. "
                         "Default: 'tiny' or the checkpoint directory's name")
    ap.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=None)
    ap.add_argument("--tool-call-parser", default=None, choices=sorted(TOOL_PARSERS))
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for the application")
    add_engine_flags(ap, skip=("model", "policy", "enable_prefix_caching", "num_threads"))
    ap.set_defaults(fn=cmd_apply)

    down = sub.add_parser("down", help="stop what `up --detach` started")
    down.set_defaults(fn=cmd_down)

    tm = sub.add_parser("tiny-model", help="write the tiny deterministic Llama checkpoint")
    tm.add_argument("path")
    tm.add_argument("--seed", type=int, default=0)
    tm.set_defaults(fn=cmd_tiny_model)

    qz = sub.add_parser("quantize", help="write a checkpoint's weights quantized (round to nearest) in a layout "
                        "the server reads: compressed-tensors, GPTQ, AWQ or FP8")
    qz.add_argument("src", help="'tiny' or a checkpoint directory")
    qz.add_argument("dst")
    from raycluster.model.quant.write import SCHEMES
    qz.add_argument("--scheme", required=True, choices=SCHEMES)
    qz.add_argument("--group-size", type=int, default=128, help="input columns per scale (FP8 blocks: rows and "
                    "columns per block)")
    qz.set_defaults(fn=cmd_quantize)

    sim = sub.add_parser("sim", help="discrete-event cluster simulator (`raycluster sim --help`)", add_help=False)
    sim.add_argument("rest", nargs=argparse.REMAINDER)
    sim.set_defaults(fn=lambda a: __import__("raycluster.sim.cli", fromlist=["main"]).main(a.rest) or 0)

    ss = sub.add_parser("sim-search", help="capacity of candidate clusters within SLOs, by simulation "
                        "(`raycluster sim-search --help`)", add_help=False)
    ss.add_argument("rest", nargs=argparse.REMAINDER)
    bench = sub.add_parser("bench", help="benchmarks that write JSON (`raycluster bench engine --help`)")
    bench.add_argument("rest", nargs=argparse.REMAINDER)
    bench.set_defaults(fn=cmd_bench)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in ("sim", "sim-search", "bench"):     # their own parsers own every flag, --help included
        if argv[0] == "bench":
            return cmd_bench(argparse.Namespace(cmd="bench", rest=argv[1:]))
        from raycluster.sim import cli as sim_cli, search_cli
        return (sim_cli if argv[0] == "sim" else search_cli).main(argv[1:]) or 0
    args = build_parser().parse_args(argv)
    try:
        check_overrides(engine_overrides(args))
    except ValueError as e:
        print(f"raycluster {args.cmd}: {e}", file=sys.stderr)
        return 2
    if args.cmd in ("up", "engine-server") and args.policy is not None:
        from raycluster.sched.registry import policy_names
        if args.policy not in policy_names():
            print(f"raycluster: --policy {args.policy!r} unknown; choose one of {', '.join(policy_names())}",
                  file=sys.stderr)
            return 2
    if args.cmd == "up" and args.haproxy and (args.address or args.no_direct_ingress):
        print("raycluster: --haproxy is for a cluster `up` starts, with direct ingress (not with --address or "
              "--no-direct-ingress): HAProxy forwards to the gateway replicas' own ports, and a joined cluster "
              "keeps the ingress its nodes were started with", file=sys.stderr)
        return 2
    return args.fn(args)


def entry() -> int:
    """The console script: `main`, quiet when its output is piped into a reader that stops early
    (`raycluster status | head`)."""
    try:
        return main()
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())   # no second error at exit
        return 1


if __name__ == "__main__":
    sys.exit(entry())
