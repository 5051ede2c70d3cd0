"""A KVP / SPP / TP / SPP x TP / KVP x TP / KVP x SPP group whose other ranks are Ray actors (and a
TP group with more ranks than the tiny model's 2 KV heads, which it replicates): the same greedy
tokens as one process, and `close` ends the ranks' serve loops and their actors."""

from __future__ import annotations

import random
import time

import pytest

pytestmark = pytest.mark.ray


@pytest.mark.parametrize("group", [{"kvp": 2}, {"spp": 2, "spp_micro_tokens": 64}, {"tp": 2},
                                   {"spp": 2, "tp": 2, "spp_micro_tokens": 64}, {"kvp": 2, "tp": 2},
                                   {"kvp": 2, "spp": 2, "spp_micro_tokens": 64}, {"tp": 4}],
                         ids=["kvp2", "spp2", "tp2", "spp2xtp2", "kvp2xtp2", "kvp2xspp2", "tp4-kv-replicated"])
def test_group_ranks_as_ray_actors_match_the_single_engine(ray_cluster, tiny_model_dir, monkeypatch, group):
    import ray

    from raycluster.engine.config import EngineConfig
    from raycluster.engine.engine import LLMEngine
    from raycluster.request import SamplingParams

    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    rng = random.Random(5)
    prompts = [[rng.randrange(6, 4000) for _ in range(n)] for n in (400, 20, 90)]
    sp = SamplingParams(max_tokens=8, ignore_eos=True)
    base = dict(model=str(tiny_model_dir), policy="fcfs", packer="token", predictor="none",
                kv_cache_tokens=2048, chunk_size=128, num_threads=1)
    single = LLMEngine.from_config(EngineConfig(**base))
    want = single.generate(prompts, sp, max_steps=500)
    engine = LLMEngine.from_config(EngineConfig(**base, **group, group_launch="ray", group_timeout_s=60))
    ranks = engine.runner.ranks
    try:
        assert engine.generate(prompts, sp, max_steps=500) == want
        engine.kv.check()
    finally:
        engine.close()
    plans_run = ray.get(ranks.calls, timeout=5)       # every rank's serve loop returned
    assert len(plans_run) == engine.config.parallel_world - 1 and min(plans_run) > 10
    # close killed the actors; ray.kill is asynchronous, so a call may still land before it.
    deadline = time.monotonic() + 15
    while True:
        try:
            ray.get(ranks.actors[0].__ray_ready__.remote(), timeout=5)
        except ray.exceptions.RayActorError:
            break
        assert time.monotonic() < deadline, "close did not kill the rank's actor"
        time.sleep(0.1)


def test_a_dead_rank_fails_the_step_instead_of_hanging(ray_cluster, tiny_model_dir, monkeypatch):
    import time

    import ray

    from raycluster.engine.config import EngineConfig
    from raycluster.engine.engine import LLMEngine
    from raycluster.request import SamplingParams

    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    engine = LLMEngine.from_config(EngineConfig(
        model=str(tiny_model_dir), policy="fcfs", packer="token", predictor="none", kv_cache_tokens=2048,
        num_threads=1, kvp=2, group_launch="ray", group_timeout_s=10))
    engine.add_request("r", [7] * 50, SamplingParams(max_tokens=50, ignore_eos=True))
    engine.step()
    assert engine.runner.ranks.alive()
    ray.kill(engine.runner.ranks.actors[0])
    t0 = time.monotonic()
    with pytest.raises(RuntimeError):
        for _ in range(50):
            engine.step()
    assert time.monotonic() - t0 < 30
    assert not engine.runner.ranks.alive()      # what the replica's health check reports
