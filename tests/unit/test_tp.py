"""Tensor parallelism: weight shards, the group's all_reduce, a TP group (ranks as threads over
gloo) against the single-process runner step by step on the logits, an engine's greedy tokens
and prompt log-probabilities with prefix caching, P/D handoffs into and out of a TP engine, and
the configurations it refuses. Checkpoints: the tiny one (GQA 8/2), a Qwen2-style one (q/k/v
biases, tied embeddings), a Mistral-style one, one with o_proj and MLP biases (the row-parallel
biases, added once), an MHA one split four ways, and two with fewer KV heads than ranks (their
heads replicated: 8/2 at tp 4, MQA at tp 2 and 4; more in test_kv_replicate.py), two whose
vocab (4099) no tp divides, untied and tied (the vocab-parallel embedding and head padded; more in
test_vocab_parallel.py), three with routed experts (Mixtral, Qwen2-MoE, Qwen3-MoE), Gemma 2 and
Gemma 3."""

from __future__ import annotations

import dataclasses
import random
import threading
import types

import pytest
import torch
from engine_arrivals import run_arrivals
from pydantic import ValidationError

from raycluster.clock import VirtualClock
from raycluster.engine.config import EngineConfig
from raycluster.engine.engine import LLMEngine
from raycluster.engine.kv_manager import KVCacheManager
from raycluster.engine.model_runner import ModelRunner, plan_logits
from raycluster.model.loader import load_model
from raycluster.model.tiny import write_tiny_model
from raycluster.parallel.factory import build_runner
from raycluster.parallel.group import Collective, GroupAddress
from raycluster.ports import free_port
from raycluster.parallel.plan import StepPlan
from raycluster.parallel.tp import TPRunner, check_tp, shard_layer_state
from raycluster.request import SamplingParams

