"""Stream pipeline parallelism: stage split, micro-batch split, and numerical equivalence of an
SPP group (ranks >= 1 as threads over gloo) with the single-process ModelRunner."""

from __future__ import annotations

import contextlib
import os

import pytest
import torch

from raycluster.engine.config import EngineConfig
from raycluster.engine.engine import LLMEngine
from raycluster.engine.kv_manager import KVCacheManager
from raycluster.engine.model_runner import ModelRunner
from raycluster.model.loader import load_model
from raycluster.parallel import spp as spp_mod
from raycluster.parallel.group import Collective, GroupAddress, ThreadRanks
from raycluster.ports import free_port
from raycluster.parallel.plan import StepPlan, plan_inputs
from raycluster.parallel.spp import SPPRunner, SPPStage, split_plan, spp_worker, stage_layers
from raycluster.request import SamplingParams

BS = 16
NUM_BLOCKS = 160


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    m, _ = load_model(tiny_model_dir)
    return m


@contextlib.contextmanager
def spp_group(model, kv: KVCacheManager, spp: int, micro_tokens: int):
    """An SPPRunner (rank 0, this thread) over ranks 1..spp-1 in threads; always torn down."""
    if spp == 1:
        runner = SPPRunner(model, kv, None, 1, torch.float32, "cpu", micro_tokens)
        yield runner
        runner.close()
        return
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    addr = GroupAddress("127.0.0.1", free_port("127.0.0.1"), spp, timeout_s=30)
    ranks = ThreadRanks(addr, lambda coll: spp_worker(model, coll, spp, kv.num_blocks, kv.block_size,
                                                      torch.float32, "cpu", micro_tokens))
    runner = None
    try:
        runner = SPPRunner(model, kv, Collective(addr, 0), spp, torch.float32, "cpu", micro_tokens)
        yield runner
    finally:
        if runner is not None:
            runner.close()
            runner.close()          # idempotent: a second None would hang nobody, but must not be sent
        ranks.join(30)
    assert not ranks.errors, ranks.errors
    assert not any(t.is_alive() for t in ranks._threads), "workers did not leave serve_rank"


def _plans() -> list[StepPlan]:
    """A 900-token prompt A in 3 chunks of 300 with a short prompt B mixed in, then decodes."""
    g = torch.Generator().manual_seed(1)
    a = torch.randint(6, 4000, (900,), generator=g).tolist()
    b = torch.randint(6, 4000, (40,), generator=g).tolist()
    ta, tb = list(range(0, 60)), list(range(100, 110))
    plans = [
        StepPlan(a[:300] + b, [0, 0], [300, 40], [ta, tb], [], [], [339]),
        StepPlan(a[300:600] + [7], [300], [300], [ta], [40], [tb], [300]),
        StepPlan(a[600:900] + [8], [600], [300], [ta], [41], [tb], [299, 300]),
    ]
    for i in range(3):
        plans.append(StepPlan([9 + i, 10 + i], [], [], [], [900 + i, 42 + i], [ta, tb], [0, 1]))
    return plans


def _reference(model) -> list[torch.Tensor]:
    runner = ModelRunner(model, KVCacheManager(NUM_BLOCKS, BS))
    return [runner.run_plan(p) for p in _plans()]


# ---- pure splits ---------------------------------------------------------------------------

def test_stage_layers_exact():
    assert stage_layers(4, 3) == [(0, 2), (2, 3), (3, 4)]
    assert stage_layers(4, 1) == [(0, 4)]
    assert stage_layers(4, 4) == [(0, 1), (1, 2), (2, 3), (3, 4)]
    assert stage_layers(7, 2) == [(0, 4), (4, 7)]
    for bad in (0, 5, -1):
        with pytest.raises(ValueError, match="spp"):
            stage_layers(4, bad)


