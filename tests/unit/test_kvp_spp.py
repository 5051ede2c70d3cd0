"""KVP x SPP (x TP), Medha's 3D parallelism in one engine group: pipeline stages that are each a
KVP group (each KVP rank a TP group when tp > 1), world rank = (stage * kvp + kvp rank) * tp +
lane, ranks as threads over gloo. The group against the single-process runner step by step on
the logits and on the KV its ranks hold (prefill chunks cut into micro-batches of 24 tokens, so
a chunk spans several micro-batches and a sub-chunk attends the earlier ones striped over the
stage's KVP ranks), block moves routed to the (stage layers x lane heads) of the KVP rank
holding each block, an engine's greedy tokens and prompt log-probabilities with prefix caching
over the striped blocks, P/D handoffs into and out of a kvp2xspp2 engine, and the config.
Checkpoints: test_tp.py's tiny (GQA 8/2, 4 layers), Qwen2-style (q/k/v biases, tied embeddings),
o_proj and MLP biases."""

from __future__ import annotations

import pytest
import torch
from test_tp import (UNEVEN_KV, _close, engine_matches_plain, handoff_matches_plain, same_as_single_runner,
                     uneven_kv, variant_models)

from raycluster.engine.config import EngineConfig
from raycluster.parallel.factory import SHARDED_KINDS, build_runner, group_kind
from raycluster.parallel.spp import SPPRunner

BS = 16
BASE = dict(policy="fcfs", packer="token", predictor="none", block_size=BS, num_threads=1, group_timeout_s=30)
CHECKPOINTS = ("tiny", "qwen2", "gqa-bias")


@pytest.fixture(scope="module")
def models(tiny_model_dir, tmp_path_factory):
    return variant_models(CHECKPOINTS, tiny_model_dir, tmp_path_factory)


def _group(model, kvp: int, spp: int, tp: int, blocks_per_rank: int) -> SPPRunner:
    cfg = EngineConfig(**BASE, kv_cache_tokens=blocks_per_rank * BS, kvp=kvp, spp=spp, tp=tp, spp_micro_tokens=24)
    assert group_kind(cfg) in SHARDED_KINDS and cfg.parallel_world == kvp * spp * tp
    runner = build_runner(cfg, model, torch.float32)
    assert isinstance(runner, SPPRunner)
    assert runner.layout == f"kvp{kvp}xspp{spp}" + (f"xtp{tp}" if tp > 1 else "")
    return runner


# ---- a group against the single runner --------------------------------------------------------------
# same_as_single_runner's tables use block ids 3..40: with 32 blocks per KVP rank they span both.
@pytest.mark.parametrize("variant,kvp,spp,tp", [(v, 2, 2, 1) for v in CHECKPOINTS] + [("tiny", 2, 2, 2)])
def test_a_kvp_spp_group_gives_the_single_runners_logits_and_kv_step_by_step(models, variant, kvp, spp, tp):
    model = models[variant]
    per_rank = 32
    runner = _group(model, kvp, spp, tp, per_rank)
    try:
        single = same_as_single_runner(model, runner)
        lo, hi = runner.layer_ranges[0]
        hk = model.config.num_key_value_heads // tp
        kv = runner.stage.kv
        assert kv.shape[:2] == (hi - lo, per_rank) and kv.shape[4] == hk
        assert runner.kv.num_blocks == kvp * per_rank          # every KVP rank's blocks, as plain KVP
        # The leader (stage 0, KVP rank 0, lane 0) holds its layers and lane 0's heads of the
        # blocks below `per_rank`, as the single runner has them.
        torch.testing.assert_close(kv[:, [5, 3, 9]], single.kv_cache[lo:hi, [5, 3, 9], ..., :hk, :],
                                   atol=1e-5, rtol=1e-5)
        # load_blocks routes each block's (layers x heads) to the ranks of its KVP rank in every
        # stage: a round trip gives the data back (blocks on every KVP rank, in any order).
        ids = [per_rank * kvp - 1, 1, per_rank, 2, per_rank + 3]
        data = torch.randn_like(single.kv_cache[:, ids])
        runner.load_blocks(ids, data)
        torch.testing.assert_close(runner.save_blocks(ids), data, atol=0, rtol=0)
        torch.testing.assert_close(kv[:, [1, 2]], data[lo:hi, [1, 3], ..., :hk, :], atol=0, rtol=0)
    finally:
        _close(runner)


