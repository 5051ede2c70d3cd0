"""EAGLE heads on a TP or KVP group's leader: the head reads the whole hidden states the leader
keeps (every TP rank holds them after each layer's all_reduce; every KVP rank runs the linear
layers on all the step's tokens) and keeps its KV in the leader's own tensor under the engine's
block ids (a KVP group's global ones). A tp 2, kvp 2 or kvp 2 x tp 2 engine (ranks as threads
over gloo) with an EAGLE-1 or EAGLE-3 head gives the plain engine's tokens and drafts what the
single-process EAGLE engine drafts, step for step (the same accepted counts); built from the
checkpoint (no process holds the whole model: the head reads its own copy of the embedding and
output head); with prefix caching; and the head's KV moves with a P/D handoff out of and into
the group."""

from __future__ import annotations

import pytest
import torch

from raycluster.engine.config import EngineConfig
from raycluster.engine.engine import LLMEngine
from raycluster.kv_transfer.base import gather_blocks, scatter_blocks
from raycluster.request import SamplingParams
from tests.unit.test_eagle import METHOD, _prompts, _run

BASE = dict(policy="fcfs", packer="token", predictor="none", kv_cache_tokens=8192, num_threads=1, group_timeout_s=30)
GREEDY = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)


def _engine(loaded, head=None, method="eagle", k=4, **cfg) -> LLMEngine:
    spec = {} if head is None else {"speculative_method": method, "speculative_model": head,
                                    "num_speculative_tokens": k}
    return LLMEngine(EngineConfig(**{**BASE, **spec, **cfg}), loaded[0], loaded[1])


def _counts(eng: LLMEngine) -> tuple[int, int, int]:
    return eng.spec.drafts, eng.spec.draft_tokens, eng.spec.accepted_tokens


GROUPS = {"tp2": {"tp": 2}, "kvp2": {"kvp": 2}, "kvp2xtp2": {"kvp": 2, "tp": 2}}


@pytest.mark.parametrize("name", ["trained", "trained3"])
@pytest.mark.parametrize("cfg", [{}, dict(enable_prefix_caching=True, block_size=8, max_num_seqs=2)],
                         ids=["plain", "prefix"])
@pytest.mark.parametrize("layout", ["tp2", "kvp2"])
def test_a_group_with_a_head_drafts_as_the_single_engine_and_keeps_its_tokens(eagle_heads, loaded, name, cfg,
                                                                              layout):
    prompts = _prompts(10, 3)
    if cfg:
        prompts = [list(range(100, 140)) + p for p in prompts]      # later requests hit the cache
    sps = [GREEDY] * len(prompts)
    expected, _ = _run(_engine(loaded, **cfg), prompts, sps)
    single = _engine(loaded, eagle_heads[name], METHOD[name], **cfg)
    _run(single, prompts, sps)
    eng = _engine(loaded, eagle_heads[name], METHOD[name], **GROUPS[layout], **cfg)
    try:
        assert eng.runner.layout == layout and eng.runner.head_kv_cache is not None
        got, _ = _run(eng, prompts, sps)
    finally:
        eng.close()
    assert got == expected
    assert _counts(eng) == _counts(single) and eng.spec.accepted_tokens > 0
    if cfg:
        assert eng.kv.hit_rate() == single.kv.hit_rate() > 0.25


@pytest.mark.parametrize("layout", ["tp2", "kvp2xtp2"])
def test_a_group_from_the_checkpoint_gives_its_head_the_whole_vocabulary(eagle_heads, loaded, tiny_model_dir,
                                                                         layout):
    """No process holds the whole model: the leader's shard has half the embedding rows, the
    head its own whole copy, read from the checkpoint."""
    prompts, sps = _prompts(6, 5), [GREEDY] * 6
    expected, _ = _run(_engine(loaded), prompts, sps)
    single = _engine(loaded, eagle_heads["trained"])
    _run(single, prompts, sps)
    eng = LLMEngine.from_config(EngineConfig(**BASE, **GROUPS[layout], model=tiny_model_dir, speculative_method="eagle",
                                             speculative_model=eagle_heads["trained"], num_speculative_tokens=4))
    try:
        assert eng.runner.layout == layout
        vocab = eng.proposer.head._target[0]
        assert vocab.model.embed_tokens.weight.shape == loaded[0].model.embed_tokens.weight.shape
        assert len(vocab.model.layers) == 0
        got, _ = _run(eng, prompts, sps)
    finally:
        eng.close()
    assert [t for t, _ in got] == [t for t, _ in expected]
    assert _counts(eng) == _counts(single)


@pytest.mark.parametrize("name", ["trained", "trained3"])
@pytest.mark.parametrize("layout", ["tp2", "kvp2"])
def test_head_kv_moves_with_a_handoff_out_of_and_into_a_group(eagle_heads, loaded, name, layout):
    """Prefill on a group, decode on a single engine, and the other way round: the decode side's
    first drafts are the single engine's (they read the head's KV the prefill wrote)."""
    prompt = _prompts(1, 9)[0] * 3
    sp = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    head, method = eagle_heads[name], METHOD[name]

    def first_drafts(engine):
        return next(r.spec_token_ids for r in engine.scheduler.requests.values())

    single = _engine(loaded, head, method)
    single.add_request("x", prompt, sp)
    single.step()
    single.step()
    expected = first_drafts(single)
    assert len(expected) == 4
    for group_side in ("prefill", "decode"):
        pre = _engine(loaded, head, method, **(GROUPS[layout] if group_side == "prefill" else {}))
        dec = _engine(loaded, head, method, **(GROUPS[layout] if group_side == "decode" else {}))
        try:
            pre.add_request("x", prompt, sp, prefill_only=True)
            (out,) = pre.step().outputs
            src = pre.parked_blocks("x")
            if group_side == "prefill":
                data = pre.runner.save_blocks(src)
                # Whole blocks as a single process stages them: the model's layers, then the head's.
                alone = _engine(loaded, head, method)
                alone.add_request("x", prompt, sp, prefill_only=True)
                alone.step()
                want = gather_blocks(alone.runner.kv_cache, alone.parked_blocks("x"))
                assert data.shape == want.shape
                torch.testing.assert_close(data, want, atol=1e-4, rtol=1e-4)
            else:
                data = gather_blocks(pre.runner.kv_cache, src)

            def fill(dst, skip, data=data):
                if group_side == "decode":
                    dec.runner.load_blocks(dst, data)
                else:
                    scatter_blocks(dec.runner.kv_cache, dst, data)
                return True

            assert dec.add_prefilled("x", prompt, out.new_token_ids, sp, fill)
            assert pre.release("x")
            dec.step()
            assert first_drafts(dec) == expected, group_side
        finally:
            pre.close()
            dec.close()
