"""KVP progressive scaling (Medha): a request's KV in contiguous ranges of `cap` blocks per rank,
starting on the least loaded rank. The allocators' placement (exact tables, start rank,
fallback when a rank is full, can_allocate / allocate agreement, frees back to their rank's
pool, a cached prefix fixing the start), the config, and groups over the layout (ranks as
threads over gloo) against the single-process runner step by step -- prefill chunks crossing
range boundaries, a decode onboarding a new rank, a short request beside a long one -- for plain
KVP, KVP x TP and KVP x SPP, and engines' greedy tokens, prefix caching and P/D handoffs."""

from __future__ import annotations

import random
import threading
import time

import pytest
import torch
from pydantic import ValidationError
from test_kvp import _generate, _scripted_steps
from test_tp import _close, engine_matches_plain, handoff_matches_plain

from raycluster.cluster.config import ClusterConfig
from raycluster.engine.config import EngineConfig
from raycluster.engine.kv_manager import KVCacheManager, OutOfBlocks
from raycluster.engine.model_runner import ModelRunner, plan_logits
from raycluster.engine.scheduler import SchedulerOutput
from raycluster.model.loader import load_model
from raycluster.parallel.factory import build_runner
from raycluster.parallel.kvp import step_ranks
from raycluster.parallel.kvp_layout import (
    ProgressiveAllocator,
    ProgressiveCachingAllocator,
    StripedAllocator,
    kvp_kv_manager,
)
from raycluster.parallel.plan import step_plan
from raycluster.request import Request, SamplingParams

BS = 16
BASE = dict(policy="fcfs", packer="token", predictor="none", block_size=BS, num_threads=1, group_timeout_s=30)
PROGRESSIVE = dict(kvp_layout="progressive")


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return load_model(tiny_model_dir)[0]


def _ranks(alloc, table: list[int]) -> list[int]:
    return [alloc.rank_of(b) for b in table]


# ---- the allocator -------------------------------------------------------------------------------
@pytest.mark.parametrize("caching", [False, True], ids=["plain", "caching"])
def test_a_request_fills_cap_blocks_of_its_start_rank_then_onboards_the_next(caching):
    cls = ProgressiveCachingAllocator if caching else ProgressiveAllocator
    a = cls(blocks_per_rank=4, world=2, cap_blocks=2, start="least_loaded")   # rank 0: blocks 0-3, rank 1: 4-7
    t = a.allocate(3)
    assert t == [0, 1, 4] and _ranks(a, t) == [0, 0, 1]        # start 0 (a tie: the lowest rank)
    # Rank 1 now has the most free blocks: the next request starts there, and its third block
    # wraps around to rank 0.
    u = a.allocate(3)
    assert _ranks(a, u) == [1, 1, 0] and u == [5, 6, 2]
    # Growing a table continues its own ranges, whoever is least loaded now.
    assert a.allocate_for(t, 1) == [7] and _ranks(a, t + [7]) == [0, 0, 1, 1]
    assert a.free_per_rank() == [1, 0] and a.num_free == 1


def test_first_fit_starts_a_new_request_on_the_lowest_rank_with_a_whole_range_free():
    """The default: rank 0 while it has `cap_blocks` free, then the next such rank; with no whole
    range free anywhere, the rank with the most free blocks (the lowest on a tie)."""
    a = ProgressiveAllocator(blocks_per_rank=6, world=3, cap_blocks=2)   # rank r: blocks 6r..6r+5
    assert a.start == "first_fit" and a.layout_label(16) == "+prog32ff"
    t1 = a.allocate(3)
    assert _ranks(a, t1) == [0, 0, 1]                   # its second range onboards rank 1
    t2 = a.allocate(2)
    assert _ranks(a, t2) == [0, 0] and _ranks(a, a.allocate(1)) == [0]
    assert a.free_per_rank() == [1, 5, 6]
    assert _ranks(a, a.allocate(1)) == [1]              # rank 0 has less than a range left
    a.free_all(t2)
    assert _ranks(a, a.allocate(2)) == [0, 0]           # freed room on rank 0 is taken first again
    assert _ranks(a, a.allocate(4)) == [1, 1, 2, 2] and a.free_per_rank() == [1, 2, 4]
    assert _ranks(a, a.allocate(1)) == [1] and _ranks(a, a.allocate(3)) == [2, 2, 0]
    assert a.free_per_rank() == [0, 1, 2]
    assert _ranks(a, a.allocate(1)) == [2]
    assert a.free_per_rank() == [0, 1, 1]
    assert _ranks(a, a.allocate(1)) == [1]              # no range anywhere: the most free, lowest first
    assert ProgressiveAllocator(4, 2, 2, start="least_loaded").layout_label(16) == "+prog32ll"
    with pytest.raises(ValueError, match="kvp_start: 'random' is not one of first_fit, least_loaded"):
        ProgressiveAllocator(4, 2, 2, start="random")