def test_a_kvp_spp_group_from_the_checkpoint_reads_only_each_ranks_part(models, tiny_model_dir):
    """Every rank, the leader too, reads its stage's layers from the files (kvp-spp is a
    SHARDED_KIND): the leader's shard has stage 0's layers, the embedding and the output head,
    not the final norm (the last stage's KVP rank 0 norms the rows)."""
    from raycluster.model.loader import load_config
    from raycluster.parallel.shard import Checkpoint, GroupModel

    model = models["tiny"]
    cfg = EngineConfig(**BASE, kv_cache_tokens=32 * BS, kvp=2, spp=2, spp_micro_tokens=24)
    runner = build_runner(cfg, Checkpoint(str(tiny_model_dir), load_config(tiny_model_dir)), torch.float32)
    try:
        assert isinstance(runner.model, GroupModel) and runner.layout == "kvp2xspp2"
        shard = runner.stage.model.model
        assert len(shard.layers) == 2 and shard.norm is None and shard.embed_tokens is not None
        same_as_single_runner(model, runner)
    finally:
        _close(runner)


# ---- the engine -------------------------------------------------------------------------------------
@pytest.mark.parametrize("variant", ["tiny", "qwen2"])
def test_a_kvp_spp_engine_gives_the_plain_engines_tokens_with_prefix_caching(models, variant):
    """Chunks of 48 tokens in micro-batches of 16 through 2 stages of 2 KVP ranks."""
    engine_matches_plain(models[variant], {"kvp": 2, "spp": 2, "spp_micro_tokens": 16}, "kvp2xspp2")


@pytest.mark.parametrize("direction", ["plain-to-kvp-spp", "kvp-spp-to-plain"])
def test_a_handoff_into_or_out_of_a_kvp_spp_engine_gives_the_plain_engines_tokens(models, direction):
    handoff_matches_plain(models["tiny"], {"kvp": 2, "spp": 2, "spp_micro_tokens": 16},
                          direction == "plain-to-kvp-spp")


def test_the_profiler_times_a_kvp_spp_group_on_tables_laid_out_like_its_allocator(models):
    from raycluster.engine.profiler import make_run_batch

    cfg = EngineConfig(**BASE, kv_cache_tokens=1024, kvp=2, spp=2, spp_micro_tokens=64, enable_prefix_caching=True)
    runner = build_runner(cfg, models["tiny"], torch.float32)
    try:
        assert runner.kv.prefix_caching and runner.kv.num_blocks == 2 * 1024 // BS
        run = make_run_batch(runner)
        for prefills, decodes in [([(128, 0)], []), ([(64, 1500)], [1800, 300])]:
            assert run(prefills, decodes) > 0
    finally:
        _close(runner)


# ---- the config -------------------------------------------------------------------------------------
def test_every_combination_of_kvp_spp_and_tp_is_a_group_kind_and_too_many_stages_is_refused(models):
    kinds = {(k, s, t): group_kind(EngineConfig(kvp=k, spp=s, tp=t)) for k in (1, 2) for s in (1, 2) for t in (1, 2)}
    assert kinds == {(1, 1, 1): "single", (2, 1, 1): "kvp", (1, 2, 1): "spp", (1, 1, 2): "tp",
                     (1, 2, 2): "spp-tp", (2, 1, 2): "kvp-tp", (2, 2, 1): "kvp-spp", (2, 2, 2): "kvp-spp-tp"}
    assert EngineConfig(kvp=2, spp=2, tp=2).parallel_world == 8
    with pytest.raises(ValueError, match="spp: 5 stages for 4 layers"):
        build_runner(EngineConfig(**BASE, kvp=2, spp=5), models["tiny"], torch.float32)
    with pytest.raises(ValueError, match=UNEVEN_KV):
        build_runner(EngineConfig(**BASE, kvp=2, spp=2, tp=6), uneven_kv(models["tiny"]), torch.float32)
