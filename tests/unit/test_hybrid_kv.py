"""The hybrid KV cache of models mixing sliding-window and full-attention layers
(raycluster.engine.kv_groups, raycluster.engine.hybrid_kv): the layer groups, the block
bookkeeping (every group's table grows alike, sliding groups give back what leaves their window,
forks and frees keep the refcounts), and the engine on it giving the same tokens as with one table
for every layer (and as transformers) while holding fewer blocks: on one process, on a TP group,
across a P/D handoff and under preemption."""

from __future__ import annotations

import random

import pytest
from family_checks import greedy_equals_transformers
from test_tp import BASE, BS, GREEDY, _close, _decode, _prefill

from raycluster.engine.config import EngineConfig
from raycluster.engine.engine import LLMEngine
from raycluster.engine.hybrid_kv import HybridKVManager
from raycluster.engine.kv_groups import kv_groups
from raycluster.engine.kv_manager import KVCacheManager, OutOfBlocks
from raycluster.model.config import ModelConfig
from raycluster.model.loader import load_model
from raycluster.model.tiny import tiny_config, write_tiny_model
from raycluster.request import Request, SamplingParams

# gpt-oss: even layers slide (window 128 in the tiny config), YaRN, sinks, experts.
GPT_OSS = dict(architectures=["GptOssForCausalLM"], num_hidden_layers=4, sliding_window=24)
# Gemma 3: five sliding layers for each full one.
GEMMA3 = dict(architectures=["Gemma3ForCausalLM"], num_hidden_layers=7, sliding_window=24,
              tie_word_embeddings=False, layer_types=["sliding_attention"] * 5 + ["full_attention", "sliding_attention"])


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return {name: load_model(write_tiny_model(tmp_path_factory.mktemp(name), seed=3, **over))[0]
            for name, over in (("gpt_oss", GPT_OSS), ("gemma3", GEMMA3))}


def _prompts(n: int, lengths, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(6, n) for _ in range(m)] for m in lengths]


def test_layers_split_into_groups_of_one_kind():
    oss = kv_groups(ModelConfig.from_dict(tiny_config(**GPT_OSS)))
    assert oss.windows == (None, 24) and oss.layers == ((1, 3), (0, 2)) and oss.num_slots == 2
    assert oss.group_of == (1, 0, 1, 0) and oss.slot_of == (0, 0, 1, 1)
    assert oss.pool_blocks(100) == 200          # the same bytes: blocks of 2 layers, not 4
    gemma = kv_groups(ModelConfig.from_dict(tiny_config(**GEMMA3)))
    # Layer 5 is full (every sixth); the rest slide: 1 full group and 6 sliding groups of one slot.
    assert gemma.num_slots == 1 and gemma.layers[0] == (5,) and len(gemma.layers) == 7
    assert gemma.windows == (None,) + (24,) * 6 and gemma.pool_blocks(10) == 70
    assert kv_groups(ModelConfig.from_dict(tiny_config())) is None           # all full
    mistral = tiny_config(architectures=["MistralForCausalLM"], sliding_window=24)
    assert kv_groups(ModelConfig.from_dict(mistral)) is None                 # all sliding


def _req(rid: str, n: int) -> Request:
    return Request(rid, list(range(6, 6 + n)), SamplingParams(max_tokens=8))


def test_tables_grow_alike_and_sliding_groups_give_back_their_past():
    groups = kv_groups(ModelConfig.from_dict(tiny_config(**GPT_OSS)))
    kv = HybridKVManager(40, 8, groups)
    assert kv.num_blocks == 40 and kv.num_free_blocks == 40 and kv.kv_slots(4) == 2
    a = _req("a", 50)
    assert kv.try_allocate(a, 50)                       # 7 blocks in each of 2 groups
    assert kv.num_free_blocks == 40 - 14 and len(kv.block_tables["a"]) == len(kv.extra_group_tables[0]["a"]) == 7
    a.num_computed_tokens = 50
    kv.release_outside_window([a])                      # positions < 50 - 24 + 1 = 27: 3 whole blocks
    sliding = kv.extra_group_tables[0]["a"]
    assert sliding[:3] == [kv.null_block] * 3 and kv.null_block not in sliding[3:]
    assert kv.num_free_blocks == 40 - 14 + 3 and kv.released_total == 3
    kv.check()
    kv.fork("a", "a2")                                  # parallel samples share all but the nulls
    kv.check()
    # Block by block, each in every group: a skipped prefix is skipped in every group.
    assert kv.handoff_table("a") == [b for pair in zip(kv.block_tables["a"], sliding) for b in pair]
    assert kv.handoff_skip(3) == 6
    assert not kv.try_allocate(_req("big", 200), 200)   # 25 blocks x 2 groups do not fit
    kv.free("a")
    kv.free("a2")
    kv.check()
    assert kv.num_free_blocks == kv.num_blocks
    assert kv.capacity_tokens() == 20 * 8 and kv.placement_blocks() == (20, 20)
    with pytest.raises(OutOfBlocks):
        kv.allocator.allocate(41)