def test_split_plan_exact():
    ids = list(range(100, 100 + 10 + 4 + 2))
    plan = StepPlan(ids, prefill_starts=[5, 0], prefill_lens=[10, 4], prefill_tables=[[1, 2], [3]],
                    decode_positions=[7, 20], decode_tables=[[4], [5, 6]], sample_rows=[13, 14, 15])
    mbs = split_plan(plan, 4)
    assert [(m.prefill_starts, m.prefill_lens, m.prefill_tables) for m in mbs] == [
        ([5], [4], [[1, 2]]), ([9], [4], [[1, 2]]), ([13], [2], [[1, 2]]), ([0], [4], [[3]]), ([], [], [])]
    assert [m.sample_rows for m in mbs] == [[], [], [], [3], [0, 1]]
    assert mbs[-1].decode_positions == [7, 20] and mbs[-1].decode_tables == [[4], [5, 6]]
    assert all(not m.decode_positions for m in mbs[:-1])
    assert [t for m in mbs for t in m.input_ids] == ids
    # The first request's chunk is sampled too: its last sub-chunk keeps the row.
    plan.sample_rows = [9, 13, 14, 15]
    assert [m.sample_rows for m in split_plan(plan, 4)] == [[], [], [1], [3], [0, 1]]
    # No decodes: no trailing micro-batch; a big micro_tokens keeps each chunk whole.
    plan2 = StepPlan(ids[:14], [5, 0], [10, 4], [[1, 2], [3]], [], [], [13])
    assert [(m.prefill_lens, m.sample_rows) for m in split_plan(plan2, 512)] == [([10], []), ([4], [3])]
    with pytest.raises(ValueError, match="micro_tokens"):
        split_plan(plan2, 0)


def test_split_plan_keeps_bidirectional_spans_whole():
    """Spans (Gemma 3's images) at rows [2, 7) of the first chunk and [11, 13) (the second chunk's
    rows 1-3): a cut that would fall inside one moves to its end."""
    ids = list(range(100, 116))
    plan = StepPlan(ids, [0, 30], [10, 6], [[1], [2]], [], [], [9, 15], bidirectional_rows=[(2, 7), (11, 13)])
    mbs = split_plan(plan, 4)
    assert [(m.prefill_starts, m.prefill_lens, m.bidirectional_rows) for m in mbs] == [
        ([0], [7], [(2, 7)]), ([7], [3], []), ([30], [4], [(1, 3)]), ([34], [2], [])]
    assert [t for m in mbs for t in m.input_ids] == ids and [m.sample_rows for m in mbs] == [[], [2], [], [1]]


def test_split_plan_metadata_matches_plan():
    """Each micro-batch's positions/slots are the plan's, sliced in order."""
    plan = _plans()[2]
    ids, pos, meta = plan_inputs(plan, BS)
    parts = [plan_inputs(m, BS) for m in split_plan(plan, 128)]
    assert torch.equal(torch.cat([p[0] for p in parts]), ids)
    assert torch.equal(torch.cat([p[1] for p in parts]), pos)
    assert torch.equal(torch.cat([p[2].slot_mapping for p in parts]), meta.slot_mapping)
    assert [p[2].prefill_kv_lens for p in parts[:3]] == [[728], [856], [900]]


# ---- numerical equivalence -----------------------------------------------------------------

