"""Speculative decoding with a draft model: the proposer drafts the draft model's own greedy
continuation however the context grew since its last proposal (checked against a plain engine
running the draft checkpoint), and an engine drafting with it gives the very tokens it gives
without drafts, greedy and seeded, under chunked prefill, KV pressure, prefix caching, a draft
KV pool too small for everyone, and aborts, with every draft block back at the end.

Drafts: the target checkpoint itself (every draft accepted), and a 2-layer model with the
target's first layers (some accepted)."""

from __future__ import annotations

import random

import pytest
from pydantic import ValidationError
from test_spec_decode import pressure_case

from raycluster.bench.spec_bench import write_first_layers
from raycluster.engine.config import EngineConfig
from raycluster.engine.draft_model import DraftModelProposer
from raycluster.engine.engine import LLMEngine
from raycluster.model.loader import load_config, load_model
from raycluster.model.tiny import write_tiny_model
from raycluster.request import Request, SamplingParams

BASE = dict(policy="fcfs", packer="token", predictor="none", kv_cache_tokens=8192)


@pytest.fixture(scope="module")
def drafts(tiny_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("drafts")
    return {"same": tiny_model_dir, "two_layers": write_tiny_model(root / "two_layers", seed=0, num_hidden_layers=2)}


def _prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(6, 4000) for _ in range(rng.choice([1, 3, 17, 40, 70]))] for _ in range(n)]


def _run(loaded, prompts, sps, draft=None, **cfg):
    """(outputs, engine) of a run to completion; outputs as (token ids, text, finish reason)."""
    model, tok = loaded
    spec = {} if draft is None else {"speculative_method": "draft_model", "speculative_model": draft,
                                     "num_speculative_tokens": 4}
    eng = LLMEngine(EngineConfig(**{**BASE, **spec, **cfg}), model, tok)
    reqs = [eng.add_request(f"r{i}", p, sp) for i, (p, sp) in enumerate(zip(prompts, sps))]
    texts = {r.request_id: "" for r in reqs}
    reasons = {}
    eng.num_preempted = 0
    for _ in range(5000):
        if not eng.has_unfinished():
            break
        res = eng.step()
        eng.num_preempted += res.num_preempted
        for o in res.outputs:
            texts[o.request_id] += o.new_text
            if o.finished:
                reasons[o.request_id] = o.finish_reason
    assert not eng.has_unfinished()
    eng.kv.check()
    assert eng.kv.num_free_blocks == eng.kv.num_blocks
    if draft is not None:
        assert eng.proposer.states == {}
        assert eng.proposer.allocator.num_free == eng.proposer.allocator.num_blocks
    return [(r.output_token_ids, texts[r.request_id], reasons[r.request_id]) for r in reqs], eng


def test_proposals_are_the_draft_models_greedy_continuation(drafts, loaded):
    """Round after round, the context grows by 1 to 5 arbitrary tokens (what the target accepted):
    each proposal equals the draft checkpoint's plain greedy continuation of the context."""
    draft, _ = load_model(drafts["two_layers"])
    plain = LLMEngine(EngineConfig(**BASE), draft, loaded[1])
    proposer = DraftModelProposer(draft, k=4, num_blocks=64, block_size=4)
    rng = random.Random(5)
    reqs = [Request(f"r{i}", p, SamplingParams()) for i, p in enumerate(_prompts(3, seed=1))]
    for _ in range(6):
        rooms = [rng.choice([1, 3, 4, 9]) for _ in reqs]
        got = proposer.propose_batch(reqs, rooms)
        for req, room, drafted in zip(reqs, rooms, got):
            want = plain.generate([req.all_token_ids], SamplingParams(max_tokens=min(4, room), ignore_eos=True))[0]
            assert drafted == want
            req.output_token_ids.extend(rng.randrange(6, 4000) for _ in range(rng.randint(1, 5)))
    assert proposer.propose_batch(reqs, [0, 0, -1]) == [[], [], []]
    for req in reqs:
        proposer.forget(req.request_id)
    assert proposer.allocator.num_free == 64 and proposer.states == {}


