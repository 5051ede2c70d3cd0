"""KV in and out of KVP / SPP groups (ranks as threads): blocks collected from a group equal the
single runner's KV for the same prefill; blocks loaded into a group decode exactly as the single
runner does; the staging port hands its blocks back."""

from __future__ import annotations

import random

import pytest
import torch

from raycluster.engine.config import EngineConfig
from raycluster.engine.kv_manager import KVCacheManager
from raycluster.engine.model_runner import ModelRunner
from raycluster.model.loader import load_model
from raycluster.parallel.factory import build_runner
from raycluster.parallel.plan import StepPlan
from raycluster.request import Request, SamplingParams

BS = 16
GROUPS = [{"kvp": 2}, {"kvp": 3}, {"spp": 2, "spp_micro_tokens": 64}, {"spp": 4, "spp_micro_tokens": 64}]


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return load_model(tiny_model_dir)[0]



def _group(model, **kw):
    cfg = EngineConfig(policy="fcfs", packer="token", predictor="none", block_size=BS, kv_cache_tokens=BS * 64,
                       group_timeout_s=30, **kw)
    return build_runner(cfg, model, torch.float32)


def _prefill_plans(kv: KVCacheManager, n: int, seed: int) -> tuple[Request, list[StepPlan]]:
    rng = random.Random(seed)
    req = Request(f"r{seed}", [rng.randrange(6, 4000) for _ in range(n)], SamplingParams())
    assert kv.try_allocate(req, n + 1)
    table = kv.block_tables[req.request_id]
    plans = [StepPlan(req.prompt_token_ids[s:s + 100], [s], [min(100, n - s)], [table], [], [],
                      [min(100, n - s) - 1] if s + 100 >= n else []) for s in range(0, n, 100)]
    return req, plans


@pytest.mark.parametrize("group", GROUPS, ids=lambda g: "-".join(f"{k}{v}" for k, v in g.items()))
def test_blocks_saved_from_a_group_equal_the_single_runners_kv(model, group):
    runner = _group(model, **group)
    try:
        req, plans = _prefill_plans(runner.kv, 250, 1)
        single = ModelRunner(model, KVCacheManager(runner.kv.num_blocks, BS))
        for p in plans:
            single.run_plan(p)
            runner.run_plan(p)
        ids = runner.kv.block_tables[req.request_id]
        got = runner.save_blocks(ids)
        want = single.kv_cache[:, ids]         # slots past the prompt are zero in both
        assert got.shape == want.shape and want.abs().sum() > 0
        torch.testing.assert_close(got, want, atol=2e-4, rtol=1e-4)
        # Staging an offer copies the same data and frees its staging blocks on unstage.
        port = runner.port
        free = port.allocator.num_free
        staged = port.stage(req.request_id, ids)
        torch.testing.assert_close(port.tensor[:, staged], got)
        port.unstage(req.request_id)
        assert port.allocator.num_free == free
    finally:
        runner.close()


@pytest.mark.parametrize("group", GROUPS, ids=lambda g: "-".join(f"{k}{v}" for k, v in g.items()))
def test_blocks_loaded_into_a_group_decode_like_the_single_runner(model, group):
    single = ModelRunner(model, KVCacheManager(128, BS))
    req, plans = _prefill_plans(single.kv, 230, 2)
    for p in plans:
        single.run_plan(p)
    src = single.kv.block_tables[req.request_id]
    runner = _group(model, **group)
    try:
        assert runner.kv.try_allocate(req, 231)
        dst = runner.kv.block_tables[req.request_id]
        free = runner.port.allocator.num_free
        # Through the port, as a connector's pull would: data lands in staging, then the ranks.
        assert runner.port.receive(dst, lambda ids: runner.port.tensor.index_copy_(
            1, torch.tensor(ids), single.kv_cache[:, src]) is not None)
        assert runner.port.allocator.num_free == free
        for step in range(3):
            want = single.run_plan(StepPlan([11 + step], [], [], [], [230 + step], [src], [0]))
            got = runner.run_plan(StepPlan([11 + step], [], [], [], [230 + step], [dst], [0]))
            torch.testing.assert_close(got, want, atol=2e-4, rtol=1e-4)
        assert not runner.port.receive(dst, lambda ids: False)      # a failed pull loads nothing
        assert runner.port.allocator.num_free == free
    finally:
        runner.close()