def _hybrid_and_plain(model, **over):
    cfg = {**BASE, "kv_cache_tokens": 4096, "chunk_size": 32, **over}
    return (LLMEngine(EngineConfig(**cfg), model),
            LLMEngine(EngineConfig(**cfg, disable_hybrid_kv_cache_manager=True), model))


@pytest.mark.parametrize("name", ["gpt_oss", "gemma3"])
def test_the_engine_gives_one_tables_tokens_on_fewer_blocks(models, name):
    model = models[name]
    hybrid, plain = _hybrid_and_plain(model)
    assert isinstance(hybrid.kv, HybridKVManager) and type(plain.kv) is KVCacheManager
    prompts = _prompts(model.config.vocab_size - 10, (5, 30, 97, 150), seed=1)
    sp = SamplingParams(max_tokens=40, ignore_eos=True)
    peak = {}
    for name_, eng in (("hybrid", hybrid), ("plain", plain)):
        reqs = [eng.add_request(f"r{i}", p, sp) for i, p in enumerate(prompts)]
        most = 0
        for _ in range(500):
            if not eng.has_unfinished():
                break
            eng.step()
            most = max(most, eng.kv.num_blocks - eng.kv.num_free_blocks)
        peak[name_] = (most, eng.kv.num_blocks)
        eng.kv.check()
        assert eng.kv.num_free_blocks == eng.kv.num_blocks
        peak[name_ + "_out"] = [r.output_token_ids for r in reqs]
    assert peak["hybrid_out"] == peak["plain_out"]
    # The same bytes: held blocks as a share of each pool. The sliding groups hold about the
    # window (2-3 blocks of 16) per request instead of its whole context.
    assert peak["hybrid"][0] / peak["hybrid"][1] < 0.75 * peak["plain"][0] / peak["plain"][1]
    assert hybrid.kv.released_total > 0


def test_gpt_oss_on_the_hybrid_cache_equals_transformers(models, tmp_path):
    path = write_tiny_model(tmp_path, seed=3, **GPT_OSS)
    model = load_model(path)[0]
    greedy_equals_transformers(path, model, [(4, 12), (60, 20), (90, 10)], seed=7, chunk_size=16)


def test_preemption_on_a_tight_pool(models):
    """A pool too small for every request at once preempts and recomputes, one table or
    several: the same tokens, and the hybrid pool preempts less."""
    model = models["gpt_oss"]
    hybrid, plain = _hybrid_and_plain(model, kv_cache_tokens=384)
    prompts = _prompts(model.config.vocab_size - 10, (60, 70, 80, 90), seed=2)
    sp = SamplingParams(max_tokens=30, ignore_eos=True)
    want = plain.generate(prompts, sp)
    assert hybrid.generate(prompts, sp) == want
    hybrid.kv.check()
    assert hybrid.kv.num_free_blocks == hybrid.kv.num_blocks
    assert plain.scheduler.preempted_total > hybrid.scheduler.preempted_total


def test_a_tp_group_on_the_hybrid_cache(models):
    model = models["gpt_oss"]
    prompts = _prompts(model.config.vocab_size - 10, (20, 75, 130), seed=4)
    sp = SamplingParams(max_tokens=12, ignore_eos=True)
    want = LLMEngine(EngineConfig(**BASE, kv_cache_tokens=4096, chunk_size=32,
                                  disable_hybrid_kv_cache_manager=True), model).generate(prompts, sp)
    eng = LLMEngine(EngineConfig(**BASE, kv_cache_tokens=4096, chunk_size=32, tp=2), model)
    try:
        assert eng.runner.layout == "tp2" and isinstance(eng.kv, HybridKVManager)
        assert eng.generate(prompts, sp) == want
        eng.kv.check()
    finally:
        _close(eng.runner)


