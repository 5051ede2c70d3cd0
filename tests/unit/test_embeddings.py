"""Pooling requests (`SamplingParams.embed`, what /v1/embeddings sends): the raw vector pools
the prompt's final hidden states as the engine's pooling type says (the last token, the mean over
the prompt, the first token), equal to the same pooling of transformers' `AutoModel`
last_hidden_state; batched with generation, chunked (MEAN and CLS carried across chunks), with the
prefix cache on (LAST reuses cached blocks, MEAN and CLS recompute every position), prefill-only
(P/D) and on a TP or KVP group alike; refused on an SPP group. (Normalising and Matryoshka cuts
happen at the API: tests/unit/test_pooling.py; over HTTP: tests/e2e and the cluster e2e.)"""

from __future__ import annotations

import copy
import random

import pytest
import torch

from raycluster.engine.config import EngineConfig
from raycluster.engine.engine import InvalidRequestError, LLMEngine
from raycluster.model.loader import load_model
from raycluster.request import SamplingParams

BASE = dict(policy="fcfs", packer="token", predictor="none", kv_cache_tokens=8192, num_threads=1)
EMBED = SamplingParams(max_tokens=1, embed=True)


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return load_model(tiny_model_dir)[0]


@pytest.fixture(scope="module")
def prompts():
    rng = random.Random(7)
    return [[rng.randrange(6, 4000) for _ in range(n)] for n in (1, 5, 17, 40, 90, 130)]


@pytest.fixture(scope="module")
def hidden_states(tiny_model_dir, prompts):
    """transformers' base model: each prompt alone, its final hidden states [n, H]."""
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoModel.from_pretrained(tiny_model_dir, dtype=torch.float32, attn_implementation="eager")
    with torch.no_grad():
        return [hf(torch.tensor([p])).last_hidden_state[0] for p in prompts]


POOL = {"last": lambda h: h[-1], "mean": lambda h: h.mean(0), "cls": lambda h: h[0]}


@pytest.fixture(scope="module")
def reference(hidden_states):
    return [h[-1] for h in hidden_states]


def _embed(eng: LLMEngine, prompts, prefix: str = "e", prefill_only: bool = False, others=()) -> list[torch.Tensor]:
    """Each prompt's vector from `eng`, run together (and after `others`: (prompt, sampling) of
    generation requests, whose tokens are returned second)."""
    # The generation requests first: their prefill rows come before the pooled ones in a step.
    gens = [eng.add_request(f"{prefix}g{i}", p, sp) for i, (p, sp) in enumerate(others)]
    reqs = [eng.add_request(f"{prefix}{i}", p, EMBED, prefill_only=prefill_only) for i, p in enumerate(prompts)]
    vectors = {}
    for _ in range(1000):
        if not eng.has_unfinished():
            break
        for out in eng.step().outputs:
            pooling = out.request_id in {r.request_id for r in reqs}
            assert (out.embedding is not None) == (out.finished and pooling)
            assert not (pooling and out.new_token_ids)      # a pooling request samples no token
            if out.embedding is not None:
                vectors[out.request_id] = torch.tensor(out.embedding)
    assert eng.kv.num_free_blocks == eng.kv.num_blocks and not eng.scheduler.parked
    return [vectors[r.request_id] for r in reqs], [g.output_token_ids for g in gens]


@pytest.mark.parametrize("chunk", [7, None])
def test_vectors_equal_transformers_batched_with_generation(model, prompts, reference, chunk):
    eng = LLMEngine(EngineConfig(**BASE, chunk_size=chunk), model)
    others = [(p, SamplingParams(max_tokens=6, ignore_eos=True)) for p in prompts[2:5]]
    got, tokens = _embed(eng, prompts, others=others)
    for g, want in zip(got, reference):
        torch.testing.assert_close(g, want, atol=1e-5, rtol=1e-5)
    assert len({tuple(g.tolist()) for g in got}) == len(prompts)
    plain = LLMEngine(EngineConfig(**BASE), model).generate([p for p, _ in others], others[0][1])
    assert tokens == plain            # pooling rows change no generated token


