"""Sequence classifiers (*ForSequenceClassification checkpoints): the config's labels, the
`score` head read beside the decoder (no output head), and the engine's pooling requests giving
the head's logits over the last token's final hidden state, equal to transformers'
LlamaForSequenceClassification on the same files; chunked, batched with each other, and on TP /
KVP groups (whose leader reads the head from the checkpoint)."""

from __future__ import annotations

import json

import pytest
import torch
from engine_arrivals import pooled_vectors

from raycluster.engine.config import EngineConfig
from raycluster.engine.engine import InvalidRequestError, LLMEngine
from raycluster.model.config import ModelConfig, ModelConfigError
from raycluster.model.loader import load_config, load_model
from raycluster.request import SamplingParams

BASE = dict(policy="fcfs", packer="token", predictor="none", kv_cache_tokens=4096, num_threads=1, chunk_size=16)
PROMPTS = [[5, 9, 300, 41, 7] * k for k in (1, 4, 9)] + [[0, 17, 18]]


@pytest.fixture(scope="module")
def reference(classifiers):
    """transformers' logits for each prompt alone, per classifier."""
    transformers = pytest.importorskip("transformers")
    out = {}
    for name, path in classifiers.items():
        hf = transformers.AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.float32,
                                                                            attn_implementation="eager")
        with torch.no_grad():
            out[name] = [hf(torch.tensor([p])).logits[0] for p in PROMPTS]
    return out


def test_the_config_names_the_labels(classifiers):
    cfg = load_config(classifiers["sentiment"])
    assert cfg.labels == ("negative", "neutral", "positive") and not cfg.has_lm_head
    assert cfg.architecture == "LlamaForCausalLM"
    raw = json.loads((classifiers["sentiment"] / "config.json").read_text())
    bare = {k: v for k, v in raw.items() if k not in ("id2label", "label2id")}
    assert ModelConfig.from_dict(bare).labels == ("LABEL_0", "LABEL_1")          # transformers' default
    assert ModelConfig.from_dict({**bare, "num_labels": 1}).labels == ("LABEL_0",)
    with pytest.raises(ModelConfigError, match="id2label"):
        ModelConfig.from_dict({**raw, "id2label": {"0": "a", "2": "c"}})


@pytest.mark.parametrize("name", ["sentiment", "reranker"])
def test_logits_equal_transformers(classifiers, reference, name):
    model, _ = load_model(classifiers[name])
    assert model.lm_head is None and model.score is not None
    eng = LLMEngine(EngineConfig(**BASE), model)
    for got, want in zip(pooled_vectors(eng, PROMPTS), reference[name]):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    with pytest.raises(InvalidRequestError, match="no output head") as e:
        eng.add_request("g", PROMPTS[0], SamplingParams(max_tokens=2))
    assert e.value.field == "model"


@pytest.mark.parametrize("group", [{"tp": 2}, {"kvp": 2}], ids=["tp2", "kvp2"])
def test_a_group_leader_applies_the_head_read_from_the_checkpoint(classifiers, reference, group):
    eng = LLMEngine.from_config(EngineConfig(**BASE, **group, model=str(classifiers["sentiment"]), group_timeout_s=60))
    try:
        assert eng.classifier is not None and eng.classifier.shape == (3, 256)
        for got, want in zip(pooled_vectors(eng, PROMPTS), reference["sentiment"]):
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    finally:
        eng.close()


def test_token_level_scores_are_the_head_on_every_position(classifiers):
    """`pool_tokens` on a decoder classifier (vLLM's token_classify: a reward model's per-token
    scores): the score head on each prompt position's final hidden state, chunked (16 tokens)."""
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoModelForSequenceClassification.from_pretrained(classifiers["sentiment"], dtype=torch.float32,
                                                                        attn_implementation="eager")
    eng = LLMEngine(EngineConfig(**BASE), load_model(classifiers["sentiment"])[0])
    reqs = [eng.add_request(f"t{i}", p, SamplingParams(max_tokens=1, embed=True, pool_tokens=True))
            for i, p in enumerate(PROMPTS)]
    for _ in range(100):
        if not eng.has_unfinished():
            break
        eng.step()
    for r, p in zip(reqs, PROMPTS):
        with torch.no_grad():
            want = hf.score(hf.model(torch.tensor([p])).last_hidden_state[0])
        torch.testing.assert_close(torch.tensor(r.embedding), want, atol=1e-5, rtol=1e-5)
