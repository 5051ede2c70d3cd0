"""Shared fixtures: the tiny checkpoint, written once per session. gloo binds loopback in every
test (tests never leave the machine), here and in every process a test starts."""

import importlib.util
import json
import os
import sys

import pytest

# Make the repo's top-level packages (raycluster, kernels) importable under plain `pytest` too.
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)
os.environ["GLOO_SOCKET_IFNAME"] = "lo"


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    from raycluster.model.tiny import write_tiny_model

    return write_tiny_model(tmp_path_factory.mktemp("tiny_model"), seed=0)


@pytest.fixture(scope="session")
def loaded(tiny_model_dir):
    """(model, tokenizer) of the tiny checkpoint, loaded once for the modules that only read them."""
    from raycluster.model.loader import load_model
    from raycluster.model.tokenizer import Tokenizer

    model, mcfg = load_model(tiny_model_dir)
    return model, Tokenizer(tiny_model_dir, mcfg.eos_token_id)


@pytest.fixture(scope="session")
def merged_lora(tiny_model_dir):
    """merged_lora(adapter_dir): the tiny model with that LoRA adapter added into its weights
    (W + scaling * B A, the plain formula): what a request served on the adapter must match."""
    import torch

    from raycluster.model.loader import load_model
    from raycluster.model.lora import TARGETS, load_adapter

    def merge(adapter_dir):
        model, cfg = load_model(tiny_model_dir)
        for (layer, module), (a, b) in load_adapter(adapter_dir, cfg, "ref").weights.items():
            with torch.no_grad():
                getattr(getattr(model.model.layers[layer], TARGETS[module]), module).weight += b @ a
        return model
    return merge


@pytest.fixture(scope="session")
def eagle_heads(tiny_model_dir, loaded, tmp_path_factory):
    """EAGLE heads for the tiny checkpoint, name -> directory: "random" / "trained" (EAGLE-1) and
    "random3" / "trained3" (EAGLE-3). The random EAGLE-3 head has a 1024-token draft vocabulary
    (d2t onto a random subset of the target's), its own embedding and aux layers 0, 1, 3 in its
    config; the trained ones learnt the tiny model's greedy output for 60 steps (seconds)."""
    import json
    import random

    import torch

    from raycluster.model.config import ModelConfig
    from raycluster.model.eagle import EagleHead, save_eagle_head
    from raycluster.model.eagle3 import Eagle3Head
    from raycluster.model.eagle_train import head_config_dict, train_eagle_head

    root = tmp_path_factory.mktemp("eagle")
    model = loaded[0]
    layers, draft_vocab = model.config.num_hidden_layers, 1024
    with open(f"{tiny_model_dir}/config.json") as f:
        target_cfg = json.load(f)
    torch.manual_seed(3)
    cfg = head_config_dict(target_cfg)
    rand = EagleHead(ModelConfig.from_dict(cfg), model, layers, fc_bias=True)
    for p in rand.parameters():
        torch.nn.init.normal_(p, std=0.05)
    save_eagle_head(rand, cfg, root / "random")
    cfg3 = {**head_config_dict(target_cfg, "eagle3"), "draft_vocab_size": draft_vocab,
            "eagle_aux_hidden_state_layer_ids": [0, 1, 3]}
    rand3 = Eagle3Head(ModelConfig.from_dict({**cfg3, "architectures": ["LlamaForCausalLM"]}), model, layers,
                       (0, 1, 3), draft_vocab, own_embedding=True)
    for p in rand3.parameters():
        torch.nn.init.normal_(p, std=0.05)
    kept = sorted(random.Random(4).sample(range(6, model.config.vocab_size), draft_vocab))
    rand3.d2t.copy_(torch.tensor(kept) - torch.arange(draft_vocab))
    save_eagle_head(rand3, cfg3, root / "random3")
    for name, method in (("trained", "eagle"), ("trained3", "eagle3")):
        train_eagle_head(tiny_model_dir, str(root / name), steps=60, num_sequences=32, gen_tokens=64,
                         batch_size=8, method=method)
    return {name: str(root / name) for name in ("random", "trained", "random3", "trained3")}


