"""Speculative decoding: the n-gram proposer, the verifier's acceptance rule, and the engine's
output with drafts against the same engine without them.

Random tiny weights rarely repeat themselves, so most engine tests draft with an oracle: a
proposer that knows the plain engine's greedy output and drafts it, corrupted at a chosen
offset. That puts accepted runs, rejections, stop conditions and KV block boundaries where a
test wants them; one test runs the real n-gram proposer on outputs long enough to cycle.
"""

from __future__ import annotations

import random

import pytest
import torch
from pydantic import ValidationError

from raycluster.engine.config import EngineConfig
from raycluster.engine.engine import LLMEngine
from raycluster.engine.sampler import Sampler
from raycluster.engine.spec_decode import NgramProposer
from raycluster.request import SamplingParams

BASE = dict(policy="fcfs", packer="token", predictor="none", kv_cache_tokens=8192)


# ---- proposer ---------------------------------------------------------------------------------
@pytest.mark.parametrize("tokens, k, max_n, min_n, want", [
    ([1, 2, 3, 4, 1, 2], 3, 4, 1, [3, 4, 1]),          # suffix [1, 2] seen at the start
    ([1, 2, 9, 1, 2, 8, 1, 2], 3, 4, 1, [8, 1, 2]),     # the latest earlier occurrence wins
    ([5, 1, 2, 3, 7, 2, 3, 9, 1, 2, 3], 2, 4, 1, [7, 2]),   # the longest match ([1 2 3]) over a later [2 3]
    ([5, 6, 7], 3, 4, 1, []),                           # nothing recurs
    ([1, 2, 3, 9, 2], 3, 4, 2, []),                     # only a 1-gram recurs, min_n is 2
    ([1, 2, 3, 9, 3], 3, 2, 1, [9, 3]),
    ([7, 7, 7, 7], 3, 4, 1, [7]),                       # the continuation stops at the context's end
    ([1, 2, 3, 4, 5, 1, 2], 2, 4, 1, [3, 4]),           # at most k
    ([4], 3, 4, 1, []),
])
def test_ngram_proposer_drafts_what_followed_the_longest_latest_match(tokens, k, max_n, min_n, want):
    assert NgramProposer(k, max_n, min_n).propose(tokens) == want


def test_ngram_proposer_caps_at_the_room_left():
    p = NgramProposer(5, 3)
    assert p.propose([1, 2, 3, 4, 5, 6, 1], 2) == [2, 3]
    assert p.propose([1, 2, 3, 4, 5, 6, 1], 0) == []


def test_config_names_the_lookup_field():
    with pytest.raises(ValidationError, match="prompt_lookup_min"):
        EngineConfig(speculative_method="ngram", prompt_lookup_min=5, prompt_lookup_max=3)
    with pytest.raises(ValidationError, match="num_speculative_tokens"):
        EngineConfig(speculative_method="ngram", num_speculative_tokens=0)


# ---- verifier ---------------------------------------------------------------------------------
def _rows(argmaxes: list[int], vocab: int = 10) -> torch.Tensor:
    rows = torch.zeros(len(argmaxes), vocab)
    for i, t in enumerate(argmaxes):
        rows[i, t] = 5.0
    return rows


@pytest.mark.parametrize("targets, drafts, want", [
    ([3, 4, 5, 6], [3, 4, 5], [3, 4, 5, 6]),       # all accepted, then the bonus token
    ([3, 4, 5, 6], [3, 9, 5], [3, 4]),             # rejected at the second: the model's token there
    ([3, 4, 5, 6], [8, 4, 5], [3]),
    ([2], [], [2]),
])
def test_greedy_verify_keeps_drafts_while_they_are_the_argmax(targets, drafts, want):
    assert Sampler().verify(_rows(targets), drafts, SamplingParams(), 0) == want


def test_sampled_verify_keeps_the_target_distribution():
    """The first token's frequencies match p, for a likely draft, an unlikely one and one
    outside the top-k (never accepted), and a draft is kept as often as p gives it."""
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0], [0.0] * 5])
    sp = SamplingParams(temperature=1.0, top_k=4)
    p = torch.softmax(torch.tensor([2.0, 1.0, 0.5, 0.0]), 0).tolist() + [0.0]
    n = 20000
    for draft in (0, 3, 4):
        sampler = Sampler(seed=draft)
        counts, kept = [0] * 5, 0
        for _ in range(n):
            out = sampler.verify(logits, [draft], sp, 0)
            counts[out[0]] += 1
            kept += len(out) == 2
        for c, want in zip(counts, p):
            assert abs(c / n - want) < 0.015, (draft, counts, p)
        assert counts[4] == 0 and kept == counts[draft]