def test_least_loaded_starts_a_new_request_on_the_rank_with_the_most_free_blocks():
    a = ProgressiveAllocator(blocks_per_rank=4, world=3, cap_blocks=4, start="least_loaded")
    a.allocate(2)                                   # rank 0
    a.allocate(1)                                   # rank 1 (ranks 1 and 2 tie)
    assert a.free_per_rank() == [2, 3, 4]
    assert _ranks(a, a.allocate(1)) == [2]
    assert _ranks(a, a.allocate(1)) == [1]          # 1 and 2 tie again at 3
    assert _ranks(a, a.allocate(2)) == [2, 2]
    with pytest.raises(ValueError, match="first_block"):
        a.allocate(1, first_index=3)                # a later block needs the request's start


def test_a_full_rank_passes_blocks_on_and_can_allocate_agrees_with_allocate_under_exhaustion():
    a = ProgressiveAllocator(blocks_per_rank=3, world=3, cap_blocks=2, start="least_loaded")
    big = a.allocate(2)                             # rank 0
    other = a.allocate(3)                           # starts on rank 1: [1, 1, 2]
    assert _ranks(a, big) == [0, 0] and _ranks(a, other) == [1, 1, 2]
    # big's blocks 2, 3 belong on rank 1, which has one block left: the second goes on to rank 2.
    grown = a.allocate_for(big, 2)
    assert _ranks(a, grown) == [1, 2]
    big += grown
    assert a.free_per_rank() == [1, 0, 1]
    assert a.can_allocate(2) and not a.can_allocate(3)
    with pytest.raises(OutOfBlocks):
        a.allocate_for(big, 3)
    assert a.free_per_rank() == [1, 0, 1]           # a refused allocation takes nothing
    # Blocks 4, 5 belong on rank 2 (the third range), which has one left: the second wraps to rank 0.
    last = a.allocate_for(big, 2)
    assert _ranks(a, last) == [2, 0] and a.num_free == 0 and not a.can_allocate(1)


