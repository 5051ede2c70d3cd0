"""Config and checkpoint errors name what is wrong; sharded checkpoints load like single ones."""

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from raycluster.model import CheckpointError, ModelConfig, ModelConfigError, load_model
from raycluster.model.tiny import tiny_config


def _copy(src, dst):
    shutil.copytree(src, dst)
    return str(dst)


def _edit_config(path, **changes):
    p = os.path.join(path, "config.json")
    with open(p) as f:
        d = json.load(f)
    for k, v in changes.items():
        if v is None:
            d.pop(k, None)
        else:
            d[k] = v
    with open(p, "w") as f:
        json.dump(d, f)


def test_unknown_architecture():
    with pytest.raises(ModelConfigError, match=r"architectures.*GPT2LMHeadModel"):
        ModelConfig.from_dict(tiny_config(architectures=["GPT2LMHeadModel"]))


@pytest.mark.parametrize("field", ["hidden_size", "num_hidden_layers", "vocab_size", "intermediate_size"])
def test_missing_field(field):
    with pytest.raises(ModelConfigError, match=field):
        ModelConfig.from_dict(tiny_config(**{field: None}))


@pytest.mark.parametrize("rope_type", ["dynamic", "mrope"])
def test_unsupported_rope_type(rope_type):
    cfg = tiny_config(rope_parameters={"rope_type": rope_type, "rope_theta": 1e4, "factor": 2.0})
    with pytest.raises(ModelConfigError, match=r"rope_scaling\.rope_type.*" + rope_type):
        ModelConfig.from_dict(cfg)
    # Old-style top-level rope_scaling with "type".
    old = tiny_config(rope_parameters=None, rope_theta=1e4, rope_scaling={"type": rope_type, "factor": 2.0})
    with pytest.raises(ModelConfigError, match="rope_type"):
        ModelConfig.from_dict(old)


def test_old_style_rope_and_dtype_fields():
    c = ModelConfig.from_dict(tiny_config(
        rope_parameters=None, rope_theta=1234.0, dtype=None, torch_dtype="bfloat16", eos_token_id=[1, 5],
        rope_scaling={"type": "linear", "factor": 2.0}))
    assert c.rope_theta == 1234.0 and c.rope_scaling["rope_type"] == "linear"
    assert c.dtype == "bfloat16" and c.eos_token_id == (1, 5)


def test_defaults_and_sliding_window_layers():
    c = ModelConfig.from_dict(tiny_config(num_key_value_heads=None, head_dim=None))
    assert c.num_key_value_heads == 8 and c.head_dim == 32 and c.max_model_len == 32768
    assert c.sliding_layers == () and c.window_of(0) is None
    # Mistral: every layer slides; the context is no longer capped at the window.
    m = ModelConfig.from_dict(tiny_config(architectures=["MistralForCausalLM"], sliding_window=4096))
    assert m.sliding_window == 4096 and m.sliding_layers == (0, 1, 2, 3) and m.max_model_len == 32768
    assert ModelConfig.from_dict(tiny_config(architectures=["MistralForCausalLM"], sliding_window=None)).sliding_layers == ()
    # Qwen2: only with use_sliding_window, on layers >= max_window_layers or as layer_types says.
    q = ModelConfig.from_dict(tiny_config(architectures=["Qwen2ForCausalLM"], sliding_window=4096))
    assert q.sliding_layers == () and q.window_of(3) is None and q.qkv_bias and not q.o_bias
    q2 = ModelConfig.from_dict(tiny_config(architectures=["Qwen2ForCausalLM"], sliding_window=4096,
                                           use_sliding_window=True, max_window_layers=2))
    assert q2.sliding_layers == (2, 3) and q2.window_of(1) is None and q2.window_of(2) == 4096
    q3 = ModelConfig.from_dict(tiny_config(architectures=["Qwen3ForCausalLM"], sliding_window=64, use_sliding_window=True,
                                           layer_types=["sliding_attention", "full_attention"] * 2))
    assert q3.sliding_layers == (0, 2)
    # Llama never slides, whatever the file says.
    assert ModelConfig.from_dict(tiny_config(sliding_window=128)).sliding_layers == ()
    with pytest.raises(ModelConfigError, match="'sliding_window'"):
        ModelConfig.from_dict(tiny_config(architectures=["MistralForCausalLM"], sliding_window=-3))
    with pytest.raises(ModelConfigError, match="'layer_types'"):
        ModelConfig.from_dict(tiny_config(architectures=["Qwen2ForCausalLM"], sliding_window=64, use_sliding_window=True,
                                          layer_types=["sliding_attention"]))


