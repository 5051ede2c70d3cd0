"""BERT-style encoders (BERT, XLM-RoBERTa) on one engine, against transformers' own models of the
same checkpoints: config reading, the final hidden states of prompts batched side by side in one
step, pooled CLS / MEAN, classifier logits with a sentence pair's token types, whole-prompt
scheduling with no KV cache, and what an encoder refuses."""

from __future__ import annotations

import json
import shutil
import warnings

import pytest
import torch

from raycluster.engine.config import EngineConfig
from raycluster.engine.engine import InvalidRequestError, LLMEngine
from raycluster.engine.profiler import make_run_batch
from raycluster.model.config import ModelConfig, ModelConfigError, model_summary
from raycluster.model.loader import load_model
from raycluster.model.tokenizer import Tokenizer
from raycluster.request import SamplingParams

transformers = pytest.importorskip("transformers")

TEXTS = ["paris is the capital of france", "a cat", "the quick brown fox jumps over the lazy dog again and again",
         "rivers"]


def _engine(path, **kw) -> tuple[LLMEngine, Tokenizer]:
    model, mcfg = load_model(path)
    cfg = EngineConfig(kv_cache_tokens=4096, policy="fcfs", predictor="none", **kw)
    return LLMEngine(cfg, model, Tokenizer(path, mcfg.eos_token_id)), Tokenizer(path)


def _pool(eng: LLMEngine, prompts: list[list[int]], starts: list[int] | None = None, max_steps: int = 20):
    """Each prompt's pooled vector (or a classifier's logits), all submitted before the first step;
    also the number of steps taken."""
    for i, ids in enumerate(prompts):
        eng.add_request(f"r{i}", ids, SamplingParams(embed=True, pair_start=(starts or [0] * len(prompts))[i]))
    out, steps = {}, 0
    while eng.has_unfinished() and steps < max_steps:
        for o in eng.step().outputs:
            if o.finished:
                out[o.request_id] = torch.tensor(o.embedding)
        steps += 1
    assert not eng.has_unfinished()
    return [out[f"r{i}"] for i in range(len(prompts))], steps


def _hf(path, cls="AutoModel"):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return getattr(transformers, cls).from_pretrained(str(path), dtype=torch.float32).eval()


def test_config_reads_bert_and_roberta(encoders):
    bert = ModelConfig.from_pretrained(encoders["bert"])
    assert bert.is_encoder and bert.encoder.family == "bert" and bert.encoder.type_vocab_size == 2
    assert (bert.max_model_len, bert.num_kv_layers, bert.has_lm_head, bert.labels) == (64, 0, False, ())
    assert bert.pooler.pooling_type == "cls" and bert.pooler.normalize      # vLLM's default for encoders
    xlmr = ModelConfig.from_pretrained(encoders["xlmr-ce"])
    # RoBERTa numbers positions from pad + 1: 66 position embeddings serve 64 tokens.
    assert (xlmr.encoder.position_offset, xlmr.max_model_len, xlmr.labels) == (2, 64, ("relevant",))
    assert model_summary(xlmr)["tasks"] == ["classify"] and model_summary(bert)["tasks"] == ["embed"]
    st = ModelConfig.from_pretrained(encoders["bert-st"]) if "bert-st" in encoders else None
    if st is not None:
        assert (st.pooler.pooling_type, st.pooler.source) == ("mean", "sentence-transformers")
    raw = json.loads((encoders["bert"] / "config.json").read_text())
    for change, field in (({"position_embedding_type": "relative_key"}, "position_embedding_type"),
                          ({"hidden_act": "mish"}, "hidden_act"), ({"num_attention_heads": 5}, "num_attention_heads"),
                          ({"quantization_config": {"quant_method": "fp8"}}, "quantization_config")):
        with pytest.raises(ModelConfigError, match=field):
            ModelConfig.from_dict({**raw, **change})
    with pytest.raises(ModelConfigError, match="pad_token_id"):
        ModelConfig.from_dict({**raw, "architectures": ["XLMRobertaModel"], "pad_token_id": None})


@pytest.mark.parametrize("name", ["bert", "xlmr", "modernbert"])
def test_batched_prompts_pool_transformers_hidden_states(encoders, name):
    """Four prompts of 3-14 tokens run in one step (one padded attention call); each prompt's
    [CLS] row and mean equal transformers' last hidden state of that prompt alone."""
    hf = _hf(encoders[name])
    for pooling in ("cls", "mean"):
        eng, tok = _engine(encoders[name], pooling_type=pooling)
        prompts = [tok.encode(t) for t in TEXTS]
        vecs, steps = _pool(eng, prompts)
        assert steps == 1 and eng.kv.num_free_blocks == eng.kv.num_blocks
        for ids, v in zip(prompts, vecs):
            with torch.no_grad():
                h = hf(torch.tensor([ids])).last_hidden_state[0]
            ref = h[0] if pooling == "cls" else h.mean(0)
            assert torch.allclose(v, ref, atol=1e-5), (name, pooling, (v - ref).abs().max())