def test_seeded_verify_draws_each_position_as_plain_sampling_does():
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(3))
    sp = SamplingParams(temperature=0.9, seed=11)
    plain = [Sampler(seed=7).sample(logits[j:j + 1], [sp], [4 + j])[0] for j in range(4)]
    assert Sampler(seed=1).verify(logits, plain[:3], sp, 4) == plain            # all kept, then the bonus
    wrong = [plain[0], (plain[1] + 1) % 50, plain[2]]
    assert Sampler(seed=2).verify(logits, wrong, sp, 4) == plain[:2]           # the model's token at 1


# ---- the engine with drafts -------------------------------------------------------------------
class OracleProposer(NgramProposer):
    """Drafts the known greedy continuation of each prompt; with `wrong_at` = j, draft j (and
    every later one) is off by one token, so exactly j drafts can be accepted. (An n-gram
    proposer with its lookup replaced: the engine calls it the same way.)"""

    def __init__(self, expected: dict[tuple, list[int]], k: int = 4, wrong_at: int | None = None) -> None:
        self.expected, self.k, self.wrong_at = expected, k, wrong_at
        self.proposed = 0

    def propose(self, tokens: list[int], k: int | None = None) -> list[int]:
        k = self.k if k is None else min(k, self.k)
        for prompt, out in self.expected.items():
            n = len(prompt)
            if tuple(tokens[:n]) == prompt and tokens[n:] == out[:len(tokens) - n]:
                drafts = out[len(tokens) - n:len(tokens) - n + k]
                if self.wrong_at is not None:
                    drafts = [t if j < self.wrong_at else (t + 1) % 4000 for j, t in enumerate(drafts)]
                self.proposed += len(drafts)
                return drafts
        return []


def _prompts(n: int = 6, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(6, 4000) for _ in range(rng.choice([3, 17, 40, 70]))] for _ in range(n)]


def _run(loaded, prompts, sps, proposer=None, **cfg):
    model, tok = loaded
    spec = {"speculative_method": "ngram"} if proposer is not None else {}
    eng = LLMEngine(EngineConfig(**{**BASE, **spec, **cfg}), model, tok)
    if proposer is not None:
        eng.proposer = proposer
    reqs = [eng.add_request(f"r{i}", p, sp) for i, (p, sp) in enumerate(zip(prompts, sps))]
    outs = {r.request_id: [] for r in reqs}
    stats = {"drafts": 0, "accepted": 0, "steps": 0, "multi": 0, "preempted": 0}
    for _ in range(5000):
        if not eng.has_unfinished():
            break
        res = eng.step()
        stats["steps"] += 1
        stats["drafts"] += res.num_draft_tokens
        stats["accepted"] += res.num_accepted_tokens
        stats["preempted"] += res.num_preempted
        for o in res.outputs:
            outs[o.request_id].append(o)
            stats["multi"] += len(o.new_token_ids) > 1
    assert not eng.has_unfinished()
    eng.kv.check()
    assert eng.kv.num_free_blocks == eng.kv.num_blocks
    result = []
    for r in reqs:
        o = outs[r.request_id]
        ids = [t for x in o for t in x.new_token_ids]
        assert ids == r.output_token_ids
        result.append((ids, "".join(x.new_text for x in o), o[-1].finish_reason, o[-1].num_output_tokens,
                       [lp for x in o for lp in (x.logprobs or [])]))
    return result, stats


def _expected(loaded, prompts, max_tokens=40):
    plain, _ = _run(loaded, prompts, [SamplingParams(max_tokens=max_tokens, ignore_eos=True)] * len(prompts))
    return {tuple(p): r[0] for p, r in zip(prompts, plain)}


@pytest.mark.parametrize("wrong_at", [None, 0, 1, 3])
@pytest.mark.parametrize("block_size", [16, 3])
def test_greedy_output_with_drafts_equals_plain_decoding(loaded, wrong_at, block_size):
    prompts = _prompts()
    sps = [SamplingParams(max_tokens=m, ignore_eos=True) for m in (40, 1, 2, 7, 33, 40)]
    want, _ = _run(loaded, prompts, sps, block_size=block_size)
    oracle = OracleProposer(_expected(loaded, prompts), wrong_at=wrong_at)
    got, stats = _run(loaded, prompts, sps, oracle, block_size=block_size)
    assert got == want
    assert stats["drafts"] > 0
    if wrong_at == 0:
        assert stats["accepted"] == 0 and stats["multi"] == 0
    else:
        assert stats["accepted"] > 0 and stats["multi"] > 0
        plain_steps = _run(loaded, prompts, sps, block_size=block_size)[1]["steps"]
        assert stats["steps"] < plain_steps