BS = 16
BASE = dict(policy="fcfs", packer="token", predictor="none", block_size=BS, num_threads=1, group_timeout_s=30)
GREEDY = SamplingParams(max_tokens=8, ignore_eos=True)
LOGPROBS = SamplingParams(max_tokens=8, ignore_eos=True, logprobs=0)
VARIANTS = {
    "tiny": None,
    "qwen2": dict(architectures=["Qwen2ForCausalLM"], hidden_size=128, num_attention_heads=4,
                  num_key_value_heads=2, intermediate_size=256, num_hidden_layers=2, tie_word_embeddings=True,
                  rope_parameters={"rope_type": "default", "rope_theta": 1e6}),
    # A sliding window shorter than most prompts here: every rank masks its heads by it.
    "mistral": dict(architectures=["MistralForCausalLM"], sliding_window=40, num_hidden_layers=2,
                    rope_parameters={"rope_type": "default", "rope_theta": 1e6}),
    "gqa-bias": dict(num_attention_heads=8, num_key_value_heads=2, head_dim=16, attention_bias=True,
                     mlp_bias=True, num_hidden_layers=2),
    "mha": dict(hidden_size=128, num_attention_heads=4, num_key_value_heads=4, head_dim=32,
                intermediate_size=256, num_hidden_layers=2),
    # Qwen3's per-head q/k norms are replicated: every rank normalises its own heads.
    "qwen3": dict(architectures=["Qwen3ForCausalLM"], hidden_size=128, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=32, intermediate_size=256, num_hidden_layers=2,
                  attention_bias=True, rope_parameters={"rope_type": "default", "rope_theta": 1e6}),
    # Fewer KV heads than ranks (vLLM replicates them): 8 heads over 2 KV heads at tp 4 (each KV
    # head on two ranks), with Qwen3's k_norm and k/v biases on the replicated head ...
    "kv-rep": dict(architectures=["Qwen3ForCausalLM"], hidden_size=128, num_attention_heads=8,
                   num_key_value_heads=2, head_dim=16, intermediate_size=256, num_hidden_layers=2,
                   attention_bias=True, rope_parameters={"rope_type": "default", "rope_theta": 1e6}),
    # ... and MQA (one KV head) at tp 2 or 4, with q/k/v and o_proj biases.
    "mqa": dict(hidden_size=128, num_attention_heads=4, num_key_value_heads=1, head_dim=32,
                intermediate_size=256, num_hidden_layers=2, attention_bias=True),
    # A vocab no tp divides (4099 is prime): the vocab-parallel embedding and head are padded
    # to a multiple of tp. Untied, and Qwen2-style tied (the head is the embedding's shard).
    "odd-vocab": dict(vocab_size=4099, num_hidden_layers=2),
    "qwen2-odd": dict(architectures=["Qwen2ForCausalLM"], hidden_size=128, num_attention_heads=4,
                      num_key_value_heads=2, intermediate_size=256, num_hidden_layers=2, tie_word_embeddings=True,
                      vocab_size=4099, rope_parameters={"rope_type": "default", "rope_theta": 1e6}),
    # Routed experts, every expert cut over the ranks, the router whole on each: Mixtral's (with
    # a window); Qwen2-MoE's shared expert and its gate on the sparse layer 1 (tied embeddings);
    # Qwen3-MoE's 8 experts with layer 1 dense.
    "mixtral": dict(architectures=["MixtralForCausalLM"], sliding_window=40, num_hidden_layers=2,
                    rope_parameters={"rope_type": "default", "rope_theta": 1e6}),
    "qwen2-moe": dict(architectures=["Qwen2MoeForCausalLM"], hidden_size=128, num_attention_heads=4,
                      num_key_value_heads=2, intermediate_size=256, num_hidden_layers=2, decoder_sparse_step=2,
                      moe_intermediate_size=96, shared_expert_intermediate_size=192, tie_word_embeddings=True),
    "qwen3-moe": dict(architectures=["Qwen3MoeForCausalLM"], hidden_size=128, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=32, intermediate_size=256, num_hidden_layers=3,
                      moe_intermediate_size=64, mlp_only_layers=[1]),
    # Gemma 2 (sandwich norms, soft caps: the final one on each lane's vocab slice, tied, padded
    # vocab) and Gemma 3 (q/k norms, its sliding layers' own RoPE base).
    "gemma2": dict(architectures=["Gemma2ForCausalLM"], num_hidden_layers=3, vocab_size=4099),
    "gemma3": dict(architectures=["Gemma3ForCausalLM"], num_hidden_layers=3),
    # Phi-3: fused q/k/v and gate/up in the file (each rank's rows read from inside them), LongRoPE
    # over 3/4 of each head.
    "phi3": dict(architectures=["Phi3ForCausalLM"], num_hidden_layers=2, max_position_embeddings=1024,
                 original_max_position_embeddings=64,
                 rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
                                  "short_factor": [1.0 + 0.05 * i for i in range(12)],
                                  "long_factor": [1.0 + 0.8 * i for i in range(12)]}),
    # Granite: its logits divisor on each lane's vocab slice (an odd vocab: padded lanes).
    "granite": dict(architectures=["GraniteForCausalLM"], num_hidden_layers=2, vocab_size=4099),
    # Cohere 2: the parallel block's two partial sums, the logit scale on each lane's slice.
    "cohere2": dict(architectures=["Cohere2ForCausalLM"], num_hidden_layers=4),
    # GLM-4-0414: fused gate/up in the file, interleaved partial RoPE, q/k/v biases.
    "glm4": dict(architectures=["Glm4ForCausalLM"], num_hidden_layers=2),
    # DeepSeek-V3: latent attention's heads split (q_b / kv_b / o_proj), the latent KV head
    # replicated on each rank, grouped routing and a shared expert.
    "deepseek_v3": dict(architectures=["DeepseekV3ForCausalLM"], num_hidden_layers=3),
    "glm4_moe": dict(architectures=["Glm4MoeForCausalLM"], num_hidden_layers=3),
    # StarCoder2: c_fc split by rows, c_proj by columns with its bias on rank 0.
    "starcoder2": dict(architectures=["Starcoder2ForCausalLM"], num_hidden_layers=2),
    # gpt-oss: each rank's sinks are its heads'; every stacked expert's interleaved gate / up
    # column pairs and down rows split, the down bias on rank 0; a window on the even layers.
    "gpt_oss": dict(architectures=["GptOssForCausalLM"], num_hidden_layers=2),
    # Llama 4: every stacked expert's gate and up halves split alike, the shared expert's partial
    # sum joining the experts' before the reduce, dense layers between.
    "llama4": dict(architectures=["Llama4ForCausalLM"], num_hidden_layers=4),
    # Granite MoE: input_linear's gate and up halves split alike, output_linear by its columns.
    "granite_moe": dict(architectures=["GraniteMoeForCausalLM"], num_hidden_layers=2),
    # Ernie 4.5's biases on every projection (o_proj's and down_proj's on rank 0); Arcee's
    # ungated MLP (up_proj by rows, down_proj by columns).
    "ernie4_5": dict(architectures=["Ernie4_5ForCausalLM"], num_hidden_layers=2),
    "arcee": dict(architectures=["ArceeForCausalLM"], num_hidden_layers=2),
    # Apertus: xIELU's parameters whole on every rank.
    "apertus": dict(architectures=["ApertusForCausalLM"], num_hidden_layers=2),
    # Hunyuan: its per-head q/k norms after RoPE, whole on every rank.
    "hunyuan": dict(architectures=["HunYuanDenseV1ForCausalLM"], num_hidden_layers=2),
    # Ministral 3: every rank scales its heads' queries alike.
    "ministral3": dict(architectures=["Ministral3ForCausalLM"], num_hidden_layers=2),
    # OLMo 2 / 3: q/k norms over the whole projection (the ranks' sums of squares all-reduced;
    # at tp 4 the 2 KV heads are replicated); Command R+: a q/k norm weight row per head.
    "olmo2": dict(architectures=["Olmo2ForCausalLM"], num_hidden_layers=2),
    "olmo3": dict(architectures=["Olmo3ForCausalLM"], num_hidden_layers=4),
    "cohere_qk_norm": dict(architectures=["CohereForCausalLM"], num_hidden_layers=2, use_qk_norm=True,
                           tie_word_embeddings=False),
}


