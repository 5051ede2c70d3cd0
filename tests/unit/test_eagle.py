"""EAGLE drafting: the EAGLE-1 head equals a transformers reference (HF's Llama decoder as EAGLE-1
wires it) through the paged cache, in one chunk or split into chunks and decode rows; for EAGLE-1
and EAGLE-3 eagle_heads alike, the proposer's drafts equal drafts recomputed from scratch with plain
causal attention at every step, an engine drafting with a head gives the very tokens it gives
without drafts (greedy, seeded, chunked prefill, KV pressure, prefix caching, aborts) with every
block back at the end, and the head's KV moves with a P/D handoff; the loader's and the config's
errors name what is wrong. (EAGLE-3's own layout: test_eagle3.py.)

Heads (tests/conftest.py `eagle_heads`): random ones (nothing accepted; the EAGLE-3 one with a
draft vocabulary, its own embedding and aux layers named in its config) and ones trained for a
few seconds on the tiny model's own greedy output (`train_eagle_head`: some accepted)."""

from __future__ import annotations

import json
import random

import pytest
import torch
from pydantic import ValidationError
from safetensors.torch import load_file, save_file

from kernels import get_attention_backend
from kernels.metadata import AttentionMetadata
from raycluster.engine.config import EngineConfig
from raycluster.engine.engine import LLMEngine
from raycluster.kv_transfer.base import gather_blocks, scatter_blocks
from raycluster.model.config import ModelConfigError
from raycluster.model.eagle import EagleHead, load_eagle_head
from raycluster.model.eagle3 import Eagle3Head
from raycluster.model.eagle_train import eagle3_forward, target_features, train_forward
from raycluster.model.loader import CheckpointError
from raycluster.request import SamplingParams

BASE = dict(policy="fcfs", packer="token", predictor="none", kv_cache_tokens=8192)


METHOD = {"random": "eagle", "trained": "eagle", "random3": "eagle3", "trained3": "eagle3"}   # eagle_heads


def _prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(6, 4000) for _ in range(rng.choice([1, 3, 17, 40, 70]))] for _ in range(n)]


def _engine(loaded, head=None, k=4, method="eagle", **cfg) -> LLMEngine:
    spec = {} if head is None else {"speculative_method": method, "speculative_model": head,
                                    "num_speculative_tokens": k}
    return LLMEngine(EngineConfig(**{**BASE, **spec, **cfg}), loaded[0], loaded[1])


def _run(eng: LLMEngine, prompts, sps, on_step=None):
    reqs = [eng.add_request(f"r{i}", p, sp) for i, (p, sp) in enumerate(zip(prompts, sps))]
    texts = {r.request_id: "" for r in reqs}
    preempted = 0
    for _ in range(5000):
        if not eng.has_unfinished():
            break
        res = eng.step()
        preempted += res.num_preempted
        for o in res.outputs:
            texts[o.request_id] += o.new_text
        if on_step is not None:
            on_step(eng, reqs)
    assert not eng.has_unfinished()
    eng.kv.check()
    assert eng.kv.num_free_blocks == eng.kv.num_blocks
    return [(r.output_token_ids, texts[r.request_id]) for r in reqs], preempted


# ---- the head against references ---------------------------------------------------------

def _hf_reference(head: EagleHead, model, ids: list[int], feats: torch.Tensor) -> torch.Tensor:
    """EAGLE-1's head with transformers' Llama decoder: fc(cat(embeds, features)) into the
    decoder layers, the first without its input norm, no final norm."""
    from transformers import LlamaConfig, LlamaModel

    c = head.config
    hf_cfg = LlamaConfig(vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
                         num_hidden_layers=c.num_hidden_layers, num_attention_heads=c.num_attention_heads,
                         num_key_value_heads=c.num_key_value_heads, head_dim=c.head_dim, rms_norm_eps=c.rms_norm_eps,
                         rope_theta=c.rope_theta, max_position_embeddings=c.max_position_embeddings,
                         attn_implementation="eager")
    hf = LlamaModel(hf_cfg).eval()
    mine = dict(head.named_parameters())
    hf.load_state_dict({n: mine[n] for n in hf.state_dict() if n in mine}, strict=False)
    hf.layers[0].input_layernorm = torch.nn.Identity()
    hf.norm = torch.nn.Identity()
    with torch.no_grad():
        x = head.fc(torch.cat((model.model.embed_tokens(torch.tensor(ids)), feats), dim=-1))
        return hf(inputs_embeds=x[None]).last_hidden_state[0]