ST_TRANSFORMER = {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"}


def _write_st_layout(root, pooling: dict, normalize: bool, extra_modules=()) -> None:
    """A sentence-transformers layout beside a checkpoint: modules.json, the Pooling module's
    config, and a Normalize module if asked."""
    modules = [ST_TRANSFORMER, {"idx": 1, "name": "1", "path": "1_Pooling",
                                "type": "sentence_transformers.models.Pooling"}]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
        (root / "2_Normalize").mkdir(exist_ok=True)
    modules.extend(extra_modules)
    (root / "modules.json").write_text(json.dumps(modules))
    (root / "1_Pooling").mkdir(exist_ok=True)
    (root / "1_Pooling" / "config.json").write_text(json.dumps(pooling))


@pytest.fixture(scope="session")
def write_st_layout():
    """`write(root, pooling config dict, normalize, extra modules=())`: a sentence-transformers
    layout beside the checkpoint in `root`."""
    return _write_st_layout


def _write_classifier(src, dst, labels: list[str], seed: int = 0):
    """The checkpoint at `src` as a LlamaForSequenceClassification with these labels: its output
    head replaced by a random `score` head [labels, H] (scaled so the logits spread)."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file
    shutil.copytree(src, dst)
    sd = load_file(str(dst / "model.safetensors"))
    del sd["lm_head.weight"]
    hidden = sd["model.norm.weight"].shape[0]
    sd["score.weight"] = torch.randn(len(labels), hidden, generator=torch.Generator().manual_seed(seed)) * 0.2
    save_file(sd, str(dst / "model.safetensors"))
    cfg = json.loads((dst / "config.json").read_text())
    cfg.update(architectures=["LlamaForSequenceClassification"], id2label=dict(enumerate(labels)),
               label2id={name: i for i, name in enumerate(labels)})
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


@pytest.fixture(scope="session")
def classifiers(tiny_model_dir, tmp_path_factory):
    """{"sentiment": a 3-label classifier, "reranker": a one-label one (a cross-encoder)} on the
    tiny checkpoint's decoder."""
    root = tmp_path_factory.mktemp("classifiers")
    return {"sentiment": _write_classifier(tiny_model_dir, root / "sentiment", ["negative", "neutral", "positive"]),
            "reranker": _write_classifier(tiny_model_dir, root / "reranker", ["relevant"], seed=1)}


@pytest.fixture(scope="session")
def st_dense_dir(tiny_model_dir, tmp_path_factory, write_st_layout):
    """sentence-transformers' own save of an embedding model on the tiny decoder: mean pooling,
    Dense 256 -> 64 (tanh), Dense 64 -> 64 (no bias, identity, residual), Normalize. Saved as
    sentence-transformers writes it: a LlamaModel (tensors without "model.", no lm_head)."""
    import shutil
    import warnings

    import torch
    st = pytest.importorskip("sentence_transformers")
    root = tmp_path_factory.mktemp("st-dense")
    shutil.copytree(tiny_model_dir, root / "src")
    write_st_layout(root / "src", {"embedding_dimension": 256, "pooling_mode": "mean"}, False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from sentence_transformers import models
        base = st.SentenceTransformer(str(root / "src"), device="cpu")
        torch.manual_seed(0)
        model = st.SentenceTransformer(device="cpu", modules=[
            base[0], base[1], models.Dense(256, 64, activation_function=torch.nn.Tanh()),
            models.Dense(64, 64, bias=False, activation_function=torch.nn.Identity(), use_residual=True),
            models.Normalize()])
        model.save(str(root / "st"))
    return root / "st"


@pytest.fixture(scope="session")
def encoders(tmp_path_factory):
    """Tiny BERT-style checkpoints (tests/encoder_checkpoints.py), written by transformers: "bert"
    (BertModel), "bert-st" (it through sentence-transformers: mean pooling, Normalize),
    "bert-ce" (a one-label BertForSequenceClassification: a cross-encoder), "bert-3" (three
    labels), "xlmr" (XLMRobertaModel), "xlmr-ce" (a one-label XLM-RoBERTa classifier), "bert-ner"
    (a three-label BertForTokenClassification), "modernbert" (ModernBertModel) and "modernbert-ce" (a
    one-label ModernBERT classifier pooling the mean)."""
    pytest.importorskip("transformers")
    from encoder_checkpoints import write_encoder, write_st_encoder

    root = tmp_path_factory.mktemp("encoders")
    out = {"bert": write_encoder(root / "bert", "BertModel"),
           "bert-ce": write_encoder(root / "bert-ce", "BertForSequenceClassification", ["relevant"], seed=1),
           "bert-3": write_encoder(root / "bert-3", "BertForSequenceClassification", ["neg", "neutral", "pos"], seed=2),
           "xlmr": write_encoder(root / "xlmr", "XLMRobertaModel", seed=3),
           "xlmr-ce": write_encoder(root / "xlmr-ce", "XLMRobertaForSequenceClassification", ["relevant"], seed=4),
           "bert-ner": write_encoder(root / "bert-ner", "BertForTokenClassification", ["O", "B-LOC", "I-LOC"], seed=5),
           "modernbert": write_encoder(root / "modernbert", "ModernBertModel", seed=6),
           "modernbert-ce": write_encoder(root / "modernbert-ce", "ModernBertForSequenceClassification", ["relevant"],
                                          seed=7)}
    if importlib.util.find_spec("sentence_transformers") is not None:
        out["bert-st"] = write_st_encoder(out["bert"], root / "bert-st")
    return out
