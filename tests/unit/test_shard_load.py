"""Ranks that read only their shard from the checkpoint (raycluster.parallel.shard.load_shard):
the file-loaded shard equals the one cut from the loaded full model, tensor for tensor, for every
rank of TP groups and SPP stage ranges; engines built from a path as tp2, spp2 and spp2xtp2 give
the single engine's greedy tokens while their leader holds only its part of the decoder layers
and, with TP lanes, only its vocab rows of the embedding and head (where it uses them);
a checkpoint missing a tensor a rank needs names it. Checkpoints: test_tp.py's tiny one (GQA
8/2, untied), a Qwen2-style one (q/k/v biases, tied embeddings), one with o_proj and MLP biases,
and that one again split over two files with an index."""

from __future__ import annotations

import json
import os
import random
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_tp import VARIANTS

from raycluster.engine.config import EngineConfig
from raycluster.engine.engine import LLMEngine
from raycluster.model.loader import CheckpointError, load_config, load_model
from raycluster.model.tiny import write_tiny_model
from raycluster.parallel.shard import Checkpoint, GroupModel, load_shard, shard_model
from raycluster.parallel.spp import stage_layers
from raycluster.request import SamplingParams

BASE = dict(policy="fcfs", packer="token", predictor="none", block_size=16, num_threads=1, group_timeout_s=30,
            kv_cache_tokens=2048, chunk_size=48)



