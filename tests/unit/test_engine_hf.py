"""The engine's greedy output equals Hugging Face transformers' `generate`, token for token.

Five checkpoints (the tiny default, an MHA one with tied embeddings, a GQA-8 one with llama3
rope scaling, a Mistral one with a 33-token sliding window, a Qwen2-MoE one), single requests and 32 mixed-length requests batched together, chunk sizes 1, 7,
64 and unchunked, and a KV cache small enough to force preemption by recompute. The reference
runs each prompt alone through HF (fp32, eager attention), so batching cannot leak into it.
"""

from __future__ import annotations

import random

import pytest
import torch

from raycluster.engine.config import EngineConfig
from raycluster.engine.engine import LLMEngine
from raycluster.engine.window_kv import SlidingWindowKVManager
from raycluster.model.loader import load_model
from raycluster.model.tiny import write_tiny_model
from raycluster.request import SamplingParams
from raycluster.sched.predictor import LinearBatchPredictor

transformers = pytest.importorskip("transformers")

VARIANTS = {
    "tiny": {},
    "mha-tied": dict(hidden_size=128, num_attention_heads=4, num_key_value_heads=4, head_dim=32,
                     num_hidden_layers=2, intermediate_size=256, tie_word_embeddings=True),
    "gqa8-llama3rope": dict(hidden_size=128, num_attention_heads=8, num_key_value_heads=1, head_dim=16,
                            num_hidden_layers=2, intermediate_size=384,
                            rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
                                             "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                             "original_max_position_embeddings": 64}),
    # Mistral with a sliding window shorter than most prompts and generations here.
    "mistral-window": dict(architectures=["MistralForCausalLM"], hidden_size=128, num_attention_heads=4,
                           num_key_value_heads=2, head_dim=32, num_hidden_layers=2, intermediate_size=256,
                           sliding_window=33, rope_parameters={"rope_type": "default", "rope_theta": 1e6}),
    # Qwen2-MoE: 4 routed experts (top 2, weights not renormalised) and a gated shared expert on
    # layer 0, layer 1 dense.
    "qwen2-moe": dict(architectures=["Qwen2MoeForCausalLM"], hidden_size=128, num_attention_heads=4,
                      num_key_value_heads=2, num_hidden_layers=2, intermediate_size=256, moe_intermediate_size=96,
                      shared_expert_intermediate_size=192, mlp_only_layers=[1]),
}


@pytest.fixture(scope="module", params=list(VARIANTS))
def checkpoint(request, tmp_path_factory, tiny_model_dir):
    if request.param == "tiny":
        path = tiny_model_dir
    else:
        path = str(tmp_path_factory.mktemp(request.param))
        write_tiny_model(path, seed=7, **VARIANTS[request.param])
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                           attn_implementation="eager").eval()
    model, mcfg = load_model(path)
    return path, hf, model, mcfg


def _workload(n: int, seed: int, vocab: int) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        length = rng.choice([1, 2, 5, 17, 40, 63, 64, 65, 130, 257])
        out.append(([rng.randrange(6, vocab) for _ in range(length)], rng.randint(1, 12)))
    return out


def _hf_greedy(hf, prompt: list[int], max_tokens: int, eos: int) -> list[int]:
    with torch.no_grad():
        seq = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                          max_new_tokens=max_tokens, do_sample=False, eos_token_id=eos, pad_token_id=eos)
    out = seq[0, len(prompt):].tolist()
    return out[: out.index(eos) + 1] if eos in out else out


@pytest.fixture(scope="module")
def reference(checkpoint):
    _, hf, _, mcfg = checkpoint
    work = _workload(32, seed=1, vocab=mcfg.vocab_size)
    eos = mcfg.eos_token_id[0]
    return work, [_hf_greedy(hf, p, m, eos) for p, m in work]


def _engine(model, **cfg) -> LLMEngine:
    return LLMEngine(EngineConfig(**{"kv_cache_tokens": 16384, "policy": "fcfs", "packer": "token", **cfg}), model)