@pytest.mark.parametrize("spp, micro", [(1, 128), (2, 128), (4, 128), (2, 1)])
def test_spp_matches_single_runner(model, spp, micro):
    ref = _reference(model)
    plans = _plans()
    if micro == 1:              # 900 one-token micro-batches per chunk is slow: the first chunk will do
        plans, ref = plans[:1], ref[:1]
    kv = KVCacheManager(NUM_BLOCKS, BS)
    with spp_group(model, kv, spp, micro) as runner:
        assert runner.layout == f"spp{spp}"
        assert runner.stage.kv.shape[0] == stage_layers(4, spp)[0][1]
        assert runner.kv_bytes_per_token() == ModelRunner(model, kv).kv_bytes_per_token()
        for plan, want in zip(plans, ref):
            got = runner.run_plan(plan)
            assert got.shape == want.shape == (len(plan.sample_rows), model.config.hidden_size)
            torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_micro_batch_order_is_what_makes_it_correct(model, monkeypatch):
    """Negative control: the equivalence above is sensitive to stream order. Running a chunk's
    sub-chunks out of order (later sub-chunks before the KV they read is written) must differ."""
    first = _plans()[0]             # A's first 300 tokens, alone and sampled at its last row
    plan = StepPlan(first.input_ids[:300], [0], [300], first.prefill_tables[:1], [], [], [299])
    ref = ModelRunner(model, KVCacheManager(NUM_BLOCKS, BS)).run_plan(plan)
    good = SPPStage(model, None, 0, 1, NUM_BLOCKS, BS, torch.float32, micro_tokens=100).run(plan)
    torch.testing.assert_close(good, ref, atol=1e-4, rtol=1e-4)
    real = spp_mod.split_plan
    monkeypatch.setattr(spp_mod, "split_plan", lambda p, m: real(p, m)[::-1])
    bad = SPPStage(model, None, 0, 1, NUM_BLOCKS, BS, torch.float32, micro_tokens=100).run(plan)
    assert bad.shape == ref.shape
    assert (bad - ref).abs().max() > 1e-2


def test_engine_with_spp_config_generates_the_same_greedy_tokens(model, monkeypatch):
    """`EngineConfig(spp=2)` builds the group (stage 1 a thread) through the runner factory."""
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    base = dict(kv_cache_tokens=4096, block_size=BS, policy="fcfs", packer="token", chunk_size=256,
                predictor="none")
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(6, 4000, (700,), generator=g).tolist(), torch.randint(6, 4000, (30,), generator=g).tolist()]
    sp = SamplingParams(max_tokens=6, ignore_eos=True)
    want = LLMEngine(EngineConfig(**base), model).generate(prompts, sp)
    eng = LLMEngine(EngineConfig(**base, spp=2, spp_micro_tokens=64, group_timeout_s=30), model)
    try:
        assert eng.runner.layout == "spp2"
        got = eng.generate(prompts, sp)
        eng.kv.check()
    finally:
        eng.close()
    assert got == want
    assert all(len(t) == 6 for t in got)
    assert eng.runner.ranks.errors == [] and not any(t.is_alive() for t in eng.runner.ranks._threads)
    with pytest.raises(ValueError, match="spp"):
        LLMEngine(EngineConfig(**base, spp=5), model)       # the tiny model has 4 layers


def test_spp_engine_with_prefix_caching_reuses_blocks_on_every_stage(model, monkeypatch):
    """Each stage keeps its layers' KV under the leader's block ids, so a cached prefix is
    valid on all of them: the second wave of prompts takes it and generates the same tokens."""
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    base = dict(kv_cache_tokens=4096, block_size=BS, policy="fcfs", packer="token", chunk_size=256,
                predictor="none")
    g = torch.Generator().manual_seed(3)
    head = torch.randint(6, 4000, (300,), generator=g).tolist()
    first = [head + torch.randint(6, 4000, (20,), generator=g).tolist()]
    later = [head + torch.randint(6, 4000, (n,), generator=g).tolist() for n in (5, 40)]
    sp = SamplingParams(max_tokens=6, ignore_eos=True)
    ref = LLMEngine(EngineConfig(**base), model)
    want = ref.generate(first, sp) + ref.generate(later, sp)
    eng = LLMEngine(EngineConfig(**base, spp=2, spp_micro_tokens=64, group_timeout_s=30,
                                 enable_prefix_caching=True), model)
    try:
        got = eng.generate(first, sp) + eng.generate(later, sp)
        eng.kv.check()
    finally:
        eng.close()
    assert got == want
    assert eng.kv.hit_tokens == 2 * (300 // BS) * BS