def test_missing_config(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_model(tmp_path)


def test_truncated_safetensors(tmp_path, tiny_model_dir):
    d = _copy(tiny_model_dir, tmp_path / "m")
    f = os.path.join(d, "model.safetensors")
    size = os.path.getsize(f)
    with open(f, "r+b") as fh:
        fh.truncate(size // 2)
    with pytest.raises(CheckpointError, match="model.safetensors"):
        load_model(d)
    with open(f, "wb") as fh:
        fh.write(b"\x00garbage")
    with pytest.raises(CheckpointError, match="model.safetensors"):
        load_model(d)


def test_shape_mismatch_and_missing_and_unexpected(tmp_path, tiny_model_dir):
    d = _copy(tiny_model_dir, tmp_path / "m")
    f = os.path.join(d, "model.safetensors")
    sd = load_file(f)
    bad = dict(sd)
    bad["model.layers.1.mlp.up_proj.weight"] = torch.zeros(3, 256)
    save_file(bad, f)
    with pytest.raises(CheckpointError, match=r"model\.layers\.1\.mlp\.up_proj\.weight"):
        load_model(d)
    bad = dict(sd)
    del bad["model.norm.weight"]
    save_file(bad, f)
    with pytest.raises(CheckpointError, match=r"missing.*model\.norm\.weight"):
        load_model(d)
    bad = dict(sd)
    bad["model.layers.0.extra.weight"] = torch.zeros(2)
    bad["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.zeros(16)  # tolerated
    save_file(bad, f)
    with pytest.raises(CheckpointError, match=r"unexpected.*extra\.weight"):
        load_model(d)
    del bad["model.layers.0.extra.weight"]
    save_file(bad, f)
    load_model(d)


def test_sharded_checkpoint_loads_equal(tmp_path, tiny_model_dir):
    d = _copy(tiny_model_dir, tmp_path / "m")
    sd = load_file(os.path.join(d, "model.safetensors"))
    os.remove(os.path.join(d, "model.safetensors"))
    names = sorted(sd)
    shards = {"model-00001-of-00002.safetensors": names[: len(names) // 2],
              "model-00002-of-00002.safetensors": names[len(names) // 2:]}
    weight_map = {}
    for fn, keys in shards.items():
        save_file({k: sd[k] for k in keys}, os.path.join(d, fn))
        weight_map.update({k: fn for k in keys})
    with open(os.path.join(d, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    sharded, _ = load_model(d)
    single, _ = load_model(tiny_model_dir)
    s1, s2 = sharded.state_dict(), single.state_dict()
    assert s1.keys() == s2.keys()
    assert all(torch.equal(s1[k], s2[k]) for k in s1)
    # A shard listed in the index but missing on disk is named.
    os.remove(os.path.join(d, "model-00002-of-00002.safetensors"))
    with pytest.raises(CheckpointError, match="model-00002-of-00002"):
        load_model(d)


def test_tied_checkpoint_with_lm_head_copy_loads(tmp_path):
    from raycluster.model import write_tiny_model
    d = write_tiny_model(tmp_path / "t", seed=2, tie_word_embeddings=True, num_hidden_layers=1)
    f = os.path.join(d, "model.safetensors")
    sd = load_file(f)
    assert "lm_head.weight" not in sd
    model, cfg = load_model(d)
    assert model.lm_head is None and cfg.tie_word_embeddings
    sd["lm_head.weight"] = sd["model.embed_tokens.weight"].clone()
    save_file(sd, f)
    load_model(d)


def test_load_bf16(tiny_model_dir):
    model, _ = load_model(tiny_model_dir, dtype=torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
