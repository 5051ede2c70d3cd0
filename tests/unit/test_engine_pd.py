"""Prefill/decode split inside one process: a prefill-only engine parks KV, a decode engine
receives those blocks and continues; the output equals a single engine's, and nothing leaks."""

from __future__ import annotations

import pytest

from raycluster.engine.config import EngineConfig
from raycluster.engine.engine import LLMEngine
from raycluster.kv_transfer.base import gather_blocks, scatter_blocks
from raycluster.model.loader import load_model
from raycluster.request import SamplingParams

PROMPTS = [[7 + i % 50 for i in range(n)] for n in (1, 5, 16, 17, 40, 130)]


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return load_model(tiny_model_dir)[0]


def _engine(model, **kw) -> LLMEngine:
    return LLMEngine(EngineConfig(**{"policy": "fcfs", "packer": "token", "kv_cache_tokens": 4096,
                                     "chunk_size": 32, **kw}), model)


def _run(eng: LLMEngine, max_steps: int = 500) -> dict[str, list]:
    outs: dict[str, list] = {}
    for _ in range(max_steps):
        if not eng.has_unfinished():
            break
        for o in eng.step().outputs:
            outs.setdefault(o.request_id, []).append(o)
    return outs


@pytest.fixture(scope="module")
def windowed(tmp_path_factory):
    """A Mistral checkpoint whose 24-token sliding window is shorter than most prompts here."""
    from raycluster.model import write_tiny_model
    path = write_tiny_model(tmp_path_factory.mktemp("mistral-window"), seed=2, architectures=["MistralForCausalLM"],
                            sliding_window=24, num_hidden_layers=2)
    return load_model(path)[0]


def test_prefill_park_handoff_decode_equals_single_engine(model):
    _handoff_equals_single_engine(model)


def test_sliding_window_model_handoff_equals_single_engine(windowed):
    _handoff_equals_single_engine(windowed)


def _handoff_equals_single_engine(model):
    sp = SamplingParams(max_tokens=9, ignore_eos=True)
    expected = _engine(model).generate(PROMPTS, sp)
    pre, dec = _engine(model), _engine(model, block_size=16)
    for i, p in enumerate(PROMPTS):
        pre.add_request(f"r{i}", p, sp, prefill_only=True)
    outs = _run(pre)
    for i, p in enumerate(PROMPTS):
        (o,) = outs[f"r{i}"]
        assert o.finished and o.finish_reason == "prefilled" and o.new_token_ids == [expected[i][0]]
        src = pre.parked_blocks(f"r{i}")

        def fill(dst, skip, src=src):
            assert skip == 0        # no prefix cache on the decode side
            scatter_blocks(dec.runner.kv_cache, dst, gather_blocks(pre.runner.kv_cache, src))
            return True

        assert dec.add_prefilled(f"r{i}", p, [o.new_token_ids[0]], sp, fill)
        assert pre.release(f"r{i}")
    pre.kv.check()
    assert pre.kv.num_free_blocks == pre.kv.num_blocks
    outs = _run(dec)
    for i in range(len(PROMPTS)):
        toks = [t for o in outs[f"r{i}"] for t in o.new_token_ids]
        assert [expected[i][0]] + toks == expected[i]
    dec.kv.check()
    assert dec.kv.num_free_blocks == dec.kv.num_blocks


def test_failed_transfer_recomputes_on_decode_side(model):
    sp = SamplingParams(max_tokens=6, ignore_eos=True)
    expected = _engine(model).generate([PROMPTS[4]], sp)[0]
    dec = _engine(model)
    assert not dec.add_prefilled("x", PROMPTS[4], [expected[0]], sp, lambda dst, skip: False)
    dec.kv.check()
    toks = [t for o in _run(dec)["x"] for t in o.new_token_ids]
    assert [expected[0]] + toks == expected
    assert dec.kv.num_free_blocks == dec.kv.num_blocks


def test_abort_of_parked_request_frees_its_kv(model):
    pre = _engine(model)
    pre.add_request("p", PROMPTS[5], SamplingParams(max_tokens=4), prefill_only=True)
    _run(pre)
    assert pre.parked_blocks("p")
    assert pre.abort_request("p")
    assert pre.parked_blocks("p") is None
    pre.kv.check()
    assert pre.kv.num_free_blocks == pre.kv.num_blocks


def test_resume_with_delivered_tokens_continues_exactly(model):
    sp = SamplingParams(max_tokens=10, ignore_eos=True)
    full = _engine(model).generate([PROMPTS[3]], sp)[0]
    eng = _engine(model)
    eng.add_request("r", PROMPTS[3], sp, output_token_ids=full[:4])
    toks = [t for o in _run(eng)["r"] for t in o.new_token_ids]
    assert full[:4] + toks == full