def paged(head, ids, feats, pieces, block_size=16) -> tuple[torch.Tensor, torch.Tensor]:
    """The head over the sequence through a paged cache holding the target's layers and the
    head's, in prefill chunks (a piece > 0) or single decode rows (a piece of -1): its two
    outputs (rows for the logits, hidden states fed back), each concatenated."""
    n = len(ids)
    nblocks = -(-n // block_size) + 2
    table = list(range(nblocks))[::-1]
    layers = head.first_kv_layer + head.num_kv_layers
    cache = torch.zeros((layers, nblocks, 2, block_size, head.config.num_key_value_heads, head.config.head_dim))
    out, pos = [], 0
    for piece in pieces:
        c = max(piece, 1)
        slots = torch.tensor([table[p // block_size] * block_size + p % block_size for p in range(pos, pos + c)])
        if piece > 0:
            meta = AttentionMetadata(c, 0, [c], [pos + c], [table], [], [], slots, block_size)
        else:
            meta = AttentionMetadata(0, 1, [], [], [], [pos + 1], [table], slots, block_size)
        out.append(head(torch.tensor(ids[pos:pos + c]), torch.arange(pos, pos + c), feats[pos:pos + c], cache, meta,
                        backend=get_attention_backend(torch.device("cpu"))))
        pos += c
    assert pos == n
    assert not cache[:head.first_kv_layer].any()        # the target's layers untouched
    return torch.cat([o[0] for o in out]), torch.cat([o[1] for o in out])


def test_head_equals_transformers_reference(eagle_heads, loaded):
    model = loaded[0]
    head = load_eagle_head(eagle_heads["random"], model)
    assert head.fc.bias is not None
    ids = _prompts(1, 5)[0] * 2
    feats = target_features(model, [ids])[0]
    ref = _hf_reference(head, model, ids, feats)
    for pieces in ([len(ids)], [13, 29, len(ids) - 42], [len(ids) - 3, -1, -1, -1]):
        for_logits, fed_back = paged(head, ids, feats, pieces)
        torch.testing.assert_close(for_logits, ref, atol=1e-4, rtol=1e-5)
        assert torch.equal(for_logits, fed_back)
    # The autograd path the trainer uses is the same function.
    with torch.no_grad():
        torch.testing.assert_close(train_forward(head, model.model.embed_tokens, torch.tensor([ids]), feats[None])[0],
                                   ref, atol=1e-4, rtol=1e-5)


def _reference_drafts(model, head, tokens: list[int], k: int) -> list[int]:
    """k greedy drafts after `tokens`, recomputed from nothing: the target's features of the
    context, then the head over the whole sequence with plain causal attention per draft."""
    nxt, drafts = list(tokens[1:]), []
    with torch.no_grad():
        fs = head.combine(target_features(model, [tokens], aux_layers=head.aux_layers)[0][:-1])
        for _ in range(k):
            if isinstance(head, Eagle3Head):
                normed, fed = eagle3_forward(head, torch.tensor([nxt]), fs[None], [])[:2]
                normed, fed = normed[0, -1:], fed[0, -1:]
            else:
                normed = fed = train_forward(head, model.model.embed_tokens, torch.tensor([nxt]), fs[None])[0, -1:]
            token = int(head.compute_logits(normed).argmax(dim=-1))
            drafts.append(token)
            nxt.append(token)
            fs = torch.cat((fs, fed))
    return drafts


@pytest.mark.parametrize("name", ["trained", "trained3", "random3"])
def test_drafts_equal_drafts_recomputed_from_scratch(eagle_heads, loaded, name):
    """After every step, each decoding request's drafts are what the head gives from scratch
    on its whole context: the catch-up over prefill chunks, accepted drafts and rejected ones,
    and the lookahead passes all read and write the right KV."""
    model = loaded[0]
    head = load_eagle_head(eagle_heads[name], model, METHOD[name])
    prompts = _prompts(6, 11)
    checked = []

    def check(eng, reqs):
        for r in reqs:
            if r.spec_token_ids and r.request_id in eng.scheduler.decoding:
                assert r.spec_token_ids == _reference_drafts(model, head, r.all_token_ids, len(r.spec_token_ids))
                checked.append(len(r.spec_token_ids))

    eng = _engine(loaded, eagle_heads[name], k=3, method=METHOD[name], max_num_batched_tokens=48, block_size=8)
    _run(eng, prompts, [SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)] * len(prompts), check)
    assert len(checked) > 30 and max(checked) == 3
    if name.startswith("trained"):
        assert eng.spec.accepted_tokens > 0


# ---- the engine's output is unchanged -------------------------------------------------------

@pytest.mark.parametrize("case", ["greedy", "seeded", "chunked", "pressure", "prefix"])
def test_engine_output_unchanged(eagle_heads, loaded, case):
    prompts = _prompts(12, 1)
    cfg, sps = {}, [SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)] * len(prompts)
    if case == "seeded":
        sps = [SamplingParams(max_tokens=30, temperature=0.8, top_p=0.9, seed=i) for i in range(len(prompts))]
    elif case == "chunked":
        cfg = dict(max_num_batched_tokens=24, block_size=3)
    elif case == "pressure":
        cfg = dict(kv_cache_tokens=320, block_size=8)
    elif case == "prefix":
        prompts = [list(range(100, 140)) + p for p in prompts]
        cfg = dict(enable_prefix_caching=True, block_size=8, max_num_seqs=2)   # later ones hit
    expected, _ = _run(_engine(loaded, **cfg), prompts, sps)
    for name in METHOD:
        eng = _engine(loaded, eagle_heads[name], method=METHOD[name], **cfg)
        got, preempted = _run(eng, prompts, sps)
        assert got == expected, name
        assert eng.spec.draft_tokens > 0
        if name.startswith("trained") and case != "seeded":
            assert eng.spec.accepted_tokens > 0.05 * eng.spec.draft_tokens, name
        if case == "pressure":
            assert preempted > 0
        if case == "prefix":
            assert eng.kv.hit_rate() > 0.3


def test_output_unchanged_with_adapters_logprobs_penalties_and_patterns(eagle_heads, loaded, tiny_model_dir, tmp_path):
    """Requests on a LoRA adapter (the head reads the adapted target's features), asking for
    logprobs, penalised, or held to a regex: the same tokens and log-probabilities as plain
    decoding."""
    from raycluster.model.tiny import write_tiny_lora

    adapter = write_tiny_lora(tmp_path / "sql", tiny_model_dir, seed=2)
    prompts = _prompts(8, 21)
    sps = []
    for i in range(len(prompts)):
        kw = dict(max_tokens=24, temperature=0.0, ignore_eos=True)
        if i % 4 == 1:
            kw.update(lora_adapter="sql")
        elif i % 4 == 2:
            kw.update(logprobs=2, presence_penalty=0.5, frequency_penalty=0.3)
        elif i % 4 == 3:
            kw.update(guided_regex="[a-z ]{4,40}")
        sps.append(SamplingParams(**kw))
    cfg = dict(lora_modules=[f"sql={adapter}"])

    def run(head, method):
        eng = _engine(loaded, head, method=method, **cfg)
        reqs = [eng.add_request(f"r{i}", p, sp) for i, (p, sp) in enumerate(zip(prompts, sps))]
        lps: dict[str, list] = {}
        for _ in range(2000):
            if not eng.has_unfinished():
                break
            for o in eng.step().outputs:
                lps.setdefault(o.request_id, []).extend(
                    [(round(lp.logprob, 4), lp.rank, [t for t, _ in lp.top]) for lp in o.logprobs or []])
        eng.kv.check()
        return [r.output_token_ids for r in reqs], lps, eng

    expected = run(None, "eagle")
    for name in ("trained", "trained3"):
        got = run(eagle_heads[name], METHOD[name])
        assert got[:2] == expected[:2], name
        assert got[2].spec.draft_tokens > 0


def test_prefix_hit_recomputes_its_last_block_with_a_head(eagle_heads, loaded):
    """As vLLM: the head's KV at a cached run's last position was made with another request's
    next token, so an engine with a head recomputes that block."""
    prompt = list(range(100, 210))          # 110 tokens: 13 full blocks of 8 before the last
    sp = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    for head, cached in ((None, 13 * 8), (eagle_heads["trained"], 12 * 8)):
        eng = _engine(loaded, head, enable_prefix_caching=True, block_size=8)
        eng.generate([prompt], sp)
        assert eng.kv.cached_prefix_tokens(prompt + [9]) == cached


def test_abort_frees_lookahead_blocks(eagle_heads, loaded):
    eng = _engine(loaded, eagle_heads["trained"], k=5, block_size=4)
    for i, p in enumerate(_prompts(4, 7)):
        eng.add_request(f"a{i}", p, SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True))
    for _ in range(6):
        eng.step()
    assert any(r.spec_token_ids for r in eng.scheduler.requests.values())
    for i in range(4):
        assert eng.abort_request(f"a{i}")
    eng.kv.check()
    assert eng.kv.num_free_blocks == eng.kv.num_blocks


@pytest.mark.parametrize("name", ["trained", "trained3"])
def test_head_kv_moves_with_a_handoff(eagle_heads, loaded, name):
    """A prefill-only engine writes the head's KV for the prompt; the decode engine that pulls
    the blocks drafts what a single engine drafts (and not when that layer stays behind)."""
    prompt = _prompts(1, 9)[0] * 3
    sp = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    head, method = eagle_heads[name], METHOD[name]

    def first_drafts(engine):
        return next(r.spec_token_ids for r in engine.scheduler.requests.values())

    single = _engine(loaded, head, k=4, method=method)
    single.add_request("x", prompt, sp)
    single.step()
    single.step()
    expected = first_drafts(single)
    results = []
    for keep_head_layer in (True, False):
        pre, dec = _engine(loaded, head, k=4, method=method), _engine(loaded, head, k=4, method=method)
        pre.add_request("x", prompt, sp, prefill_only=True)
        (out,) = pre.step().outputs
        src = pre.parked_blocks("x")

        def fill(dst, skip, src=src, keep=keep_head_layer):
            data = gather_blocks(pre.runner.kv_cache, src)
            if not keep:
                data[-1] = 0
            scatter_blocks(dec.runner.kv_cache, dst, data)
            return True

        assert dec.add_prefilled("x", prompt, out.new_token_ids, sp, fill)
        pre.release("x")
        dec.step()
        results.append(first_drafts(dec))
    assert results[0] == expected and len(expected) == 4
    assert results[1] != expected


# ---- errors ------------------------------------------------------------------------------

def write_head(path, tensors: dict, config: dict) -> str:
    """A head directory with these tensors and this config.json (loader tests' variants)."""
    path.mkdir()
    (path / "config.json").write_text(json.dumps(config))
    save_file(tensors, str(path / "model.safetensors"))
    return str(path)


def test_loader_and_config_errors(eagle_heads, loaded, tmp_path):
    model = loaded[0]
    src = eagle_heads["random"]
    tensors = load_file(f"{src}/model.safetensors")
    cfg = json.load(open(f"{src}/config.json"))

    def write(name, t=tensors, c=cfg):
        return write_head(tmp_path / name, t, c)

    # vLLM's names: a `model.` prefix, an EagleLlamaForCausalLM config, the target's embedding copied in
    ok = write("prefixed", {**{"model." + n: t for n, t in tensors.items()},
                            "model.embed_tokens.weight": torch.zeros(1)},
               {**cfg, "architectures": ["EagleLlamaForCausalLM"]})
    load_eagle_head(ok, model)
    with pytest.raises(CheckpointError, match="missing tensors.*fc.weight"):
        load_eagle_head(write("no_fc", {n: t for n, t in tensors.items() if n != "fc.weight"}), model)
    with pytest.raises(CheckpointError, match="unexpected tensor 'layers.1"):
        load_eagle_head(write("extra", {**tensors, "layers.1.mlp.up_proj.weight": torch.zeros(2)}), model)
    with pytest.raises(ValueError, match="speculative_model: the EAGLE head's hidden_size"):
        load_eagle_head(write("wide", c={**cfg, "hidden_size": 128}), model)
    with pytest.raises(ModelConfigError, match="EAGLE-3"):
        load_eagle_head(write("eagle3", c={**cfg, "draft_vocab_size": 32000}), model)
    with pytest.raises(ModelConfigError, match="is not an eagle head"):
        load_eagle_head(write("qwen", c={**cfg, "architectures": ["Qwen2ForCausalLM"]}), model)
    with pytest.raises(ModelConfigError, match="an eagle3 head: speculative_method 'eagle3'"):
        load_eagle_head(eagle_heads["random3"], model)
    with pytest.raises(ModelConfigError, match="an eagle head: speculative_method 'eagle'"):
        load_eagle_head(src, model, "eagle3")
    with pytest.raises(ValidationError, match="speculative_model: speculative_method 'eagle' needs an EAGLE head"):
        EngineConfig(speculative_method="eagle")
    with pytest.raises(ValidationError, match="speculative_kv_tokens"):
        EngineConfig(speculative_method="eagle", speculative_model=src, speculative_kv_tokens=64)
    with pytest.raises(ValidationError, match="speculative_method: 'eagle' runs on a single-process engine"):
        EngineConfig(**BASE, speculative_method="eagle", speculative_model=src, spp=2)
