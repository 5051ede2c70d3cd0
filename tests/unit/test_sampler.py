"""Sampling: greedy, temperature, top-k, top-p, per-request seeds independent of batching."""

import pytest
import torch

from raycluster.engine.sampler import Sampler, token_seed
from raycluster.request import SamplingParams


def test_greedy_is_argmax():
    logits = torch.tensor([[0.1, 2.0, -1.0], [3.0, 0.0, 0.0]])
    assert Sampler().sample(logits, [SamplingParams(), SamplingParams()], [0, 0]) == [1, 0]


def test_top_k_one_equals_greedy_and_top_p_tiny_keeps_only_best():
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(0))
    greedy = logits.argmax(-1).tolist()
    s = Sampler()
    assert s.sample(logits, [SamplingParams(temperature=1.0, top_k=1)] * 4, [0] * 4) == greedy
    assert s.sample(logits, [SamplingParams(temperature=1.0, top_p=1e-6)] * 4, [0] * 4) == greedy


def test_top_k_restricts_support():
    logits = torch.arange(10, dtype=torch.float32)[None]
    s = Sampler(seed=1)
    seen = {s.sample(logits, [SamplingParams(temperature=5.0, top_k=3)], [i])[0] for i in range(200)}
    assert seen == {7, 8, 9}


def test_seeded_request_is_reproducible_regardless_of_batch():
    vocab = 100
    rows = torch.randn(8, vocab, generator=torch.Generator().manual_seed(3))
    sp = SamplingParams(temperature=1.0, seed=42)
    alone = Sampler(seed=0)
    batched = Sampler(seed=123)
    a = [alone.sample(rows[i:i + 1], [sp], [i])[0] for i in range(8)]
    b = []
    for i in range(8):    # same request, now sharing each step with an unseeded neighbour
        b.append(batched.sample(torch.stack([rows[i], rows[(i + 1) % 8]]),
                                [sp, SamplingParams(temperature=1.0)], [i, 3])[0])
    assert a == b


def test_a_seeded_draw_depends_on_seed_and_position_only():
    """Token k of a seeded request: the same from any sampler, whatever came before it (a resume
    or a P/D handoff starts mid-stream); other positions and seeds draw differently."""
    row = torch.zeros(1, 1000)          # uniform: the draw is the generator's alone
    sp = SamplingParams(temperature=1.0, seed=5)
    stream = Sampler(seed=0)
    seq = [stream.sample(row, [sp], [k])[0] for k in range(20)]
    assert [Sampler(seed=9).sample(row, [sp], [k])[0] for k in (7, 3, 12)] == [seq[7], seq[3], seq[12]]
    assert len(set(seq)) > 15
    other = [Sampler().sample(row, [SamplingParams(temperature=1.0, seed=6)], [k])[0] for k in range(20)]
    assert sum(a == b for a, b in zip(seq, other)) <= 2
    assert len({token_seed(s, k) for s in range(-3, 30) for k in range(30)}) == 33 * 30
    assert all(0 <= token_seed(s, k) < 2 ** 64 for s in (-(2 ** 70), 0, 2 ** 70) for k in (0, 1))


def test_min_p_keeps_tokens_at_least_that_fraction_of_the_likeliest():
    """vLLM's min_p: with logits 0..9 at temperature 1, p_i / p_max = e^(i - 9), so min_p 0.3 keeps
    tokens 8 and 9 (e^-1 = 0.37), min_p 0.1 also 7 (e^-2 = 0.135), and min_p 1 only the best;
    greedy rows ignore it. Checked against the definition over softmax probabilities."""
    logits = torch.arange(10, dtype=torch.float32)[None]
    s = Sampler(seed=2)
    for min_p, support in ((0.3, {8, 9}), (0.1, {7, 8, 9}), (1.0, {9})):
        seen = {s.sample(logits, [SamplingParams(temperature=1.0, min_p=min_p)], [i])[0]
                for i in range(300)}
        probs = torch.softmax(logits[0], -1)
        assert seen == support == {i for i in range(10) if probs[i] >= min_p * probs.max()}
    assert s.sample(logits - 5, [SamplingParams(min_p=0.9)], [0]) == [9]


def test_logprobs_rank_counts_strictly_likelier_tokens():
    """vLLM's `rank`: 1 + the tokens with a strictly higher log-probability in the row (ties
    share the better rank), the same with or without top alternatives; log_softmax values."""
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0], [0.5, -2.0, 4.0, 0.5]])
    lps = Sampler.logprobs(logits, [0, 0, 0, 1, 1], [0, 1, 3, 3, 1], [0, 2, 0, 1, 0])
    assert [e.rank for e in lps] == [3, 1, 4, 2, 4]
    ref = torch.log_softmax(logits, dim=-1)
    want = [ref[0, 0], ref[0, 1], ref[0, 3], ref[1, 3], ref[1, 1]]
    assert [e.logprob for e in lps] == pytest.approx([w.item() for w in want])
    assert {t for t, _ in lps[1].top} == {1, 2} and lps[3].top == [(2, pytest.approx(ref[1, 2].item()))]


def test_allowed_token_ids_restrict_greedy_and_random_draws():
    """vLLM's allowed_token_ids: greedy takes the best allowed id (not the best overall), random
    draws stay inside the set, and other rows of the batch are untouched."""
    torch.manual_seed(0)
    logits = torch.randn(2, 50)
    allowed = [3, 17, 41]
    restricted = SamplingParams(allowed_token_ids=allowed)
    free = SamplingParams()
    pen = Sampler.penalize(logits, [restricted, free], [[1], [1]], [[], []])
    assert torch.equal(pen[1], logits[1])
    s = Sampler()
    best = max(allowed, key=lambda t: logits[0, t].item())
    assert int(logits[0].argmax()) not in allowed           # the mask decides, not luck
    assert s.sample(pen, [restricted, free], [0, 0]) == [best, int(logits[1].argmax())]
    hot = SamplingParams(temperature=5.0, allowed_token_ids=allowed)
    draws = {s.sample(Sampler.penalize(logits[:1], [hot], [[1]], [[]]), [hot], [k])[0] for k in range(200)}
    assert draws == set(allowed)


def test_an_empty_allowed_list_is_refused_naming_the_field():
    with pytest.raises(ValueError, match="^allowed_token_ids"):
        SamplingParams(allowed_token_ids=[]).validate()


def test_bad_words_ban_a_words_last_token_where_the_output_would_complete_it():
    """vLLM's rule: a one-token word is banned everywhere; a longer one only where the output so
    far ends with the rest of it."""
    logits = torch.zeros(1, 10)
    sp = SamplingParams(bad_words_token_ids=[[4], [7, 8, 9]])

    def banned(output):
        row = Sampler.penalize(logits, [sp], [[1]], [output])[0]
        return sorted(torch.nonzero(torch.isinf(row)).view(-1).tolist())

    assert banned([]) == [4]
    assert banned([7]) == [4]
    assert banned([3, 7, 8]) == [4, 9]
    assert banned([7, 8, 3]) == [4]


def test_bad_words_are_tokenized_at_the_start_and_after_a_space(tiny_model_dir):
    from raycluster.model.tokenizer import Tokenizer, bad_words_token_ids

    tok = Tokenizer(tiny_model_dir)
    seqs = bad_words_token_ids(tok, ["robot"])
    assert seqs[0] == tok.encode("robot", add_special_tokens=False)
    assert all(tok.decode(s).strip() == "robot" for s in seqs)
    assert tok.encode(" robot", add_special_tokens=False) in seqs or \
        len(tok.encode(" robot", add_special_tokens=False)) != len(seqs[0])
