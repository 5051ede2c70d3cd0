"""KV-cache parallelism: the striped allocator, each rank's share, and a KVP group (ranks as
threads over gloo) against the single-process runner -- step by step on the hidden states, and
end to end on greedy tokens, including a context no single rank can hold."""

from __future__ import annotations

import random

import pytest
import torch
from pydantic import ValidationError

from raycluster.cluster.config import ClusterConfig
from raycluster.engine.config import EngineConfig
from raycluster.engine.engine import InvalidRequestError, LLMEngine
from raycluster.engine.kv_manager import KVCacheManager
from raycluster.engine.model_runner import ModelRunner
from raycluster.engine.scheduler import SchedulerOutput
from raycluster.model.loader import load_model
from raycluster.parallel.factory import build_runner
from raycluster.parallel.kvp import local_share
from raycluster.parallel.kvp_layout import StripedAllocator
from raycluster.parallel.plan import step_plan
from raycluster.request import Request, SamplingParams

BASE = dict(policy="fcfs", packer="token", predictor="none", block_size=16)


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return load_model(tiny_model_dir)[0]


def test_striped_allocator_places_logical_block_i_on_rank_i_mod_world():
    a = StripedAllocator(blocks_per_rank=4, world=2)
    assert a.allocate(5, 0) == [0, 4, 1, 5, 2]          # ranks 0,1,0,1,0
    assert a.allocate(2, 5) == [6, 3]                     # indices 5, 6 -> ranks 1, 0
    assert a.num_free == 1 and a.free_blocks() == [7]
    assert a.can_allocate(1, 1) and not a.can_allocate(1, 0)   # rank 0 is full, rank 1 is not
    with pytest.raises(RuntimeError, match="free per rank"):
        a.allocate(1, 2)
    a.free(4)
    a.free_all([0, 1])
    assert sorted(a.free_blocks()) == [0, 1, 4, 7] and a.num_free == 4
    with pytest.raises(ValueError, match="double free"):
        a.free(0)
    kv = KVCacheManager(8, 16, StripedAllocator(4, 2))
    req = Request("r", list(range(70)), SamplingParams())
    assert kv.try_allocate(req, 70)
    assert kv.block_tables["r"] == [0, 4, 1, 5, 2]
    kv.check()
    kv.free("r")
    kv.check()
    assert kv.num_free_blocks == 8


def test_local_share_counts_each_ranks_tokens():
    table = [0, 4, 1, 5, 2]                 # blocks_per_rank 4, world 2, block 16
    assert local_share(table, 70, 0, 16, 4) == ([0, 1, 2], 16 + 16 + 6)
    assert local_share(table, 70, 1, 16, 4) == ([0, 1], 32)
    assert local_share(table, 48, 1, 16, 4) == ([0], 16)     # last block (index 2) is rank 0's
    assert local_share(table, 17, 1, 16, 4) == ([0], 1)
    assert local_share(table, 16, 1, 16, 4) == ([], 0)
    # Any table works: ownership is by block id (rank 1 holds ids 4..7), not by position.
    assert local_share([4, 5, 0, 6], 60, 1, 16, 4) == ([0, 1, 2], 16 + 16 + 12)
    assert local_share([4, 5, 0, 6], 60, 0, 16, 4) == ([0], 16)
    a = StripedAllocator(4, 2)
    assert a.alias_table(5, 3) == [3, 7, 0, 4, 1]       # logical block i on rank i % 2, like allocate


def _scripted_steps(kv: KVCacheManager, block_size: int, drafts: bool = False) -> list:
    """Step plans of two requests: a 300-token prompt in chunks of 100 (chunk starts mid-block),
    a 40-token one joining in the second step, then decodes of both; with `drafts`, two more
    decode steps run draft tokens (speculative decoding: several decode rows of one request,
    across a block edge)."""
    rng = random.Random(1)
    a = Request("a", [rng.randrange(6, 4000) for _ in range(300)], SamplingParams())
    b = Request("b", [rng.randrange(6, 4000) for _ in range(40)], SamplingParams())
    steps = [([(a, 100)], [], {}), ([(a, 100), (b, 40)], [], {}), ([(a, 100)], [b], {})] \
        + [([], [a, b], {})] * 5 + [([], [a, b], {"b": [11, 12, 13]}), ([], [a, b], {"a": [14] * 8, "b": [15]})][:2 * drafts]
    plans = []
    for prefills, decodes, spec in steps:
        for r, n in prefills:
            assert kv.try_allocate(r, n)
        for r in decodes:
            assert kv.try_allocate(r, 1 + len(spec.get(r.request_id, ())))
        plans.append(step_plan(SchedulerOutput(prefills, decodes, spec_tokens=spec), kv.block_tables)[0])
        for r, n in prefills:
            r.num_computed_tokens += n
            if r.num_computed_tokens == r.num_prompt_tokens:
                r.output_token_ids.append(rng.randrange(6, 4000))
        for r in decodes:
            for t in spec.get(r.request_id, []):      # every draft accepted
                r.num_computed_tokens += 1
                r.output_token_ids.append(t)
            r.num_computed_tokens += 1
            r.output_token_ids.append(rng.randrange(6, 4000))
    return plans