def variant_models(names, tiny_model_dir, tmp_path_factory) -> dict:
    """The named VARIANTS' checkpoints, written and loaded (for the group test modules)."""
    out = {}
    for name in names:
        over = VARIANTS[name]
        path = tiny_model_dir if over is None else write_tiny_model(tmp_path_factory.mktemp(name), seed=1, **over)
        out[name] = load_model(path)[0]
    return out


@pytest.fixture(scope="module")
def models(tiny_model_dir, tmp_path_factory):
    return variant_models(VARIANTS, tiny_model_dir, tmp_path_factory)


def _group(model, tp: int, **cfg) -> TPRunner:
    # One table for every layer: the plans here name one table per request (a hybrid cache's
    # groups would need one each: tests/unit/test_hybrid_kv.py).
    runner = build_runner(EngineConfig(**{**BASE, "kv_cache_tokens": 64 * BS, "disable_hybrid_kv_cache_manager": True,
                                          **cfg, "tp": tp}), model, torch.float32)
    assert isinstance(runner, TPRunner) and runner.layout == f"tp{tp}"
    return runner


def _close(runner: TPRunner) -> None:
    runner.close()
    runner.close()              # idempotent
    if runner.ranks is None:    # a single-process runner (the group helpers below run on one too)
        return
    assert runner.ranks.errors == []
    assert not any(t.is_alive() for t in runner.ranks._threads), "ranks did not leave serve_rank"


# ---- shards and the collective ----------------------------------------------------------------------
def test_shards_put_back_together_are_the_layer_and_row_biases_live_on_rank_0(models):
    full = {k[len("model.layers.0."):]: v for k, v in models["gqa-bias"].state_dict().items()
            if k.startswith("model.layers.0.")}
    parts = [shard_layer_state(full, r, 2, 2) for r in range(2)]
    column = ["self_attn.q_proj.weight", "self_attn.k_proj.bias", "self_attn.v_proj.weight", "mlp.gate_proj.weight",
              "mlp.up_proj.bias"]
    for name in column:
        torch.testing.assert_close(torch.cat([p[name] for p in parts], 0), full[name], atol=0, rtol=0)
    for name in ("self_attn.o_proj.weight", "mlp.down_proj.weight"):
        assert all(p[name].is_contiguous() for p in parts)
        torch.testing.assert_close(torch.cat([p[name] for p in parts], 1), full[name], atol=0, rtol=0)
    # q heads 0-3 read KV heads 0 (of 2 in all): rank 0 holds both, as a whole GQA group.
    assert parts[0]["self_attn.q_proj.weight"].shape[0] == 4 * 16 and parts[0]["self_attn.k_proj.weight"].shape[0] == 16
    for name in ("self_attn.o_proj.bias", "mlp.down_proj.bias"):
        assert parts[0][name] is full[name] and name not in parts[1]
    assert parts[1]["input_layernorm.weight"] is full["input_layernorm.weight"]       # replicated, shared