def _cut_points(loaded, prompts):
    """(prompt index, output position) of tokens that arrive inside a multi-token output of an
    oracle run, not at its end: where a stop must cut an accepted run short."""
    expected = _expected(loaded, prompts)
    model, tok = loaded
    eng = LLMEngine(EngineConfig(**BASE, speculative_method="ngram"), model, tok)
    eng.proposer = OracleProposer(expected)
    for i, p in enumerate(prompts):
        eng.add_request(f"r{i}", p, SamplingParams(max_tokens=40, ignore_eos=True))
    cuts, seen = [], {}
    while eng.has_unfinished():
        for o in eng.step().outputs:
            i = int(o.request_id[1:])
            start = seen.get(i, 0)
            cuts.extend((i, start + j) for j in range(len(o.new_token_ids) - 1))
            seen[i] = start + len(o.new_token_ids)
    return expected, cuts


def test_stop_token_ids_and_stop_strings_inside_an_accepted_run(loaded):
    prompts = _prompts(4, seed=2)
    expected, cuts = _cut_points(loaded, prompts)
    assert cuts
    model, tok = loaded
    rng = random.Random(0)
    for i, pos in rng.sample(cuts, min(6, len(cuts))):
        out = expected[tuple(prompts[i])]
        stop_id = out[pos]
        text = tok.decode(out[:pos + 1])
        stop_str = text[-3:] if len(text.strip()) >= 3 else None
        variants = [SamplingParams(max_tokens=40, ignore_eos=True, stop_token_ids=[stop_id]),
                    SamplingParams(max_tokens=40, ignore_eos=True, stop_token_ids=[stop_id],
                                   include_stop_str_in_output=True),
                    SamplingParams(max_tokens=pos + 1, ignore_eos=True)]
        if stop_str:
            variants += [SamplingParams(max_tokens=40, ignore_eos=True, stop=[stop_str]),
                         SamplingParams(max_tokens=40, ignore_eos=True, stop=[stop_str],
                                        include_stop_str_in_output=True)]
        for sp in variants:
            want, _ = _run(loaded, [prompts[i]], [sp])
            got, stats = _run(loaded, [prompts[i]], [sp], OracleProposer(expected))
            assert got == want, (sp, pos)
            assert stats["accepted"] > 0


