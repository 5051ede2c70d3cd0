"""SPP x TP: pipeline stages that are each a TP group (world rank = stage * tp + lane, ranks as
threads over gloo). The subgroup a stage's lanes all-reduce in, a shard of a stage's layer range,
the group against the single-process runner step by step on the logits and on the KV, an
engine's greedy tokens and prompt log-probabilities with chunked prefill, streamed micro-batches
and prefix caching, P/D handoffs into and out of an spp2xtp2 engine, and what it
refuses. Checkpoints: test_tp.py's (tiny GQA 8/2 with 4 layers; Qwen2-style with q/k/v biases;
Mistral-style; o_proj and MLP biases), each split into 2 stages of 2 TP ranks."""

from __future__ import annotations

import threading

import pytest
import torch
from test_tp import (UNEVEN_KV, engine_matches_plain, handoff_matches_plain, same_as_single_runner, uneven_kv,
                     variant_models)

from raycluster.engine.config import EngineConfig
from raycluster.parallel.factory import build_runner
from raycluster.parallel.group import Collective, GroupAddress
from raycluster.ports import free_port
from raycluster.parallel.spp import SPPRunner
from raycluster.parallel.tp import shard_model
from raycluster.request import SamplingParams

BS = 16
BASE = dict(policy="fcfs", packer="token", predictor="none", block_size=BS, num_threads=1, group_timeout_s=30)
GREEDY = SamplingParams(max_tokens=8, ignore_eos=True)
CHECKPOINTS = ("tiny", "qwen2", "mistral", "gqa-bias", "qwen3-moe")     # qwen3-moe: stages mixing sparse and dense layers



@pytest.fixture(scope="module")
def models(tiny_model_dir, tmp_path_factory):
    return variant_models(CHECKPOINTS, tiny_model_dir, tmp_path_factory)


def _group(model, spp: int, tp: int, **cfg) -> SPPRunner:
    runner = build_runner(EngineConfig(**{**BASE, "kv_cache_tokens": 64 * BS, "spp_micro_tokens": 32, **cfg,
                                          "spp": spp, "tp": tp}), model, torch.float32)
    assert isinstance(runner, SPPRunner) and runner.layout == f"spp{spp}xtp{tp}"
    return runner


def _close(runner: SPPRunner) -> None:
    runner.close()
    runner.close()              # idempotent
    assert runner.ranks.errors == []
    assert not any(t.is_alive() for t in runner.ranks._threads), "ranks did not leave serve_rank"


