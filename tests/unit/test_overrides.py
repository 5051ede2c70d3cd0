"""vLLM's --hf-overrides (raycluster.model.overrides): config.json fields changed in a derived
directory, and a causal LM turned into a classifier scoring with rows of its output head
(`classifier_from_token`: Qwen3-Reranker's `from_2_way_softmax`, `no_post_processing`), whose
logits equal transformers' causal-LM logits at those tokens, on one engine and a tp 2 group."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from engine_arrivals import pooled_vectors
from pydantic import ValidationError
from safetensors.torch import load_file, save_file

from raycluster.engine.config import EngineConfig
from raycluster.engine.engine import LLMEngine
from raycluster.model.loader import load_config, load_model
from raycluster.model.overrides import OverrideError, merged
from raycluster.model.registry import resolve_model_path
from raycluster.model.tokenizer import Tokenizer

BASE = dict(policy="fcfs", packer="token", predictor="none", kv_cache_tokens=4096, num_threads=1, chunk_size=16)
PROMPTS = [[5, 9, 300, 41, 7] * k for k in (1, 4, 9)] + [[0, 17, 18]]
RERANKER = {"architectures": ["LlamaForSequenceClassification"], "is_original_qwen3_reranker": True}


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("RAYCLUSTER_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture(scope="module")
def hf_logits(tiny_model_dir):
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32,
                                                           attn_implementation="eager")
    with torch.no_grad():
        return [hf(torch.tensor([p])).logits[0, -1] for p in PROMPTS]


def _tokens(tiny_model_dir, n: int) -> tuple[list[str], list[int]]:
    vocab = Tokenizer(tiny_model_dir)._tok.get_vocab()
    names = sorted(t for t in vocab if t.isalpha() and len(t) > 2)[:n]
    return names, [vocab[t] for t in names]


def test_overrides_merge_nested_fields_and_flags_take_json():
    assert merged({"a": 1, "r": {"x": 1, "y": 2}}, {"r": {"y": 3}, "b": [1]}) == {"a": 1, "r": {"x": 1, "y": 3}, "b": [1]}
    assert EngineConfig(hf_overrides='{"max_position_embeddings": 128}').hf_overrides == {"max_position_embeddings": 128}
    for bad in ("{nope", "[1, 2]"):
        with pytest.raises(ValidationError, match="hf_overrides"):
            EngineConfig(hf_overrides=bad)


def test_a_field_override_reads_through_a_derived_directory(tiny_model_dir, cache):
    path = resolve_model_path(str(tiny_model_dir), {"max_position_embeddings": 96, "rope_parameters": {"rope_theta": 500.0}})
    assert path.startswith(str(cache)) and resolve_model_path(str(tiny_model_dir)) == str(tiny_model_dir)
    cfg = load_config(path)
    assert (cfg.max_model_len, cfg.rope_theta) == (96, 500.0)
    assert json.loads((Path(tiny_model_dir) / "config.json").read_text())["max_position_embeddings"] != 96
    # Same overrides, same directory; the weights load from the source's files.
    assert resolve_model_path(str(tiny_model_dir), {"max_position_embeddings": 96, "rope_parameters": {"rope_theta": 500.0}}) == path
    model, _ = load_model(path)
    ref, _ = load_model(tiny_model_dir)
    assert torch.equal(model.model.embed_tokens.weight, ref.model.embed_tokens.weight)


def test_qwen3_reranker_scores_are_the_two_token_logit_difference(tiny_model_dir, cache, hf_logits):
    (no, yes), (no_id, yes_id) = _tokens(tiny_model_dir, 2)
    path = resolve_model_path(str(tiny_model_dir), {**RERANKER, "classifier_from_token": [no, yes]})
    cfg = load_config(path)
    assert cfg.labels == ("true",) and not cfg.has_lm_head
    eng = LLMEngine(EngineConfig(**BASE), load_model(path)[0])
    for got, logits in zip(pooled_vectors(eng, PROMPTS), hf_logits):
        want = logits[yes_id] - logits[no_id]
        torch.testing.assert_close(got, want[None], atol=1e-5, rtol=1e-5)
        # sigmoid of the score = the softmax probability of "yes" between the two tokens
        p = torch.softmax(logits[[no_id, yes_id]], -1)[1]
        assert torch.sigmoid(got[0]).item() == pytest.approx(p.item(), abs=1e-6)


def test_no_post_processing_keeps_one_label_per_token_also_on_a_tp_group(tiny_model_dir, cache, hf_logits):
    names, ids = _tokens(tiny_model_dir, 3)
    overrides = {"architectures": ["LlamaForSequenceClassification"], "classifier_from_token": names}
    path = resolve_model_path(str(tiny_model_dir), overrides)
    assert load_config(path).labels == tuple(names)
    single = LLMEngine(EngineConfig(**BASE), load_model(path)[0])
    for got, logits in zip(pooled_vectors(single, PROMPTS), hf_logits):
        torch.testing.assert_close(got, logits[ids], atol=1e-5, rtol=1e-5)
    # A tp group's ranks read their shards through the derived index (the source's lm_head left out).
    eng = LLMEngine.from_config(EngineConfig(**BASE, tp=2, model=str(tiny_model_dir), hf_overrides=overrides,
                                             group_timeout_s=60))
    try:
        for got, logits in zip(pooled_vectors(eng, PROMPTS), hf_logits):
            torch.testing.assert_close(got, logits[ids], atol=1e-5, rtol=1e-5)
    finally:
        eng.close()


def test_a_sharded_checkpoint_keeps_its_index(tiny_model_dir, cache, tmp_path, hf_logits):
    """Two shards and an index: a plain override links the index; a classifier's index maps the
    shards' tensors but lm_head, and score.safetensors."""
    src = tmp_path / "sharded"
    shutil.copytree(tiny_model_dir, src)
    sd = load_file(str(src / "model.safetensors"))
    (src / "model.safetensors").unlink()
    names = sorted(sd)
    half = len(names) // 2
    save_file({k: sd[k] for k in names[:half]}, str(src / "a.safetensors"))
    save_file({k: sd[k] for k in names[half:]}, str(src / "b.safetensors"))
    (src / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {k: "a.safetensors" if i < half else "b.safetensors" for i, k in enumerate(names)}}))
    load_model(resolve_model_path(str(src), {"max_position_embeddings": 64}))
    (no, yes), (no_id, yes_id) = _tokens(tiny_model_dir, 2)
    path = resolve_model_path(str(src), {**RERANKER, "classifier_from_token": [no, yes]})
    eng = LLMEngine(EngineConfig(**BASE), load_model(path)[0])
    got = pooled_vectors(eng, PROMPTS[:1])[0]
    torch.testing.assert_close(got, (hf_logits[0][yes_id] - hf_logits[0][no_id])[None], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("overrides,match", [
    ({**RERANKER, "classifier_from_token": ["a"]}, "from_2_way_softmax takes two tokens"),
    ({**RERANKER, "classifier_from_token": ["no-such-token-xyz", "the"]}, "not a token of the vocabulary"),
    ({"architectures": ["LlamaForCausalLM"], "classifier_from_token": ["the"]}, "hf_overrides.architectures"),
    ({**RERANKER, "classifier_from_token": ["a", "b"], "method": "sum"}, "hf_overrides.method"),
])
def test_overrides_that_cannot_apply_are_refused_by_field(tiny_model_dir, cache, overrides, match):
    with pytest.raises(OverrideError, match=match):
        resolve_model_path(str(tiny_model_dir), overrides)
    assert not list(cache.glob("overrides-*"))          # nothing half-written left behind