@pytest.mark.parametrize("start", ["first_fit", "least_loaded"])
@pytest.mark.parametrize("seed", range(4))
def test_random_churn_keeps_counts_agreement_and_frees_each_block_to_its_ranks_pool(seed, start):
    """Requests arrive, grow and finish at random on a small pool: every `can_allocate` answer
    is what `allocate` then does, per-rank free counts are each rank's unused blocks, and a
    freed block is back in its own rank's pool."""
    rng = random.Random(seed)
    world, per_rank = 3, 5
    kv = kvp_kv_manager(per_rank, world, 4, tokens_per_rank=8, start=start)      # cap 2 blocks
    a = kv.allocator
    live: dict[str, Request] = {}
    for step in range(300):
        if live and rng.random() < 0.3:
            rid = rng.choice(sorted(live))
            table = list(kv.block_tables.get(rid, []))
            kv.free(rid)
            del live[rid]
            for b in table:
                assert b in a._pools[b // per_rank]
        else:
            rid = rng.choice(sorted(live)) if live and rng.random() < 0.6 else f"r{step}"
            req = live.get(rid) or Request(rid, list(range(40)))
            n = rng.randrange(1, 12)
            table = kv.block_tables.get(rid, [])
            need = kv.blocks_needed(req.num_computed_tokens + n) - len(table)
            said = need <= 0 or a.can_allocate(need, len(table))
            assert kv.try_allocate(req, n) == said
            if said:
                req.num_computed_tokens += n
                live[rid] = req
        used = {b for t in kv.block_tables.values() for b in t}
        assert a.free_per_rank() == [sum(b not in used for b in a._rank_blocks(r)) for r in range(world)]
        kv.check()


@pytest.mark.parametrize("start", ["first_fit", "least_loaded"])
def test_alias_tables_are_what_allocate_lays_out_from_an_empty_pool(start):
    lengths = [3, 1, 5, 2, 4, 1]
    a = ProgressiveAllocator(blocks_per_rank=8, world=3, cap_blocks=2, start=start)
    fresh = ProgressiveAllocator(blocks_per_rank=8, world=3, cap_blocks=2, start=start)
    assert a.alias_tables(lengths) == [fresh.allocate(n) for n in lengths]
    assert a.alias_table(3, 2) == a.alias_tables([2, 3])[1]
    # Longer than the pool: ids wrap within their rank (the profiler's tables may alias).
    (long,) = a.alias_tables([40])
    assert _ranks(a, long)[:6] == [0, 0, 1, 1, 2, 2] and all(0 <= b < 24 for b in long)
    # The default alias_tables is each alias_table after the ones before it (the profiler's old tables).
    s = StripedAllocator(4, 2)
    assert s.alias_tables([3, 2]) == [s.alias_table(3, 0), s.alias_table(2, 3)]


def test_a_cached_prefix_fixes_the_start_rank():
    kv = kvp_kv_manager(6, 2, 4, prefix_caching=True, tokens_per_rank=8, start="least_loaded")   # cap 2 blocks of 4
    a = kv.allocator
    first = Request("a", list(range(18)))
    assert kv.try_allocate(first, 18)
    assert _ranks(a, kv.block_tables["a"]) == [0, 0, 1, 1, 0]
    kv.cache_full_blocks(first, 18)
    kv.free("a")
    filler = Request("f", [7] * 5)
    assert kv.try_allocate(filler, 5)                     # 2 blocks: rank 0 (the most free, a tie)
    assert _ranks(a, kv.block_tables["f"]) == [0, 0]
    b = Request("b", list(range(16)) + [99, 98, 97])
    assert kv.match_prefix(b) == 16                       # a's blocks 0-3: started on rank 0
    b.num_computed_tokens = 16
    assert kv.try_allocate(b, 3)
    # Block 4 belongs to b's third range: rank (0 + 4 // 2) % 2 = 0, though rank 1 has more room
    # (2 free blocks on rank 0 after the match revived two, 4 on rank 1).
    assert a.free_per_rank() == [1, 4]
    assert _ranks(a, kv.block_tables["b"]) == [0, 0, 1, 1, 0]
    kv.check()


# ---- the config ------------------------------------------------------------------------------------
def test_the_config_defaults_to_striped_and_names_the_field_it_refuses():
    cfg = EngineConfig()
    assert cfg.kvp_layout == "striped" and cfg.kvp_progressive_tokens() is None
    assert EngineConfig(**PROGRESSIVE).kvp_start == "first_fit"
    # A dumped config rebuilds (a group's Ray ranks get theirs so), striped or not.
    assert EngineConfig(**EngineConfig(kvp=2).model_dump()).kvp_start == "first_fit"
    # Default range: one rank's pool / kvp, in whole blocks.
    assert EngineConfig(kvp=3, kv_cache_tokens=1000, **PROGRESSIVE).kvp_progressive_tokens() == 1000 // 16 // 3 * 16
    assert EngineConfig(kvp=2, kv_cache_tokens=16, **PROGRESSIVE).kvp_progressive_tokens() == 16
    assert EngineConfig(kvp=2, kvp_tokens_per_rank=64, **PROGRESSIVE).kvp_progressive_tokens() == 64
    for bad, msg in [({"kvp_tokens_per_rank": 64}, "only for kvp_layout 'progressive'"),
                     ({"kvp_tokens_per_rank": 40, **PROGRESSIVE}, "not a multiple of block_size 16"),
                     ({"kvp_tokens_per_rank": 4096, "kv_cache_tokens": 2048, **PROGRESSIVE}, "more than one rank's"),
                     ({"kvp_tokens_per_rank": 0, **PROGRESSIVE}, "kvp_tokens_per_rank"),
                     ({"kvp_layout": "ring"}, "kvp_layout"),
                     ({"kvp_start": "lowest", **PROGRESSIVE}, "kvp_start")]:
        with pytest.raises(ValidationError, match="kvp_tokens_per_rank|kvp_layout|kvp_start") as e:
            EngineConfig(kvp=2, **bad)
        assert msg in str(e.value)
    # A cluster spec's engine overrides pass through to each pool's engine, and fail at deploy time.
    spec = ClusterConfig(pools=[{"role": "mixed", "engine": {"kvp": 2, **PROGRESSIVE, "kvp_tokens_per_rank": 512}}])
    assert spec.engine_config(spec.pools[0]).kvp_progressive_tokens() == 512
    with pytest.raises(ValidationError, match="kvp_tokens_per_rank: 500 is not a multiple"):
        ClusterConfig(engine={"kvp_layout": "progressive"}, pools=[{"role": "mixed",
                                                                    "engine": {"kvp": 2, "kvp_tokens_per_rank": 500}}])


# ---- groups against the single runner, step by step -------------------------------------------------
def _steps_match_single(model, runner, per_rank: int, world: int, drafts: bool = False) -> dict[str, list[int]]:
    """test_kvp's scripted steps (a 300-token prompt in chunks of 100, a 40-token one joining in
    the second step, then decodes of both) laid out by the group's allocator, against a single
    runner with the same block ids: the logits agree step by step. Returns the block tables."""
    plans = _scripted_steps(runner.kv, BS, drafts)
    single = ModelRunner(model, KVCacheManager(per_rank * world, BS))
    for plan in plans:
        want, got = plan_logits(single, plan), plan_logits(runner, plan)
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, atol=2e-4, rtol=1e-4)
    return runner.kv.block_tables


