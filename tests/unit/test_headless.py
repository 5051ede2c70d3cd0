"""Checkpoints without an output head (a base model's save: LlamaModel, or a causal LM's config
over tensors stored without the "model." prefix and no lm_head, as sentence-transformers writes
embedding models): read with the names mapped, served for pooling only (generation refused
naming `model`), on one process and on TP / KVP groups reading their shards from the files,
refused on an SPP group; the vectors equal transformers' base model on the same files. A tied
bare-named checkpoint keeps its head (the embedding) and generates as the prefixed one does."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from engine_arrivals import pooled_vectors
from safetensors.torch import load_file, save_file

from raycluster.engine.config import EngineConfig
from raycluster.engine.engine import InvalidRequestError, LLMEngine
from raycluster.engine.profiler import make_run_batch
from raycluster.model.loader import CheckpointError, load_config, load_model
from raycluster.model.tiny import write_tiny_model
from raycluster.request import SamplingParams

BASE = dict(policy="fcfs", packer="token", predictor="none", kv_cache_tokens=4096, num_threads=1,
            pooling_type="mean", chunk_size=16)
EMBED = SamplingParams(max_tokens=1, embed=True)
PROMPTS = [[5, 9, 300, 41, 7] * k for k in (1, 4, 9)]


def _bare_copy(src, dst, architecture: str | None, keep_head: bool = False):
    """`src` re-saved as a base model: tensors without "model.", no lm_head (unless `keep_head`)."""
    shutil.copytree(src, dst)
    sd = load_file(str(dst / "model.safetensors"))
    bare = {k.removeprefix("model."): v for k, v in sd.items() if keep_head or k != "lm_head.weight"}
    save_file(bare, str(dst / "model.safetensors"))
    if architecture is not None:
        cfg = json.loads((dst / "config.json").read_text())
        (dst / "config.json").write_text(json.dumps({**cfg, "architectures": [architecture]}))
    return dst


@pytest.fixture(scope="module")
def headless(tiny_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("headless")
    return {"base": _bare_copy(tiny_model_dir, root / "base", "LlamaModel"),
            "causal": _bare_copy(tiny_model_dir, root / "causal", None)}


@pytest.fixture(scope="module")
def hidden_states(headless):
    """transformers' LlamaModel read from the headless files: each prompt's final hidden states."""
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoModel.from_pretrained(headless["base"], dtype=torch.float32, attn_implementation="eager")
    with torch.no_grad():
        return [hf(torch.tensor([p])).last_hidden_state[0] for p in PROMPTS]


@pytest.mark.parametrize("kind", ["base", "causal"])
def test_a_headless_checkpoint_is_read_as_a_pooling_only_model(headless, hidden_states, kind):
    cfg = load_config(headless[kind])
    assert cfg.bare_names and not cfg.has_lm_head and cfg.architecture == "LlamaForCausalLM"
    model, _ = load_model(headless[kind])
    assert model.lm_head is None
    eng = LLMEngine(EngineConfig(**BASE), model)
    for got, h in zip(pooled_vectors(eng, PROMPTS), hidden_states):
        torch.testing.assert_close(got, h.mean(0), atol=1e-5, rtol=1e-5)
    with pytest.raises(InvalidRequestError, match="no output head") as e:
        eng.add_request("g", PROMPTS[0], SamplingParams(max_tokens=4))
    assert e.value.field == "model" and not eng.has_unfinished()
    # The start-up profile times its steps without logits.
    assert make_run_batch(eng.runner)([(16, 0)], [8, 20]) > 0


@pytest.mark.parametrize("group", [{"tp": 2}, {"kvp": 2}, {"kvp": 2, "tp": 2}], ids=["tp2", "kvp2", "kvp2xtp2"])
def test_groups_read_their_shards_of_a_headless_checkpoint(headless, hidden_states, group):
    eng = LLMEngine.from_config(EngineConfig(**BASE, **group, model=str(headless["base"]), group_timeout_s=60))
    try:
        for got, h in zip(pooled_vectors(eng, PROMPTS), hidden_states):
            torch.testing.assert_close(got, h.mean(0), atol=1e-5, rtol=1e-5)
        assert make_run_batch(eng.runner)([(16, 0)], [8]) > 0
    finally:
        eng.close()


def test_an_spp_group_is_refused_for_a_headless_checkpoint(headless):
    with pytest.raises(ValueError, match="without an output head"):
        LLMEngine.from_config(EngineConfig(**BASE, spp=2, model=str(headless["base"])))


def test_a_tied_bare_checkpoint_keeps_its_head(tmp_path):
    prefixed = write_tiny_model(tmp_path / "tied", tie_word_embeddings=True)
    bare = _bare_copy(tmp_path / "tied", tmp_path / "tied-bare", "LlamaModel")
    cfg = load_config(bare)
    assert cfg.bare_names and cfg.has_lm_head
    sp = SamplingParams(max_tokens=8, ignore_eos=True)
    want = LLMEngine(EngineConfig(**BASE), load_model(prefixed)[0]).generate(PROMPTS, sp)
    assert LLMEngine(EngineConfig(**BASE), load_model(bare)[0]).generate(PROMPTS, sp) == want


def test_an_untied_bare_checkpoint_with_its_head_generates(headless, tiny_model_dir, tmp_path):
    bare = _bare_copy(tiny_model_dir, tmp_path / "with-head", None, keep_head=True)
    assert load_config(bare).has_lm_head
    sp = SamplingParams(max_tokens=8, ignore_eos=True)
    want = LLMEngine(EngineConfig(**BASE), load_model(tiny_model_dir)[0]).generate(PROMPTS, sp)
    assert LLMEngine(EngineConfig(**BASE), load_model(bare)[0]).generate(PROMPTS, sp) == want


def test_a_prefixed_causal_lm_missing_its_head_is_still_an_error(tiny_model_dir, tmp_path):
    root = tmp_path / "broken"
    shutil.copytree(tiny_model_dir, root)
    sd = load_file(str(root / "model.safetensors"))
    save_file({k: v for k, v in sd.items() if k != "lm_head.weight"}, str(root / "model.safetensors"))
    assert load_config(root).has_lm_head
    with pytest.raises(CheckpointError, match="missing tensors in checkpoint: lm_head.weight"):
        load_model(root)


def test_a_tp_group_applies_the_dense_modules_read_from_the_checkpoint(st_dense_dir):
    single = LLMEngine(EngineConfig(**BASE), load_model(st_dense_dir)[0])
    want = pooled_vectors(single, PROMPTS)
    assert want[0].shape == (64,)
    eng = LLMEngine.from_config(EngineConfig(**BASE, tp=2, model=str(st_dense_dir), group_timeout_s=60))
    try:
        assert eng.projector is not None
        for got, w in zip(pooled_vectors(eng, PROMPTS), want):
            torch.testing.assert_close(got, w, atol=1e-5, rtol=1e-5)
    finally:
        eng.close()