def test_a_handoff_between_hybrid_engines(models):
    """The prefill side offers every group's blocks, block by block; the decode side, laid out
    alike, allocates them in that order: its tokens are a plain engine's."""
    model = models["gpt_oss"]
    prompt = _prompts(model.config.vocab_size - 10, (77,), seed=6)[0]
    hybrid, plain = _hybrid_and_plain(model)
    want = plain.generate([prompt], GREEDY)[0]
    decode = LLMEngine(EngineConfig(**BASE, kv_cache_tokens=4096, chunk_size=32), model)
    first, data = _prefill(hybrid, "h", prompt)
    groups = hybrid.kv.groups
    assert data.shape[0] == groups.num_slots and data.shape[1] == groups.num_groups * -(-len(prompt) // BS)
    tokens, moved, _ = _decode(decode, "h", prompt, first, data)
    assert first == want[:1] and tokens == want and moved == [0]
    assert decode.kv.released_total > 0         # its sliding groups gave back the past after admission


def test_drafts_on_the_hybrid_cache(models):
    """A decode running drafts takes a row per draft on each group's table (drafts from an
    oracle that knows the greedy output, wrong from the third on: accepted and rejected runs)."""
    from test_spec_decode import OracleProposer

    model = models["gemma3"]
    _, plain = _hybrid_and_plain(model)
    prompts = _prompts(model.config.vocab_size - 10, (20, 45, 90), seed=8)
    sp = SamplingParams(max_tokens=40, ignore_eos=True)
    want = plain.generate(prompts, sp)
    drafting = LLMEngine(EngineConfig(**BASE, kv_cache_tokens=4096, chunk_size=32, speculative_method="ngram",
                                      num_speculative_tokens=4), model)
    assert isinstance(drafting.kv, HybridKVManager)
    drafting.proposer = OracleProposer({tuple(p): w for p, w in zip(prompts, want)}, wrong_at=2)
    assert drafting.generate(prompts, sp) == want
    assert drafting.spec.draft_tokens > 0 and 0 < drafting.spec.accepted_tokens < drafting.spec.draft_tokens
    drafting.kv.check()


# ---- prefix caching on the hybrid cache -------------------------------------------------------------
def test_a_hit_needs_every_full_block_and_the_sliding_groups_window(monkeypatch):
    """A's 56 computed tokens (7 blocks of 8; window 24) are cached in both groups. A hit of h
    blocks needs blocks 0..h-1 of the full group and, of the sliding group, those from the one
    holding position 8h - 23 on; with the sliding group's later blocks gone it is shorter. The hit's
    sliding entries before its window are null, as if released."""
    from raycluster.engine.hybrid_prefix import HybridPrefixCachingKVManager

    groups = kv_groups(ModelConfig.from_dict(tiny_config(**GPT_OSS)))
    kv = HybridPrefixCachingKVManager(40, 8, groups)
    a = _req("a", 57)
    assert kv.match_prefix(a) == 0 and kv.try_allocate(a, 57)
    a.num_computed_tokens = 56
    kv.cache_full_blocks(a, 56)
    kv.release_outside_window([a])          # the sliding group's blocks 0-3 leave its window, findable still
    sliding = kv.extra_group_tables[0]["a"]
    assert kv.cached_prefix_tokens(a.all_token_ids) == 56
    hidden: set[int] = set()
    lookup = kv.allocator.lookup
    monkeypatch.setattr(kv.allocator, "lookup", lambda key: None if lookup(key) in hidden else lookup(key))
    hidden.add(sliding[6])
    assert kv.cached_prefix_tokens(a.all_token_ids) == 48          # blocks 3-5 serve a hit of 6
    hidden.add(sliding[5])
    assert kv.cached_prefix_tokens(a.all_token_ids) == 40          # blocks 2-4 serve a hit of 5
    hidden.add(kv.block_tables["a"][2])
    assert kv.cached_prefix_tokens(a.all_token_ids) == 16          # the full group's chain ends at 2
    monkeypatch.undo()
    b = _req("b", 57)
    assert kv.match_prefix(b) == 56
    table = kv.extra_group_tables[0]["b"]
    assert table[:4] == [kv.null_block] * 4 and table[4:] == sliding[4:7]
    assert kv.block_tables["b"] == kv.block_tables["a"][:7]
    kv.check()
    assert kv.hit_tokens == 56 and kv.query_tokens == 2 * 57
    for rid in ("a", "b"):
        kv.free(rid)
    kv.check()
    assert kv.num_free_blocks == kv.num_blocks


@pytest.mark.parametrize("group", [{}, {"tp": 2}], ids=["single", "tp2"])
def test_prefix_caching_on_the_hybrid_cache_gives_the_plain_tokens(models, group):
    """Timed arrivals sharing a 70-token prefix (past the 24-token window), some asking for prompt
    log-probabilities: the tokens of an engine without prefix caching, hits counted."""
    from test_tp import engine_matches_plain

    model = models["gpt_oss"]
    engine_matches_plain(model, group, "tp2" if group else "single")


def test_a_handoff_skips_a_prefix_the_decode_side_has_cached(models):
    """The decode engine has the prompt's first two blocks cached (a 40-token shared start, past
    the 24-token window): it pulls the rest of every group's blocks, the handoff table's first
    2 x groups entries skipped, and decodes a plain engine's tokens."""
    model = models["gemma3"]
    rng = random.Random(3)
    shared = [rng.randrange(6, 4000) for _ in range(40)]
    prompt = shared + [rng.randrange(6, 4000) for _ in range(57)]
    cfg = {**BASE, "kv_cache_tokens": 2048, "chunk_size": 32}
    want = LLMEngine(EngineConfig(**cfg, disable_hybrid_kv_cache_manager=True), model).generate([prompt], GREEDY)[0]
    prefill, decode = (LLMEngine(EngineConfig(**cfg, enable_prefix_caching=True), model) for _ in range(2))
    decode.generate([shared + [7, 8, 9]], GREEDY)
    first, data = _prefill(prefill, "h", prompt)
    groups = prefill.kv.groups
    assert data.shape[1] == groups.num_groups * -(-len(prompt) // BS)
    tokens, moved, _ = _decode(decode, "h", prompt, first, data)
    assert moved == [2 * groups.num_groups] and first == want[:1] and tokens == want