def _group(model, **cfg):
    """A group over the progressive layout, least loaded first unless `cfg` says otherwise: the
    tests below spread requests over the ranks on purpose."""
    return build_runner(EngineConfig(**BASE, **PROGRESSIVE, **{"kvp_start": "least_loaded", **cfg}), model,
                        torch.float32)


@pytest.mark.parametrize("world", [2, 3])
def test_prefill_chunks_crossing_ranges_match_the_single_runner(model, world):
    """Ranges of 2 blocks: every 100-token chunk of the long prompt spans three or four ranges
    (and every rank), the short one joins on the least loaded rank."""
    runner = _group(model, kvp=world, kv_cache_tokens=24 * BS, kvp_tokens_per_rank=2 * BS)
    try:
        assert runner.layout == f"kvp{world}+prog32ll" and type(runner.kv.allocator) is ProgressiveAllocator
        tables = _steps_match_single(model, runner, 24, world)
        a = runner.kv.allocator
        assert _ranks(a, tables["a"]) == [(i // 2) % world for i in range(20)]
        # b arrived when a held 13 blocks (7 on rank 0 of 2, 5 on rank 0 of 3): it starts on the
        # rank with the most free blocks (rank 1; of 3, ranks 1 and 2 tie).
        assert _ranks(a, tables["b"]) == [1, 1, 2 % world]
    finally:
        _close(runner)


def test_a_decode_that_onboards_a_new_rank_beside_a_short_request_matches_the_single_runner(model):
    """Ranges of 19 blocks (304 tokens): the long prompt's 300 tokens stay on rank 0 and its fifth
    decode (token 304) takes the first block of rank 1, where the short request lives whole."""
    runner = _group(model, kvp=2, kv_cache_tokens=24 * BS, kvp_tokens_per_rank=19 * BS)
    try:
        tables = _steps_match_single(model, runner, 24, 2)
        a = runner.kv.allocator
        assert _ranks(a, tables["a"]) == [0] * 19 + [1]
        assert _ranks(a, tables["b"]) == [1, 1, 1]
    finally:
        _close(runner)


def test_draft_rows_of_a_decode_crossing_ranges_match_the_single_runner(model):
    """Speculative decoding's rows (a decode's last token and its drafts, one decode row each)
    where the drafts run past the end of one rank's range into the next."""
    runner = _group(model, kvp=2, kv_cache_tokens=24 * BS, kvp_tokens_per_rank=2 * BS)
    try:
        tables = _steps_match_single(model, runner, 24, 2, drafts=True)
        assert set(_ranks(runner.kv.allocator, tables["a"])) == {0, 1}
    finally:
        _close(runner)


@pytest.mark.parametrize("group", [{"tp": 2}, {"spp": 2, "spp_micro_tokens": 24}, {"spp": 2, "tp": 2}],
                         ids=["kvp2xtp2", "kvp2xspp2", "kvp2xspp2xtp2"])
def test_kvp_with_tp_lanes_or_spp_stages_over_the_progressive_layout_matches_the_single_runner(model, group):
    """Ranges of 3 blocks: chunks cross ranges, the short request starts on rank 1; with SPP the
    chunks are cut into micro-batches of 24 tokens, so a sub-chunk's prefix spans both ranks."""
    runner = _group(model, kvp=2, kv_cache_tokens=24 * BS, kvp_tokens_per_rank=3 * BS, **group)
    try:
        assert runner.layout.endswith("+prog48ll")
        tables = _steps_match_single(model, runner, 24, 2)
        a = runner.kv.allocator
        assert _ranks(a, tables["a"]) == [(i // 3) % 2 for i in range(20)]
        assert _ranks(a, tables["b"]) == [1, 1, 1]
    finally:
        _close(runner)


# Where the requests of the test below live and which KVP ranks each of its steps needs, per start rule.
SKIP_CASES = {
    # a on rank 0, b on rank 1, c on rank 2 and then rank 0
    "least_loaded": ({"a": [0] * 3, "b": [1] * 4, "c": [2] * 4 + [0] * 3},
                     [[0], [0, 1], [0, 1], [0, 1, 2], [0, 1], [0], [0, 2]]),
    # all on rank 0 but c's second range: most steps run on the leader alone
    "first_fit": ({"a": [0] * 3, "b": [0] * 4, "c": [0] * 4 + [1] * 3},
                  [[0], [0], [0], [0, 1], [0], [0], [0, 1]]),
}


@pytest.mark.parametrize("start", list(SKIP_CASES))
@pytest.mark.parametrize("group", [{}, {"tp": 2}, {"spp": 2, "spp_micro_tokens": 24}],
                         ids=["kvp3", "kvp3xtp2", "kvp3xspp2"])
def test_a_step_runs_only_on_the_ranks_holding_its_kv(model, monkeypatch, group, start):
    """Ranges of 4 blocks over 3 KVP ranks, requests of 40, 50 and 100 tokens placed by the start
    rule (`SKIP_CASES`). Each step runs on rank 0 (it samples) and
    the ranks holding the step's KV, with all their TP lanes and SPP stages (with SPP, micro-batch
    by micro-batch); the others sit it out (the attention states are gathered over the ranks
    that run). A step of rank 0 alone posts nothing to the group. The logits agree with the
    single runner's step by step."""
    from raycluster.parallel import kvp as kvp_module
    from raycluster.parallel import spp as spp_module

    tp, spp = group.get("tp", 1), group.get("spp", 1)
    ran: list[str] = []
    plan_inputs = kvp_module.plan_inputs

    def recording(*args, **kwargs):        # every rank running a step (or micro-batch) builds its inputs
        ran.append(threading.current_thread().name)
        return plan_inputs(*args, **kwargs)

    monkeypatch.setattr(kvp_module, "plan_inputs", recording)
    monkeypatch.setattr(spp_module, "plan_inputs", recording)
    runner = _group(model, kvp=3, kv_cache_tokens=24 * BS, kvp_tokens_per_rank=4 * BS, kvp_start=start, **group)
    posted = []
    post_plan = runner.coll.post_plan
    runner.coll.post_plan = lambda msg: (posted.append(msg), post_plan(msg))
    single = ModelRunner(model, KVCacheManager(24 * 3, BS))
    rng = random.Random(1)
    a, b, c = (Request(name, [rng.randrange(6, 4000) for _ in range(n)], SamplingParams())
               for name, n in (("a", 40), ("b", 50), ("c", 100)))
    steps = [([(a, 40)], []), ([(b, 50)], [a]), ([], [a, b]), ([(c, 100)], [b]), ([], [b]), ([], [a]), ([], [c])]
    want_tables, want_ranks = SKIP_CASES[start]
    try:
        for (prefills, decodes), kvp_ranks in zip(steps, want_ranks):
            for r, n in prefills:
                assert runner.kv.try_allocate(r, n)
            for r in decodes:
                assert runner.kv.try_allocate(r, 1)
            plan = step_plan(SchedulerOutput(prefills=prefills, decodes=decodes), runner.kv.block_tables)[0]
            assert step_ranks(plan, BS, 24, 3) == kvp_ranks
            ran.clear()
            n_posted = len(posted)
            torch.testing.assert_close(plan_logits(runner, plan), plan_logits(single, plan), atol=2e-4, rtol=1e-4)
            runner.coll.flush()
            want = {"MainThread"} | {f"rank-{(s * 3 + k) * tp + t}" for s in range(spp) for k in kvp_ranks
                                     for t in range(tp)} - {"rank-0"}
            deadline = time.monotonic() + 10
            while set(ran) != want and time.monotonic() < deadline:
                time.sleep(0.01)        # the lanes outside the logits' gather may finish later
            assert set(ran) == want
            if spp == 1:                # one run per rank
                assert len(ran) == len(want)
            assert len(posted) - n_posted == (0 if kvp_ranks == [0] and tp == spp == 1 else 1)
            for r, n in prefills:
                r.num_computed_tokens += n
                r.output_token_ids.append(rng.randrange(6, 4000))
            for r in decodes:
                r.num_computed_tokens += 1
                r.output_token_ids.append(rng.randrange(6, 4000))
        a_ = runner.kv.allocator
        assert {k: _ranks(a_, t) for k, t in runner.kv.block_tables.items()} == want_tables
        assert runner.ranks.errors == []
    finally:
        _close(runner)


@pytest.mark.parametrize("tp", [1, 2], ids=["kvp2", "kvp2xtp2"])
def test_block_moves_reach_the_group_only_when_another_rank_holds_some(model, tp):
    """P/D handoffs through the leader's port: blocks all on rank 0 load and save without a
    message to the group (plain KVP; TP lanes hold the leader's other heads, so they always get
    one); blocks over both ranks go through it. Either way what is saved is what was loaded."""
    runner = _group(model, kvp=2, tp=tp, kv_cache_tokens=8 * BS, kvp_tokens_per_rank=4 * BS, kvp_start="first_fit")
    posted = []
    post_plan = runner.coll.post_plan
    runner.coll.post_plan = lambda msg: (posted.append(type(msg).__name__), post_plan(msg))
    try:
        short = runner.kv.allocator.allocate(3)                 # rank 0
        long = runner.kv.allocator.allocate(6)                  # a range on rank 0, then rank 1
        assert _ranks(runner.kv.allocator, short) == [0] * 3
        assert _ranks(runner.kv.allocator, long) == [0] * 4 + [1] * 2
        g = torch.Generator().manual_seed(0)
        for table, msgs in ((short, [] if tp == 1 else ["KVLoad", "KVSave"]), (long, ["KVLoad", "KVSave"])):
            shape = list(runner.port.tensor.shape)
            shape[1] = len(table)
            data = torch.randn(shape, generator=g, dtype=runner.port.tensor.dtype)
            posted.clear()
            runner.load_blocks(table, data)
            torch.testing.assert_close(runner.save_blocks(table), data, atol=0, rtol=0)
            assert posted == msgs
        assert runner.ranks.errors == []
    finally:
        _close(runner)


# ---- engines -----------------------------------------------------------------------------------------
def test_a_progressive_engine_gives_the_plain_engines_greedy_tokens_and_holds_more_than_a_rank(model):
    """Mixed lengths in one batch (ranges of 4 blocks, or as large as a rank's pool: 32 blocks),
    and a 710-token request, more than one rank's 512 tokens."""
    rng = random.Random(0)
    prompts = [[rng.randrange(6, 4000) for _ in range(n)] for n in (700, 33, 150, 1)]
    want = _generate(model, prompts, kv_cache_tokens=4096, chunk_size=100)
    for cap, start in ((64, "first_fit"), (64, "least_loaded"), (512, "first_fit")):
        assert _generate(model, prompts, kv_cache_tokens=512, chunk_size=100, kvp=2, group_timeout_s=30,
                         kvp_layout="progressive", kvp_tokens_per_rank=cap, kvp_start=start) == want


@pytest.mark.parametrize("group", [{"kvp": 2}, {"kvp": 2, "tp": 2}], ids=["kvp2", "kvp2xtp2"])
def test_a_progressive_engine_with_prefix_caching_gives_the_plain_engines_tokens(model, group):
    engine_matches_plain(model, {**group, **PROGRESSIVE, "kvp_tokens_per_rank": 32},
                         "kvp2" + ("xtp2" if "tp" in group else "") + "+prog32ff")


@pytest.mark.parametrize("direction", ["plain-to-progressive", "progressive-to-plain"])
def test_a_handoff_into_or_out_of_a_progressive_kvp_engine_gives_the_plain_engines_tokens(model, direction):
    """P/D through the leader's StagedPort: blocks are global ids, so a progressive table (ranges
    of 2 blocks: the 97-token prompt over both ranks) loads and saves as a striped one does."""
    handoff_matches_plain(model, {"kvp": 2, **PROGRESSIVE, "kvp_tokens_per_rank": 32},
                          direction == "plain-to-progressive")


def test_the_profiler_times_a_progressive_group_on_tables_laid_out_like_its_allocator(model):
    from raycluster.engine.profiler import make_run_batch, profile_key

    runner = _group(model, kvp=2, kv_cache_tokens=1024, kvp_tokens_per_rank=256, enable_prefix_caching=True)
    try:
        assert type(runner.kv.allocator) is ProgressiveCachingAllocator
        run = make_run_batch(runner)
        for prefills, decodes in [([(128, 0)], []), ([(64, 1500)], [1800, 300]), ([], [4000] * 3)]:
            assert run(prefills, decodes) > 0
        key = profile_key(runner)
    finally:
        _close(runner)
    striped = build_runner(EngineConfig(**BASE, kvp=2, kv_cache_tokens=1024), model, torch.float32)
    try:
        assert profile_key(striped) != key          # a layout is profiled under its own key
    finally:
        _close(striped)


def test_the_parallel_bench_times_both_layouts_side_by_side(tmp_path, tiny_model_dir):
    import json

    from raycluster.bench.parallel_bench import main

    out = tmp_path / "layout.json"
    assert main(["--model", str(tiny_model_dir), "--parts", "kvp-layout", "--contexts", "40,300", "--chunk", "128",
                 "--kvp-tokens-per-rank", "64", "--decode-steps", "2", "--repeats", "1", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert set(res) == {"meta", "kvp-layout"} and res["meta"]["kvp_tokens_per_rank"] == 64
    assert [r["context"] for r in res["kvp-layout"]] == [40, 300]
    for row in res["kvp-layout"]:
        assert set(row["tpot_ms"]) == {"1 process, 1 thread", "kvp2 striped, 1 thread per rank",
                                       "kvp2 progressive, 1 thread per rank"}
        assert all(t > 0 for t in row["tpot_ms"].values())