def test_all_reduce_sums_in_place_on_every_rank():
    addr = GroupAddress("127.0.0.1", free_port("127.0.0.1"), 3, timeout_s=30)
    got, errors = {}, []

    def rank(r: int) -> None:
        try:
            t = torch.full((2, 3), float(r + 1))
            out = Collective(addr, r).all_reduce(t)
            got[r] = (out is t, t.clone())
        except BaseException as e:      # surfaced below; a thread must not die silently
            errors.append(e)

    threads = [threading.Thread(target=rank, args=(r,), daemon=True) for r in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors and sorted(got) == [0, 1, 2]
    for same, t in got.values():
        assert same and torch.equal(t, torch.full((2, 3), 6.0))


# ---- a group against the single runner --------------------------------------------------------------
def _plans(table_a: list[int], table_b: list[int], vocab: int) -> list[StepPlan]:
    """A 300-token prompt A in chunks of 100 (the second starts mid-block) with a 40-token B
    joining in the second step, then decodes of both; A's rows are all sampled in one step
    (as prompt log-probabilities would be)."""
    rng = random.Random(1)
    a = [rng.randrange(6, vocab) for _ in range(300)]
    b = [rng.randrange(6, vocab) for _ in range(40)]
    plans = [StepPlan(a[:100], [0], [100], [table_a], [], [], list(range(100))),
             StepPlan(a[100:200] + b, [100, 0], [100, 40], [table_a, table_b], [], [], [139]),
             StepPlan(a[200:] + [7], [200], [100], [table_a], [40], [table_b], [99, 100])]
    for i in range(4):
        plans.append(StepPlan([9 + i, 10 + i], [], [], [], [300 + i, 41 + i], [table_a, table_b], [0, 1]))
    return plans


def same_as_single_runner(model, runner) -> ModelRunner:
    """Run `_plans` through a group `runner` and a single-process runner with the same block ids:
    the logits agree step by step, and the KV the group gathers from its ranks (each holding its
    share of the same blocks) is the single runner's. Returns the single runner."""
    single = ModelRunner(model, KVCacheManager(64, BS))           # same block ids
    table_a, table_b = list(range(40, 20, -1)), [5, 3, 9]        # out of order, as after frees
    for plan in _plans(table_a, table_b, model.config.vocab_size - 10):
        want = plan_logits(single, plan)
        got = plan_logits(runner, plan)         # a vocab-parallel group's own, gathered from its lanes
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-5)
    ids = table_a[:19] + table_b
    torch.testing.assert_close(runner.save_blocks(ids), single.kv_cache[:, ids], atol=1e-5, rtol=1e-5)
    assert runner.kv_bytes_per_token() == single.kv_bytes_per_token()
    return single


@pytest.mark.parametrize("variant,tp", [("tiny", 2), ("qwen2", 2), ("mistral", 2), ("gqa-bias", 2), ("mha", 4),
                                        ("qwen3", 2), ("kv-rep", 4), ("mqa", 2), ("mqa", 4), ("odd-vocab", 2),
                                        ("qwen2-odd", 4), ("mixtral", 2), ("qwen2-moe", 2), ("qwen3-moe", 4),
                                        ("gemma2", 2), ("gemma3", 4), ("phi3", 2),
                                        ("granite", 2), ("cohere2", 2), ("glm4", 2),
                                        ("deepseek_v3", 2), ("deepseek_v3", 4), ("glm4_moe", 2),
                                        ("starcoder2", 2), ("gpt_oss", 2), ("gpt_oss", 4),
                                        ("llama4", 2), ("llama4", 4), ("granite_moe", 2), ("granite_moe", 4),
                                        ("ernie4_5", 2), ("arcee", 2), ("apertus", 2), ("hunyuan", 2),
                                        ("ministral3", 2), ("olmo2", 2), ("olmo2", 4), ("olmo3", 2),
                                        ("cohere_qk_norm", 2), ("cohere_qk_norm", 4)])