@pytest.mark.parametrize("chunk", [1, 7, 64, None])
def test_batched_mixed_requests_match_hf(checkpoint, reference, chunk):
    _, _, model, _ = checkpoint
    work, expected = reference
    eng = _engine(model, chunk_size=chunk, max_num_batched_tokens=512 if chunk else 4096)
    got = eng.generate([p for p, _ in work], [SamplingParams(max_tokens=m) for _, m in work])
    assert got == expected
    eng.kv.check()
    assert eng.kv.num_free_blocks == eng.kv.num_blocks


def test_single_requests_match_hf(checkpoint, reference):
    _, _, model, _ = checkpoint
    work, expected = reference
    eng = _engine(model, chunk_size=64)
    for (p, m), exp in list(zip(work, expected))[:6]:
        assert eng.generate([p], SamplingParams(max_tokens=m)) == [exp]
    eng.kv.check()


def _squeezed(eng) -> None:
    """The KV squeeze bit: requests were preempted, or for a sliding-window model the blocks
    behind the window went back instead (its decodes then need no net new blocks; a forced
    preemption of such a request: tests/unit/test_window_kv.py)."""
    if isinstance(eng.kv, SlidingWindowKVManager):
        assert eng.kv.released_total > 0
    else:
        assert eng.scheduler.preempted_total > 0


def test_preemption_by_recompute_keeps_output_exact(checkpoint, reference):
    """KV for ~2 long requests only: decodes evict others, which recompute later."""
    _, _, model, _ = checkpoint
    work, expected = reference
    eng = _engine(model, chunk_size=64, block_size=16, kv_cache_tokens=640, max_num_batched_tokens=256)
    got = eng.generate([p for p, _ in work], [SamplingParams(max_tokens=m) for _, m in work])
    assert got == expected
    _squeezed(eng)
    eng.kv.check()
    assert eng.kv.num_free_blocks == eng.kv.num_blocks


def test_priority_preemption_keeps_output_exact(checkpoint, reference):
    """The same KV squeeze under the `priority` policy with mixed priorities: the lowest-priority
    running requests give up their KV (the one asking, too, when it ranks last), and every
    request still yields HF's tokens."""
    _, _, model, _ = checkpoint
    work, expected = reference
    eng = _engine(model, policy="priority", chunk_size=64, block_size=16, kv_cache_tokens=640,
                  max_num_batched_tokens=256)
    reqs = [eng.add_request(f"r{i}", p, SamplingParams(max_tokens=m), priority=(i * 7) % 4, arrival_time=float(i))
            for i, (p, m) in enumerate(work)]
    for _ in range(100_000):
        if not eng.has_unfinished():
            break
        eng.step()
    assert [r.output_token_ids for r in reqs] == expected
    _squeezed(eng)
    eng.kv.check()
    assert eng.kv.num_free_blocks == eng.kv.num_blocks


HAND_PREDICTOR = LinearBatchPredictor(overhead_s=2e-3, per_prefill_token_s=5e-5, per_attn_pair_s=3e-9,
                                      per_decode_s=2e-4, per_decode_kv_s=1e-8)


@pytest.mark.parametrize("policy", ["fcfs", "edf", "srpt", "lrs", "lars", "kairos", "justitia", "vtc", "srjf",
                                    "priority"])
def test_every_policy_with_medha_packer_and_kairos_decode_matches_hf(checkpoint, reference, policy):
    """Scheduling changes order and chunking, never the tokens: tight budget, small KV."""
    path, _, model, _ = checkpoint
    if "tiny_model" not in str(path) and policy not in ("fcfs", "lars"):
        pytest.skip("every policy runs on the tiny checkpoint; the variants run fcfs and lars")
    work, expected = reference
    eng = LLMEngine(EngineConfig(policy=policy, packer="medha", decode_selector="kairos", tpot_ms=20,
                                 kv_cache_tokens=2048, long_threshold=128), model,
                    predictor=HAND_PREDICTOR)
    got = eng.generate([p for p, _ in work], [SamplingParams(max_tokens=m) for _, m in work])
    assert got == expected
    eng.kv.check()
    assert eng.kv.num_free_blocks == eng.kv.num_blocks


