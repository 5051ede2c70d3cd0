"""The config.json of a BERT-style encoder (BERT, RoBERTa, XLM-RoBERTa), read into the fields
`ModelConfig` shares with the decoders plus an `EncoderSpec` of what only encoders have.

Encoders serve pooling only (vLLM's encoder-only models: embeddings, and as a
*ForSequenceClassification, classify / score / rerank as a cross-encoder): every prompt runs whole
in one step with bidirectional attention and keeps no KV cache. Data enters as config.json's dict
and leaves as keyword arguments for `ModelConfig`; errors name the field.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

# Architecture -> (family, classification head). The family says how positions are numbered
# (RoBERTa's start after the padding id) and what the checkpoint prefixes its tensors with in a
# *For* class; the head: "bert" = the pooler (dense + tanh over [CLS]) then `classifier`,
# "roberta" = `classifier.dense` + tanh then `classifier.out_proj` (no pooler), "token" =
# `classifier` alone, on each token; None: a base model.
ENCODER_ARCHITECTURES: dict[str, tuple[str, str | None]] = {
    "BertModel": ("bert", None),
    "BertForSequenceClassification": ("bert", "bert"),
    "RobertaModel": ("roberta", None),
    "RobertaForSequenceClassification": ("roberta", "roberta"),
    "XLMRobertaModel": ("roberta", None),
    "XLMRobertaForSequenceClassification": ("roberta", "roberta"),
    # Token classifiers (NER, ...): `classifier` on every token's final hidden state.
    "BertForTokenClassification": ("bert", "token"),
    "RobertaForTokenClassification": ("roberta", "token"),
    "XLMRobertaForTokenClassification": ("roberta", "token"),
}
ACTIVATIONS = ("gelu", "gelu_new", "gelu_pytorch_tanh", "relu", "silu")


@dataclass(frozen=True)
class EncoderSpec:
    family: str                 # "bert" | "roberta"
    head: str | None            # the classification head's kind (None: a base model)
    type_vocab_size: int        # token types (segments): 2 for BERT, 1 for RoBERTa
    layer_norm_eps: float
    hidden_act: str             # one of ACTIVATIONS (HF's names: "gelu" is the exact erf form)
    position_offset: int        # RoBERTa numbers positions from padding id + 1, BERT from 0

    @property
    def checkpoint_prefix(self) -> str:
        """What a *For* class's checkpoint puts before the encoder's tensor names."""
        return self.family + "."


def encoder_fields(arch: str, d: dict[str, Any], req: Callable[..., Any], labels: Callable[[dict], tuple[str, ...]]
                   ) -> dict[str, Any]:
    """ModelConfig keyword arguments for an encoder checkpoint's config.json `d`. `req(name)`
    reads a required int field, `labels(d)` a classifier's label names (config.py's)."""
    from raycluster.model.config import ModelConfigError

    family, head = ENCODER_ARCHITECTURES[arch]
    if d.get("quantization_config"):
        raise ModelConfigError("config field 'quantization_config': quantized encoders are not supported")
    kind = d.get("position_embedding_type", "absolute")
    if kind not in (None, "absolute"):
        raise ModelConfigError(f"config field 'position_embedding_type' = {kind!r} is not supported (absolute only)")
    act = d.get("hidden_act", "gelu")
    if act not in ACTIVATIONS:
        raise ModelConfigError(f"config field 'hidden_act' = {act!r} is not supported (supported: "
                               f"{', '.join(ACTIVATIONS)})")
    hidden, heads, max_pos = req("hidden_size"), req("num_attention_heads"), req("max_position_embeddings")
    if hidden % heads:
        raise ModelConfigError(f"config field 'num_attention_heads' = {heads} does not divide hidden_size = {hidden}")
    types = int(d.get("type_vocab_size", 2 if family == "bert" else 1))
    if types < 1:
        raise ModelConfigError(f"config field 'type_vocab_size' = {types} must be at least 1")
    pad = d.get("pad_token_id")
    if family == "roberta" and pad is None:
        raise ModelConfigError("config field 'pad_token_id' is required: RoBERTa numbers positions after it")
    offset = int(pad) + 1 if family == "roberta" else 0
    if max_pos - offset < 2:
        raise ModelConfigError(f"config field 'max_position_embeddings' = {max_pos} leaves no positions after the "
                               f"{offset} RoBERTa skips")
    spec = EncoderSpec(family=family, head=head, type_vocab_size=types,
                       layer_norm_eps=float(d.get("layer_norm_eps", 1e-12)), hidden_act=act, position_offset=offset)
    return dict(
        architecture=arch, vocab_size=req("vocab_size"), hidden_size=hidden, intermediate_size=req("intermediate_size"),
        num_hidden_layers=req("num_hidden_layers"), num_attention_heads=heads, num_key_value_heads=heads,
        head_dim=hidden // heads, rms_norm_eps=spec.layer_norm_eps, rope_theta=0.0, rope_scaling=None,
        max_position_embeddings=max_pos, max_model_len=max_pos - offset,
        # BERT's configs say tie_word_embeddings for the masked-LM head, which is not served.
        tie_word_embeddings=False, has_lm_head=False, labels=labels(d) if head else (),
        qkv_bias=True, o_bias=True, mlp_bias=True, dtype=d.get("dtype") or d.get("torch_dtype"),
        encoder=spec, raw=dict(d))