def test_a_tp_group_gives_the_single_runners_logits_step_by_step(models, variant, tp):
    model = models[variant]
    runner = _group(model, tp)
    try:
        same_as_single_runner(model, runner)
        assert runner.rank0.kv_cache.shape[4] == max(1, model.config.num_key_value_heads // tp)
    finally:
        _close(runner)


def _prefix_arrivals(vocab: int, seed: int):
    """Mixed prompts (1 to 200 tokens), half of them starting with one shared 70-token prefix,
    arriving over the first steps; two ask for prompt log-probabilities."""
    rng = random.Random(seed)
    shared = [rng.randrange(6, vocab) for _ in range(70)]
    arrivals = []
    for i, n in enumerate((200, 33, 1, 90, 17, 150, 5, 64)):
        tail = [rng.randrange(6, vocab) for _ in range(n)]
        sp = SamplingParams(max_tokens=8, ignore_eos=True, prompt_logprobs=2 if i in (1, 3) else None)
        arrivals.append((i * 3, f"r{i}", shared + tail if i % 2 else tail, sp))
    return arrivals


def engine_matches_plain(model, group: dict, layout: str) -> None:
    """Timed arrivals sharing prefixes through a plain engine and through one led by a group
    (`group`: its config fields, prefix caching on): the same tokens, prefix hits counted where
    they were served, and the prompt logprobs asked for."""
    arrivals = _prefix_arrivals(model.config.vocab_size - 10, 4)
    cfg = dict(BASE, kv_cache_tokens=4096, chunk_size=48)
    plain = LLMEngine(EngineConfig(**cfg), model, clock=VirtualClock())
    try:
        want = run_arrivals(plain, arrivals, 500)
    finally:
        plain.close()
    eng = LLMEngine(EngineConfig(**cfg, **group, enable_prefix_caching=True), model, clock=VirtualClock())
    try:
        assert eng.runner.layout == layout
        got = run_arrivals(eng, arrivals, 500)
    finally:
        _close(eng.runner)
    assert {r: q.output_token_ids for r, q in got.items()} == {r: q.output_token_ids for r, q in want.items()}
    assert eng.kv.hit_tokens >= 2 * 64 and sum(q.num_cached_tokens for q in got.values()) == eng.kv.hit_tokens
    for rid in ("r1", "r3"):
        g, w = got[rid].prompt_logprobs, want[rid].prompt_logprobs
        assert len(g) == len(w) == len(want[rid].prompt_token_ids) - 1
        assert [e.logprob for e in g] == pytest.approx([e.logprob for e in w], abs=1e-4)
        assert [e.top[0][0] for e in g] == [e.top[0][0] for e in w]


@pytest.mark.parametrize("variant", ["tiny", "qwen2", "mistral", "gqa-bias", "qwen2-odd", "mixtral", "qwen2-moe"])
def test_a_tp_engine_gives_the_plain_engines_tokens_with_prefix_caching(models, variant):
    engine_matches_plain(models[variant], {"tp": 2}, "tp2")


# ---- P/D handoffs -----------------------------------------------------------------------------------
def _prefill(eng: LLMEngine, rid: str, prompt: list[int]) -> tuple[list[int], torch.Tensor]:
    """Run `prompt` prefill-only on `eng` and offer its KV as an instance does (through the
    runner's port: a TP leader stages whole blocks gathered from its ranks). Returns the first
    token and the offered blocks [L, n, 2, B, Hkv, D]."""
    eng.add_request(rid, prompt, GREEDY, prefill_only=True)
    for _ in range(100):
        if rid in eng.scheduler.parked:
            break
        eng.step()
    first = list(eng.scheduler.parked[rid].output_token_ids)
    port = eng.runner.port
    ids = port.stage(rid, eng.parked_blocks(rid))
    data = port.tensor[:, ids].clone()
    port.unstage(rid)
    assert eng.release(rid)
    return first, data


def _decode(eng: LLMEngine, rid: str, prompt: list[int], first: list[int], data: torch.Tensor,
            sampling: SamplingParams = GREEDY) -> tuple[list[int], list[int], list[float]]:
    """Admit the handed-off request on `eng`, its KV pulled through the port as an instance's
    connector would, and decode it to the end. Returns its tokens, the skipped blocks and the
    log-probabilities of the tokens it decoded (when `sampling` asks for them)."""
    moved, logprobs = [], []

    def fill_kv(block_ids, skip):
        moved.append(skip)
        port = eng.runner.port
        return port.receive(block_ids, lambda ids: port.tensor.index_copy_(
            1, torch.tensor(ids), data[:, skip:]) is not None)

    assert eng.add_prefilled(rid, prompt, first, sampling, fill_kv)
    req = eng.scheduler.requests[rid]
    for _ in range(100):
        if not eng.has_unfinished():
            break
        logprobs += [e.logprob for o in eng.step().outputs if o.request_id == rid for e in o.logprobs or ()]
    eng.kv.check()
    assert eng.kv.num_free_blocks == eng.kv.num_blocks
    return req.output_token_ids, moved, logprobs


def handoff_matches_plain(model, group: dict, into_group: bool) -> None:
    """A P/D handoff between a plain engine and one led by a group (`group`: its config fields,
    prefix caching on), into the group (whose cache holds the shared prefix: 2 blocks skipped)
    or out of it: the offered KV is whole blocks (every layer, every head) and the decoded tokens
    and their log-probabilities are the plain engine's."""
    rng = random.Random(3)
    shared = [rng.randrange(6, 4000) for _ in range(40)]             # 2 full blocks + 8
    warm = shared + [rng.randrange(6, 4000) for _ in range(6)]
    prompt = shared + [rng.randrange(6, 4000) for _ in range(57)]
    cfg = dict(BASE, kv_cache_tokens=2048, chunk_size=32)
    plain = LLMEngine(EngineConfig(**cfg), model)
    want_req = plain.add_request("w", prompt, LOGPROBS)
    want_lp = []
    while plain.has_unfinished():
        want_lp += [e.logprob for o in plain.step().outputs if o.request_id == "w" for e in o.logprobs or ()]
    want = list(want_req.output_token_ids)
    grouped = LLMEngine(EngineConfig(**cfg, **group, enable_prefix_caching=True), model)
    pre, dec = (plain, grouped) if into_group else (grouped, plain)
    try:
        if into_group:
            dec.generate([warm], GREEDY)
        first, data = _prefill(pre, "h", prompt)
        assert first == want[:1] and data.shape[1] == -(-len(prompt) // BS)
        assert data.shape[0] == model.config.num_hidden_layers              # whole blocks: every layer
        assert data.shape[4] == model.config.num_key_value_heads            # and every head
        tokens, moved, logprobs = _decode(dec, "h", prompt, first, data, LOGPROBS)
        assert tokens == want
        assert len(logprobs) == len(want) - 1 and logprobs == pytest.approx(want_lp[1:], abs=1e-4)
        assert moved == ([2] if into_group else [0])
    finally:
        _close(grouped.runner)
        plain.close()


@pytest.mark.parametrize("direction", ["plain-to-tp", "tp-to-plain"])
def test_a_handoff_into_or_out_of_a_tp_engine_gives_the_plain_engines_tokens(models, direction):
    handoff_matches_plain(models["tiny"], {"tp": 2}, direction == "plain-to-tp")


# ---- what it refuses --------------------------------------------------------------------------------
def uneven_kv(model) -> types.SimpleNamespace:
    """A stand-in for `model` with 12 heads over 4 KV heads (intermediate 768): tp 6 divides the
    heads and the MLP but neither divides the KV heads nor is a multiple of them (refused before
    any rank starts, so only its config is read)."""
    return types.SimpleNamespace(config=dataclasses.replace(model.config, num_attention_heads=12,
                                                            num_key_value_heads=4, intermediate_size=768))


UNEVEN_KV = "tp: 6 ranks neither divide the model's num_key_value_heads"


def test_tp_refuses_uneven_heads_or_mlp(models):
    tiny = models["tiny"]                          # 8 heads, 2 KV heads, intermediate 768
    with pytest.raises(ValueError, match="tp: 3 ranks do not divide the model's num_attention_heads"):
        LLMEngine(EngineConfig(**BASE, tp=3), tiny)
    with pytest.raises(ValueError, match=UNEVEN_KV):
        build_runner(EngineConfig(**BASE, tp=6), uneven_kv(tiny), torch.float32)
    with pytest.raises(ValueError, match="intermediate_size"):
        check_tp(dataclasses.replace(tiny.config, intermediate_size=769), 2)
    check_tp(tiny.config, 4)                       # 2 KV heads over 4 ranks: replicated (test_kv_replicate.py)
    check_tp(tiny.config, 8)
    assert EngineConfig(tp=2, spp=2).parallel_world == 4        # SPP x TP: tests/unit/test_spp_tp.py
    assert EngineConfig(tp=2, kvp=2).parallel_world == 4        # KVP x TP: tests/unit/test_kvp_tp.py
    with pytest.raises(ValidationError, match="tp"):
        EngineConfig(tp=0)