def test_logprobs_match_hf_log_softmax(checkpoint):
    """Each sampled token's log-probability and the top-k alternatives equal log_softmax of HF's
    logits at that position (greedy and sampled, batched, chunked), within fp32 rounding."""
    _, hf, model, _ = checkpoint
    rng = random.Random(11)
    prompts = [[rng.randrange(6, 500) for _ in range(n)] for n in (3, 40, 97)]
    params = [SamplingParams(max_tokens=6, logprobs=5, ignore_eos=True),
              SamplingParams(max_tokens=6, logprobs=0, ignore_eos=True, temperature=0.8, seed=3),
              SamplingParams(max_tokens=6, ignore_eos=True)]
    eng = LLMEngine(EngineConfig(policy="fcfs", packer="token", chunk_size=32, kv_cache_tokens=2048), model)
    for i, (p, sp) in enumerate(zip(prompts, params)):
        eng.add_request(f"r{i}", p, sp)
    toks: dict[str, list[int]] = {}
    lps: dict[str, list] = {}
    while eng.has_unfinished():
        for o in eng.step().outputs:
            toks.setdefault(o.request_id, []).extend(o.new_token_ids)
            if o.logprobs is not None:
                assert len(o.logprobs) == len(o.new_token_ids)
                lps.setdefault(o.request_id, []).extend(o.logprobs)
    assert "r2" not in lps and [len(lps[r]) for r in ("r0", "r1")] == [6, 6]
    for i, k in ((0, 5), (1, 0)):
        ids = torch.tensor([prompts[i] + toks[f"r{i}"]])
        with torch.no_grad():
            ref = torch.log_softmax(hf(ids).logits[0].float(), dim=-1)[len(prompts[i]) - 1:-1]
        for pos, e in enumerate(lps[f"r{i}"]):
            lp, top = e.logprob, e.top
            assert lp == pytest.approx(ref[pos, toks[f"r{i}"][pos]].item(), abs=2e-4)
            vals, idx = ref[pos].topk(k) if k else (torch.empty(0), torch.empty(0, dtype=torch.long))
            assert [t for t, _ in top] == idx.tolist()
            assert [v for _, v in top] == pytest.approx(vals.tolist(), abs=2e-4)
        if k:
            assert all(e.top[0][0] == t for e, t in zip(lps["r0"], toks["r0"]))   # greedy: the best


@pytest.mark.parametrize("preempt", [False, True])
def test_prompt_logprobs_match_hf_log_softmax(checkpoint, preempt):
    """Prompt log-probabilities (vLLM's `prompt_logprobs`, what `echo` with `logprobs` reports):
    for every prompt token after the first, log_softmax of HF's logits at the position before
    it, and the top-k there; computed over chunks of 7 tokens, batched with requests that ask
    for none, under prefix caching (a request asking for them computes every position), and
    with preemption by recompute (entries are overwritten, not appended). Delivered once, with
    the first token; generation is unchanged."""
    _, hf, model, _ = checkpoint
    rng = random.Random(5)
    shared = [rng.randrange(6, 500) for _ in range(32)]
    prompts = [shared + [rng.randrange(6, 500) for _ in range(n)] for n in (9, 30)] + [[17], shared + [9, 9]]
    params = [SamplingParams(max_tokens=4, ignore_eos=True, prompt_logprobs=3),
              SamplingParams(max_tokens=4, ignore_eos=True, prompt_logprobs=0, logprobs=1),
              SamplingParams(max_tokens=4, ignore_eos=True, prompt_logprobs=2),
              SamplingParams(max_tokens=4, ignore_eos=True)]
    cfg = dict(policy="fcfs", packer="token", chunk_size=7, enable_prefix_caching=True, block_size=8,
               kv_cache_tokens=2048)
    if preempt:
        cfg.update(kv_cache_tokens=96, max_num_seqs=4)
    eng = LLMEngine(EngineConfig(**cfg), model)
    plain = LLMEngine(EngineConfig(policy="fcfs", packer="token", kv_cache_tokens=2048), model)
    eng.add_request("warm", shared + [5, 5], SamplingParams(max_tokens=1))   # caches the shared blocks
    while eng.has_unfinished():
        eng.step()
    for i, (p, sp) in enumerate(zip(prompts, params)):
        eng.add_request(f"r{i}", p, sp)
    toks: dict[str, list[int]] = {}
    plps: dict[str, list] = {}
    for _ in range(10_000):
        if not eng.has_unfinished():
            break
        for o in eng.step().outputs:
            toks.setdefault(o.request_id, []).extend(o.new_token_ids)
            if o.prompt_logprobs is not None:
                assert o.request_id not in plps and len(toks[o.request_id]) == 1
                plps[o.request_id] = o.prompt_logprobs
    if preempt:
        assert eng.scheduler.preempted_total > 0
    assert sorted(plps) == ["r0", "r1", "r2"]
    assert [toks[f"r{i}"] for i in range(4)] == plain.generate(prompts, SamplingParams(max_tokens=4, ignore_eos=True))
    assert plps["r2"] == [None]                              # a one-token prompt: nothing to predict
    for i, k in ((0, 3), (1, 0)):
        got, prompt = plps[f"r{i}"], prompts[i]
        assert len(got) == len(prompt) and got[0] is None
        with torch.no_grad():
            ref = torch.log_softmax(hf(torch.tensor([prompt])).logits[0].float(), dim=-1)
        for pos in range(1, len(prompt)):
            lp, top = got[pos].logprob, got[pos].top
            assert lp == pytest.approx(ref[pos - 1, prompt[pos]].item(), abs=2e-4)
            vals, idx = ref[pos - 1].topk(k) if k else (torch.empty(0), torch.empty(0, dtype=torch.long))
            assert [t for t, _ in top] == idx.tolist()
            assert [v for _, v in top] == pytest.approx(vals.tolist(), abs=2e-4)
    assert eng.kv.hit_tokens == 32           # only r3, which asks for none, took the cached prefix


