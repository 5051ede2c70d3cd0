"""A mixed pool that scales to zero (min_instances 0) on a local Ray cluster with Serve's own
autoscaler and the router-probing policy (raycluster.cluster.autoscale): it is deployed with no
instance and stays at zero while idle; a request waits in the router's queue, the policy's probe
sees it, Serve starts one replica (0 -> 1) and the request completes with the single engine's
greedy text; idle again, the pool goes back to zero after downscale_to_zero_delay_s, and a second
request brings it back. Every wait is bounded (a failure, never a hang)."""

from __future__ import annotations

import asyncio
import random
import threading
import time

import httpx
import pytest
from cluster_http import complete
from serve_app import deployed_app

pytestmark = [pytest.mark.ray, pytest.mark.e2e, pytest.mark.slow]     # ~2 min: CI runs it (RUN_SLOW=1)

ROUTER = "router-scale-zero"
CFG = {"model": "tiny", "policy": "fcfs", "threads_per_instance": 1, "max_local_waiting": 2,
       "router_name": ROUTER,
       "engine": {"kv_cache_tokens": 4096, "packer": "token", "predictor": "none"},
       "pools": [{"role": "mixed", "instances": 0, "autoscaling": {
           "min_instances": 0, "max_instances": 1, "target_per_instance": 2,
           "target_tokens_per_instance": 100000,        # both units through Serve's controller (not binding)
           "upscale_delay_s": 1.0, "downscale_delay_s": 2.0, "downscale_to_zero_delay_s": 4.0,
           "metrics_interval_s": 0.5, "look_back_period_s": 2.0}}]}
OUT_TOKENS = 24



@pytest.fixture(scope="module")
def prompts(tiny_model_dir):
    """Two prompts with the single engine's greedy text."""
    from raycluster.engine.config import EngineConfig
    from raycluster.engine.engine import LLMEngine
    from raycluster.model.loader import load_model
    from raycluster.model.tokenizer import Tokenizer
    from raycluster.request import SamplingParams

    rng = random.Random(23)
    ps = [[rng.randrange(6, 4000) for _ in range(n)] for n in (40, 90)]
    model, mcfg = load_model(tiny_model_dir)
    tok = Tokenizer(tiny_model_dir, mcfg.eos_token_id)
    eng = LLMEngine(EngineConfig(policy="fcfs", packer="token", kv_cache_tokens=8192), model)
    outs = eng.generate(ps, [SamplingParams(max_tokens=OUT_TOKENS, ignore_eos=True)] * len(ps))
    return [(p, tok.decode(o)) for p, o in zip(ps, outs)]


@pytest.fixture(scope="module")
def cluster(ray_cluster):
    # Healthy with no instance: the router has a pool that starts one on demand.
    with deployed_app(CFG, ROUTER, 120, "scale-to-zero cluster") as url:
        yield url


class _Watch:
    """Samples the pool's RUNNING replicas and the router's instances every 0.2 s, in a thread."""

    def __init__(self) -> None:
        import ray

        from deployments import scaling

        self.samples: list[tuple[float, int, int]] = []     # (time, replicas, router instances)
        self.targets: list[tuple[float, int]] = []          # (time, Serve's target replica count)
        self._router = ray.get_actor(ROUTER, namespace="raycluster")
        self._scaling = scaling
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    def _run(self) -> None:
        import ray

        while not self._stop.is_set():
            try:
                details = self._scaling._client().get_serve_details()
                dep = details["applications"]["raycluster"]["deployments"]["pool-mixed"]
                n = sum(1 for r in dep.get("replicas", []) if r.get("state") == "RUNNING")
                st = ray.get(self._router.status.remote(), timeout=5)
                now = time.monotonic()
                self.samples.append((now, n, len(st["instances"])))
                self.targets.append((now, dep["target_num_replicas"]))
                self.status = st
            except Exception:       # noqa: BLE001 -- a missed sample is not a failure
                pass
            self._stop.wait(0.2)

    def last(self) -> tuple[int, int]:
        return self.samples[-1][1:] if self.samples else (-1, -1)

    def wait(self, pred, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.samples and pred(*self.last()):
                return True
            time.sleep(0.2)
        return False

    def first(self, pred, since: float) -> float | None:
        return next((t for t, n, i in self.samples if t >= since and pred(n, i)), None)

    def stop(self) -> None:
        self._stop.set()
        self._t.join(5)


def _one(url: str, prompt, timeout_s: float) -> str:
    async def go() -> str:
        async with httpx.AsyncClient(timeout=timeout_s) as c:
            return await asyncio.wait_for(complete(c, url, prompt, OUT_TOKENS, stream=False), timeout_s)
    return asyncio.run(go())


def test_pool_scales_from_zero_for_a_request_and_back_to_zero_when_idle(cluster, prompts):
    url = cluster
    watch = _Watch()
    try:
        # Deployed at zero, and stays there while idle (the probe sees an empty queue).
        assert watch.wait(lambda n, i: n == 0 and i == 0, 30), watch.samples[-3:]
        t_idle = time.monotonic()
        time.sleep(5)
        assert all(n == 0 and i == 0 for t, n, i in watch.samples if t >= t_idle), watch.samples[-10:]
        assert all(k == 0 for t, k in watch.targets if t >= t_idle), watch.targets[-10:]

        timings = []
        for round_, (prompt, want) in enumerate(prompts):
            t0 = time.monotonic()
            text = _one(url, prompt, 150)          # waits in the router's queue while a replica starts
            t_done = time.monotonic() - t0
            assert text == want, (round_, text, want)
            t_reg = watch.first(lambda n, i: i >= 1, t0)
            t_run = watch.first(lambda n, i: n >= 1, t0)
            assert t_reg is not None, watch.samples[-5:]
            # Idle again: back to zero after downscale_to_zero_delay_s (4 s) plus Serve's window.
            t1 = time.monotonic()
            assert watch.wait(lambda n, i: n == 0 and i == 0, 60), (round_, watch.samples[-5:])
            t_zero = time.monotonic() - t1
            # And stays there: Serve's target does not come back up with nothing queued.
            t2 = time.monotonic()
            time.sleep(6)
            flaps = [(t - t2, k) for t, k in watch.targets if t >= t2 and k != 0]
            assert not flaps, (round_, flaps)
            assert watch.status["inflight"] == 0 and watch.status["queue_depth"] == 0, watch.status
            timings.append((t_reg - t0, (t_run - t0) if t_run else None, t_done, t_zero))
        for k, (reg, run, done, zero) in enumerate(timings):
            print(f"\nround {k}: instance registered with the router {reg:.1f} s after the request, replica "
                  f"RUNNING at {run if run is None else round(run, 1)} s, request done at {done:.1f} s; "
                  f"back to zero {zero:.1f} s after it")
    finally:
        watch.stop()
