"""Expert parallelism (`enable_expert_parallel`, vLLM's --enable-expert-parallel over the tp ranks):
each rank holds a whole share of a MoE model's experts instead of a slice of each. The shards
sum to the whole block and read from the checkpoint equal the ones cut in memory; TP, SPP x TP
and KVP x TP groups give the single runner's logits and the plain engine's tokens; what it
refuses. (Experts split over TP ranks: test_tp.py and test_moe.py.)"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from pydantic import ValidationError
from test_shard_load import _same_shard
from test_tp import BASE, BS, VARIANTS, _close, engine_matches_plain, same_as_single_runner

from raycluster.engine.config import EngineConfig
from raycluster.model.loader import load_model
from raycluster.model.tiny import write_tiny_model
from raycluster.parallel.factory import build_runner
from raycluster.parallel.shard import Checkpoint, check_tp, expert_range, load_shard, shard_model

CHECKPOINTS = ("mixtral", "qwen2-moe", "qwen3-moe")


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    return {n: write_tiny_model(tmp_path_factory.mktemp(n), seed=1, **VARIANTS[n]) for n in CHECKPOINTS}


@pytest.fixture(scope="module")
def models(paths):
    return {n: load_model(p)[0] for n, p in paths.items()}


# ---- shards ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name,tp", [("mixtral", 2), ("mixtral", 4), ("qwen2-moe", 2), ("qwen3-moe", 2)])
def test_ep_ranks_hold_whole_experts_and_sum_to_the_block(models, paths, name, tp):
    model = models[name]
    cfg = model.config
    layer = cfg.moe.layers[0]
    shards = [shard_model(model, r, tp, expert_parallel=True) for r in range(tp)]
    whole = model.model.layers[layer].ffn
    for r, s in enumerate(shards):
        block = s.model.layers[layer].ffn
        mine = expert_range(cfg.moe.num_experts, tp, r)
        assert list(block.experts) == [str(e) for e in mine]
        for e in mine:       # whole experts: the full model's own storage, not copies
            for (n, p), (_, q) in zip(block.experts[str(e)].named_parameters(),
                                      whole.experts[str(e)].named_parameters()):
                assert p.data_ptr() == q.data_ptr() and p.shape == q.shape, n
        if whole.shared_expert is not None:     # the shared expert is still split over the ranks
            assert block.shared_expert.down_proj.weight.shape[1] * tp == cfg.moe.shared_intermediate_size
    x = torch.randn(31, cfg.hidden_size, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(sum(s.model.layers[layer].ffn(x) for s in shards), whole(x), atol=1e-5, rtol=1e-5)
    # Read from the files, a rank's shard is the one cut from the model in memory.
    for r in range(tp):
        _same_shard(load_shard(Checkpoint(paths[name], cfg), r, tp, expert_parallel=True), shards[r])


# ---- groups against the single runner and the plain engine ----------------------------------------------
def _group(model, **cfg):
    return build_runner(EngineConfig(**{**BASE, "kv_cache_tokens": 64 * BS, "enable_expert_parallel": True, **cfg}),
                        model, torch.float32)


@pytest.mark.parametrize("name,group,layout", [
    ("mixtral", {"tp": 2}, "tp2ep"), ("qwen2-moe", {"tp": 4}, "tp4ep"),
    ("qwen3-moe", {"spp": 2, "tp": 2, "spp_micro_tokens": 32}, "spp2xtp2ep"),
])
def test_an_ep_group_gives_the_single_runners_logits_step_by_step(models, name, group, layout):
    runner = _group(models[name], **group)
    try:
        assert runner.layout == layout
        same_as_single_runner(models[name], runner)
    finally:
        _close(runner)


@pytest.mark.parametrize("name,group,layout", [
    ("mixtral", {"tp": 2}, "tp2ep"),
    ("qwen2-moe", {"kvp": 2, "tp": 2}, "kvp2xtp2ep"),
    ("qwen3-moe", {"spp": 2, "tp": 2, "spp_micro_tokens": 16}, "spp2xtp2ep"),
])
def test_an_ep_engine_gives_the_plain_engines_tokens_with_prefix_caching(models, name, group, layout):
    engine_matches_plain(models[name], {**group, "enable_expert_parallel": True}, layout)


# ---- what it refuses, and where it does nothing -------------------------------------------------------
def test_ep_needs_tp_and_experts_that_share_out_evenly(models):
    with pytest.raises(ValidationError, match="enable_expert_parallel: the experts are shared out over the tp ranks"):
        EngineConfig(enable_expert_parallel=True)
    cfg = models["mixtral"].config                      # 4 experts
    check_tp(cfg, 4, expert_parallel=True)
    odd = dataclasses.replace(cfg, moe=dataclasses.replace(cfg.moe, num_experts=6))
    with pytest.raises(ValueError, match="enable_expert_parallel: 4 ranks do not share the model's 6 experts"):
        check_tp(odd, 4, expert_parallel=True)
    # Each expert's intermediate size need not split under EP (it is held whole).
    uneven = dataclasses.replace(cfg, moe=dataclasses.replace(cfg.moe, intermediate_size=385))
    with pytest.raises(ValueError, match="moe_intermediate_size"):
        check_tp(uneven, 2)
    check_tp(uneven, 2, expert_parallel=True)


def test_ep_on_a_dense_model_changes_nothing(tiny_model_dir):
    model, _ = load_model(tiny_model_dir)
    runner = _group(model, tp=2)
    try:
        assert runner.layout == "tp2"
        same_as_single_runner(model, runner)
    finally:
        _close(runner)
