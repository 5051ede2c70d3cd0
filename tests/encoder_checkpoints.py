"""Tiny BERT-style checkpoints written by transformers itself (test-time reference only), with a
WordPiece tokenizer trained here: what the hub's BERT / XLM-RoBERTa embedding models and
cross-encoders look like on disk, small enough to build in a second.

`write_encoder(dir, arch, labels)` writes config.json, model.safetensors and the tokenizer files;
`write_st_encoder(src, dst, pooling)` saves it through sentence-transformers with a Pooling and a
Normalize module (an embedding model as the hub ships one).
"""

from __future__ import annotations

import warnings
from pathlib import Path

CORPUS = ["the quick brown fox jumps over the lazy dog", "paris is the capital of france",
          "a cat sat on the mat", "machine learning serves models at scale",
          "what is the capital of germany", "berlin is the capital of germany",
          "rivers run to the sea", "the wind moves over the quiet town"]


def _tokenizer(roberta: bool, token_types: bool = True):
    """A WordPiece tokenizer with BERT's pair template ([CLS] a [SEP] b [SEP], the second text
    token type 1; with `token_types` false every token type 0 and none passed to the model, as
    ModernBERT's tokenizer), or XLM-RoBERTa's (<s> a </s></s> b </s>, every token type 0, no token
    types passed to the model, as XLMRobertaTokenizerFast)."""
    import transformers
    from tokenizers import BertWordPieceTokenizer, processors

    tok = BertWordPieceTokenizer(lowercase=True)
    # XLM-RoBERTa's ids: <s> 0, <pad> 1, </s> 2, <unk> 3 (its positions start at pad + 1 = 2).
    specials = ["<s>", "<pad>", "</s>", "<unk>", "<mask>"] if roberta else \
        ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    tok.train_from_iterator(CORPUS * 10, vocab_size=160, min_frequency=1, special_tokens=specials)
    cls, pad, sep, unk, mask = specials if roberta else (specials[2], specials[0], specials[3], specials[1], specials[4])
    inner = tok._tokenizer
    if not roberta and token_types:
        return transformers.BertTokenizerFast(tokenizer_object=inner, unk_token=unk, sep_token=sep, pad_token=pad,
                                              cls_token=cls, mask_token=mask)
    ids = {t: inner.token_to_id(t) for t in (cls, sep)}
    pair = f"{cls} $A {sep} {sep} $B:0 {sep}:0" if roberta else f"{cls} $A {sep} $B:0 {sep}:0"
    inner.post_processor = processors.TemplateProcessing(single=f"{cls} $A {sep}", pair=pair,
                                                         special_tokens=list(ids.items()))
    inner.unk_token = unk
    return transformers.PreTrainedTokenizerFast(tokenizer_object=inner, bos_token=cls, eos_token=sep, unk_token=unk,
                                                pad_token=pad, cls_token=cls, sep_token=sep, mask_token=mask,
                                                model_input_names=["input_ids", "attention_mask"])


def write_encoder(root: Path, arch: str, labels: list[str] | None = None, seed: int = 0) -> Path:
    """A random `arch` checkpoint (BertModel, BertForSequenceClassification, BertForTokenClassification,
    XLMRobertaModel, XLMRobertaForSequenceClassification, ModernBertModel,
    ModernBertForSequenceClassification: 4 layers, mean-pooling classifier) of 2 layers x 32 hidden in `root`, with its tokenizer."""
    import torch
    import transformers

    roberta, modern = arch.startswith("XLMRoberta"), arch.startswith("ModernBert")
    root.mkdir(parents=True, exist_ok=True)
    tok = _tokenizer(roberta, token_types=not modern)
    tok.save_pretrained(str(root))
    kw = dict(vocab_size=len(tok), hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
              max_position_embeddings=66 if roberta else 64, pad_token_id=tok.pad_token_id)
    if labels:
        kw.update(id2label=dict(enumerate(labels)), label2id={name: i for i, name in enumerate(labels)})
    if modern:      # 4 layers: global, local, local, global; a local window of 4 either side
        kw.update(num_hidden_layers=4, intermediate_size=48, local_attention=8, classifier_pooling="mean",
                  bos_token_id=tok.cls_token_id, eos_token_id=tok.sep_token_id, cls_token_id=tok.cls_token_id,
                  sep_token_id=tok.sep_token_id)
    config = (transformers.XLMRobertaConfig if roberta else transformers.ModernBertConfig if modern
              else transformers.BertConfig)(**kw)
    torch.manual_seed(seed)
    model = getattr(transformers, arch)(config).eval()
    with torch.no_grad():       # spread the logits: a random head near zero would compare nothing
        for name, p in model.named_parameters():
            if name.startswith("classifier") and name.endswith("weight"):
                p.mul_(20.0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model.save_pretrained(str(root))
    return root


def write_st_encoder(src: Path, dst: Path, pooling: str = "mean") -> Path:
    """sentence-transformers' own save of the encoder at `src`: Transformer, Pooling (`pooling`),
    Normalize."""
    import sentence_transformers as st
    from sentence_transformers import models

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        word = models.Transformer(str(src))
        pool = models.Pooling(word.get_word_embedding_dimension(), pooling_mode=pooling)
        st.SentenceTransformer(modules=[word, pool, models.Normalize()], device="cpu").save(str(dst))
    return dst
