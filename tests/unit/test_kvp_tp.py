"""KVP x TP: KVP ranks that are each a TP group (world rank = kvp rank * tp + lane, ranks as
threads over gloo). The group against the single-process runner step by step on the logits and
on the KV its ranks hold, block moves routed to the lanes of the KVP rank holding each block, an
engine's greedy tokens and prompt log-probabilities with prefix caching over the striped blocks,
P/D handoffs into and out of a kvp2xtp2 engine, and what it refuses (uneven heads).
Checkpoints: test_tp.py's tiny (GQA 8/2), Qwen2-style (q/k/v biases, tied embeddings),
o_proj and MLP biases, and MHA (4/4, split four ways)."""

from __future__ import annotations

import pytest
import torch
from test_tp import (UNEVEN_KV, _close, engine_matches_plain, handoff_matches_plain, same_as_single_runner,
                     uneven_kv, variant_models)

from raycluster.engine.config import EngineConfig
from raycluster.parallel.factory import build_runner, group_kind
from raycluster.parallel.kvp import KVPRunner

BS = 16
BASE = dict(policy="fcfs", packer="token", predictor="none", block_size=BS, num_threads=1, group_timeout_s=30)
CHECKPOINTS = ("tiny", "qwen2", "gqa-bias", "mha", "qwen2-moe")



@pytest.fixture(scope="module")
def models(tiny_model_dir, tmp_path_factory):
    return variant_models(CHECKPOINTS, tiny_model_dir, tmp_path_factory)


def _group(model, kvp: int, tp: int, blocks_per_rank: int) -> KVPRunner:
    cfg = EngineConfig(**BASE, kv_cache_tokens=blocks_per_rank * BS, kvp=kvp, tp=tp)
    assert group_kind(cfg) == "kvp-tp" and cfg.parallel_world == kvp * tp
    runner = build_runner(cfg, model, torch.float32)
    assert isinstance(runner, KVPRunner) and runner.layout == f"kvp{kvp}xtp{tp}"
    return runner


# ---- a group against the single runner --------------------------------------------------------------
# same_as_single_runner's tables use block ids 3..40: with 32 blocks per rank (kvp2) they span both
# KVP ranks, with 16 (kvp3) all three.
@pytest.mark.parametrize("variant,kvp,tp,per_rank", [(v, 2, 2, 32) for v in CHECKPOINTS]
                         + [("tiny", 3, 2, 16), ("mha", 2, 4, 32)])
def test_a_kvp_tp_group_gives_the_single_runners_logits_and_kv_step_by_step(models, variant, kvp, tp, per_rank):
    model = models[variant]
    runner = _group(model, kvp, tp, per_rank)
    try:
        single = same_as_single_runner(model, runner)
        hk = model.config.num_key_value_heads // tp
        assert runner.rank0.kv_cache.shape[1] == per_rank and runner.rank0.kv_cache.shape[4] == hk
        assert runner.kv.num_blocks == kvp * per_rank            # every KVP rank's blocks, as plain KVP
        # The leader (KVP rank 0, lane 0) holds lane 0's heads of the blocks below `per_rank`, as
        # the single runner has them.
        torch.testing.assert_close(runner.rank0.kv_cache[:, [5, 3, 9]], single.kv_cache[:, [5, 3, 9], ..., :hk, :],
                                   atol=1e-5, rtol=1e-5)
        # load_blocks routes each block's heads to the lanes of its KVP rank: a round trip gives
        # the data back (blocks on every KVP rank, in any order).
        ids = [per_rank * kvp - 1, 1, per_rank, 2, per_rank + 3]
        data = torch.randn_like(single.kv_cache[:, ids])
        runner.load_blocks(ids, data)
        torch.testing.assert_close(runner.save_blocks(ids), data, atol=0, rtol=0)
        torch.testing.assert_close(runner.rank0.kv_cache[:, [1, 2]], data[:, [1, 3], ..., :hk, :], atol=0, rtol=0)
    finally:
        _close(runner)


# ---- the engine -------------------------------------------------------------------------------------
@pytest.mark.parametrize("variant", CHECKPOINTS)
def test_a_kvp_tp_engine_gives_the_plain_engines_tokens_with_prefix_caching(models, variant):
    engine_matches_plain(models[variant], {"kvp": 2, "tp": 2}, "kvp2xtp2")


@pytest.mark.parametrize("direction", ["plain-to-kvp-tp", "kvp-tp-to-plain"])
def test_a_handoff_into_or_out_of_a_kvp_tp_engine_gives_the_plain_engines_tokens(models, direction):
    handoff_matches_plain(models["tiny"], {"kvp": 2, "tp": 2}, direction == "plain-to-kvp-tp")


def test_the_profiler_times_a_kvp_tp_group_on_tables_laid_out_like_its_allocator(models):
    """An instance's batch-time predictor is fitted on the group itself: synthetic steps (aliased
    striped tables, KV deeper than one KVP rank) run through the lanes too."""
    from raycluster.engine.profiler import make_run_batch

    cfg = EngineConfig(**BASE, kv_cache_tokens=1024, kvp=2, tp=2, enable_prefix_caching=True)
    runner = build_runner(cfg, models["tiny"], torch.float32)
    try:
        assert runner.kv.prefix_caching
        run = make_run_batch(runner)
        for prefills, decodes in [([(128, 0)], []), ([(64, 1500)], [1800, 300]), ([], [4000] * 3)]:
            assert run(prefills, decodes) > 0
    finally:
        _close(runner)


# ---- what it refuses --------------------------------------------------------------------------------
def test_kvp_tp_refuses_uneven_heads(models):
    assert EngineConfig(kvp=2, tp=2).parallel_world == 4
    with pytest.raises(ValueError, match=UNEVEN_KV):
        build_runner(EngineConfig(**BASE, kvp=2, tp=6), uneven_kv(models["tiny"]), torch.float32)
