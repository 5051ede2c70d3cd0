"""The vocab-parallel embedding and output head of TP lanes (raycluster.parallel.vocab, vLLM's
VocabParallelEmbedding / ParallelLMHead): each lane holds only its padded V' / tp rows of the
embedding and the head (a tied model's head the same tensor), read from the checkpoint as cut
from the loaded model; the lanes' lookups sum to the full embedding bit for bit and their logit
slices, in lane order and without the padding columns, are the full logits; groups of every
kind with TP lanes (tp, spp-tp, kvp-tp, kvp-spp-tp) over vocabs no tp divides give the single
runner's logits step by step and the plain engine's tokens and prompt log-probabilities.
Checkpoints: test_tp.py's "odd-vocab" (untied, vocab 4099) and "qwen2-odd" (tied, vocab 4099),
and the tiny one (vocab 4096)."""

from __future__ import annotations

import pytest
import torch
from test_tp import BS, _close, engine_matches_plain, same_as_single_runner

from raycluster.engine.config import EngineConfig
from raycluster.model.loader import load_model
from raycluster.model.tiny import write_tiny_model
from raycluster.parallel.factory import build_runner
from raycluster.parallel.shard import Checkpoint, load_shard, shard_model
from raycluster.parallel.vocab import ParallelLMHead, VocabParallelEmbedding, padded_vocab, vocab_rows
from test_tp import VARIANTS

BASE = dict(policy="fcfs", packer="token", predictor="none", block_size=BS, num_threads=1, group_timeout_s=30)
NAMES = ("odd-vocab", "qwen2-odd")


@pytest.fixture(scope="module")
def paths(tiny_model_dir, tmp_path_factory):
    out = {"tiny": str(tiny_model_dir)}
    for name in NAMES:
        out[name] = write_tiny_model(tmp_path_factory.mktemp(name), seed=1, **VARIANTS[name])
    return out


@pytest.fixture(scope="module")
def models(paths):
    return {name: load_model(p)[0] for name, p in paths.items()}


def test_the_vocab_is_padded_to_a_multiple_of_tp_and_split_in_lane_order():
    assert padded_vocab(4099, 2) == 4100 and padded_vocab(4099, 4) == 4100 and padded_vocab(4096, 4) == 4096
    assert [vocab_rows(4099, 4, t) for t in range(4)] == [(0, 1025, 1025), (1025, 2050, 1025),
                                                        (2050, 3075, 1025), (3075, 4099, 1025)]
    assert vocab_rows(4099, 2, 1) == (2050, 4099, 2050)
    assert vocab_rows(5, 4, 3) == (5, 5, 2)          # a lane of padding only
    with pytest.raises(ValueError):
        vocab_rows(10, 2, 2)


def _storage_elems(*tensors) -> int:
    seen = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() // t.element_size() for t in tensors}
    return sum(seen.values())


@pytest.mark.parametrize("name", NAMES + ("tiny",))
@pytest.mark.parametrize("tp", [2, 4])
def test_each_lane_holds_only_its_rows_read_from_the_file_as_cut_from_the_model(paths, models, name, tp):
    full = models[name]
    cfg = full.config
    V, H, tied = cfg.vocab_size, cfg.hidden_size, cfg.tie_word_embeddings
    want_head = full.model.embed_tokens.weight if tied else full.lm_head.weight
    embeds, heads = [], []
    for lane in range(tp):
        lo, hi, rows = vocab_rows(V, tp, lane)
        cut = shard_model(full, lane, tp)
        read = load_shard(Checkpoint(paths[name], cfg), lane, tp)
        for m in (cut, read):
            emb, head = m.model.embed_tokens, m.lm_head
            assert isinstance(emb, VocabParallelEmbedding) and isinstance(head, ParallelLMHead)
            assert (emb.lo, emb.hi) == (lo, hi)
            assert emb.weight.shape == head.weight.shape == (rows, H)
            assert (head.weight is emb.weight) == tied
            assert torch.equal(emb.weight[hi - lo:], torch.zeros(rows - (hi - lo), H))    # padding rows
        # Read from the file, only V' / tp rows are held: tied, one tensor for both; untied, two.
        # (Cut from the full model, they are views of it where no padding falls.)
        assert _storage_elems(read.model.embed_tokens.weight, read.lm_head.weight) == rows * H * (1 if tied else 2)
        assert torch.equal(read.model.embed_tokens.weight, cut.model.embed_tokens.weight)
        assert torch.equal(read.lm_head.weight, cut.lm_head.weight)
        embeds.append(read.model.embed_tokens.weight[:hi - lo])
        heads.append(read.lm_head.weight[:hi - lo])
    assert torch.equal(torch.cat(embeds), full.model.embed_tokens.weight)
    assert torch.equal(torch.cat(heads), want_head)