def test_eos_inside_an_accepted_run_ends_the_request_there(loaded):
    """The tiny model's EOS is id 1: pretend a token of the output is EOS by listing it."""
    prompts = _prompts(3, seed=4)
    expected, cuts = _cut_points(loaded, prompts)
    i, pos = cuts[len(cuts) // 2]
    eos_like = expected[tuple(prompts[i])][pos]
    sp = SamplingParams(max_tokens=40, stop_token_ids=[eos_like])
    want, _ = _run(loaded, [prompts[i]], [sp])
    got, _ = _run(loaded, [prompts[i]], [sp], OracleProposer(expected))
    assert got == want and got[0][2] == "stop" and got[0][0][-1] == eos_like


def test_logprobs_of_drafted_tokens_equal_plain_ones(loaded):
    prompts = _prompts(3, seed=5)
    sps = [SamplingParams(max_tokens=20, ignore_eos=True, logprobs=3)] * 3
    want, _ = _run(loaded, prompts, sps)
    got, stats = _run(loaded, prompts, sps, OracleProposer(_expected(loaded, prompts, 20)))
    assert stats["accepted"] > 0
    for (ids_w, text_w, _, _, lps_w), (ids_g, text_g, _, _, lps_g) in zip(want, got):
        assert ids_w == ids_g and text_w == text_g and len(lps_g) == len(ids_g)
        for a, b in zip(lps_w, lps_g):
            assert a.rank == b.rank and a.logprob == pytest.approx(b.logprob, abs=1e-4)
            assert [t for t, _ in a.top] == [t for t, _ in b.top]


def pressure_case() -> tuple[list[list[int]], dict]:
    """8 prompts sharing a 40-token prefix, and an engine config whose 320-token KV pool cannot
    hold all of them with 30 output tokens each (preemptions), prefix caching on."""
    rng = random.Random(9)
    shared = [rng.randrange(6, 4000) for _ in range(40)]
    prompts = [shared + [rng.randrange(6, 4000) for _ in range(rng.randrange(1, 20))] for _ in range(8)]
    return prompts, dict(kv_cache_tokens=320, block_size=8, enable_prefix_caching=True)


def test_drafts_under_kv_pressure_and_prefix_caching(loaded):
    """A pool too small for every request at once (preemption by recompute) and prefix caching:
    same tokens, every block back at the end (_run checks)."""
    prompts, cfg = pressure_case()
    sps = [SamplingParams(max_tokens=30, ignore_eos=True)] * 8
    want, plain = _run(loaded, prompts, sps, **cfg)
    got, stats = _run(loaded, prompts, sps, OracleProposer(_expected(loaded, prompts, 30)), **cfg)
    assert got == want
    assert plain["preempted"] > 0 and stats["preempted"] > 0 and stats["accepted"] > 0


def test_drafts_respect_the_token_budget(loaded):
    prompts = _prompts(6, seed=6)
    sps = [SamplingParams(max_tokens=30, ignore_eos=True)] * 6
    model, tok = loaded
    eng = LLMEngine(EngineConfig(**BASE, speculative_method="ngram", max_num_batched_tokens=9,
                                 num_speculative_tokens=4, chunk_size=8), model, tok)
    eng.proposer = OracleProposer(_expected(loaded, prompts, 30))
    for i, p in enumerate(prompts):
        eng.add_request(f"r{i}", p, sps[i])
    worst = 0
    while eng.has_unfinished():
        out = eng.scheduler.schedule()
        worst = max(worst, out.num_tokens)
        assert all(len(d) <= 4 for d in out.spec_tokens.values())
        # Run what was scheduled (the engine's own step would schedule again).
        eng.scheduler.update(out, *_sample(eng, out))
    assert worst <= 9


def _sample(eng, out):
    step = eng.runner.execute(out)
    sampled = dict(zip([r.request_id for r in step.requests],
                       eng.sampler.sample(step.logits, [r.sampling for r in step.requests],
                                          [len(r.output_token_ids) for r in step.requests])))
    accepted = {r.request_id: eng.sampler.verify(rows, out.spec_tokens[r.request_id], r.sampling,
                                                 len(r.output_token_ids)) for r, rows in step.drafts}
    return sampled, accepted


def _penalized_params(out: list[int]) -> list[SamplingParams]:
    """Every history-dependent option, set so that it changes this output (`out`: the plain
    greedy one): its tokens penalised, biased or banned after a prefix, EOS held back."""
    return [SamplingParams(max_tokens=30, ignore_eos=True, repetition_penalty=1.3),
            SamplingParams(max_tokens=30, ignore_eos=True, frequency_penalty=1.5, presence_penalty=0.5),
            SamplingParams(max_tokens=30, ignore_eos=True, logit_bias={out[5]: -100.0, out[9]: 30.0}),
            SamplingParams(max_tokens=30, ignore_eos=True, bad_words_token_ids=[out[3:5], [out[12]]]),
            SamplingParams(max_tokens=30, min_tokens=20, stop_token_ids=[out[6], out[15]]),
            SamplingParams(max_tokens=30, ignore_eos=True, allowed_token_ids=sorted(set(out[:20]) | {7, 8}))]


@pytest.mark.parametrize("wrong_at", [None, 1, 3])
@pytest.mark.parametrize("pattern", [{"guided_regex": r"(ab|[a-z ]{2,6}|[0-9]+)+"},
                                     {"guided_grammar": 'start: item+\nitem: "ab" | "xyz" | " "'}],
                         ids=["regex", "grammar"])
def test_structured_outputs_mask_each_drafted_row_by_the_pattern_state_after_the_drafts(loaded, pattern, wrong_at):
    """The oracle drafts each request's plain structured output (then wrong tokens, which the
    pattern may refuse): the tokens are the plain run's, and they still match the pattern."""
    import re

    model, tok = loaded
    prompts = [[6 + i] + p for i, p in enumerate(_prompts(3, seed=12))]
    sps = [SamplingParams(max_tokens=24, ignore_eos=True, **pattern)] * 3
    want, _ = _run(loaded, prompts, sps)
    oracle = OracleProposer({tuple(p): w[0] for p, w in zip(prompts, want)}, wrong_at=wrong_at)
    got, stats = _run(loaded, prompts, sps, oracle)
    assert got == want and stats["drafts"] > 0
    if wrong_at != 1:
        assert stats["accepted"] > 0
    if "guided_regex" in pattern:
        for ids, *_ in got:
            assert re.fullmatch(r"(ab|[a-z ]{2,6}|[0-9]+)*", tok.decode(ids))


@pytest.mark.parametrize("wrong_at", [None, 2])
def test_penalties_bias_bans_and_min_tokens_apply_to_each_drafted_row(loaded, wrong_at):
    """The oracle drafts each request's own plain output under its options, so most drafts are
    accepted; each row must see the drafts before it as output (penalties, bad words, min_tokens)
    for the tokens to stay the plain run's."""
    prompt = _prompts(1, seed=7)[0]
    base = _expected(loaded, [prompt], 30)[tuple(prompt)]
    sps = _penalized_params(base)
    prompts = [prompt] * len(sps)
    want, _ = _run(loaded, prompts, sps)
    assert all(w[0] != base for w in want[:4])          # each option changed the output
    oracle = OracleProposer({}, wrong_at=wrong_at)
    # One oracle entry per request: tell them apart by a distinct first prompt token.
    prompts = [[6 + i] + prompt for i in range(len(sps))]
    want, _ = _run(loaded, prompts, sps)
    oracle.expected = {tuple(p): w[0] for p, w in zip(prompts, want)}
    got, stats = _run(loaded, prompts, sps, oracle)
    assert got == want and stats["accepted"] > 0


@pytest.mark.parametrize("temperature", [0.05, 1.0])
def test_seeded_sampled_output_with_drafts_equals_plain_sampling(loaded, temperature):
    """A seeded request's tokens are the ones it gets without drafts, whatever is drafted: the
    oracle drafts the plain run's tokens, two right and then wrong ones."""
    prompts = _prompts(3, seed=8)
    sps = [SamplingParams(max_tokens=30, temperature=temperature, top_p=0.95, seed=s) for s in (1, 2, 3)]
    want, _ = _run(loaded, prompts, sps)
    oracle = OracleProposer({tuple(p): w[0] for p, w in zip(prompts, want)}, wrong_at=2)
    got, stats = _run(loaded, prompts, sps, oracle)
    assert got == want and stats["accepted"] > 0 and stats["accepted"] < stats["drafts"]


def test_ngram_drafts_on_outputs_that_cycle(loaded):
    """The real proposer: the tiny model's greedy outputs fall into cycles after a few hundred
    tokens; drafts are accepted there, in fewer steps, and the tokens are unchanged."""
    prompts = _prompts(2, seed=0)
    sps = [SamplingParams(max_tokens=300, ignore_eos=True)] * 2
    want, plain = _run(loaded, prompts, sps)
    got, stats = _run(loaded, prompts, sps, None, speculative_method="ngram", num_speculative_tokens=5)
    assert got == want
    assert stats["accepted"] > 0 and stats["steps"] < plain["steps"]


def test_blocks_filled_by_drafted_tokens_are_cached_as_plain_decoding_caches_them(loaded):
    """A follow-up prompt that extends the first request's whole context finds as many cached
    tokens whether that context was decoded with drafts or without."""
    model, tok = loaded
    prompt = _prompts(1, seed=10)[0]
    expected = _expected(loaded, [prompt], 30)

    def cached(proposer) -> int:
        spec = {"speculative_method": "ngram"} if proposer else {}
        eng = LLMEngine(EngineConfig(**BASE, block_size=4, enable_prefix_caching=True, **spec), model, tok)
        if proposer:
            eng.proposer = proposer
        first = eng.add_request("a", prompt, SamplingParams(max_tokens=30, ignore_eos=True))
        while eng.has_unfinished():
            eng.step()
        follow = eng.add_request("b", prompt + first.output_token_ids + [7], SamplingParams(max_tokens=1))
        while eng.has_unfinished():
            eng.step()
        return follow.num_cached_tokens

    oracle = OracleProposer(expected)
    plain = cached(None)
    assert plain == (len(prompt) + 29) // 4 * 4        # every full block of what was computed
    assert cached(oracle) == plain and oracle.proposed > 0


def test_spec_decode_counts_by_position():
    from raycluster.engine.spec_decode import SpecDecodeCounts

    c = SpecDecodeCounts(4)
    for drafted, kept in ((4, 2), (4, 0), (3, 3), (4, 4)):
        c.add(drafted, kept)
    assert (c.drafts, c.draft_tokens, c.accepted_tokens, c.accepted_per_pos) == (4, 15, 9, [3, 3, 2, 1])