@pytest.mark.parametrize("delivered", [1, 7, 23])
def test_resumed_request_hands_off_all_its_tokens(model, delivered):
    """A request resumed with tokens already delivered (after an instance or router restart)
    prefills prompt + those tokens, and the decode side continues after all of them."""
    sp = SamplingParams(max_tokens=30, ignore_eos=True)
    full = _engine(model).generate([PROMPTS[5]], sp)[0]
    pre, dec = _engine(model), _engine(model, block_size=16)
    pre.add_request("r", PROMPTS[5], sp, prefill_only=True, output_token_ids=full[:delivered])
    (o,) = _run(pre)["r"]
    assert o.finish_reason == "prefilled" and o.new_token_ids == [full[delivered]]
    src = pre.parked_blocks("r")
    assert len(src) == -(-(len(PROMPTS[5]) + delivered) // pre.kv.block_size)

    def fill(dst, skip):
        scatter_blocks(dec.runner.kv_cache, dst, gather_blocks(pre.runner.kv_cache, src))
        return True

    assert dec.add_prefilled("r", PROMPTS[5], full[:delivered + 1], sp, fill)
    toks = [t for o in _run(dec)["r"] for t in o.new_token_ids]
    assert full[:delivered + 1] + toks == full
    assert pre.release("r") and pre.kv.num_free_blocks == pre.kv.num_blocks
    assert dec.kv.num_free_blocks == dec.kv.num_blocks


def test_decode_side_prefix_cache_pulls_only_the_blocks_it_lacks(model):
    """A decode engine with prefix caching keeps handed-off KV findable: a later handoff whose
    prompt starts with a cached prefix asks for only the blocks after it, one whose KV it holds
    entirely moves nothing, and every output equals a single engine's."""
    sp = SamplingParams(max_tokens=7, ignore_eos=True)
    system = [3 + i % 90 for i in range(64)]          # 4 full blocks of 16
    prompts = [system + [200, 201, 202], system + [300 + i for i in range(21)], system + [200, 201, 202]]
    prompts[2] = system[:48]                           # 3 full blocks, all cached once r0 is in
    expected = _engine(model).generate(prompts, sp)
    pre = _engine(model, block_size=16)
    dec = _engine(model, block_size=16, enable_prefix_caching=True)
    moved: list[tuple[int, int]] = []
    for i, p in enumerate(prompts):
        pre.add_request(f"r{i}", p, sp, prefill_only=True)
        (o,) = _run(pre)[f"r{i}"]
        src = pre.parked_blocks(f"r{i}")

        def fill(dst, skip, src=src):
            moved.append((skip, len(dst)))
            assert len(dst) == len(src) - skip
            scatter_blocks(dec.runner.kv_cache, dst, gather_blocks(pre.runner.kv_cache, src[skip:]))
            return True

        assert dec.add_prefilled(f"r{i}", p, [o.new_token_ids[0]], sp, fill)
        assert pre.release(f"r{i}")
        if i == 0:
            outs = _run(dec)            # r0 decodes and finishes: its blocks stay cached
            assert [expected[0][0]] + [t for o in outs["r0"] for t in o.new_token_ids] == expected[0]
    # r0: nothing cached, 5 blocks move; r1 (85 tokens of KV): the 4 system blocks are cached,
    # 2 move; r2 (48 tokens of KV, all in r0's first 3 blocks): nothing moves, fill not called.
    assert moved == [(0, 5), (4, 2)]
    outs = _run(dec)
    for i in (1, 2):
        assert [expected[i][0]] + [t for o in outs[f"r{i}"] for t in o.new_token_ids] == expected[i]
    assert dec.kv.hit_tokens == 64 + 48
    dec.kv.check()
    assert dec.kv.num_free_blocks == dec.kv.num_blocks


def test_awd_packer_batches_short_prefills_and_output_is_exact(model):
    """prefill-short pool: AWD holds short prompts for its window and releases whole prompts
    sharing one padded shape bucket together; tokens equal a plain engine's."""
    sp = SamplingParams(max_tokens=5, ignore_eos=True)
    expected = _engine(model).generate(PROMPTS, sp)
    eng = _engine(model, packer="awd")
    plans = []
    plan = eng.scheduler.packer.plan
    eng.scheduler.packer.plan = lambda *a: plans.append(plan(*a)) or plans[-1]
    assert eng.generate(PROMPTS, sp) == expected
    first = next(p for p in plans if p)
    assert sorted(n for _, n in first) == [1, 5]          # the 8-token bucket, whole prompts
    assert all(n == r.num_prompt_tokens for p in plans for r, n in p if r.num_prompt_tokens <= 256)
    eng.kv.check()
    assert eng.kv.num_free_blocks == eng.kv.num_blocks