def _split_with_index(src: str, dst: str) -> str:
    """The checkpoint at `src` copied to `dst` as two safetensors files and an index."""
    shutil.copytree(src, dst)
    sd = load_file(os.path.join(dst, "model.safetensors"))
    os.remove(os.path.join(dst, "model.safetensors"))
    names = sorted(sd)
    weight_map = {}
    for i, keys in enumerate((names[::2], names[1::2])):        # interleaved: every layer spans both files
        fn = f"model-0000{i + 1}-of-00002.safetensors"
        save_file({k: sd[k] for k in keys}, os.path.join(dst, fn))
        weight_map.update({k: fn for k in keys})
    with open(os.path.join(dst, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    return dst


@pytest.fixture(scope="module")
def paths(tiny_model_dir, tmp_path_factory):
    out = {"tiny": str(tiny_model_dir)}
    for name in ("qwen2", "gqa-bias", "qwen3", "qwen2-moe", "mixtral", "phi3", "glm4", "deepseek_v3", "starcoder2",
                 "gpt_oss", "llama4", "granite_moe", "apertus", "olmo2", "cohere_qk_norm"):
        out[name] = write_tiny_model(tmp_path_factory.mktemp(name), seed=1, **VARIANTS[name])
    out["sharded"] = _split_with_index(out["gqa-bias"], str(tmp_path_factory.mktemp("sharded") / "m"))
    return out


def _ranges(n: int) -> list[range]:
    """Every layer, and each stage's range for 2 and 3 stages (where there are enough layers)."""
    out = [range(n)]
    for spp in (2, 3):
        if spp <= n:
            out += [range(lo, hi) for lo, hi in stage_layers(n, spp)]
    return out


def _same_shard(a: torch.nn.Module, b: torch.nn.Module) -> None:
    """`a` (read from the files) is `b` (cut from the full model), and each of a's tensors owns
    its storage: no view into a larger tensor or the mapped file keeps more than the part."""
    assert a.config == b.config
    for name, t in a.state_dict().items():
        assert t.is_contiguous() and t.untyped_storage().nbytes() == t.numel() * t.element_size(), name
    assert [(n, type(m)) for n, m in a.named_modules()] == [(n, type(m)) for n, m in b.named_modules()]
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert sa[k].shape == sb[k].shape and sa[k].dtype == sb[k].dtype, k
        assert torch.equal(sa[k], sb[k]), k
        assert sa[k].device.type == "cpu", k


@pytest.mark.parametrize("name", ["tiny", "qwen2", "gqa-bias", "qwen3", "sharded", "qwen2-moe", "mixtral", "phi3",
                                  "glm4", "deepseek_v3", "starcoder2", "gpt_oss", "llama4",
                                  "granite_moe", "apertus", "olmo2", "cohere_qk_norm"])
def test_a_file_loaded_shard_equals_the_shard_cut_from_the_full_model(paths, name):
    full, cfg = load_model(paths[name])
    ckpt = Checkpoint(paths[name], cfg)
    for tp in (1, 2) + ((4,) if cfg.num_key_value_heads % 4 == 0 else ()):
        for layers in _ranges(cfg.num_hidden_layers):
            for rank in range(tp):
                _same_shard(load_shard(ckpt, rank, tp, layers=layers), shard_model(full, rank, tp, layers=layers))


def test_the_mha_checkpoint_splits_four_ways_from_the_file(tmp_path):
    path = write_tiny_model(tmp_path / "mha", seed=1, **VARIANTS["mha"])
    full, cfg = load_model(path)
    for rank in range(4):
        _same_shard(load_shard(Checkpoint(path, cfg), rank, 4), shard_model(full, rank, 4))


def test_a_shard_loads_only_the_modules_it_is_asked_for(paths):
    cfg = load_config(paths["tiny"])       # untied
    bare = load_shard(Checkpoint(paths["tiny"], cfg), 1, 2, layers=range(2, 4), embed=False, norm=False, head=False)
    assert bare.model.embed_tokens is None and bare.model.norm is None and bare.lm_head is None
    assert all(k.startswith("model.layers.") for k in bare.state_dict())
    head = load_shard(Checkpoint(paths["tiny"], cfg), 0, 2, embed=False, norm=False, head=True)
    assert head.lm_head is not None and head.model.embed_tokens is None
    assert head.lm_head.weight.shape == (cfg.vocab_size // 2, cfg.hidden_size)      # its vocab rows only
    tied_cfg = load_config(paths["qwen2"])
    tied = load_shard(Checkpoint(paths["qwen2"], tied_cfg), 0, 2, embed=False, norm=False, head=True)
    # The tied head is lane 0's rows of the embedding, read as the head (no embedding asked for).
    assert tied.lm_head is not None and tied.model.embed_tokens is None
    full, _ = load_model(paths["qwen2"])
    h = torch.randn(3, tied_cfg.hidden_size)
    half = tied_cfg.vocab_size // 2
    torch.testing.assert_close(tied.lm_head(h), full.compute_logits(h)[:, :half], atol=1e-6, rtol=1e-6)
    # Without TP lanes the head is the whole tied embedding, as before.
    whole = load_shard(Checkpoint(paths["qwen2"], tied_cfg), 0, 1, embed=False, norm=False, head=True)
    assert whole.lm_head is None and whole.model.embed_tokens is not None
    assert torch.equal(whole.compute_logits(h), full.compute_logits(h))


# ---- engines built from the path ----------------------------------------------------------------------
def _prompts(vocab: int) -> list[list[int]]:
    rng = random.Random(3)
    shared = [rng.randrange(6, vocab) for _ in range(40)]
    return [shared + [rng.randrange(6, vocab) for _ in range(n)] for n in (150, 9, 60)] + [[7, 8, 9]]


def _run(eng: LLMEngine, prompts: list[list[int]], tag: str) -> list[tuple[list[int], list[float] | None]]:
    """Each prompt's greedy tokens and, for the first, its prompt log-probabilities (every prompt
    token's logits: a finer check than the tokens of a tiny random model)."""
    reqs = [eng.add_request(f"{tag}{i}", p, SamplingParams(max_tokens=8, ignore_eos=True,
                                                           prompt_logprobs=1 if i == 0 else None))
            for i, p in enumerate(prompts)]
    for _ in range(500):
        if not eng.has_unfinished():
            break
        eng.step()
    return [(list(r.output_token_ids), None if r.prompt_logprobs is None else [e.logprob for e in r.prompt_logprobs])
            for r in reqs]


def _same_run(got, want) -> None:
    assert [t for t, _ in got] == [t for t, _ in want]
    assert got[0][1] == pytest.approx(want[0][1], abs=1e-4)


def _layer_elems(modules, layers: bool = True) -> int:
    """Elements of the storage behind the decoder-layer parameters these modules hold (each
    storage counted once, whole: a slice that is a view of a full tensor counts as the full one);
    `layers=False`: behind the others (embedding, final norm, output head)."""
    seen = {}
    for m in modules:
        for name, p in m.named_parameters(remove_duplicate=False):
            if (".layers." in f".{name}") == layers and p.device.type != "meta":
                st = p.untyped_storage()
                seen[st.data_ptr()] = st.nbytes() // p.element_size()
    return sum(seen.values())


def _leader_modules(eng: LLMEngine) -> list:
    """The engine's model, the runner's model and the leader rank's own shard."""
    runner = eng.runner
    mods = [getattr(runner, "rank0", None), getattr(runner, "stage", None)]
    mods = [r.model for r in mods if r is not None]
    for m in (eng.model, runner.model):
        mods.append(m.leader_shard if isinstance(m, GroupModel) else m)
    return mods


def _leader_layer_elems(eng: LLMEngine) -> int:
    """What the leader keeps of the decoder layers."""
    return _layer_elems(_leader_modules(eng))


def _leader_vocab_elems(eng: LLMEngine) -> int:
    """What the leader keeps outside the decoder layers: its embedding, final norm and head."""
    return _layer_elems(_leader_modules(eng), layers=False)


def _want_vocab_elems(cfg, group: dict) -> int:
    """What a leader reading from the path holds outside the layers. With TP lanes (vocab-
    parallel): its V / tp rows of the embedding, and of the head where it computes logits (a
    tied head the same rows), and the final norm where it norms: TP and KVP x TP leaders both,
    an SPP x TP leader (first stage) neither. Plain SPP: the whole embedding and head, no norm.
    (Before the vocab-parallel head every such leader held the whole embedding and head.)"""
    tp, V, H = group.get("tp", 1), cfg.vocab_size, cfg.hidden_size
    heads = 1 if cfg.tie_word_embeddings else 2
    if tp == 1:
        return V * H * heads
    rows = -(-V // tp)
    return rows * H if group.get("spp", 1) > 1 else rows * H * heads + H


@pytest.mark.parametrize("name,group,layout,share", [
    ("tiny", {"tp": 2}, "tp2", 2), ("qwen2", {"tp": 2}, "tp2", 2), ("sharded", {"tp": 2}, "tp2", 2),
    ("phi3", {"tp": 2}, "tp2", 2),
    ("tiny", {"spp": 2, "spp_micro_tokens": 16}, "spp2", 2),
    ("tiny", {"spp": 2, "tp": 2, "spp_micro_tokens": 16}, "spp2xtp2", 4),
    ("gqa-bias", {"spp": 2, "tp": 2, "spp_micro_tokens": 16}, "spp2xtp2", 4),
    ("qwen2", {"kvp": 2, "tp": 2}, "kvp2xtp2", 2)])         # KVP replicates: a lane's share is 1/tp
def test_an_engine_built_from_the_path_matches_the_single_engine_and_its_leader_holds_its_part(
        paths, name, group, layout, share):
    full, cfg = load_model(paths[name])
    prompts = _prompts(cfg.vocab_size - 10)
    single = LLMEngine.from_config(EngineConfig(model=paths[name], **BASE))
    want = _run(single, prompts, "a")
    eng = LLMEngine.from_config(EngineConfig(model=paths[name], **BASE, **group, enable_prefix_caching=True))
    try:
        assert eng.runner.layout == layout
        assert isinstance(eng.model, GroupModel) and eng.model.config == cfg
        assert eng.vocab_size == single.vocab_size and eng.max_model_len == single.max_model_len
        assert eng.runner.kv_bytes_per_token() == single.runner.kv_bytes_per_token()
        assert eng.runner.model.kv_cache_shape(5, 16) == full.kv_cache_shape(5, 16)
        _same_run(_run(eng, prompts, "a"), want)
        _same_run(_run(eng, prompts[:2], "b"), want[:2])        # again, from the prefix cache
        assert eng.kv.hit_tokens >= 32         # prompt 1 reused the shared prefix (prompt 0 asks for prompt logprobs)
        whole = _layer_elems([full])
        held = _leader_layer_elems(eng)
        # 1/share of the layers, give or take the replicated norms and rank 0's row biases ...
        assert whole / share <= held <= whole / share * 1.02, (held, whole)
        # ... and of the embedding and head its vocab rows only, where it uses them.
        assert _leader_vocab_elems(eng) == _want_vocab_elems(cfg, group), (_leader_vocab_elems(eng), layout)
    finally:
        eng.close()
        assert eng.runner.ranks.errors == []
        single.close()


def test_a_leader_given_the_full_model_keeps_it(paths):
    """The measure above sees a full model where one is kept: a group built from a model object."""
    full, _ = load_model(paths["tiny"])
    eng = LLMEngine(EngineConfig(model=paths["tiny"], **BASE, tp=2), full)
    try:
        assert _leader_layer_elems(eng) >= _layer_elems([full])
    finally:
        eng.close()


# ---- checkpoint errors --------------------------------------------------------------------------------
def _without(src: str, dst, name: str) -> str:
    d = shutil.copytree(src, dst)
    f = os.path.join(d, "model.safetensors")
    sd = load_file(f)
    del sd[name]
    save_file(sd, f)
    return str(d)


def test_a_missing_tensor_a_rank_needs_is_named(paths, tmp_path):
    gone = "model.layers.3.mlp.down_proj.weight"
    d = _without(paths["tiny"], tmp_path / "m", gone)
    ckpt = Checkpoint(d, load_config(d))
    for rank in range(2):
        with pytest.raises(CheckpointError, match=gone.replace(".", r"\.")):
            load_shard(ckpt, rank, 2)
    with pytest.raises(CheckpointError, match="lm_head"):
        load_shard(Checkpoint(_without(paths["tiny"], tmp_path / "h", "lm_head.weight"), ckpt.config), 0, 2,
                   layers=range(0, 2))


def test_a_misshapen_or_unexpected_tensor_is_named(paths, tmp_path):
    d = shutil.copytree(paths["tiny"], tmp_path / "m")
    f = os.path.join(d, "model.safetensors")
    sd = load_file(f)
    sd["model.layers.1.self_attn.k_proj.weight"] = sd["model.layers.1.self_attn.k_proj.weight"][:-2].contiguous()
    save_file(sd, f)
    ckpt = Checkpoint(str(d), load_config(d))
    with pytest.raises(CheckpointError, match=r"shape mismatch for tensor 'model\.layers\.1\.self_attn\.k_proj"):
        load_shard(ckpt, 1, 2, layers=range(0, 2))
    sd = load_file(os.path.join(paths["tiny"], "model.safetensors"))
    sd["model.layers.9.extra"] = torch.zeros(2)
    save_file(sd, f)
    with pytest.raises(CheckpointError, match=r"unexpected tensor 'model\.layers\.9\.extra'"):
        load_shard(ckpt, 0, 2)