def test_masked_lm_checkpoint_serves_its_encoder(encoders, tmp_path):
    """A checkpoint saved from BertForMaskedLM (tensors under `bert.`, a `cls.*` head) named as a
    BertModel: the prefix is stripped and the pretraining head left out, as for the hub's bert-base."""
    mlm_dir = tmp_path / "mlm"
    shutil.copytree(encoders["bert"], mlm_dir)
    cfg = transformers.BertConfig.from_pretrained(str(mlm_dir))
    torch.manual_seed(5)
    mlm = transformers.BertForMaskedLM(cfg).eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mlm.save_pretrained(str(mlm_dir))
    raw = json.loads((mlm_dir / "config.json").read_text())
    (mlm_dir / "config.json").write_text(json.dumps({**raw, "architectures": ["BertModel"]}))
    eng, tok = _engine(mlm_dir, pooling_type="mean")
    ids = tok.encode(TEXTS[0])
    (vec,), _ = _pool(eng, [ids])
    with torch.no_grad():
        ref = mlm.bert(torch.tensor([ids])).last_hidden_state[0].mean(0)
    assert torch.allclose(vec, ref, atol=1e-5)


@pytest.mark.parametrize("name", ["bert-ce", "bert-3", "xlmr-ce", "modernbert-ce"])
def test_classifier_logits_with_pair_token_types(encoders, name):
    """Pairs joined by the tokenizer's template, batched in one step: logits = transformers'
    *ForSequenceClassification given the same ids and token types (BERT's second text is type 1;
    XLM-RoBERTa has one type)."""
    hf = _hf(encoders[name], "AutoModelForSequenceClassification")
    hf_tok = transformers.AutoTokenizer.from_pretrained(str(encoders[name]))
    eng, tok = _engine(encoders[name])
    pairs = [(TEXTS[0], TEXTS[1]), (TEXTS[2], TEXTS[3]), (TEXTS[1], TEXTS[0])]
    encoded = [tok.pair_encoding(a, b) for a, b in pairs]
    logits, steps = _pool(eng, [ids for ids, _ in encoded], [s for _, s in encoded])
    assert steps == 1
    for (a, b), (ids, start), got in zip(pairs, encoded, logits):
        enc = hf_tok(a, b, return_tensors="pt")
        assert enc["input_ids"][0].tolist() == ids
        if "token_type_ids" in enc:
            types = enc["token_type_ids"][0].tolist()
            assert start == types.index(1) and types == [0] * start + [1] * (len(ids) - start)
        else:
            assert start == 0
        with torch.no_grad():
            ref = hf(**enc).logits[0]
        assert got.shape == ref.shape and torch.allclose(got, ref, atol=1e-5), (got, ref)
    if name == "bert-ce":       # token types matter: read as one text, the logit differs
        (flat,), _ = _pool(eng, [encoded[0][0]])
        assert abs(flat.item() - logits[0].item()) > 1e-4


def test_encoder_schedules_whole_prompts_without_kv(encoders):
    """Prompts run whole even past a step's token budget and with chunking or prefix caching
    asked for; a prompt of the full context pools, one token more is refused; generation, groups,
    LoRA and speculative decoding are refused by name."""
    eng, tok = _engine(encoders["bert"], max_num_batched_tokens=16, chunk_size=4, enable_prefix_caching=True,
                       packer="token")
    assert (eng.config.packer, eng.config.chunk_size, eng.kv.prefix_caching) == ("token", None, False)
    assert eng.runner.kv_cache.numel() == 0 and eng.runner.kv_bytes_per_token() == 0
    hf = _hf(encoders["bert"])
    full = [2] + [7] * 62 + [3]                   # 64 tokens: the whole context
    vecs, steps = _pool(eng, [full, tok.encode(TEXTS[2]), tok.encode(TEXTS[1])])
    assert steps == 3                             # over the 16-token budget: one prompt per step
    with torch.no_grad():
        ref = hf(torch.tensor([full])).last_hidden_state[0, 0]
    assert torch.allclose(vecs[0], ref, atol=1e-5)
    with pytest.raises(InvalidRequestError) as e:
        eng.add_request("long", full + [7], SamplingParams(embed=True))
    assert e.value.field == "prompt"
    with pytest.raises(InvalidRequestError) as e:
        eng.add_request("gen", full[:5], SamplingParams(max_tokens=4))
    assert e.value.field == "model"
    with pytest.raises(InvalidRequestError) as e:
        eng.add_request("pair", full[:5], SamplingParams(embed=True, pair_start=9))
    assert e.value.field == "pair_start"
    model, _ = load_model(encoders["bert"])
    for kw, field in (({"tp": 2}, "tp"), ({"speculative_method": "ngram"}, "speculative_method"),
                      ({"lora_modules": [f"a={encoders['bert']}"]}, "lora_modules")):
        with pytest.raises(ValueError, match=field):
            LLMEngine(EngineConfig(kv_cache_tokens=1024, predictor="none", policy="fcfs", **kw), model)


