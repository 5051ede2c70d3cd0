"""Engine behaviour beyond greedy equality: bad input, aborts, stop strings, seeds, streaming."""

from __future__ import annotations

import pytest

from raycluster.engine.config import EngineConfig
from raycluster.engine.engine import InvalidRequestError, LLMEngine
from raycluster.request import SamplingParams


def _engine(loaded, **cfg) -> LLMEngine:
    model, tok = loaded
    return LLMEngine(EngineConfig(**{"kv_cache_tokens": 8192, "policy": "fcfs", "packer": "token", **cfg}), model, tok)


@pytest.mark.parametrize("prompt, sampling, field", [
    ([], SamplingParams(), "prompt"),
    ([7] * 40, SamplingParams(), "prompt"),                 # max_model_len is 32 below
    ([7, 99999], SamplingParams(), "prompt"),               # outside the vocabulary
    ([7, 8], SamplingParams(max_tokens=0), "max_tokens"),
    ([7, 8], SamplingParams(max_tokens=-3), "max_tokens"),
    ([7, 8], SamplingParams(temperature=-1), "temperature"),
    ([7, 8], SamplingParams(top_p=0.0), "top_p"),
])
def test_bad_requests_are_clear_errors_and_leak_nothing(loaded, prompt, sampling, field):
    eng = _engine(loaded, max_model_len=32)
    with pytest.raises(InvalidRequestError) as info:
        eng.add_request("bad", prompt, sampling)
    assert info.value.field == field
    assert not eng.has_unfinished()
    eng.kv.check()
    assert eng.kv.num_free_blocks == eng.kv.num_blocks


def test_prompt_over_kv_capacity_is_rejected(loaded):
    eng = _engine(loaded, kv_cache_tokens=64, block_size=16)
    with pytest.raises(InvalidRequestError, match="KV capacity"):
        eng.add_request("big", [7] * 100, SamplingParams())


def test_duplicate_request_id_is_rejected(loaded):
    eng = _engine(loaded)
    eng.add_request("same", [7, 8], SamplingParams())
    with pytest.raises(ValueError, match="already in use"):
        eng.add_request("same", [7, 8], SamplingParams())


@pytest.mark.parametrize("abort_after_steps", [0, 1, 3, 6])
def test_abort_at_any_point_frees_blocks_at_once(loaded, abort_after_steps):
    eng = _engine(loaded, chunk_size=16, block_size=8)
    eng.add_request("victim", [9] * 50, SamplingParams(max_tokens=20, ignore_eos=True))   # 4 prefill chunks
    eng.add_request("other", [10] * 5, SamplingParams(max_tokens=20, ignore_eos=True))
    for _ in range(abort_after_steps):
        eng.step()
    assert eng.abort_request("victim")
    assert not eng.kv.holds("victim")
    eng.kv.check()
    while eng.has_unfinished():
        eng.step()
    eng.kv.check()
    assert eng.kv.num_free_blocks == eng.kv.num_blocks
    assert not eng.abort_request("victim")


def test_outputs_stream_one_token_per_step_and_finish_reasons(loaded):
    eng = _engine(loaded)
    eng.add_request("a", [11, 12, 13], SamplingParams(max_tokens=5, ignore_eos=True))
    seen, reasons = [], []
    for _ in range(20):
        if not eng.has_unfinished():
            break
        for out in eng.step().outputs:
            seen.append(len(out.new_token_ids))
            reasons.append(out.finish_reason)
    assert seen == [1] * 5
    assert reasons == [None] * 4 + ["length"]


def test_the_first_tokens_output_carries_its_prefill_time(loaded):
    """First scheduled to first token on the engine's clock (vLLM's prefill time): a 40-token
    prompt in chunks of 16 over three steps, the clock moving 0.5 s per step, waiting one step
    behind another request first; later outputs and a resumed request's carry none."""
    from raycluster.clock import VirtualClock

    clock = VirtualClock(10.0)
    model, tok = loaded
    eng = LLMEngine(EngineConfig(kv_cache_tokens=8192, policy="fcfs", packer="token", chunk_size=16,
                                 max_num_batched_tokens=16, predictor="none"), model, tok, clock=clock)
    sp = SamplingParams(max_tokens=3, ignore_eos=True)
    eng.add_request("first", [7] * 16, sp)
    eng.add_request("a", list(range(20, 60)), sp)
    eng.add_request("resumed", [11, 12, 13], sp, output_token_ids=[14, 15])
    seen: dict[str, list] = {}
    for _ in range(30):
        if not eng.has_unfinished():
            break
        for out in eng.step().outputs:
            seen.setdefault(out.request_id, []).append(out.prefill_s)
        clock.advance(0.5)
    assert seen["first"] == [0.0, None, None]       # scheduled and sampled in its first step
    assert seen["a"] == [1.0, None, None]           # chunks at 10.5, 11.0, 11.5: first token at 11.5
    assert set(seen["resumed"]) == {None}