@pytest.mark.parametrize("which", ["same", "two_layers"])
@pytest.mark.parametrize("cfg", [{}, {"block_size": 3, "chunk_size": 7}])
def test_greedy_output_with_a_draft_model_equals_plain_decoding(drafts, loaded, which, cfg):
    prompts = _prompts(8, seed=2)
    sps = [SamplingParams(max_tokens=m, ignore_eos=True) for m in (30, 1, 2, 7, 30, 25, 30, 12)]
    want, _ = _run(loaded, prompts, sps, **cfg)
    got, eng = _run(loaded, prompts, sps, drafts[which], **cfg)
    assert got == want
    assert eng.spec.draft_tokens > 0
    if which == "same":
        assert eng.spec.accepted_tokens == eng.spec.draft_tokens
    else:
        assert 0 < eng.spec.accepted_tokens < eng.spec.draft_tokens


@pytest.mark.parametrize("which", ["same", "two_layers"])
def test_a_draft_model_under_kv_pressure_and_prefix_caching(drafts, loaded, which):
    """A target pool too small for every request at once (preemption by recompute: a preempted
    request's draft KV stays valid) and prefix caching."""
    prompts, cfg = pressure_case()
    sps = [SamplingParams(max_tokens=30, ignore_eos=True)] * 8
    want, _ = _run(loaded, prompts, sps, **cfg)
    got, eng = _run(loaded, prompts, sps, drafts[which], **cfg)
    assert got == want
    assert eng.num_preempted > 0 and eng.spec.accepted_tokens > 0


def test_seeded_sampled_output_with_a_draft_model_equals_plain_sampling(drafts, loaded):
    prompts = _prompts(4, seed=3)
    sps = [SamplingParams(max_tokens=24, temperature=0.8, top_p=0.95, seed=s) for s in range(4)]
    want, _ = _run(loaded, prompts, sps)
    got, eng = _run(loaded, prompts, sps, drafts["two_layers"])
    assert got == want and eng.spec.draft_tokens > 0


def test_a_draft_pool_too_small_for_everyone_drafts_for_whom_it_can(drafts, loaded):
    """speculative_kv_tokens: 96 (a few prompts' worth): some requests draft, the rest decode
    plainly; the same tokens either way."""
    prompts = _prompts(8, seed=4)
    sps = [SamplingParams(max_tokens=20, ignore_eos=True)] * 8
    want, _ = _run(loaded, prompts, sps)
    got, eng = _run(loaded, prompts, sps, drafts["same"], speculative_kv_tokens=96)
    _, roomy = _run(loaded, prompts, sps, drafts["same"])
    assert got == want and 0 < eng.spec.draft_tokens < roomy.spec.draft_tokens


def test_past_the_drafts_context_a_request_decodes_without_drafts(loaded, tmp_path):
    """A draft with 48 positions: the request drafts while the draft can read its tokens and
    feed its drafts but the last (positions up to 47: tokens + drafts up to 49, k shrinking at
    the end), then decodes plainly; the tokens are the plain run's."""
    short = write_tiny_model(tmp_path / "short", seed=0, num_hidden_layers=2, max_position_embeddings=48)
    prompts = [[7 + i for i in range(30)]]
    sps = [SamplingParams(max_tokens=40, ignore_eos=True)]
    want, _ = _run(loaded, prompts, sps)
    model, tok = loaded
    eng = LLMEngine(EngineConfig(**BASE, speculative_method="draft_model", speculative_model=short,
                                 num_speculative_tokens=4), model, tok)
    req = eng.add_request("r0", prompts[0], sps[0])
    longest = 0
    while eng.has_unfinished():
        eng.step()
        if req.spec_token_ids:
            longest = max(longest, req.num_tokens + len(req.spec_token_ids))
    assert req.output_token_ids == want[0][0] and eng.spec.draft_tokens > 0
    assert longest == 49


