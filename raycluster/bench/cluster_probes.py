"""Probes that locate the cluster's added latency, run inside a live local cluster.

Each takes what it needs (gateway URL, router handle or name, prompts) and returns seconds
(lists) or `summ` dicts: the Serve HTTP floor (GET /v1/models), /health, one router actor round
trip from the driver and from inside a Serve replica, 1-token requests through a `ClusterClient`
in the driver (router + instance, no HTTP), and the messaging path alone with a fake instance
(`null_engine_ttft`). Used by `raycluster.bench.cluster_bench`.
"""

from __future__ import annotations

import asyncio
import time

from raycluster.bench.cluster_bench import summ


def http_get_times(url: str, n: int, path: str = "/v1/models", warmup: int = 10) -> list[float]:
    """Sequential GETs. `/v1/models` is the HTTP floor (Serve proxy + gateway, no Ray call);
    `/health` adds one router actor call (status) from the replica."""
    import httpx

    out = []
    with httpx.Client(timeout=30) as c:
        for i in range(n + warmup):
            t0 = time.perf_counter()
            c.get(url + path).raise_for_status()
            if i >= warmup:
                out.append(time.perf_counter() - t0)
    return out


def actor_rtt(router, n: int, method: str = "inflight") -> list[float]:
    import ray

    out = []
    for i in range(n + 10):
        t0 = time.perf_counter()
        ray.get(getattr(router, method).remote())
        if i >= 10:
            out.append(time.perf_counter() - t0)
    return out


def client_ttft(router, ps: list[list[int]], warmup: int = 10) -> list[float]:
    """1-token requests through a ClusterClient in the driver: router + instance, no HTTP/Serve."""
    from raycluster.cluster.client import ClusterClient
    from raycluster.request import SamplingParams

    async def run():
        cc = ClusterClient(submit=lambda m: router.submit.remote(m), abort=lambda rid: router.abort.remote(rid),
                           pull=lambda gid, t: router.pull.remote(gid, t), status=lambda: router.status.remote(),
                           tokenizer=None, max_model_len=32768, vocab_size=4096, eos_token_ids=(1,),
                           gateway_id="gw-bench-driver")
        out = []
        for i, p in enumerate(ps[:warmup] + ps):
            t0 = time.perf_counter()
            async for o in cc.generate(cc.next_id(), p, SamplingParams(max_tokens=1, ignore_eos=True)):
                if o.finished:
                    break
            if i >= warmup:
                out.append(time.perf_counter() - t0)
        if cc._pull_task:
            cc._pull_task.cancel()
        return out

    return asyncio.run(run())


def replica_actor_rtt(url: str, router_name: str, n: int) -> dict:
    """Router actor calls made from inside a Serve replica (as the gateway makes them), timed in the
    replica: a throwaway app at /bench-probe awaiting router.inflight / router.status n times."""
    import httpx
    from ray import serve

    @serve.deployment(ray_actor_options={"num_cpus": 0})
    class Probe:
        def __init__(self, name: str) -> None:
            import ray
            self.router = ray.get_actor(name, namespace="raycluster")

        async def __call__(self, request) -> dict:
            out = {}
            for meth in ("inflight", "status"):
                xs = []
                for i in range(n + 10):
                    t0 = time.perf_counter()
                    await getattr(self.router, meth).remote()
                    if i >= 10:
                        xs.append(time.perf_counter() - t0)
                out[meth] = xs
            return out

    serve.run(Probe.bind(router_name), name="bench-probe", route_prefix="/bench-probe", blocking=False)
    try:
        for _ in range(120):
            try:
                r = httpx.get(f"{url}/bench-probe", timeout=60)
                if r.status_code == 200:
                    return {k: summ(v) for k, v in r.json().items()}
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        return {"error": "probe app did not answer"}
    finally:
        try:
            serve.delete("bench-probe")
        except Exception:
            pass


def null_engine_ttft(ps: list[list[int]], warmup: int = 10) -> dict:
    """The messaging path alone: a second router actor, a fake instance thread in this process that
    answers every work item with one token at once (no engine), and a ClusterClient submitting
    1-token requests. Legs (perf_counter, one process): submit -> the instance's poll returns ->
    its push returns -> the client sees the event."""
    import threading

    import ray

    from raycluster.cluster.client import ClusterClient
    from raycluster.cluster.messages import InstanceStats, StepReport, TokenEvent
    from raycluster.cluster.router_actor import RouterActor
    from raycluster.cluster.router_core import RouterConfig
    from raycluster.request import SamplingParams

    router = RouterActor.options(name="bench-null-router", namespace="raycluster").remote(RouterConfig(policy="fcfs"))
    stop = threading.Event()
    seen: dict[str, float] = {}
    pushed: dict[str, float] = {}
    n_work = [0]

    def stats():
        return InstanceStats("null-0", "mixed", kv_free_blocks=4096, kv_total_blocks=4096, work_seen=n_work[0])

    def fake_instance():
        while not stop.is_set():
            reply = ray.get(router.poll.remote("null-0", stats(), 0.5))
            if not reply.work:
                continue
            t = time.perf_counter()
            n_work[0] += len(reply.work)
            for w in reply.work:
                seen[w.meta.request_id] = t
            ray.get(router.push.remote(StepReport(stats(), [TokenEvent(w.meta.request_id, [7], True, "length")
                                                            for w in reply.work])))
            t = time.perf_counter()
            for w in reply.work:
                pushed[w.meta.request_id] = t

    th = threading.Thread(target=fake_instance, daemon=True)
    th.start()
    deadline = time.monotonic() + 60          # registered once its first poll reached the router
    while not ray.get(router.status.remote())["instances"] and time.monotonic() < deadline:
        time.sleep(0.1)

    async def run():
        cc = ClusterClient(submit=lambda m: router.submit.remote(m), abort=lambda rid: router.abort.remote(rid),
                           pull=lambda gid, t: router.pull.remote(gid, t), status=lambda: router.status.remote(),
                           tokenizer=None, max_model_len=32768, vocab_size=4096, eos_token_ids=(1,),
                           gateway_id="gw-bench-null")
        legs = {"total": [], "submit_to_poll": [], "poll_to_push_done": [], "push_done_to_client": []}
        for i, p in enumerate(ps[:warmup] + ps):
            rid = cc.next_id()
            t0 = time.perf_counter()
            async for o in cc.generate(rid, p, SamplingParams(max_tokens=1, ignore_eos=True)):
                if o.finished:
                    break
            t1 = time.perf_counter()
            if i >= warmup and rid in seen and rid in pushed:
                legs["total"].append(t1 - t0)
                legs["submit_to_poll"].append(seen[rid] - t0)
                legs["poll_to_push_done"].append(pushed[rid] - seen[rid])
                legs["push_done_to_client"].append(t1 - pushed[rid])
        if cc._pull_task:
            cc._pull_task.cancel()
        return legs

    try:
        legs = asyncio.run(run())
    finally:
        stop.set()
        th.join(2.0)
        ray.kill(router)
    return {k: summ(v) for k, v in legs.items()}
