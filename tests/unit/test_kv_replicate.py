"""KV heads replicated when tp exceeds them (vLLM's placement): rank r of tp holds the one KV head
r // (tp / Hkv), so tp / Hkv consecutive ranks share it. Against the single-process runner and
the plain engine, for every group kind that shards by TP (tp, spp-tp, kvp-tp, kvp-spp-tp): the
head placement and what check_tp refuses, each rank's weight rows (cut in memory and read from
the files), step-by-step logits, the KV every rank holds (every replica its own copy) and the KV
gathered back (each head once, from its first holder), the bytes a handoff moves, engine tokens
and prompt log-probabilities with prefix caching, P/D handoffs both ways, an engine built from the
path, and the simulator's memory model. Checkpoints: test_tp.py's "kv-rep" (Qwen3-style, 8 heads
over 2 KV heads, k_norm, q/k/v/o biases) and "mqa" (4 heads over 1 KV head, biases)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from test_shard_load import BASE as PATH_BASE
from test_shard_load import _prompts, _run, _same_run, _same_shard
from test_tp import (BS, UNEVEN_KV, VARIANTS, _close, engine_matches_plain, handoff_matches_plain,
                     same_as_single_runner, uneven_kv)

from raycluster.engine.config import EngineConfig
from raycluster.engine.engine import LLMEngine
from raycluster.engine.kv_manager import KVCacheManager
from raycluster.engine.model_runner import plan_logits
from raycluster.model.loader import load_model
from raycluster.model.tiny import write_tiny_model
from raycluster.parallel.factory import build_runner
from raycluster.parallel.group import Collective, GroupAddress, ThreadRanks
from raycluster.ports import free_port
from raycluster.parallel.kv_port import rank_handler
from raycluster.parallel.kvp import KVPRunner
from raycluster.parallel.plan import StepPlan
from raycluster.parallel.shard import (Checkpoint, check_tp, kv_heads_of, kv_holder, kv_split, load_shard,
                                       shard_config, shard_layer_state, shard_model)
from raycluster.parallel.spp import SPPRunner
from raycluster.parallel.tp import TPRank, TPRunner

torch.set_num_threads(1)
NAMES = ("kv-rep", "mqa")
BASE_CFG = dict(policy="fcfs", packer="token", predictor="none", block_size=BS, num_threads=1, group_timeout_s=30)


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    return {n: write_tiny_model(tmp_path_factory.mktemp(n), seed=1, **VARIANTS[n]) for n in NAMES}


@pytest.fixture(scope="module")
def models(paths):
    return {n: load_model(p)[0] for n, p in paths.items()}


# ---- placement --------------------------------------------------------------------------------------
def test_heads_are_placed_as_vllm_does_and_each_ranks_query_heads_read_its_kv_head():
    # (Hkv, tp): heads of each rank, and which ranks are the first holders
    assert [kv_heads_of(2, 4, r) for r in range(4)] == [(0, 1), (0, 1), (1, 1), (1, 1)]
    assert [kv_holder(2, 4, r) for r in range(4)] == [True, False, True, False]
    assert [kv_heads_of(4, 8, r)[0] for r in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]      # Qwen2-7B at tp 8
    assert [kv_heads_of(1, 4, r) for r in range(4)] == [(0, 1)] * 4                     # MQA
    assert [kv_holder(1, 4, r) for r in range(4)] == [True, False, False, False]
    assert [kv_heads_of(8, 2, r) for r in range(2)] == [(0, 4), (4, 4)] and kv_split(8, 2) == (4, 1)
    assert all(kv_holder(8, 2, r) for r in range(2)) and kv_split(2, 8) == (1, 4)
    for hq, hkv in ((8, 2), (4, 1), (28, 4), (32, 8), (64, 8), (16, 16)):
        for tp in range(1, hq + 1):
            if hq % tp or (hkv % tp and tp % hkv):
                continue
            group = hq // hkv
            for r in range(tp):
                first, n = kv_heads_of(hkv, tp, r)
                q = range(r * hq // tp, (r + 1) * hq // tp)
                assert {h // group for h in q} <= set(range(first, first + n)), (hq, hkv, tp, r)


def test_check_tp_accepts_a_multiple_of_the_kv_heads_and_refuses_the_rest(models):
    cfg = models["kv-rep"].config                  # 8 heads, 2 KV heads, intermediate 256
    for tp in (1, 2, 4, 8):
        check_tp(cfg, tp)
    sub = shard_config(cfg, 4)
    assert (sub.num_attention_heads, sub.num_key_value_heads, sub.intermediate_size) == (2, 1, 64)
    with pytest.raises(ValueError, match="tp: 3 ranks do not divide the model's num_attention_heads"):
        check_tp(cfg, 3)
    with pytest.raises(ValueError, match="tp: 4 ranks do not divide the model's intermediate_size"):
        check_tp(dataclasses.replace(cfg, intermediate_size=258), 4)
    with pytest.raises(ValueError, match=UNEVEN_KV):
        check_tp(uneven_kv(models["kv-rep"]).config, 6)        # 12 heads over 4 KV heads
    for group in ({"tp": 6}, {"spp": 2, "tp": 6}, {"kvp": 2, "tp": 6}, {"kvp": 2, "spp": 2, "tp": 6}):
        with pytest.raises(ValueError, match=UNEVEN_KV):
            build_runner(EngineConfig(**BASE_CFG, **group), uneven_kv(models["kv-rep"]), torch.float32)


# ---- weights ----------------------------------------------------------------------------------------
def test_a_ranks_kv_rows_are_its_heads_and_the_file_loaded_shard_equals_the_cut_one(models, paths):
    model = models["kv-rep"]
    d = model.config.head_dim
    full = {k[len("model.layers.1."):]: v for k, v in model.state_dict().items() if k.startswith("model.layers.1.")}
    for r in range(4):
        part = shard_layer_state(full, r, 4, 2)
        h = r // 2
        for name in ("self_attn.k_proj.weight", "self_attn.k_proj.bias", "self_attn.v_proj.weight",
                     "self_attn.v_proj.bias"):
            assert torch.equal(part[name], full[name][h * d:(h + 1) * d]), (r, name)
        assert torch.equal(part["self_attn.q_proj.weight"], full["self_attn.q_proj.weight"][r * 2 * d:(r + 1) * 2 * d])
        assert part["self_attn.k_norm.weight"] is full["self_attn.k_norm.weight"]       # per head_dim: whole
        assert ("self_attn.o_proj.bias" in part) == (r == 0)
    for name, tps in (("kv-rep", (4, 8)), ("mqa", (2, 4))):
        full_model, cfg = load_model(paths[name])
        for tp in tps:
            for layers in (range(2), range(0, 1), range(1, 2)):
                for rank in range(tp):
                    _same_shard(load_shard(Checkpoint(paths[name], cfg), rank, tp, layers=layers),
                                shard_model(full_model, rank, tp, layers=layers))


# ---- a TP group, every rank's KV in view --------------------------------------------------------------
def _tp_group_in_view(model, tp: int) -> tuple[TPRunner, dict[int, TPRank]]:
    """A TP group whose ranks (threads) the test can read: {rank: TPRank}."""
    addr = GroupAddress("127.0.0.1", free_port("127.0.0.1"), tp, timeout_s=30)
    held: dict[int, TPRank] = {}

    def make(coll):
        held[coll.rank] = TPRank(model, coll, coll.rank, tp, 64, BS, torch.float32)
        return rank_handler(held[coll.rank])

    ranks = ThreadRanks(addr, make)
    runner = TPRunner(model, KVCacheManager(64, BS), Collective(addr, 0), tp, ranks=ranks)
    held[0] = runner.rank0
    return runner, held


@pytest.mark.parametrize("variant,tp", [("kv-rep", 4), ("mqa", 2), ("mqa", 4)])
def test_every_replica_holds_its_head_and_blocks_are_gathered_once_from_the_first(models, variant, tp):
    model = models[variant]
    hkv = model.config.num_key_value_heads
    runner, held = _tp_group_in_view(model, tp)
    try:
        single = same_as_single_runner(model, runner)
        ids = list(range(21, 41)) + [5, 3, 9]                     # the blocks _plans wrote
        assert sorted(held) == list(range(tp))
        for r, rank in held.items():
            h = kv_heads_of(hkv, tp, r)[0]
            assert rank.kv_cache.shape == (2, 64, 2, BS, 1, model.config.head_dim)
            torch.testing.assert_close(rank.kv_cache[:, ids], single.kv_cache[:, ids, ..., h:h + 1, :],
                                       atol=1e-5, rtol=1e-5)
        # Gathered from the first holder of each head (rank h * tp / Hkv): spoiling the other
        # replicas changes nothing, spoiling a first holder does.
        firsts = list(range(0, tp, tp // hkv))
        for r, rank in held.items():
            if r not in firsts:
                rank.kv_cache[:, ids] = float("nan")
        torch.testing.assert_close(runner.save_blocks(ids), single.kv_cache[:, ids], atol=1e-5, rtol=1e-5)
        held[firsts[-1]].kv_cache[:, 3] = 0.0
        assert not torch.equal(runner.save_blocks([3]), single.kv_cache[:, [3]])
        # A load sends every replica its head (and nothing else).
        data = torch.randn_like(single.kv_cache[:, [7, 1, 60]])
        runner.load_blocks([7, 1, 60], data)
        # A step's all_reduces reach every rank after it has written what it was sent before.
        runner.run_plan(StepPlan([7], [], [], [], [0], [[50]], [0]))
        for r, rank in held.items():
            h = kv_heads_of(hkv, tp, r)[0]
            assert torch.equal(rank.kv_cache[:, [7, 1, 60]], data[..., h:h + 1, :]), r
        assert torch.equal(runner.save_blocks([7, 1, 60]), data)
    finally:
        _close(runner)


@pytest.mark.parametrize("variant,tp", [("kv-rep", 4), ("mqa", 2)])
def test_a_handoff_moves_a_plain_engines_bytes_each_head_once(models, variant, tp):
    """What the leader receives for a save is every head but its own, once; what it sends for a
    load is each other rank's head; kv_bytes_per_token is the plain runner's."""
    model = models[variant]
    cfg = model.config
    runner = build_runner(EngineConfig(**BASE_CFG, kv_cache_tokens=64 * BS, tp=tp), model, torch.float32)
    moved = {"send": 0, "recv": 0}
    coll = runner.coll
    send, recv = coll.send, coll.recv

    def counting_send(t, *a, **k):
        moved["send"] += t.numel()
        return send(t, *a, **k)

    def counting_recv(t, *a, **k):
        moved["recv"] += t.numel()
        return recv(t, *a, **k)

    try:
        head = cfg.num_hidden_layers * 3 * 2 * BS * cfg.head_dim          # one head of 3 blocks
        data = torch.randn(cfg.num_hidden_layers, 3, 2, BS, cfg.num_key_value_heads, cfg.head_dim)
        coll.send, coll.recv = counting_send, counting_recv
        runner.load_blocks([4, 0, 9], data)
        assert moved == {"send": (tp - 1) * head, "recv": 0}
        moved.update(send=0)
        assert torch.equal(runner.save_blocks([4, 0, 9]), data)
        assert moved == {"send": 0, "recv": (cfg.num_key_value_heads - 1) * head}
        coll.send, coll.recv = send, recv
        plain = LLMEngine(EngineConfig(**BASE_CFG, kv_cache_tokens=64 * BS), model)
        assert runner.kv_bytes_per_token() == plain.runner.kv_bytes_per_token()
        assert runner.port.tensor.shape[4] == cfg.num_key_value_heads
        plain.close()
    finally:
        coll.send, coll.recv = send, recv
        _close(runner)


# ---- the other group kinds against the single runner ------------------------------------------------------
@pytest.mark.parametrize("variant,group,layout", [
    ("mqa", {"spp": 2, "tp": 2}, "spp2xtp2"),
    ("kv-rep", {"spp": 2, "tp": 4}, "spp2xtp4"),
    ("mqa", {"kvp": 2, "tp": 2}, "kvp2xtp2"),
    ("kv-rep", {"kvp": 2, "tp": 4}, "kvp2xtp4"),
    ("mqa", {"kvp": 2, "spp": 2, "tp": 2}, "kvp2xspp2xtp2")])
def test_a_replicated_group_of_each_kind_gives_the_single_runners_logits_and_kv(models, variant, group, layout):
    model = models[variant]
    per_rank = 32            # same_as_single_runner's block ids 3..40 span both KVP ranks
    cfg = EngineConfig(**BASE_CFG, kv_cache_tokens=(per_rank if "kvp" in group else 64) * BS, spp_micro_tokens=32,
                       **group)
    runner = build_runner(cfg, model, torch.float32)
    try:
        assert isinstance(runner, SPPRunner if "spp" in group else KVPRunner) and runner.layout == layout
        single = same_as_single_runner(model, runner)
        kv = runner.stage.kv if "spp" in group else runner.rank0.kv_cache
        assert kv.shape[4] == 1
        # A round trip through every rank (each replica its head, each head back once) ...
        ids = [per_rank * 2 - 1, 1, per_rank, 2, per_rank + 3] if "kvp" in group else [63, 1, 30, 2, 45]
        data = torch.randn_like(single.kv_cache[:, ids])
        runner.load_blocks(ids, data)
        assert torch.equal(runner.save_blocks(ids), data)
        # ... and every replica attends over what it was sent: a decode over those blocks as a
        # request's table gives the single runner's logits on the same data.
        single.kv_cache[:, ids] = data
        plan = StepPlan([11], [], [], [], [len(ids) * BS - 1], [ids], [0])
        torch.testing.assert_close(plan_logits(runner, plan), plan_logits(single, plan), atol=1e-4, rtol=1e-5)
        assert runner.kv_bytes_per_token() == single.kv_bytes_per_token()
    finally:
        _close(runner)


# ---- engines ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("variant,group,layout", [
    ("kv-rep", {"tp": 4}, "tp4"), ("mqa", {"tp": 2}, "tp2"),
    ("mqa", {"spp": 2, "tp": 2, "spp_micro_tokens": 16}, "spp2xtp2"),
    ("mqa", {"kvp": 2, "tp": 2}, "kvp2xtp2")])
def test_a_replicated_engine_gives_the_plain_engines_tokens_with_prefix_caching(models, variant, group, layout):
    engine_matches_plain(models[variant], group, layout)


@pytest.mark.parametrize("variant,group", [("kv-rep", {"tp": 4}), ("mqa", {"tp": 2}),
                                           ("mqa", {"spp": 2, "tp": 2, "spp_micro_tokens": 16}),
                                           ("mqa", {"kvp": 2, "tp": 2})])
@pytest.mark.parametrize("into_group", [True, False], ids=["plain-to-group", "group-to-plain"])
def test_a_handoff_into_or_out_of_a_replicated_engine_gives_the_plain_engines_tokens(models, variant, group,
                                                                                     into_group):
    handoff_matches_plain(models[variant], group, into_group)


def test_an_engine_built_from_the_path_with_replicated_heads_matches_the_single_engine(paths):
    path = paths["kv-rep"]
    full, cfg = load_model(path)
    prompts = _prompts(cfg.vocab_size - 10)
    single = LLMEngine.from_config(EngineConfig(model=path, **PATH_BASE))
    want = _run(single, prompts, "a")
    eng = LLMEngine.from_config(EngineConfig(model=path, **PATH_BASE, tp=4, enable_prefix_caching=True))
    try:
        assert eng.runner.layout == "tp4"
        assert eng.runner.kv_bytes_per_token() == single.runner.kv_bytes_per_token()
        leader = eng.runner.rank0.model.model.layers[0].self_attn
        assert leader.k_proj.weight.shape == (cfg.head_dim, cfg.hidden_size)        # one KV head
        _same_run(_run(eng, prompts, "a"), want)
    finally:
        eng.close()
        assert eng.runner.ranks.errors == []
        single.close()


# ---- the simulator ------------------------------------------------------------------------------------
def test_the_simulators_memory_model_counts_replicated_kv_heads():
    from raycluster.sched.roofline import GPUS, MODELS
    from raycluster.sim.cluster import kv_tokens
    from raycluster.sim.spec import SimSpec

    m, g = MODELS["llama-3-8b"], GPUS["A100"]         # 8 KV heads
    got = {}
    for tp in (8, 16, 32):
        spec = SimSpec(gpu="a100", pools=[{"role": "mixed", "tp": tp}])
        got[tp] = kv_tokens(spec, spec.pools[0], spec.engine_config(spec.pools[0]))
        free = g.memory_bytes * tp * spec.gpu_memory_utilization - m.params * m.dtype_bytes
        # Every rank holds max(1, 8 / tp) heads of each token: tp / 8 copies of every head past tp 8.
        assert got[tp] == int(free // (m.kv_bytes_per_token() * max(1, tp // m.kv_heads)))
    assert got[16] < 2 * got[8]                       # twice the GPUs, not twice the tokens
    # The step-time model already reads a rank's max(1, 8 / tp) heads: past tp 8 a decode's
    # (memory-bound) attention time stops shrinking.
    from raycluster.sched.roofline import RooflinePredictor
    att = {tp: RooflinePredictor(tp=tp).cost([], [4096] * 64).attention for tp in (4, 8, 16)}
    assert att[8] == pytest.approx(att[4] / 2) and att[16] == pytest.approx(att[8])