def test_startup_profile_times_encoder_steps(encoders):
    """The batch-time profile's synthetic steps (prefill chunks with history, decodes) run on an
    encoder as prompts of those lengths, cut to its context; an engine with LARS profiles at start."""
    eng, _ = _engine(encoders["xlmr"])
    run = make_run_batch(eng.runner)
    assert run([(200, 300), (5, 0)], [40, 50]) > 0      # 200 tokens > the 64-token context: cut
    model, _ = load_model(encoders["xlmr"])
    lars = LLMEngine(EngineConfig(kv_cache_tokens=1024, policy="lars", packer="medha", max_num_batched_tokens=256,
                                  max_num_seqs=8), model)
    assert lars.predictor is not None and lars.config.packer == "token"


@pytest.mark.parametrize("lengths", [[9, 5], [40, 3, 4, 20, 7, 1, 30, 33], [2, 2, 2], [64]])
def test_prompts_of_any_length_mix_attend_only_to_their_own(encoders, lengths):
    """Prompts are grouped by length for attention (padding under 2x per group) and come back in
    step order: each equals transformers on that prompt alone."""
    model, _ = load_model(encoders["bert"])
    hf = _hf(encoders["bert"])
    gen = torch.Generator().manual_seed(sum(lengths))
    seqs = [torch.randint(5, model.config.vocab_size, (n,), generator=gen) for n in lengths]
    out = model(torch.cat(seqs), lengths)
    first = 0
    for s in seqs:
        with torch.no_grad():
            want = hf(s[None]).last_hidden_state[0]
        torch.testing.assert_close(out[first:first + len(s)], want, atol=1e-5, rtol=1e-5)
        first += len(s)


def test_modernbert_config_as_transformers_5_and_the_hub_write_it(encoders):
    """transformers 5's `layer_types` / `rope_parameters` and the hub's `global_attn_every_n_layers`
    / `global_rope_theta` / `local_rope_theta` read the same; the classifier pools its mean."""
    new = ModelConfig.from_pretrained(encoders["modernbert-ce"])
    enc = new.encoder
    assert (enc.family, enc.sliding_layers, enc.local_window, new.pooler.pooling_type) == ("modernbert", (1, 2), 4,
                                                                                             "mean")
    assert (enc.rope_theta_global, enc.rope_theta_local) == (160000.0, 10000.0) and new.labels == ("relevant",)
    raw = json.loads((encoders["modernbert"] / "config.json").read_text())
    hub = {k: v for k, v in raw.items() if k not in ("layer_types", "rope_parameters")}
    hub.update(global_attn_every_n_layers=2, global_rope_theta=8000.0, local_rope_theta=500.0, local_attention=16)
    old = ModelConfig.from_dict(hub).encoder
    assert (old.sliding_layers, old.local_window, old.rope_theta_global, old.rope_theta_local) == ((1, 3), 8, 8000.0,
                                                                                                   500.0)
    for change, field in (({"layer_types": ["full_attention"]}, "layer_types"),
                          ({"classifier_pooling": "max"}, "classifier_pooling"),
                          ({"rope_parameters": {"full_attention": {"rope_type": "yarn", "factor": 2.0}}}, "rope_type")):
        with pytest.raises(ModelConfigError, match=field):
            ModelConfig.from_dict({**raw, **change})


def test_modernbert_local_layers_see_only_their_window(encoders):
    """The band matters: attending globally on the local layers changes a 30-token prompt's states."""
    model, _ = load_model(encoders["modernbert"])
    ids = torch.randint(5, model.config.vocab_size, (30,), generator=torch.Generator().manual_seed(0))
    local = model(ids, [30])
    with torch.no_grad():
        want = _hf(encoders["modernbert"])(ids[None]).last_hidden_state[0]
    torch.testing.assert_close(local, want, atol=1e-5, rtol=1e-5)
    for layer in model.layers:
        layer.attn.local = False
    assert (model(ids, [30]) - want).abs().max() > 1e-3