def _rank_bounds(row: torch.Tensor, token: int, tol: float = 2e-4) -> tuple[int, int]:
    """The rank of `token` in a reference log_softmax row (1 + the tokens strictly above it),
    as an interval: tokens within `tol` of it may fall on either side in the engine's fp32
    arithmetic (batched, chunked), so only those may move it."""
    v = row[token].item()
    return 1 + int((row > v + tol).sum()), 1 + int((row > v - tol).sum())


def test_ranks_match_hf_log_softmax(checkpoint):
    """vLLM's `rank` of each prompt token (with `prompt_logprobs`) and of each sampled token
    (with `logprobs`): 1 + the number of vocabulary tokens with a strictly higher log-probability
    under log_softmax of HF's logits at the position before it (greedy tokens: rank 1). Chunks
    of 7, batched with a sampled request; with or without top alternatives."""
    _, hf, model, _ = checkpoint
    rng = random.Random(23)
    prompts = [[rng.randrange(6, 500) for _ in range(n)] for n in (19, 40)]
    params = [SamplingParams(max_tokens=8, ignore_eos=True, prompt_logprobs=2, logprobs=2),
              SamplingParams(max_tokens=8, ignore_eos=True, prompt_logprobs=0, logprobs=0, temperature=1.5, seed=9)]
    eng = LLMEngine(EngineConfig(policy="fcfs", packer="token", chunk_size=7, kv_cache_tokens=2048), model)
    for i, (p, sp) in enumerate(zip(prompts, params)):
        eng.add_request(f"r{i}", p, sp)
    toks: dict[str, list[int]] = {}
    lps: dict[str, list] = {}
    plps: dict[str, list] = {}
    for _ in range(1_000):
        if not eng.has_unfinished():
            break
        for o in eng.step().outputs:
            toks.setdefault(o.request_id, []).extend(o.new_token_ids)
            lps.setdefault(o.request_id, []).extend(o.logprobs or [])
            if o.prompt_logprobs is not None:
                plps[o.request_id] = o.prompt_logprobs
    exact = total = 0
    for i in range(2):
        seq = prompts[i] + toks[f"r{i}"]
        with torch.no_grad():
            ref = torch.log_softmax(hf(torch.tensor([seq])).logits[0].float(), dim=-1)
        got = plps[f"r{i}"][1:] + lps[f"r{i}"]           # entry j: token j + 1 of seq
        assert len(got) == len(seq) - 1
        for pos, e in enumerate(got):
            lo, hi = _rank_bounds(ref[pos], seq[pos + 1])
            assert lo <= e.rank <= hi, (i, pos, e.rank, lo, hi)
            exact += e.rank == 1 + int((ref[pos] > ref[pos, seq[pos + 1]]).sum())
            total += 1
            if e.top:                               # the top-k are ranks 1..k, the token among them by its rank
                assert e.rank > len(e.top) or e.top[e.rank - 1][0] == seq[pos + 1] or lo < hi
    assert exact >= 0.9 * total, (exact, total)     # ties within fp32 noise are rare
    assert [e.rank for e in lps["r0"]] == [1] * 8    # greedy
    assert max(e.rank for e in plps["r0"][1:]) > 20  # random prompt tokens: far down the vocabulary