def test_a_cached_prefix_and_a_prefill_only_request_give_the_same_vectors(model, prompts, reference):
    eng = LLMEngine(EngineConfig(**BASE, enable_prefix_caching=True), model)
    first, _ = _embed(eng, prompts, "a")
    again, _ = _embed(eng, prompts, "b")          # the prompts' full blocks come from the cache now
    assert eng.kv.hit_tokens >= 16 * 3
    # P/D: a prefill instance's request ends at its first (one) token, with its vector, unparked.
    pd, _ = _embed(eng, prompts, "c", prefill_only=True)
    for a, b, c, want in zip(first, again, pd, reference):
        torch.testing.assert_close(b, a, atol=1e-6, rtol=0)
        torch.testing.assert_close(c, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("pooling", ["mean", "cls"])
@pytest.mark.parametrize("chunk", [7, None])
def test_mean_and_cls_pooling_across_chunks_equal_transformers(model, prompts, hidden_states, pooling, chunk):
    eng = LLMEngine(EngineConfig(**BASE, chunk_size=chunk, pooling_type=pooling, enable_prefix_caching=True), model)
    others = [(p, SamplingParams(max_tokens=5, ignore_eos=True)) for p in prompts[3:]]
    got, tokens = _embed(eng, prompts, others=others)
    for g, h in zip(got, hidden_states):
        torch.testing.assert_close(g, POOL[pooling](h), atol=1e-5, rtol=1e-5)
    # Every position is computed again: a cached prefix would skip the rows these pool.
    hits = eng.kv.hit_tokens
    again, _ = _embed(eng, prompts, "b")
    assert eng.kv.hit_tokens == hits
    for a, b in zip(got, again):
        torch.testing.assert_close(b, a, atol=1e-6, rtol=0)
    assert tokens == LLMEngine(EngineConfig(**BASE), model).generate([p for p, _ in others], others[0][1])


@pytest.mark.parametrize("pooling", ["max", "mean_sqrt", "weighted_mean"])
def test_sentence_transformers_modes_across_chunks_equal_their_formulas(model, prompts, hidden_states, pooling):
    """sentence-transformers' max, mean_sqrt_len_tokens and weightedmean (weights 1..n), carried
    across 7-token chunks, over transformers' hidden states."""
    from dataclasses import replace

    from raycluster.model.pooling import PoolerConfig
    st_model = copy.copy(model)
    st_model.config = replace(model.config, pooler=PoolerConfig(pooling_type=pooling))
    got, _ = _embed(LLMEngine(EngineConfig(**BASE, chunk_size=7), st_model), prompts)
    for g, h in zip(got, hidden_states):
        w = torch.arange(1, h.shape[0] + 1, dtype=h.dtype)
        want = {"max": h.max(0).values, "mean_sqrt": h.sum(0) / h.shape[0] ** 0.5,
                "weighted_mean": (w[:, None] * h).sum(0) / w.sum()}[pooling]
        torch.testing.assert_close(g, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("chunk", [7, None])
def test_token_level_pooling_returns_every_row(model, prompts, hidden_states, chunk):
    """`pool_tokens` (vLLM's token_embed): every prompt position's final hidden state, across
    chunks and next to generation; never from the prefix cache (a hit would skip rows)."""
    eng = LLMEngine(EngineConfig(**BASE, chunk_size=chunk, enable_prefix_caching=True), model)
    rows = SamplingParams(max_tokens=1, embed=True, pool_tokens=True)
    for rnd in range(2):            # the second round finds the first's blocks cached, and must not use them
        reqs = [eng.add_request(f"t{rnd}-{i}", p, rows) for i, p in enumerate(prompts)]
        eng.add_request(f"g{rnd}", prompts[3], SamplingParams(max_tokens=4, ignore_eos=True))
        out = {}
        for _ in range(200):
            if not eng.has_unfinished():
                break
            out.update({o.request_id: o.embedding for o in eng.step().outputs if o.embedding is not None})
        for r, h in zip(reqs, hidden_states):
            torch.testing.assert_close(torch.tensor(out[r.request_id]), h, atol=1e-5, rtol=1e-5)
    assert eng.kv.hit_tokens == 0 or all(r.num_cached_tokens == 0 for r in reqs)


def test_the_checkpoint_pooler_decides_unless_the_engine_overrides_it(model, prompts, hidden_states):
    from dataclasses import replace

    from raycluster.model.pooling import PoolerConfig
    mean_model = copy.copy(model)
    mean_model.config = replace(model.config, pooler=PoolerConfig(pooling_type="mean"))
    assert LLMEngine(EngineConfig(**BASE), mean_model).pooling_type == "mean"
    got, _ = _embed(LLMEngine(EngineConfig(**BASE), mean_model), prompts[:3])
    for g, h in zip(got, hidden_states):
        torch.testing.assert_close(g, h.mean(0), atol=1e-5, rtol=1e-5)
    assert LLMEngine(EngineConfig(**BASE, pooling_type="cls"), mean_model).pooling_type == "cls"
    assert LLMEngine(EngineConfig(**BASE), model).pooling_type == "last"


@pytest.mark.parametrize("group", [{"tp": 2}, {"kvp": 2}], ids=["tp2", "kvp2"])
def test_a_group_leader_returns_the_same_vectors(model, prompts, hidden_states, group):
    eng = LLMEngine(EngineConfig(**BASE, **group, group_timeout_s=30, chunk_size=7, pooling_type="mean"), model)
    try:
        got, _ = _embed(eng, prompts)
    finally:
        eng.close()
    for g, h in zip(got, hidden_states):
        torch.testing.assert_close(g, h.mean(0), atol=1e-5, rtol=1e-5)


def test_an_spp_group_refuses_pooling_requests_naming_the_input(model, prompts):
    eng = LLMEngine(EngineConfig(**BASE, spp=2, group_timeout_s=30), model)
    try:
        with pytest.raises(InvalidRequestError, match="embeddings are not served by a spp2 group") as e:
            eng.add_request("e", prompts[0], EMBED)
        assert e.value.field == "input"
        assert not eng.has_unfinished()
    finally:
        eng.close()


def test_pooling_steps_never_run_the_output_head(model, prompts):
    eng = LLMEngine(EngineConfig(**BASE, chunk_size=16), model)
    calls = []
    head = eng.runner.model.compute_logits
    eng.runner.model.compute_logits = lambda h: calls.append(h.shape[0]) or head(h)
    try:
        _embed(eng, prompts)
        assert calls == []
        _embed(eng, prompts[:2], "m", others=[(prompts[2], SamplingParams(max_tokens=3))])
        assert calls and max(calls) == 1        # only the generation request's rows
    finally:
        del eng.runner.model.compute_logits