@pytest.mark.parametrize("name", NAMES)
def test_a_lane_reads_only_the_vocab_modules_it_is_asked_for(paths, name):
    cfg = load_model(paths[name])[1]
    ckpt = Checkpoint(paths[name], cfg)
    rows = vocab_rows(cfg.vocab_size, 2, 1)[2]
    head = load_shard(ckpt, 1, 2, layers=range(1, 2), embed=False, norm=True, head=True)
    assert head.model.embed_tokens is None and head.lm_head.weight.shape == (rows, cfg.hidden_size)
    embed = load_shard(ckpt, 1, 2, layers=range(0, 1), embed=True, norm=False, head=False)
    assert embed.lm_head is None and embed.model.embed_tokens.weight.shape == (rows, cfg.hidden_size)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("tp", [2, 4])
def test_the_lanes_lookups_sum_to_the_full_embedding_and_their_slices_are_the_full_logits(models, name, tp):
    full = models[name]
    V = full.config.vocab_size
    ids = torch.tensor([0, 1, 1024, 1025, 2049, 2050, 3074, 3075, V - 1, 7, V - 2])
    shards = [shard_model(full, lane, tp) for lane in range(tp)]
    lookups = [s.model.embed_tokens(ids) for s in shards]          # identity reduce: one lane's part each
    for lane, part in enumerate(lookups):
        lo, hi, _ = vocab_rows(V, tp, lane)
        mine = (ids >= lo) & (ids < hi)
        assert torch.equal(part[~mine], torch.zeros_like(part[~mine]))
    assert torch.equal(sum(lookups), full.model.embed_tokens(ids))
    h = torch.randn(5, full.config.hidden_size)
    slices = torch.cat([s.lm_head(h) for s in shards], 1)
    assert slices.shape == (5, padded_vocab(V, tp))
    torch.testing.assert_close(slices[:, :V], full.compute_logits(h), atol=1e-5, rtol=1e-5)
    assert torch.equal(slices[:, V:], torch.zeros(5, padded_vocab(V, tp) - V))


# ---- groups of every kind with TP lanes, over a vocab no tp divides ---------------------------------
GROUPS = [("odd-vocab", {"tp": 2}, "tp2"), ("qwen2-odd", {"tp": 4}, "tp4"),
          ("qwen2-odd", {"spp": 2, "tp": 2, "spp_micro_tokens": 32}, "spp2xtp2"),
          ("odd-vocab", {"spp": 2, "tp": 2, "spp_micro_tokens": 32}, "spp2xtp2"),
          ("odd-vocab", {"kvp": 2, "tp": 2}, "kvp2xtp2"), ("qwen2-odd", {"kvp": 2, "tp": 2}, "kvp2xtp2"),
          ("qwen2-odd", {"kvp": 2, "spp": 2, "tp": 2, "spp_micro_tokens": 32}, "kvp2xspp2xtp2")]


@pytest.mark.parametrize("name,group,layout", GROUPS, ids=[f"{n}-{l}" for n, _, l in GROUPS])
def test_a_group_with_tp_lanes_gives_the_single_runners_logits_step_by_step(models, name, group, layout):
    model = models[name]
    # same_as_single_runner's tables use block ids up to 40: 64 blocks per KVP rank.
    runner = build_runner(EngineConfig(**BASE, kv_cache_tokens=64 * BS, **group), model, torch.float32)
    try:
        assert runner.layout == layout and runner.returns_logits
        same_as_single_runner(model, runner)
    finally:
        _close(runner)


@pytest.mark.parametrize("name,group,layout", [
    ("odd-vocab", {"spp": 2, "tp": 2, "spp_micro_tokens": 16}, "spp2xtp2"),
    ("qwen2-odd", {"kvp": 2, "tp": 2}, "kvp2xtp2"),
    ("odd-vocab", {"kvp": 2, "spp": 2, "tp": 2, "spp_micro_tokens": 16}, "kvp2xspp2xtp2")])
def test_a_group_engine_over_a_padded_vocab_gives_the_plain_engines_tokens_and_prompt_logprobs(
        models, name, group, layout):
    engine_matches_plain(models[name], group, layout)


def test_a_group_built_from_the_checkpoint_reads_only_its_lanes_vocab_rows(paths, models):
    """An spp2xtp2 group from the path: the leader (stage 0, lane 0) holds its embedding rows and
    no head (the last stage's lanes compute the logits), and gives the single runner's logits."""
    cfg = models["odd-vocab"].config
    runner = build_runner(EngineConfig(**BASE, kv_cache_tokens=64 * BS, spp=2, tp=2, spp_micro_tokens=32),
                          Checkpoint(paths["odd-vocab"], cfg), torch.float32)
    try:
        shard = runner.stage.model
        assert shard.lm_head is None and shard.model.norm is None
        assert shard.model.embed_tokens.weight.shape == (vocab_rows(cfg.vocab_size, 2, 0)[2], cfg.hidden_size)
        with pytest.raises(RuntimeError, match="vocab-parallel"):
            runner.model.compute_logits(torch.zeros(1, cfg.hidden_size))
        same_as_single_runner(models["odd-vocab"], runner)
    finally:
        _close(runner)