def test_stop_string_ends_request_and_is_not_emitted(loaded):
    model, tok = loaded
    prompt = tok.encode("The river ran down to the sea and the")
    eng = _engine(loaded)
    free_run = eng.generate([prompt], SamplingParams(max_tokens=24, ignore_eos=True))[0]
    text = tok.decode(free_run)
    stop = text[len(text) // 2: len(text) // 2 + 3]
    assert stop.strip(), text
    eng.add_request("s", prompt, SamplingParams(max_tokens=24, ignore_eos=True, stop=[stop]))
    pieces, reason = [], None
    for _ in range(100):
        if not eng.has_unfinished():
            break
        for out in eng.step().outputs:
            pieces.append(out.new_text)
            reason = out.finish_reason or reason
    got = "".join(pieces)
    assert reason == "stop"
    assert got == text[: text.index(stop)]
    eng.kv.check()


def test_seeded_sampling_reproducible_across_batches(loaded):
    sp = SamplingParams(max_tokens=12, temperature=0.9, top_p=0.9, top_k=50, seed=1234, ignore_eos=True)
    eng = _engine(loaded)
    alone = eng.generate([[20, 21, 22]], sp)[0]
    crowd = eng.generate([[20, 21, 22], [30] * 40, [40] * 7],
                         [sp, SamplingParams(max_tokens=12, temperature=1.0),
                          SamplingParams(max_tokens=3)])[0]
    assert alone == crowd
    other_seed = eng.generate([[20, 21, 22]], SamplingParams(**{**sp.__dict__, "seed": 99}))[0]
    assert other_seed != alone


def test_a_seeded_request_resumed_elsewhere_continues_its_stream(loaded):
    """A seeded request cut after k tokens and resumed on another engine from prompt + those
    tokens (a router's resume, or a P/D handoff's decode side after k = 1) yields the tokens the
    first engine would have: token k's draw depends on (seed, k), not on a generator's history."""
    sp = SamplingParams(max_tokens=12, temperature=0.9, top_p=0.95, seed=77, ignore_eos=True)
    whole = _engine(loaded).generate([[20, 21, 22]], sp)[0]
    assert len(set(whole)) > 3              # really sampled
    for k in (1, 5):
        eng = _engine(loaded)
        req = eng.add_request("r", [20, 21, 22], sp, output_token_ids=whole[:k])
        for _ in range(50):
            if not eng.has_unfinished():
                break
            eng.step()
        assert req.output_token_ids == whole, k
        eng.kv.check()


@pytest.mark.parametrize("policy, order", [("priority", ["a", "b", "c"]), ("fcfs", ["c", "a", "b"])])
def test_the_priority_policy_serves_lower_values_first(loaded, policy, order):
    """vLLM's priority scheduling: one sequence at a time, three requests queued with priorities
    2, 0, 1 start in priority order (FCFS: in arrival order)."""
    eng = _engine(loaded, policy=policy, max_num_seqs=1)
    for k, (rid, prio) in enumerate((("c", 2), ("a", 0), ("b", 1))):
        eng.add_request(rid, [20, 21, 22], SamplingParams(max_tokens=2, ignore_eos=True), priority=prio,
                        arrival_time=float(k))
    started = []
    for _ in range(50):
        if not eng.has_unfinished():
            break
        started += [o.request_id for o in eng.step().outputs if o.request_id not in started]
    assert started == order
    eng.kv.check()


def test_eos_and_stop_token_ids_stop_unless_ignored(loaded):
    eng = _engine(loaded)
    greedy = eng.generate([[20, 21, 22]], SamplingParams(max_tokens=8, ignore_eos=True))[0]
    third = greedy[2]
    assert third not in greedy[:2]
    stopped = eng.generate([[20, 21, 22]], SamplingParams(max_tokens=8, stop_token_ids=[third]))[0]
    assert stopped == greedy[:3]
    eng.eos_token_ids = (third,)        # pretend the model's EOS is the third greedy token
    assert eng.generate([[20, 21, 22]], SamplingParams(max_tokens=8))[0] == greedy[:3]
    assert eng.generate([[20, 21, 22]], SamplingParams(max_tokens=8, ignore_eos=True))[0] == greedy


def test_engines_sharing_a_model_step_concurrently_in_threads(loaded):
    """Each runner has its own attention backend (scratch buffers), so two engines on one model
    object, stepping at the same time in two threads, both produce the single engine's tokens."""
    import threading

    model, _ = loaded
    prompts = [[(7 * i + j) % 900 + 6 for j in range(20 + 37 * i)] for i in range(6)]
    sp = SamplingParams(max_tokens=30, ignore_eos=True)
    mk = lambda: LLMEngine(EngineConfig(policy="fcfs", packer="token", kv_cache_tokens=4096, chunk_size=64),  # noqa: E731
                           model)
    want = mk().generate(prompts, sp)
    got: dict[int, list] = {}
    threads = [threading.Thread(target=lambda k=k: got.__setitem__(k, mk().generate(prompts, sp))) for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert got == {0: want, 1: want}