# ---- the subgroup and the stage's shard ------------------------------------------------------------
def test_subgroups_all_reduce_over_their_members_only_and_send_in_their_own_ranks():
    addr = GroupAddress("127.0.0.1", free_port("127.0.0.1"), 4, timeout_s=30)
    got, errors = {}, []

    def rank(r: int) -> None:
        try:
            coll = Collective(addr, r)
            sub = coll.subgroup([0, 1] if r < 2 else [3, 2])        # members in any order
            t = sub.all_reduce(torch.full((3,), float(r + 1)))
            # Subgroup ranks: in [3, 2], world rank 3 is rank 0 of its subgroup.
            if sub.rank == 0:
                sub.send(torch.full((2,), 10.0 * r), 1).wait()
                other = None
            else:
                other = sub.recv(torch.empty(2), 0).tolist()
            coll.all_reduce(w := torch.ones(1))           # the world's group still works beside it
            got[r] = (sub.rank, sub.world, sub.members, t.tolist(), other, w.item())
        except BaseException as e:      # surfaced below; a thread must not die silently
            errors.append(e)

    threads = [threading.Thread(target=rank, args=(r,), daemon=True) for r in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    assert got[0][:4] == (0, 2, [0, 1], [3.0] * 3) and got[1][:4] == (1, 2, [0, 1], [3.0] * 3)
    assert got[3][:4] == (0, 2, [3, 2], [7.0] * 3) and got[2][:4] == (1, 2, [3, 2], [7.0] * 3)
    assert got[1][4] == [0.0, 0.0] and got[2][4] == [30.0, 30.0]
    assert all(g[5] == 4.0 for g in got.values())


def test_a_subgroup_must_hold_its_rank_once():
    addr = GroupAddress("127.0.0.1", free_port("127.0.0.1"), 1, timeout_s=10)
    coll = Collective(addr, 0)
    for bad in ([1], [0, 0], [0, 1]):
        with pytest.raises(ValueError, match="subgroup"):
            coll.subgroup(bad)


def test_a_stage_shard_holds_its_layer_range_and_its_heads(models):
    model = models["gqa-bias"]                     # 2 layers, 8 heads over 2 KV heads
    full = model.state_dict()
    shard = shard_model(model, 1, 2, layers=range(1, 2))
    assert shard.config.num_hidden_layers == 1 and len(shard.model.layers) == 1
    assert shard.kv_cache_shape(5, BS) == (1, 5, 2, BS, 1, 16)
    # It is layer 1's second half of the heads, not layer 0's.
    torch.testing.assert_close(shard.model.layers[0].self_attn.q_proj.weight,
                               full["model.layers.1.self_attn.q_proj.weight"][64:], atol=0, rtol=0)
    assert shard.model.layers[0].self_attn.o_proj.bias is None          # rank 0 adds it
    for bad in (range(3), range(2, 2), range(0, 2, 2)):
        with pytest.raises(ValueError, match="layers"):
            shard_model(model, 0, 2, layers=bad)


# ---- a group against the single runner --------------------------------------------------------------
@pytest.mark.parametrize("variant,spp,tp", [(v, 2, 2) for v in CHECKPOINTS] + [("tiny", 3, 2)])
def test_an_spp_tp_group_gives_the_single_runners_logits_and_kv_step_by_step(models, variant, spp, tp):
    model = models[variant]
    runner = _group(model, spp, tp)
    try:
        # Each rank holds its stage's layers and its heads of the same blocks.
        single = same_as_single_runner(model, runner)
        lo, hi = runner.layer_ranges[0]
        assert runner.stage.kv.shape[0] == hi - lo
        assert runner.stage.kv.shape[4] == model.config.num_key_value_heads // tp
        # load_blocks routes each (layers x heads) slice to its rank: a round trip through the
        # ranks gives the data back, and the leader holds its own slice.
        data = torch.randn_like(single.kv_cache[:, [1, 2, 7]])
        runner.load_blocks([1, 2, 7], data)
        torch.testing.assert_close(runner.save_blocks([1, 2, 7]), data, atol=0, rtol=0)
        hk = runner.stage.kv.shape[4]
        torch.testing.assert_close(runner.stage.kv[:, [1, 2, 7]], data[lo:hi, ..., :hk, :], atol=0, rtol=0)
    finally:
        _close(runner)


@pytest.mark.parametrize("variant", CHECKPOINTS)
def test_an_spp_tp_engine_gives_the_plain_engines_tokens_with_prefix_caching(models, variant):
    """Chunks of 48 tokens in micro-batches of 16: several micro-batches per step stream through
    the stages."""
    engine_matches_plain(models[variant], {"spp": 2, "tp": 2, "spp_micro_tokens": 16}, "spp2xtp2")


# ---- P/D handoffs -----------------------------------------------------------------------------------
@pytest.mark.parametrize("direction", ["plain-to-spp-tp", "spp-tp-to-plain"])
def test_a_handoff_into_or_out_of_an_spp_tp_engine_gives_the_plain_engines_tokens(models, direction):
    handoff_matches_plain(models["tiny"], {"spp": 2, "tp": 2, "spp_micro_tokens": 16},
                          direction == "plain-to-spp-tp")


# ---- what it refuses --------------------------------------------------------------------------------
def test_spp_tp_refuses_too_many_stages_and_uneven_heads(models):
    tiny = models["tiny"]                          # 4 layers, 8 heads, 2 KV heads
    assert EngineConfig(spp=2, tp=2).parallel_world == 4
    with pytest.raises(ValueError, match="spp: 5 stages for 4 layers"):
        build_runner(EngineConfig(**BASE, spp=5, tp=2), tiny, torch.float32)
    with pytest.raises(ValueError, match=UNEVEN_KV):
        build_runner(EngineConfig(**BASE, spp=2, tp=6), uneven_kv(tiny), torch.float32)
