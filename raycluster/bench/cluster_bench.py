"""Cluster overhead benchmarks: the Serve gateway + router + instance path vs one in-process engine.

    python -m raycluster.bench.cluster_bench --out FILE.json [--skip-convoy] [--n-ttft 200]
        [--streams 32] [--stream-tokens 128] [--variants default,throughput_optimized,direct_ingress[,haproxy]]

1. TTFT of 1-token requests (16-token prompts, sequential): (a) `LLMEngine.add_request` + `step`
   to the first token in this process, back to back (the headline baseline) and, for context,
   after 10 ms of idle before each request (the cold-cache cost every request through the
   cluster pays, since each finds the instance idle); (b) the cluster (local topology: one mixed instance,
   threads_per_instance=1) over HTTP via the Serve gateway. To locate the added time the cluster
   phase also measures: the Serve HTTP floor (GET /v1/models), one Ray actor round trip to the
   router, and the same 1-token request submitted by a `ClusterClient` in the driver (router +
   instance path without HTTP / Serve proxy / gateway).
2. Streaming: 32 concurrent requests of 128 tokens (ignore_eos) through the engine's own step
   loop vs 32 concurrent SSE streams (httpx async) through the gateway: tokens/s, ratio, and the
   per-stream gap between SSE events (an event carries every token of one router pull).
3. (unless --skip-convoy) the convoy demonstration: `raycluster.bench.cluster_convoy`.

Each cluster variant (default Serve; RAY_SERVE_THROUGHPUT_OPTIMIZED=1; Serve direct ingress,
where the gateway is also measured on its replica's own port, without the proxy hop; and, only
when named, `haproxy`: HAProxy instead of Serve's proxy on the Serve port, in front of direct
ingress, whose stats and metrics listeners bind every interface) runs in a child process of this
one with its flags set before ray.init, so they reach every Ray process and each variant gets a
fresh Ray; the in-process engine baseline runs before and after, here.
Ray: 127.0.0.1 only, no dashboard, temp dir under /tmp; the child tears down what it started.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager

from raycluster.ports import free_port

PROMPT_LEN = 16
IDLE_S = 0.010   # idle time before each request of the engine's second baseline


def pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, int(round(q / 100 * (len(s) - 1)))))]


def summ(xs_s: list[float]) -> dict:
    """Seconds in, milliseconds out."""
    ms = [x * 1e3 for x in xs_s]
    return {"n": len(ms), "p50_ms": pct(ms, 50), "p90_ms": pct(ms, 90), "p99_ms": pct(ms, 99),
            "mean_ms": statistics.fmean(ms) if ms else None}


def prompts(n: int, seed: int = 0, vocab=(6, 4000)) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(*vocab) for _ in range(PROMPT_LEN)] for _ in range(n)]


# ------------------------------------------------------------------ in-process engine baseline
def make_engine(threads: int = 1):
    import torch

    from raycluster.cluster.config import ClusterConfig
    from raycluster.engine.engine import LLMEngine
    from raycluster.model.loader import load_model
    from raycluster.model.registry import resolve_model_path

    torch.set_num_threads(threads)
    cfg = ClusterConfig(threads_per_instance=threads)      # the same engine config as the instance
    ecfg = cfg.engine_config(cfg.pools[0])
    model, _ = load_model(resolve_model_path(ecfg.model))
    return LLMEngine(ecfg, model, tokenizer=None)


def engine_ttft(engine, ps: list[list[int]], warmup: int = 10, idle_s: float = 0.0) -> list[float]:
    """Seconds to the first token of each prompt, one request at a time. `idle_s` sleeps before
    each request: a request that finds the engine idle (as every sequential request through the
    cluster does) pays for cold caches, ~1 ms here, which back-to-back calls never see."""
    from raycluster.request import SamplingParams

    out = []
    for i, p in enumerate(ps[:warmup] + ps):
        if idle_s:
            time.sleep(idle_s)
        t0 = time.perf_counter()
        engine.add_request(f"t{i}", p, SamplingParams(max_tokens=1, ignore_eos=True))
        first = None
        for _ in range(1000):
            res = engine.step()
            if first is None and any(o.new_token_ids for o in res.outputs):
                first = time.perf_counter() - t0
            if not engine.has_unfinished():
                break
        if i >= warmup:
            out.append(first)
    return out


def engine_stream(engine, n: int, tokens: int, seed: int = 1) -> dict:
    from raycluster.request import SamplingParams

    ps = prompts(n, seed)
    times: dict[str, list[float]] = {}
    t0 = time.perf_counter()
    for i, p in enumerate(ps):
        engine.add_request(f"s{seed}-{i}", p, SamplingParams(max_tokens=tokens, ignore_eos=True))
        times[f"s{seed}-{i}"] = []
    deadline = t0 + 600
    steps = 0
    while engine.has_unfinished() and time.perf_counter() < deadline:
        res = engine.step()
        steps += 1
        t = time.perf_counter()
        for o in res.outputs:
            times[o.request_id].extend([t] * len(o.new_token_ids))
    wall = time.perf_counter() - t0
    res = stream_stats(times, wall, t0)
    res["engine_steps"] = steps
    res["wall_per_step_ms"] = 1e3 * wall / max(1, steps)
    return res


def stream_stats(times: dict[str, list[float]], wall: float, t0: float, events: dict | None = None) -> dict:
    total = sum(len(v) for v in times.values())
    gaps = [b - a for v in (events or times).values() for a, b in zip(v, v[1:])]
    ttft = [v[0] - t0 for v in times.values() if v]
    return {"streams": len(times), "tokens": total, "wall_s": wall, "tok_per_s": total / wall if wall else None,
            "gap": summ(gaps), "ttft": summ(ttft),
            "tokens_per_event": total / max(1, sum(len(v) for v in (events or times).values()))}


# ------------------------------------------------------------------ the cluster (child process)
@contextmanager
def local_cluster(cfg: dict, port: int, tmp: str):
    """ray.init (local, 127.0.0.1, no dashboard) + serve.start + serve.run(build_app(cfg)) + /health."""
    import ray
    from ray import serve

    from deployments.app import build_app
    from deployments.launcher import wait_healthy

    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    ray.init(num_cpus=8, include_dashboard=False, namespace="raycluster", _temp_dir=tmp,
             _node_ip_address="127.0.0.1", log_to_driver=False)
    router_name = cfg.get("router_name", "raycluster-router")
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(build_app(cfg), name="raycluster", route_prefix="/", blocking=False)
        url = f"http://127.0.0.1:{port}"
        if not wait_healthy(url + "/health", 300):
            raise RuntimeError("cluster not healthy within 300 s")
        yield url, ray.get_actor(router_name, namespace="raycluster")
    finally:
        for f in (lambda: serve.delete("raycluster"),
                  lambda: ray.kill(ray.get_actor(router_name, namespace="raycluster")),
                  serve.shutdown, ray.shutdown):
            try:
                f()
            except Exception:
                pass


def config_names(ap: argparse.ArgumentParser, text: str, configs: dict) -> list[str]:
    """The comma-separated `--configs` names, each one of `configs` (else a usage error)."""
    names = [n for n in text.split(",") if n]
    if unknown := [n for n in names if n not in configs]:
        ap.error(f"--configs: unknown {', '.join(unknown)}; choose from {', '.join(configs)}")
    return names


def run_configs(module: str, names: list[str], child_argv, done_file, timeout_s: float,
                env: dict | None = None) -> list[str]:
    """Run `python -m module --config NAME ...` (`child_argv(name)` gives the rest) for each
    configuration in its own process, one after the other (a fresh local Ray each); returns the
    names that exited 0 and left `done_file(name)`."""
    done = []
    tag = module.rsplit(".", 1)[-1]
    for name in names:
        print(f"{tag}: {name} ...", flush=True)
        try:
            rc = subprocess.run([sys.executable, "-m", module, "--config", name, *child_argv(name)],
                                env=env, timeout=timeout_s).returncode
        except subprocess.TimeoutExpired:
            rc = -1
        if rc == 0 and os.path.exists(done_file(name)):
            done.append(name)
        else:
            print(f"{tag}: {name} failed (exit {rc})", flush=True)
    return done


def http_ttft(url: str, ps: list[list[int]], warmup: int = 10) -> list[float]:
    import httpx

    out = []
    with httpx.Client(timeout=60) as c:
        for i, p in enumerate(ps[:warmup] + ps):
            body = {"prompt": p, "max_tokens": 1, "temperature": 0, "ignore_eos": True}
            t0 = time.perf_counter()
            r = c.post(url + "/v1/completions", json=body)
            dt = time.perf_counter() - t0
            r.raise_for_status()
            if i >= warmup:
                out.append(dt)
    return out


def http_stream(url: str, n: int, tokens: int, seed: int = 1) -> dict:
    import httpx

    ps = prompts(n, seed)

    async def one(c, p, key, times, events):
        body = {"prompt": p, "max_tokens": tokens, "temperature": 0, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}}
        async with c.stream("POST", url + "/v1/completions", json=body) as r:
            r.raise_for_status()
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                ev = json.loads(line[6:])
                t = time.perf_counter()
                if ev.get("choices"):
                    events[key].append(t)
                if ev.get("usage"):
                    k = ev["usage"]["completion_tokens"]
                    # tokens per event are not in the SSE chunk: spread them over the events
                    ev_t = events[key]
                    times[key] = [ev_t[min(len(ev_t) - 1, j * len(ev_t) // max(1, k))] for j in range(k)]

    async def run():
        times = {i: [] for i in range(n)}
        events = {i: [] for i in range(n)}
        limits = httpx.Limits(max_connections=n + 4, max_keepalive_connections=n + 4)
        async with httpx.AsyncClient(timeout=600, limits=limits) as c:
            t0 = time.perf_counter()
            await asyncio.gather(*(one(c, p, i, times, events) for i, p in enumerate(ps)))
            wall = time.perf_counter() - t0
        return stream_stats(times, wall, t0, events)

    return asyncio.run(run())


def cluster_phase(args) -> dict:
    from raycluster.bench import cluster_probes as probes
    from deployments import direct_ingress, haproxy_ingress

    cfg = {"model": "tiny", "policy": "lars", "threads_per_instance": 1, "pools": [{"role": "mixed", "instances": 1}]}
    ps = prompts(args.n_ttft, seed=0)
    n = min(200, args.n_ttft)
    with tempfile.TemporaryDirectory(prefix="rcb-", dir="/tmp") as tmp:
        os.environ["RAY_TMPDIR"] = tmp
        if os.environ.get(haproxy_ingress.FLAG) == "1":
            haproxy_ingress.enable_env(tmp)
        try:
            with local_cluster(cfg, free_port(), tmp) as (url, router):
                res = {"env": {k: os.environ.get(k, "0") for k in VARIANT_FLAGS}}
                direct = direct_ingress.urls("raycluster")
                res["direct_url"] = direct[0] if direct else None
                http_stream(url, 4, 8, seed=99)                # warm the streaming path
                res["http_ttft"] = summ(http_ttft(url, ps))
                if direct:      # the same requests without Serve's proxy hop, in the same cluster
                    res["http_ttft_direct"] = summ(http_ttft(direct[0], ps))
                    res["http_floor_direct"] = summ(probes.http_get_times(direct[0], n))
                res["client_ttft"] = summ(probes.client_ttft(router, ps))
                res["http_floor"] = summ(probes.http_get_times(url, n))
                res["actor_rtt"] = summ(probes.actor_rtt(router, n))
                res["http_health"] = summ(probes.http_get_times(url, n, "/health"))
                res["null_engine"] = probes.null_engine_ttft(ps)
                res["replica_actor_rtt"] = probes.replica_actor_rtt(url, cfg.get("router_name", "raycluster-router"), 100)
                res["driver_status_rtt"] = summ(probes.actor_rtt(router, 100, "status"))
                res["http_ttft_again"] = summ(http_ttft(direct[0] if direct else url, ps[: max(20, args.n_ttft // 4)],
                                                        warmup=0))
                res["stream"] = http_stream(url, args.streams, args.stream_tokens)
                if direct:
                    res["stream_direct"] = http_stream(direct[0], args.streams, args.stream_tokens, seed=3)
        finally:
            haproxy_ingress.stop_processes()    # HAProxy outlives Ray (a no-op without it)
    return res


# Cluster variants: environment set before the child's ray.init, so every Ray process has it.
VARIANT_FLAGS = ("RAY_SERVE_THROUGHPUT_OPTIMIZED", "RAY_SERVE_ENABLE_DIRECT_INGRESS", "RAY_SERVE_ENABLE_HA_PROXY")
DIRECT = {"RAY_SERVE_ENABLE_DIRECT_INGRESS": "1", "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "2"}
VARIANTS = {
    "default": {},
    "throughput_optimized": {"RAY_SERVE_THROUGHPUT_OPTIMIZED": "1"},
    "direct_ingress": DIRECT,
    # HAProxy on the Serve port, forwarding to the replicas' direct ports (its files go in the
    # child's temp dir: cluster_phase).
    "haproxy": {**DIRECT, "RAY_SERVE_ENABLE_HA_PROXY": "1"},
}


def run_child(args, env_extra: dict) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_SERVE_")}
    env.update(env_extra)
    with tempfile.NamedTemporaryFile(suffix=".json", dir="/tmp", delete=False) as fh:
        out = fh.name
    cmd = [sys.executable, "-m", "raycluster.bench.cluster_bench", "--phase", "cluster", "--out", out,
           "--n-ttft", str(args.n_ttft), "--streams", str(args.streams), "--stream-tokens", str(args.stream_tokens)]
    p = subprocess.run(cmd, env=env, timeout=900)
    if p.returncode != 0:
        return {"error": f"cluster phase exited {p.returncode}"}
    with open(out) as fh:
        res = json.load(fh)
    os.unlink(out)
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m raycluster.bench.cluster_bench", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--n-ttft", type=int, default=200)
    ap.add_argument("--streams", type=int, default=32)
    ap.add_argument("--stream-tokens", type=int, default=128)
    ap.add_argument("--variants", default=",".join(v for v in VARIANTS if v != "haproxy"),
                    help=f"comma-separated cluster variants among {', '.join(VARIANTS)}")
    ap.add_argument("--skip-convoy", action="store_true")
    ap.add_argument("--convoy-args", default="", help="extra arguments for raycluster.bench.cluster_convoy")
    ap.add_argument("--phase", choices=["all", "cluster"], default="all", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)

    if args.phase == "cluster":
        res = cluster_phase(args)
        with open(args.out, "w") as fh:
            json.dump(res, fh, indent=2)
        return 0

    ps = prompts(args.n_ttft, seed=0)
    results: dict = {"meta": {"argv": sys.argv, "n_ttft": args.n_ttft, "prompt_tokens": PROMPT_LEN,
                              "streams": args.streams, "stream_tokens": args.stream_tokens,
                              "threads_per_instance": 1, "cpus": os.cpu_count()}}
    engine = make_engine(1)
    print("engine baseline ...", flush=True)
    base_ttft = engine_ttft(engine, ps)
    idle_ttft = engine_ttft(engine, ps, idle_s=IDLE_S)
    base_stream = engine_stream(engine, args.streams, args.stream_tokens)
    variants = [v for v in args.variants.split(",") if v]
    for name in variants:
        print(f"cluster ({name}) ...", flush=True)
        results[f"cluster_{name}"] = run_child(args, VARIANTS[name])
    print("engine baseline again ...", flush=True)
    base_ttft2 = engine_ttft(engine, ps)
    idle_ttft2 = engine_ttft(engine, ps, idle_s=IDLE_S)
    base_stream2 = engine_stream(engine, args.streams, args.stream_tokens, seed=2)
    results["engine"] = {"ttft": summ(base_ttft), "ttft_after": summ(base_ttft2), "ttft_pooled": summ(base_ttft + base_ttft2),
                         "ttft_idle_pooled": summ(idle_ttft + idle_ttft2), "idle_s": IDLE_S,
                         "stream": base_stream, "stream_after": base_stream2}
    eng_p50 = results["engine"]["ttft_pooled"]["p50_ms"]
    eng_tps = statistics.fmean([base_stream["tok_per_s"], base_stream2["tok_per_s"]])
    for name in variants:
        c = results[f"cluster_{name}"]
        if "error" in c:
            continue
        c["added_p50_ms_http"] = c["http_ttft"]["p50_ms"] - eng_p50
        c["added_p50_ms_router_path"] = c["client_ttft"]["p50_ms"] - eng_p50
        c["added_p50_ms_http_over_client"] = c["http_ttft"]["p50_ms"] - c["client_ttft"]["p50_ms"]
        c["stream_tok_s_ratio_cluster_over_engine"] = c["stream"]["tok_per_s"] / eng_tps
        if c.get("http_ttft_direct"):
            c["added_p50_ms_http_direct"] = c["http_ttft_direct"]["p50_ms"] - eng_p50
            c["added_p50_ms_http_direct_vs_idle_engine"] = (
                c["http_ttft_direct"]["p50_ms"] - results["engine"]["ttft_idle_pooled"]["p50_ms"])
            c["stream_direct_tok_s_ratio"] = c["stream_direct"]["tok_per_s"] / eng_tps
            print(f"[{name}] direct ingress ({c['direct_url']}): 1-token TTFT p50/p99 "
                  f"{c['http_ttft_direct']['p50_ms']:.2f}/{c['http_ttft_direct']['p99_ms']:.2f} ms -> added p50 "
                  f"{c['added_p50_ms_http_direct']:.2f} ms ({c['added_p50_ms_http_direct_vs_idle_engine']:.2f} vs "
                  f"the engine after {IDLE_S * 1e3:.0f} ms idle: "
                  f"{results['engine']['ttft_idle_pooled']['p50_ms']:.2f}; "
                  f"HTTP floor {c['http_floor_direct']['p50_ms']:.2f}); "
                  f"{args.streams} streams {c['stream_direct']['tok_per_s']:.0f} tok/s "
                  f"(ratio {c['stream_direct_tok_s_ratio']:.2f})", flush=True)
        print(f"[{name}] 1-token TTFT p50/p99 ms: engine {eng_p50:.2f}/{results['engine']['ttft_pooled']['p99_ms']:.2f}"
              f"  router-path {c['client_ttft']['p50_ms']:.2f}/{c['client_ttft']['p99_ms']:.2f}"
              f"  http {c['http_ttft']['p50_ms']:.2f}/{c['http_ttft']['p99_ms']:.2f}"
              f"  -> added p50 {c['added_p50_ms_http']:.2f} ms (HTTP floor {c['http_floor']['p50_ms']:.2f},"
              f" actor rtt {c['actor_rtt']['p50_ms']:.2f} from the driver,"
              f" {c.get('replica_actor_rtt', {}).get('inflight', {}).get('p50_ms')} from a Serve replica;"
              f" null-engine router path {c['null_engine']['total']['p50_ms']:.2f})", flush=True)
        s = c["stream"]
        print(f"[{name}] {args.streams} streams x {args.stream_tokens} tok: cluster {s['tok_per_s']:.0f} tok/s vs "
              f"engine {eng_tps:.0f} tok/s (ratio {c['stream_tok_s_ratio_cluster_over_engine']:.2f}); "
              f"SSE event gap p50/p99 {s['gap']['p50_ms']:.1f}/{s['gap']['p99_ms']:.1f} ms, "
              f"{s['tokens_per_event']:.2f} tok/event; engine token gap p50/p99 "
              f"{base_stream['gap']['p50_ms']:.1f}/{base_stream['gap']['p99_ms']:.1f} ms", flush=True)
    with open(args.out, "w") as fh:
        json.dump(results, fh, indent=2)
    if not args.skip_convoy:
        from raycluster.bench import cluster_convoy
        base = os.path.splitext(args.out)[0]
        return cluster_convoy.main(["--out-dir", base + "-convoy"] + args.convoy_args.split())
    return 0


if __name__ == "__main__":
    sys.exit(main())