def _penalized_reference(hf, prompt: list[int], n: int, presence: float, frequency: float, rep: float) -> list[int]:
    """Greedy decoding over HF's logits with the penalties applied by their definitions."""
    seq, out = list(prompt), []
    for _ in range(n):
        with torch.no_grad():
            row = hf(torch.tensor([seq])).logits[0, -1].float()
        seen = sorted(set(seq))
        vals = row[seen]
        row[seen] = torch.where(vals < 0, vals * rep, vals / rep)
        for t in set(out):
            row[t] -= presence + frequency * out.count(t)
        out.append(int(row.argmax()))
        seq.append(out[-1])
    return out


# A random tiny model hardly ever repeats a token, so positive penalties alone rarely change its
# greedy output; these settings do (negative ones invite repeats, positive ones then push back).
@pytest.mark.parametrize("presence, frequency, rep", [(-2.0, 1.5, 1.0), (0.0, -2.0, 1.0), (0.0, 0.0, 0.5),
                                                       (0.5, -1.0, 1.2)])
def test_penalties_match_their_definitions_over_hf_logits(checkpoint, presence, frequency, rep):
    path, hf, model, _ = checkpoint
    if "tiny_model" not in str(path):
        pytest.skip("sampling runs on the tiny checkpoint (the variants repeat their last token regardless)")
    rng = random.Random(5)
    prompts = [[rng.choice([7, 8, 9, 10, 11, 300, 301]) for _ in range(n)] for n in (4, 33)]
    sp = SamplingParams(max_tokens=12, ignore_eos=True, presence_penalty=presence, frequency_penalty=frequency,
                        repetition_penalty=rep)
    eng = LLMEngine(EngineConfig(policy="fcfs", packer="token", chunk_size=16, kv_cache_tokens=2048), model)
    plain = SamplingParams(max_tokens=12, ignore_eos=True)
    got = eng.generate(prompts + prompts, [sp, sp, plain, plain])
    assert got[:2] == [_penalized_reference(hf, p, 12, presence, frequency, rep) for p in prompts]
    assert got[:2] != got[2:]        # the penalties changed the output; the unpenalized neighbours kept theirs
    if rep != 1.0 and presence == frequency == 0.0:     # HF's own processor agrees with ours
        ref = hf.generate(torch.tensor([prompts[1]]), max_new_tokens=12, do_sample=False, repetition_penalty=rep,
                          eos_token_id=None, pad_token_id=0)[0, len(prompts[1]):].tolist()
        assert got[1] == ref


def test_penalize_by_hand():
    from raycluster.engine.sampler import Sampler

    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0], [1.0, 1.0, 1.0, 1.0]])
    sps = [SamplingParams(presence_penalty=0.5, frequency_penalty=0.25, repetition_penalty=2.0), SamplingParams()]
    out = Sampler.penalize(logits, sps, prompts=[[1], [0]], outputs=[[3, 3, 0], [1]])
    # token 0: output once: 2/2 - 0.5 - 0.25; token 1: prompt only: -1*2; token 2: unseen; token 3:
    # output twice: 3/2 - 0.5 - 0.5
    assert out[0].tolist() == [0.25, -2.0, 0.5, 0.5]
    assert out[1].tolist() == [1.0, 1.0, 1.0, 1.0] and logits[0].tolist() == [2.0, -1.0, 0.5, 3.0]
    out = Sampler.penalize(logits, [SamplingParams(logit_bias={2: 10.0, 0: -1.5})], [[1]], [[]])
    assert out[0].tolist() == [0.5, -1.0, 10.5, 3.0]
