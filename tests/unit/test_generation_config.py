"""generation_config.json as vLLM reads it: more EOS ids for the model (merged into
ModelConfig.eos_token_id), and default sampling parameters for the request fields a client left
out (`to_sampling(defaults=...)`), `max_new_tokens` as the default `max_tokens`."""

import json
import shutil

import pytest

from raycluster.model.config import ModelConfig
from raycluster.model.generation_config import GenerationDefaults, load_generation_config
from raycluster.server.protocol import ChatCompletionRequest, CompletionRequest


def test_only_the_keys_in_the_file_count(tmp_path):
    assert load_generation_config(tmp_path) == GenerationDefaults()
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"do_sample": True, "eos_token_id": [7, 9], "temperature": 0.7, "top_p": 0.8, "top_k": 20,
         "repetition_penalty": 1.05, "max_new_tokens": 64, "bos_token_id": 0, "top_a": 3}))
    got = load_generation_config(tmp_path)
    assert got.eos_token_ids == (7, 9)
    assert got.sampling == {"temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05,
                            "max_tokens": 64}
    (tmp_path / "generation_config.json").write_text('{"eos_token_id": 5}')
    assert load_generation_config(tmp_path) == GenerationDefaults((5,), {})
    (tmp_path / "generation_config.json").write_text("{not json")
    with pytest.raises(ValueError, match="generation_config.json"):
        load_generation_config(tmp_path)


def test_the_models_eos_ids_include_the_generation_configs(tiny_model_dir, tmp_path):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(tiny_model_dir, ckpt)
    base = ModelConfig.from_pretrained(ckpt).eos_token_id
    (ckpt / "generation_config.json").write_text(json.dumps({"eos_token_id": [base[0], 42, 42]}))
    assert ModelConfig.from_pretrained(ckpt).eos_token_id == base + (42,)


def test_defaults_fill_only_the_fields_a_request_left_out():
    defaults = {"temperature": 0.7, "top_k": 20, "top_p": 0.8, "repetition_penalty": 1.05, "max_tokens": 64}
    sp = CompletionRequest(prompt="x").to_sampling(defaults=defaults)
    assert (sp.temperature, sp.top_k, sp.top_p, sp.repetition_penalty, sp.min_p) == (0.7, 20, 0.8, 1.05, 0.0)
    # Set explicitly, even to the API's own default value: the request's value stands.
    sp = ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], temperature=1.0, top_k=0) \
        .to_sampling(defaults=defaults)
    assert (sp.temperature, sp.top_k, sp.top_p) == (1.0, 0, 0.8)
    sp = CompletionRequest(prompt="x").to_sampling()
    assert (sp.temperature, sp.top_k, sp.top_p, sp.repetition_penalty) == (1.0, 0, 1.0, 1.0)
