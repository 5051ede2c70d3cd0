"""The pooler of a checkpoint (raycluster.model.pooling): read from sentence-transformers files
(current and legacy Pooling configs, Normalize present or not) and config.json's Matryoshka
fields, with refusals naming what is unsupported; the API-side finishing (cut, then normalise)
and the chunk-by-chunk pooling state (a chunk at position 0 starts over)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from raycluster.model.config import ModelConfigError
from raycluster.model.loader import load_config
from raycluster.model.pooling import (PoolerConfig, PoolerConfigError, check_dimensions, finish_vector,
                                      pool_chunk, pooled, read_pooler_config)

def test_without_sentence_transformers_files_a_decoder_pools_its_last_token_normalised(tmp_path):
    assert read_pooler_config(str(tmp_path), {}) == PoolerConfig("last", True, False, None, "default")
    assert read_pooler_config(None, {"is_matryoshka": True}).matryoshka
    cfg = read_pooler_config(None, {"matryoshka_dimensions": [64, 16, 64]})
    assert cfg.matryoshka and cfg.matryoshka_dimensions == (16, 64)


@pytest.mark.parametrize("pooling,normalize,want", [
    ({"embedding_dimension": 64, "pooling_mode": "mean", "include_prompt": True}, True, ("mean", True)),
    ({"pooling_mode": ["cls"]}, False, ("cls", False)),
    ({"pooling_mode_lasttoken": True, "pooling_mode_mean_tokens": False}, True, ("last", True)),
    ({"pooling_mode_cls_token": True}, False, ("cls", False)),
    ({"word_embedding_dimension": 64}, False, ("mean", False)),       # sentence-transformers' default mode
    ({"pooling_mode": "max"}, True, ("max", True)),
    ({"pooling_mode_max_tokens": True}, True, ("max", True)),
    ({"pooling_mode": "weightedmean"}, False, ("weighted_mean", False)),
    ({"pooling_mode_mean_sqrt_len_tokens": True}, True, ("mean_sqrt", True)),
])
def test_sentence_transformers_pooling_and_normalize_modules(write_st_layout, tmp_path, pooling, normalize, want):
    write_st_layout(tmp_path, pooling, normalize)
    cfg = read_pooler_config(str(tmp_path), {})
    assert (cfg.pooling_type, cfg.normalize, cfg.source) == (*want, "sentence-transformers")
    assert cfg.needs_every_position == (want[0] != "last")


@pytest.mark.parametrize("pooling,extra,match", [
    ({"pooling_mode": "median"}, (), "pooling mode 'median' is not supported"),
    ({"pooling_mode": ["mean", "cls"]}, (), r"pooling mode \('mean', 'cls'\)|pooling mode \['mean', 'cls'\]"),
    ({"pooling_mode_mean_tokens": True, "pooling_mode_max_tokens": True}, (), "is not supported"),
    ({"pooling_mode": "mean", "include_prompt": False}, (), "include_prompt false"),
    ({"pooling_mode": "mean"}, ({"idx": 1, "name": "3", "path": "3_LayerNorm",
                                 "type": "sentence_transformers.models.LayerNorm"},), "'3_LayerNorm' .* is not supported"),
])
def test_what_cannot_be_reproduced_is_refused_by_name(write_st_layout, tmp_path, pooling, extra, match):
    write_st_layout(tmp_path, pooling, True, extra)
    with pytest.raises(PoolerConfigError, match=match):
        read_pooler_config(str(tmp_path), {})


def test_a_checkpoint_directory_carries_its_pooler_into_the_model_config(write_st_layout, tiny_model_dir, tmp_path):
    root = tmp_path / "st"
    shutil.copytree(tiny_model_dir, root)
    write_st_layout(root, {"pooling_mode": "mean"}, False)
    cfg = json.loads((root / "config.json").read_text())
    (root / "config.json").write_text(json.dumps({**cfg, "matryoshka_dimensions": [16, 32]}))
    pooler = load_config(root).pooler
    assert pooler == PoolerConfig("mean", False, True, (16, 32), "sentence-transformers")
    (root / "config.json").write_text(json.dumps({**cfg, "matryoshka_dimensions": [0]}))
    with pytest.raises(ModelConfigError, match="matryoshka_dimensions"):
        load_config(root)
    (root / "config.json").write_text(json.dumps(cfg))
    (root / "modules.json").write_text("[{")
    with pytest.raises(ModelConfigError, match="modules.json: invalid JSON"):
        load_config(root)


def test_dimensions_are_checked_against_the_matryoshka_sizes():
    plain, any_size, listed = PoolerConfig(), PoolerConfig(matryoshka=True), \
        PoolerConfig(matryoshka=True, matryoshka_dimensions=(16, 32))
    assert check_dimensions(plain, None, 64) is None and check_dimensions(plain, 64, 64) is None
    assert "not trained for shorter" in check_dimensions(plain, 16, 64)
    assert check_dimensions(any_size, 7, 64) is None
    assert "at most this model's 64" in check_dimensions(any_size, 65, 64)
    assert check_dimensions(listed, 32, 64) is None
    assert "[16, 32]" in check_dimensions(listed, 8, 64)


def test_finishing_cuts_first_then_normalises():
    raw = [3.0, 4.0, 12.0]
    assert finish_vector(raw, None, False) == raw
    assert finish_vector(raw, None, True) == pytest.approx([3 / 13, 4 / 13, 12 / 13])
    assert finish_vector(raw, 2, True) == pytest.approx([0.6, 0.8])
    assert finish_vector(raw, 2, False) == [3.0, 4.0]


def test_pooling_state_across_chunks_and_a_restart_at_position_zero():
    h = torch.randn(6, 4, generator=torch.Generator().manual_seed(0))
    w = torch.arange(1, 7, dtype=torch.float32)
    for kind, want in (("mean", h.mean(0)), ("cls", h[0]), ("last", h[-1]), ("max", h.max(0).values),
                       ("mean_sqrt", h.sum(0) / 6 ** 0.5), ("weighted_mean", (w[:, None] * h).sum(0) / w.sum()),
                       ("all", h)):
        state = pool_chunk(None, kind, h[:2], 0)
        state = pool_chunk(state, kind, h[2:5], 2)
        # A preempted request recomputes from position 0: what it held before is dropped.
        state = pool_chunk(pool_chunk(state, kind, h[5:], 5), kind, h[:4], 0)
        state = pool_chunk(state, kind, h[4:], 4)
        torch.testing.assert_close(pooled(state, kind, 6), want, atol=1e-6, rtol=1e-6, msg=kind)


def test_sentence_transformers_dense_modules_are_read_in_order(st_dense_dir):
    from raycluster.model.pooling import DenseSpec
    pooler = load_config(st_dense_dir).pooler
    assert pooler.dense == (DenseSpec("2_Dense", 256, 64, True, "tanh", False),
                            DenseSpec("3_Dense", 64, 64, False, "identity", True))
    assert (pooler.pooling_type, pooler.normalize, pooler.output_size(256)) == ("mean", True, 64)


def test_the_projector_is_the_dense_formula(st_dense_dir):
    from raycluster.model.projector import load_projector
    proj = load_projector(str(st_dense_dir), load_config(st_dense_dir).pooler)
    (_, w1, b1, _), (_, w2, _, _) = proj.layers
    x = torch.randn(256)
    h = torch.tanh(w1 @ x + b1)
    torch.testing.assert_close(proj(x), w2 @ h + h)


DENSE = {"idx": 2, "name": "2", "path": "2_Dense", "type": "sentence_transformers.models.Dense"}


@pytest.mark.parametrize("modules,dense_cfg,match", [
    ([DENSE], {"in_features": 256, "out_features": 8, "activation_function": "torch.nn.modules.activation.ELU"},
     "activation_function 'torch.nn.modules.activation.ELU' is not supported"),
    ([DENSE], {"in_features": 256}, "in_features and out_features must be ints"),
    ([DENSE, {**DENSE, "idx": 3, "path": "3_Dense"}], {"in_features": 256, "out_features": 8},
     "'3_Dense' takes 256 features, '2_Dense' gives 8"),
    ([{**DENSE, "idx": 0}], {"in_features": 256, "out_features": 8}, "before the Pooling one"),
])
def test_dense_modules_that_cannot_run_are_refused(write_st_layout, tmp_path, modules, dense_cfg, match):
    write_st_layout(tmp_path, {"pooling_mode": "mean"}, False, modules)
    for m in modules:
        (tmp_path / m["path"]).mkdir(exist_ok=True)
        (tmp_path / m["path"] / "config.json").write_text(json.dumps(dense_cfg))
    with pytest.raises(PoolerConfigError, match=match):
        read_pooler_config(str(tmp_path), {})


def test_a_dense_module_after_normalize_is_refused(write_st_layout, tmp_path):
    write_st_layout(tmp_path, {"pooling_mode": "mean"}, True, [{**DENSE, "idx": 3}])
    with pytest.raises(PoolerConfigError, match="after a Normalize module"):
        read_pooler_config(str(tmp_path), {})


def test_dense_weights_that_do_not_fit_are_a_checkpoint_error(st_dense_dir, tmp_path):
    from safetensors.torch import save_file

    from raycluster.model.loader import CheckpointError, load_model
    root = tmp_path / "bad"
    shutil.copytree(st_dense_dir, root)
    save_file({"linear.weight": torch.zeros(64, 128), "linear.bias": torch.zeros(64)},
              str(root / "2_Dense" / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"'2_Dense': linear.weight is \(64, 128\), its config says \(64, 256\)"):
        load_model(root)
    (root / "2_Dense" / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="only safetensors weights"):
        load_model(root)


def test_sentence_bert_config_caps_the_context_and_lowercases(write_st_layout, tiny_model_dir, tmp_path):
    """sentence_bert_config.json's max_seq_length caps the served context and do_lower_case
    lowercases texts first: the ids sentence-transformers reads (vLLM reads both too)."""
    from raycluster.model.tokenizer import Tokenizer
    root = tmp_path / "st"
    shutil.copytree(tiny_model_dir, root)
    write_st_layout(root, {"pooling_mode": "mean", "embedding_dimension": 256}, False)
    (root / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 12, "do_lower_case": True}))
    text = "Hello World THE river runs to the sea"
    assert load_config(root).max_model_len == 12
    tok = Tokenizer(root)
    assert tok.encode(text) == tok.encode(text.lower()) != Tokenizer(tiny_model_dir).encode(text)
    st = pytest.importorskip("sentence_transformers")
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref = st.SentenceTransformer(str(root), device="cpu")
    assert ref.max_seq_length == 12
    assert ref.tokenize([text])["input_ids"][0].tolist() == tok.encode(text)[:12]
    (root / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 0}))
    with pytest.raises(ModelConfigError, match="max_seq_length"):
        load_config(root)