@pytest.mark.parametrize("world", [2, 3])
def test_kvp_group_matches_the_single_runner_step_by_step(model, world):
    bs, per_rank = 16, 16
    cfg = EngineConfig(**BASE, kv_cache_tokens=per_rank * bs, kvp=world, group_timeout_s=30)
    kvp = build_runner(cfg, model, torch.float32)
    try:
        plans = _scripted_steps(kvp.kv, bs, drafts=True)
        single = ModelRunner(model, KVCacheManager(per_rank * world, bs))   # same global block ids
        used = {b // per_rank for p in plans for t in p.prefill_tables + p.decode_tables for b in t}
        assert used == set(range(world))
        for plan in plans:
            want, got = single.run_plan(plan), kvp.run_plan(plan)
            assert got.shape == want.shape
            torch.testing.assert_close(got, want, atol=2e-4, rtol=1e-4)
    finally:
        kvp.close()
    for t in kvp.ranks._threads:
        assert not t.is_alive()
    assert kvp.ranks.errors == []


def _generate(model, prompts, **cfg):
    engine = LLMEngine(EngineConfig(**BASE, **cfg), model)
    try:
        out = engine.generate(prompts, SamplingParams(max_tokens=10, ignore_eos=True), max_steps=500)
        engine.kv.check()
        assert engine.kv.num_free_blocks == engine.kv.num_blocks
        return out
    finally:
        engine.close()


def test_kvp_engine_greedy_tokens_equal_and_it_holds_a_context_no_rank_can(model):
    rng = random.Random(0)
    prompts = [[rng.randrange(6, 4000) for _ in range(n)] for n in (700, 33, 150, 1)]
    want = _generate(model, prompts, kv_cache_tokens=4096, chunk_size=100)
    assert _generate(model, prompts, kv_cache_tokens=512, chunk_size=100, kvp=2, group_timeout_s=30) == want
    # 700 + 10 tokens need 45 blocks: more than one rank's 32, fewer than two ranks' 64.
    with pytest.raises(InvalidRequestError):
        _generate(model, prompts[:1], kv_cache_tokens=512, chunk_size=100)
    assert _generate(model, prompts[:1], kv_cache_tokens=512, chunk_size=100, kvp=2,
                     group_timeout_s=30) == want[:1]


def test_parallel_config_errors_name_the_field():
    assert EngineConfig(kvp=2, spp=2).parallel_world == 4      # KVP x SPP: tests/unit/test_kvp_spp.py
    with pytest.raises(ValidationError, match="kvp"):
        EngineConfig(kvp=0)
    ClusterConfig(pools=[{"role": "prefill-long", "engine": {"spp": 2}}, {"role": "decode", "engine": {"kvp": 2}}])
    ClusterConfig(pools=[{"role": "mixed", "engine": {"kvp": 2, "group_launch": "ray"}}])


def test_every_topology_file_is_a_valid_cluster_config():
    import pathlib

    import yaml

    files = sorted((pathlib.Path(__file__).parents[2] / "deployments").glob("*.yaml"))
    assert {f.name for f in files} >= {"local.yaml", "mixed.yaml", "pd.yaml", "kvp.yaml"}
    for f in files:
        [app] = yaml.safe_load(f.read_text())["applications"]
        ClusterConfig(**app["args"])


@pytest.mark.parametrize("caching", [False, True], ids=["plain", "prefix-caching"])
def test_the_profiler_times_a_kvp_group_on_tables_laid_out_like_its_allocator(model, caching):
    """The batch-time predictor of a KVP instance is fitted on the group itself: synthetic
    steps (aliased tables, KV deeper than one rank) must run through it, with the striped
    caching allocator too."""
    from raycluster.engine.profiler import make_run_batch

    cfg = EngineConfig(**BASE, kv_cache_tokens=1024, kvp=2, group_timeout_s=30, enable_prefix_caching=caching)
    runner = build_runner(cfg, model, torch.float32)
    try:
        assert runner.kv.prefix_caching is caching
        run = make_run_batch(runner)
        for prefills, decodes in [([(128, 0)], []), ([(64, 1500)], [1800, 300]), ([], [4000] * 3)]:
            assert run(prefills, decodes) > 0
    finally:
        runner.close()
    assert runner.ranks.errors == []