def test_a_long_prompts_catch_up_is_cut_to_the_step_budget(drafts, loaded):
    """max_num_batched_tokens 32 (also the draft's catch-up budget): 70- and 90-token prompts are
    prefilled by the draft over several steps, no draft pass over 32 + rows of the others; the
    requests draft once caught up, and the tokens are the plain run's."""
    prompts = [[7 + i for i in range(70)], [9 + i for i in range(90)], [11, 12, 13]]
    sps = [SamplingParams(max_tokens=24, ignore_eos=True)] * 3
    cfg = {"max_num_batched_tokens": 32, "chunk_size": 32}
    want, _ = _run(loaded, prompts, sps, **cfg)
    model, tok = loaded
    eng = LLMEngine(EngineConfig(**BASE, **cfg, speculative_method="draft_model", speculative_model=drafts["same"],
                                 num_speculative_tokens=4), model, tok)
    sizes = []
    real = eng.proposer._run

    def counted(plan):
        sizes.append(sum(plan.prefill_lens))
        return real(plan)
    eng.proposer._run = counted
    reqs = [eng.add_request(f"r{i}", p, sp) for i, (p, sp) in enumerate(zip(prompts, sps))]
    for _ in range(500):
        if not eng.has_unfinished():
            break
        eng.step()
    assert [r.output_token_ids for r in reqs] == [w[0] for w in want]
    assert max(sizes) <= 32 and sum(1 for n in sizes if n) >= 5        # 71 + 91 tokens in chunks of <= 32
    assert eng.spec.accepted_tokens == eng.spec.draft_tokens > 0


def test_an_aborted_request_gives_its_draft_blocks_back(drafts, loaded):
    model, tok = loaded
    eng = LLMEngine(EngineConfig(**BASE, speculative_method="draft_model", speculative_model=drafts["same"]),
                    model, tok)
    for i, p in enumerate(_prompts(3, seed=6)):
        eng.add_request(f"r{i}", p, SamplingParams(max_tokens=50, ignore_eos=True))
    for _ in range(4):
        eng.step()
    assert set(eng.proposer.states) == {"r0", "r1", "r2"}
    eng.abort_request("r1")
    assert set(eng.proposer.states) == {"r0", "r2"}
    held = sum(len(s.table) for s in eng.proposer.states.values())
    assert eng.proposer.allocator.num_used == held


def test_draft_model_config_names_the_field(drafts, loaded, tmp_path):
    with pytest.raises(ValidationError, match="speculative_model: speculative_method 'draft_model' needs"):
        EngineConfig(speculative_method="draft_model")
    with pytest.raises(ValidationError, match="speculative_model: a draft model or EAGLE head is only for"):
        EngineConfig(speculative_method="ngram", speculative_model="tiny")
    other = write_tiny_model(tmp_path / "other_vocab", vocab_size=512)
    model, tok = loaded
    with pytest.raises(ValueError, match="speculative_model: the draft's vocabulary has 512 tokens"):
        LLMEngine(EngineConfig(**BASE, speculative_method="draft_model", speculative_model=other), model, tok)


def test_a_draft_of_the_targets_first_layers(loaded, tiny_model_dir, tmp_path):
    """`bench spec-decode --draft-layers N`: the target's embeddings, first N layers, norm and
    head, and its tokenizer; N outside [1, layers - 1] is refused."""
    path = write_first_layers(tiny_model_dir, str(tmp_path / "d"), 2)
    draft, cfg = load_model(path)
    assert cfg.num_hidden_layers == 2 and cfg.vocab_size == load_config(tiny_model_dir).vocab_size
    target = dict(loaded[0].named_parameters())
    for name, param in draft.named_parameters():
        assert param.equal(target[name]), name
    assert len(dict(draft.named_parameters())) < len(target)
    with pytest.raises(ValueError, match="--draft-layers: 4 is not in"):
        write_first_layers(tiny_model_dir, str(tmp_path / "e"), 4)
