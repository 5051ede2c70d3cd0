"""The config.json of a BERT-style encoder (BERT, RoBERTa, XLM-RoBERTa, ModernBERT), read into the fields
`ModelConfig` shares with the decoders plus an `EncoderSpec` of what only encoders have.

Encoders serve pooling only (vLLM's encoder-only models: embeddings, and as a
*ForSequenceClassification, classify / score / rerank as a cross-encoder): every prompt runs whole
in one step with bidirectional attention and keeps no KV cache. Data enters as config.json's dict
and leaves as keyword arguments for `ModelConfig`; errors name the field.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

# Architecture -> (family, classification head). The family says the layers (BERT / RoBERTa:
# post-norm, learned positions, RoBERTa's numbered after the padding id; ModernBERT: pre-norm,
# RoPE, GeGLU, local attention on most layers: raycluster.model.modernbert) and what a *For*
# class prefixes the encoder's tensors with. The head: "bert" = the pooler (dense + tanh over
# [CLS]) then `classifier`; "roberta" = `classifier.dense` + tanh then `classifier.out_proj` (no
# pooler); "token" = `classifier` alone, on each token; "modernbert" = `head` (dense, activation,
# LayerNorm) then `classifier`, and "modernbert-token" that on each token; None: a base model.
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
    "ModernBertModel": ("modernbert", None),
    "ModernBertForSequenceClassification": ("modernbert", "modernbert"),
    "ModernBertForTokenClassification": ("modernbert", "modernbert-token"),
}
TOKEN_HEADS = ("token", "modernbert-token")
ACTIVATIONS = ("gelu", "gelu_new", "gelu_pytorch_tanh", "relu", "silu")


@dataclass(frozen=True)
class EncoderSpec:
    family: str                 # "bert" | "roberta" | "modernbert"
    head: str | None            # the classification head's kind (None: a base model)
    type_vocab_size: int        # token types (segments): 2 for BERT, 1 for RoBERTa and ModernBERT
    layer_norm_eps: float
    hidden_act: str             # one of ACTIVATIONS (HF's names: "gelu" is the exact erf form)
    position_offset: int        # RoBERTa numbers positions from padding id + 1, BERT from 0
    # ModernBERT only: which layers attend locally (within `local_window` positions either side)
    # and their RoPE bases; biases of its norms, MLP and attention; its classification head.
    sliding_layers: tuple[int, ...] = ()
    local_window: int = 0
    rope_theta_global: float = 0.0
    rope_theta_local: float = 0.0
    norm_bias: bool = True
    mlp_bias: bool = True
    attention_bias: bool = True
    classifier_activation: str = "gelu"
    classifier_bias: bool = True
    default_pooling: str = "cls"  # what embeddings and the classifier pool (ModernBERT's classifier_pooling)

    @property
    def checkpoint_prefix(self) -> str:
        """What a *For* class's checkpoint puts before the encoder's tensor names."""
        return "model." if self.family == "modernbert" else self.family + "."


def encoder_fields(arch: str, d: dict[str, Any], req: Callable[..., Any], labels: Callable[[dict], tuple[str, ...]]
                   ) -> dict[str, Any]:
    """ModelConfig keyword arguments for an encoder checkpoint's config.json `d`. `req(name)`
    reads a required int field, `labels(d)` a classifier's label names (config.py's)."""
    from raycluster.model.config import ModelConfigError

    family, head = ENCODER_ARCHITECTURES[arch]
    if d.get("quantization_config"):
        raise ModelConfigError("config field 'quantization_config': quantized encoders are not supported")
    if family == "modernbert":
        return _modernbert_fields(arch, head, d, req, labels)
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


def _modernbert_fields(arch: str, head: str | None, d: dict[str, Any], req, labels) -> dict[str, Any]:
    """ModernBERT's config.json, as transformers 5 writes it (`layer_types`, `rope_parameters` per
    layer type) or as the hub's checkpoints do (`global_attn_every_n_layers`, `global_rope_theta`,
    `local_rope_theta`)."""
    from raycluster.model.config import ModelConfigError

    hidden, heads, layers = req("hidden_size"), req("num_attention_heads"), req("num_hidden_layers")
    if hidden % heads:
        raise ModelConfigError(f"config field 'num_attention_heads' = {heads} does not divide hidden_size = {hidden}")
    acts = {name: d.get(name, "gelu") for name in ("hidden_activation", "classifier_activation")}
    for name, act in acts.items():
        if act not in ACTIVATIONS:
            raise ModelConfigError(f"config field {name!r} = {act!r} is not supported (supported: "
                                   f"{', '.join(ACTIVATIONS)})")
    types = d.get("layer_types")
    if types is None:
        every = int(d.get("global_attn_every_n_layers", 3))
        types = ["sliding_attention" if i % every else "full_attention" for i in range(layers)]
    if not isinstance(types, list) or len(types) != layers or \
            not set(types) <= {"sliding_attention", "full_attention"}:
        raise ModelConfigError(f"config field 'layer_types' must give each of the {layers} layers "
                               "'full_attention' or 'sliding_attention'")
    rope = d.get("rope_parameters") or {}

    def theta(kind: str, legacy: str, default: float) -> float:
        params = rope.get(kind) or {}
        if params.get("rope_type", "default") != "default":
            raise ModelConfigError(f"config field 'rope_parameters.{kind}.rope_type' = {params['rope_type']!r} "
                                   "is not supported (default only)")
        return float(params.get("rope_theta", d.get(legacy, default)))

    pooling = d.get("classifier_pooling", "cls")
    if pooling not in ("cls", "mean"):
        raise ModelConfigError(f"config field 'classifier_pooling' = {pooling!r} is not supported (cls or mean)")
    eps = float(d.get("norm_eps", 1e-5))
    spec = EncoderSpec(
        family="modernbert", head=head, type_vocab_size=1, layer_norm_eps=eps, hidden_act=acts["hidden_activation"],
        position_offset=0, sliding_layers=tuple(i for i, t in enumerate(types) if t == "sliding_attention"),
        local_window=int(d.get("local_attention", 128)) // 2,
        rope_theta_global=theta("full_attention", "global_rope_theta", 160000.0),
        rope_theta_local=theta("sliding_attention", "local_rope_theta", 10000.0),
        norm_bias=bool(d.get("norm_bias", False)), mlp_bias=bool(d.get("mlp_bias", False)),
        attention_bias=bool(d.get("attention_bias", False)), classifier_activation=acts["classifier_activation"],
        classifier_bias=bool(d.get("classifier_bias", False)), default_pooling=pooling)
    max_pos = req("max_position_embeddings")
    return dict(
        architecture=arch, vocab_size=req("vocab_size"), hidden_size=hidden, intermediate_size=req("intermediate_size"),
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=heads, head_dim=hidden // heads,
        rms_norm_eps=eps, rope_theta=spec.rope_theta_global, rope_scaling=None, max_position_embeddings=max_pos,
        max_model_len=max_pos, tie_word_embeddings=False, has_lm_head=False, labels=labels(d) if head else (),
        dtype=d.get("dtype") or d.get("torch_dtype"), encoder=spec, raw=dict(d))
