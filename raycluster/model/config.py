"""ModelConfig: the subset of a Hugging Face config.json (Llama / Qwen2 / Qwen3 / Mistral, the
mixture-of-experts Mixtral / Qwen2-MoE / Qwen3-MoE, Phi-3 (fused projections, LongRoPE, partial
rotary), GLM-4, Granite, OLMo 2, SmolLM3, EXAONE 4 (their own fields: raycluster.model.family_config), Cohere's
Command models (raycluster.model.cohere_config), and Gemma / Gemma 2 / Gemma 3 whose own fields raycluster.model.gemma_config reads) that the from-scratch model needs, validated
with errors that name the offending field.

Accepts both transformers-5 files (`rope_parameters`, `dtype`) and older ones (top-level
`rope_theta` / `rope_scaling` with `rope_type` or `type`, `torch_dtype`; raycluster.model.rope_config).
Sliding-window attention follows Hugging Face: Mistral and Phi-3 slide on every layer when `sliding_window` is set;
Qwen2 / Qwen3 only with `use_sliding_window`, on the layers `layer_types` marks
"sliding_attention" (or, without it, layers i >= `max_window_layers`); Llama never; the MoE
models as their dense kin, except Qwen3-MoE (every layer) and Qwen2-MoE (without `layer_types`,
the even layers below `max_window_layers`). `moe` (a `MoEConfig`) says which layers route
tokens to experts and how.
Base models (LlamaModel, MistralModel, Qwen2Model, Qwen3Model: embedding checkpoints) are read
as their causal LM without an output head (`has_lm_head`); sequence classifiers (*ForSequenceClassification)
as one with a `score` head of `labels` rows instead. BERT-style encoders (BERT, RoBERTa, XLM-RoBERTa,
raycluster.model.encoder_config) fill the shared fields and an `encoder` spec. `quant` (a `QuantConfig`) says how a quantized checkpoint (compressed-tensors, GPTQ, AWQ, FP8)
stores its linear weights. `window_of(layer)` gives a layer's window. `from_pretrained` adds the end-of-sequence ids of a
generation_config.json beside config.json.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from typing import Any

from raycluster.model.cohere_config import COHERE_ARCHITECTURES, cohere_fields
from raycluster.model.encoder_config import ENCODER_ARCHITECTURES, TOKEN_HEADS, EncoderSpec, encoder_fields
from raycluster.model.family_config import (FAMILY_ARCHITECTURES, FUSED_PROJECTIONS, apertus_rope, family_fields,
                                            hunyuan_rope, ministral3_rope)
from raycluster.model.gemma_config import GEMMA_ARCHITECTURES, GemmaSpec, gemma_fields
from raycluster.model.generation_config import load_generation_config
from raycluster.model.gpt_oss_config import ARCHITECTURE as GPT_OSS, gpt_oss_fields, gpt_oss_rope
from raycluster.model.llama4_config import ARCHITECTURE as LLAMA4, Llama4Spec, llama4_fields
from raycluster.model.mla_config import MLASpec
from raycluster.model.moe_config import MoEConfig, moe_config
from raycluster.model.mrope import MRopeSpec
from raycluster.model.multimodal_config import MULTIMODAL_ARCHITECTURES, STACKED_EXPERTS, mrope_of, text_config_of
from raycluster.model.pooling import (PoolerConfig, PoolerConfigError, read_pooler_config,
                                      sentence_transformers_options)
from raycluster.model.quant.config import QuantConfig, QuantConfigError, parse_quant_config
from raycluster.model.rope_config import (RopeConfigError, layer_type_ropes, longrope_for_context, parse_rope,
                                          scaled_context)

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "MistralForCausalLM",
                           "MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM",
                           *FAMILY_ARCHITECTURES, *GEMMA_ARCHITECTURES, *COHERE_ARCHITECTURES, GPT_OSS, LLAMA4)
# Base models saved without an output head (e5-mistral's MistralModel, embedding models written by
# sentence-transformers): served as their causal LM's decoder, for pooling only unless tied.
BASE_ARCHITECTURES = {"LlamaModel": "LlamaForCausalLM", "MistralModel": "MistralForCausalLM",
                      "Qwen2Model": "Qwen2ForCausalLM", "Qwen3Model": "Qwen3ForCausalLM",
                      "GemmaModel": "GemmaForCausalLM", "Gemma2Model": "Gemma2ForCausalLM"}
# Sequence classifiers (rerankers, reward / sentiment models): the causal LM's decoder, the last
# token's final hidden state through a `score` head of num_labels rows instead of an output head.
CLASSIFIER_ARCHITECTURES = {"LlamaForSequenceClassification": "LlamaForCausalLM",
                            "MistralForSequenceClassification": "MistralForCausalLM",
                            "Qwen2ForSequenceClassification": "Qwen2ForCausalLM",
                            "Qwen3ForSequenceClassification": "Qwen3ForCausalLM"}
MOE_ARCHITECTURES = ("MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM", "DeepseekV2ForCausalLM",
                     "GraniteMoeForCausalLM",
                     "DeepseekV3ForCausalLM", "Glm4MoeForCausalLM")
# Architectures served from no quantized checkpoint (raycluster.model.quant): Phi-3's fused
# projections, DeepSeek's latent attention, gpt-oss's stacked experts (its own MXFP4 files aside).
UNQUANTIZABLE = ("Phi3ForCausalLM", "DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM", GPT_OSS)
# Of those, served from FP8 checkpoints (DeepSeek-V3 / R1's own format; dequantized at load, so the
# latent attention's absorbed projections read dense weights).
FP8_ONLY = ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM")


class ModelConfigError(ValueError):
    """config.json is missing a field or uses something this model does not implement."""


@dataclass
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None  # None for default rope; else has "rope_type"
    max_position_embeddings: int
    max_model_len: int
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False           # Qwen3: RMSNorm over each query / key head before RoPE
    # Hunyuan: the same norm after RoPE, under the names query_layernorm / key_layernorm.
    qk_norm_after_rope: bool = False
    # OLMo 2: q/k RMSNorm over the whole projection (every head together), not per head.
    qk_norm_across_heads: bool = False
    # Where each block's norms sit: "pre" (Llama: before attention and the MLP), "sandwich"
    # (Gemma 2 / 3: before and after each), "post" (OLMo 2: after each block's output only),
    # "parallel" (Cohere: one norm feeding attention and the MLP side by side), "glm4" (GLM-4-0414:
    # as sandwich, under its own names). raycluster.model.llama.BLOCK_NORMS names them.
    block_norms: str = "pre"
    # Cohere (raycluster.model.cohere_config): LayerNorm without bias instead of RMSNorm; RoPE on
    # interleaved pairs; q/k norms with one weight row per head; the logits' multiplier; layers
    # without any position embedding (Cohere 2's full-attention layers).
    layer_norm: bool = False
    # StarCoder2: LayerNorm with a bias (torch's), and an ungated MLP c_fc -> GELU-tanh -> c_proj.
    layer_norm_bias: bool = False
    plain_mlp: bool = False
    # An ungated MLP under up_proj / down_proj: "relu2" (Arcee's AFM, ReLU squared between),
    # "xielu" (Apertus, its learnt xIELU); None: gated (or StarCoder2's plain_mlp).
    ungated_mlp: str | None = None
    rope_interleaved: bool = False
    qk_norm_per_head_weights: bool = False
    logit_scale: float = 1.0
    nope_layers: tuple[int, ...] = ()
    # Ministral 3: (beta, original context) of the factor on every layer's queries past the
    # pretraining context (raycluster.model.query_scale); None: no factor.
    query_scaling: tuple[float, int] | None = None
    # gpt-oss: a learnt logit per attention head (`self_attn.sinks`) joining each softmax.
    attention_sinks: bool = False
    # Gemma 3, OLMo 3: the sliding layers' own plain RoPE base (None: every layer turns alike).
    sliding_rope_theta: float | None = None
    partial_rotary_factor: float = 1.0  # the share of each head RoPE turns (its first dims)
    # Granite's multipliers (1.0 / None elsewhere): on the embeddings, on each block's output
    # before the residual add, as the attention scale (instead of head_dim ** -0.5), and the
    # divisor of the logits.
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    attention_multiplier: float | None = None
    logits_scaling: float = 1.0
    # Projections a checkpoint stores fused, split at load: Phi-3's q/k/v as one "qkv_proj" and
    # gate/up as one "gate_up_proj"; GLM's gate/up only.
    fused_projections: tuple[str, ...] = ()
    bos_token_id: int | None = None
    eos_token_id: tuple[int, ...] = ()
    dtype: str | None = None
    sliding_window: int | None = None  # the window of the sliding layers, if any
    sliding_layers: tuple[int, ...] = ()  # indices of the layers that slide (of the full model)
    moe: MoEConfig | None = None        # the sparse layers' experts (None: every layer dense)
    quant: QuantConfig | None = None    # how a quantized checkpoint stores its linear weights (None: dense)
    # How /v1/embeddings pools the final hidden states (raycluster.model.pooling): from a
    # sentence-transformers layout beside config.json, else a decoder's LAST token, normalised.
    pooler: PoolerConfig = PoolerConfig()
    # False: the checkpoint has no output head (a base model, or a causal LM saved without
    # lm_head): it serves pooling requests only. `bare_names`: its tensors are stored as a base
    # model saves them, without the "model." prefix (the loader sets both from the files).
    has_lm_head: bool = True
    bare_names: bool = False
    # A sequence classifier's label names, one per row of its `score` head (empty: not one).
    labels: tuple[str, ...] = ()
    # DeepSeek's multi-head latent attention (raycluster.model.mla); None: plain attention.
    mla: MLASpec | None = None
    # A BERT-style encoder's own fields (raycluster.model.encoder_config); None: a decoder.
    encoder: EncoderSpec | None = None
    # What a Gemma-family decoder does differently (raycluster.model.gemma_config); None: not one.
    gemma: GemmaSpec | None = None
    # An image-text checkpoint served on its text alone (raycluster.model.multimodal_config): its
    # architecture, and the prefix its text model's tensors carry (the loader reads it off the names).
    multimodal: str | None = None
    # Qwen-VL's multimodal RoPE (raycluster.model.mrope), for prompts with images; text alone
    # turns by plain RoPE.
    mrope: MRopeSpec | None = None
    text_prefix: str = ""
    # What Llama 4's layers do differently (raycluster.model.llama4_config); None: not Llama 4.
    llama4: Llama4Spec | None = None
    raw: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    def window_of(self, layer: int) -> int | None:
        """The sliding window of decoder layer `layer` (its index in the full model), or None."""
        return self.sliding_window if layer in self.sliding_layers else None

    def is_moe_layer(self, layer: int) -> bool:
        """Whether decoder layer `layer` (its index in the full model) has routed experts."""
        return self.moe is not None and layer in self.moe.layers

    @property
    def architectures(self) -> list[str]:
        return [self.architecture]

    @property
    def is_encoder(self) -> bool:
        return self.encoder is not None

    @property
    def token_classifier(self) -> bool:
        """A *ForTokenClassification: its head classifies every token, not a pooled vector."""
        return self.encoder is not None and self.encoder.head in TOKEN_HEADS

    @property
    def num_kv_layers(self) -> int:
        """Layers that keep KV in the cache: none for an encoder (each prompt runs whole, once)."""
        return 0 if self.encoder is not None else self.num_hidden_layers

    @property
    def rotary_dim(self) -> int:
        if self.mla is not None:
            return self.mla.qk_rope_head_dim
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def torch_attention_only(self) -> bool:
        """Attention only the torch backend computes: sliding windows, Gemma 2's score caps, sinks,
        Llama 4's attention chunks."""
        return bool(self.sliding_layers) or self.attention_sinks or self.attention_chunk is not None or (
            self.gemma is not None and self.gemma.attn_softcap is not None)

    @property
    def attention_chunk(self) -> int | None:
        """Llama 4's: the chunk its RoPE layers attend within (None: no chunked attention)."""
        return self.llama4.attention_chunk_size if self.llama4 is not None else None

    @property
    def num_kv_groups(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike) -> "ModelConfig":
        path = os.fspath(path)
        cfg_path = os.path.join(path, "config.json") if os.path.isdir(path) else path
        if not os.path.exists(cfg_path):
            raise FileNotFoundError(f"no config.json found at {cfg_path!r}")
        try:
            with open(cfg_path) as f:
                data = json.load(f)
        except json.JSONDecodeError as e:
            raise ModelConfigError(f"{cfg_path}: invalid JSON: {e}") from e
        cfg = cls.from_dict(data)
        try:
            cfg = dataclasses.replace(cfg, pooler=read_pooler_config(
                os.path.dirname(cfg_path), data, cfg.encoder.default_pooling if cfg.is_encoder else "last"))
            st_max = sentence_transformers_options(os.path.dirname(cfg_path)).get("max_seq_length")
        except PoolerConfigError as e:
            raise ModelConfigError(str(e)) from e
        if st_max is not None and st_max < cfg.max_model_len:
            # As vLLM: a sentence-transformers model serves the length it was trained to read.
            cfg = dataclasses.replace(cfg, max_model_len=st_max)
        # generation_config.json may name more EOS ids (Llama-3 instruct's <|eot_id|>, Qwen's
        # <|endoftext|> beside <|im_end|>): HF's generate and vLLM stop on each.
        try:
            extra = load_generation_config(os.path.dirname(cfg_path)).eos_token_ids
        except ValueError as e:
            raise ModelConfigError(str(e)) from e
        more = tuple(t for t in extra if t not in cfg.eos_token_id)
        return dataclasses.replace(cfg, eos_token_id=cfg.eos_token_id + tuple(dict.fromkeys(more))) if more else cfg

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ModelConfig":
        archs = d.get("architectures")
        if not archs or not isinstance(archs, list):
            raise ModelConfigError(f"config field 'architectures' missing or not a list: {archs!r}")
        arch = archs[0]
        if arch in ENCODER_ARCHITECTURES:
            return cls._encoder(arch, d)
        if arch in MULTIMODAL_ARCHITECTURES:
            _, text = text_config_of(arch, d, ModelConfigError)
            try:
                cfg = cls.from_dict(text)
            except ModelConfigError as e:      # its fields are the text config's
                raise ModelConfigError(str(e).replace("config field '", "config field 'text_config.", 1)) from None
            if arch in STACKED_EXPERTS:
                cfg = dataclasses.replace(cfg, moe=dataclasses.replace(cfg.moe, stacked=STACKED_EXPERTS[arch]))
            return dataclasses.replace(cfg, multimodal=arch, raw=dict(d), mrope=mrope_of(arch, d))
        headless, classifier = arch in BASE_ARCHITECTURES, arch in CLASSIFIER_ARCHITECTURES
        arch = BASE_ARCHITECTURES.get(arch) or CLASSIFIER_ARCHITECTURES.get(arch) or arch
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ModelConfigError(
                f"config field 'architectures' = {archs!r} is not supported (supported: "
                f"{', '.join(SUPPORTED_ARCHITECTURES + tuple(BASE_ARCHITECTURES) + tuple(CLASSIFIER_ARCHITECTURES) + tuple(ENCODER_ARCHITECTURES) + MULTIMODAL_ARCHITECTURES)})")
        labels = _labels(d) if classifier else ()

        def req(name: str, typ=int):
            if name not in d or d[name] is None:
                raise ModelConfigError(f"config field {name!r} is required but missing")
            try:
                return typ(d[name])
            except (TypeError, ValueError) as e:
                raise ModelConfigError(f"config field {name!r} has invalid value {d[name]!r}") from e

        hidden = req("hidden_size")
        heads = req("num_attention_heads")
        vocab = req("vocab_size")
        inter = req("intermediate_size")
        layers = req("num_hidden_layers")
        max_pos = req("max_position_embeddings")
        kv_heads = int(d.get("num_key_value_heads") or heads)
        head_dim = int(d.get("head_dim") or hidden // heads)
        if heads % kv_heads:
            raise ModelConfigError(
                f"config field 'num_key_value_heads' = {kv_heads} does not divide num_attention_heads = {heads}")
        eps = float(d.get("rms_norm_eps", 1e-5 if arch == GPT_OSS else 1e-6))    # Cohere's layer_norm_eps: cohere_fields

        gemma = arch in GEMMA_ARCHITECTURES
        # Gemma 3's and OLMo 3's sliding layers turn by their own plain RoPE.
        global_rope, local_rope = \
            layer_type_ropes(d, d.get("rope_local_base_freq", 10000.0)) if arch == "Gemma3ForCausalLM" else \
            layer_type_ropes(d, d.get("rope_theta", 500000.0)) if arch == "Olmo3ForCausalLM" else \
            (gpt_oss_rope(d), None) if arch == GPT_OSS else \
            (apertus_rope(d), None) if arch == "ApertusForCausalLM" else \
            (hunyuan_rope(d, head_dim), None) if arch == "HunYuanDenseV1ForCausalLM" else \
            (ministral3_rope(d), None) if arch == "Ministral3ForCausalLM" else (d, None)
        try:
            theta, scaling, partial = parse_rope(global_rope)
            local_theta, local_scaling, _ = parse_rope(local_rope) if local_rope is not None else (None, None, 1.0)
        except RopeConfigError as e:
            raise ModelConfigError(str(e)) from None
        if local_scaling:
            raise ModelConfigError("config field 'rope_parameters.sliding_attention': only the default RoPE is "
                                   f"supported on {arch}'s sliding layers")

        # Biases and the family's own fields (raycluster.model.family_config; its sliding fields,
        # EXAONE 4's, replace the generic reading below).
        own = family_fields(arch, d, layers, ModelConfigError)
        if gemma:
            own["mlp_bias"] = False
            family = gemma_fields(arch, d, layers, head_dim, ModelConfigError)
        elif arch in COHERE_ARCHITECTURES:
            family = {"sliding_window": None, "sliding_layers": (), **cohere_fields(arch, d, layers, ModelConfigError)}
        elif arch == GPT_OSS:       # its sliding layers, sinks and experts
            family = gpt_oss_fields(d, layers, ModelConfigError)
        elif arch == LLAMA4:        # its NoPE layers, q/k norms, experts and dense MLPs' own width
            family = {"sliding_window": None, "sliding_layers": (), **llama4_fields(d, layers, ModelConfigError)}
            inter = family.pop("intermediate_size")
        else:
            window, sliding = _sliding_layers(arch, d, layers)
            family = {"sliding_window": window, "sliding_layers": sliding}
        moe = moe_config(arch, d, layers, ModelConfigError) if arch in MOE_ARCHITECTURES else family.pop("moe", None)
        # Gemma 3's max_position_embeddings already counts its global layers' linear scaling.
        max_len = max_pos if arch == "Gemma3ForCausalLM" else scaled_context(max_pos, scaling)
        scaling = longrope_for_context(scaling, max_len)
        raw_quant = d.get("quantization_config")
        if moe is not None and moe.mxfp4:     # gpt-oss's packed experts: dequantized at load, the rest dense
            raw_quant = None
        try:
            quant = parse_quant_config(raw_quant)
        except QuantConfigError as e:
            raise ModelConfigError(str(e)) from None
        if quant is not None and arch in UNQUANTIZABLE and not (arch in FP8_ONLY and not quant.integer):
            raise ModelConfigError(f"config field 'quantization_config': quantized {arch} checkpoints (Phi-3's fused "
                                   "projections, DeepSeek's latent attention beyond its FP8 releases, gpt-oss's "
                                   "stacked experts beyond its MXFP4 files) are not supported")
        try:
            pooler = read_pooler_config(None, d)
        except PoolerConfigError as e:
            raise ModelConfigError(str(e)) from None

        eos = d.get("eos_token_id")
        if eos is None:
            eos_t: tuple[int, ...] = ()
        elif isinstance(eos, (list, tuple)):
            eos_t = tuple(int(x) for x in eos)
        else:
            eos_t = (int(eos),)
        bos = d.get("bos_token_id")
        # transformers' defaults: Gemma, Cohere, StarCoder2 and Ernie 4.5 tie, the rest not.
        tied = bool(d.get("tie_word_embeddings", gemma or arch in (*COHERE_ARCHITECTURES, "Starcoder2ForCausalLM",
                                                                   "Ernie4_5ForCausalLM")))

        return cls(
            architecture=arch, vocab_size=vocab, hidden_size=hidden, intermediate_size=inter,
            num_hidden_layers=layers, num_attention_heads=heads,
            # DeepSeek's latent attention caches one latent "head" (raycluster.model.mla_config).
            num_key_value_heads=own.pop("num_key_value_heads", kv_heads), head_dim=own.pop("head_dim", head_dim),
            rope_theta=theta, rope_scaling=scaling,
            max_position_embeddings=max_pos, max_model_len=max_len,
            tie_word_embeddings=tied,
            has_lm_head=not classifier and (not headless or tied),
            labels=labels,
            bos_token_id=int(bos) if bos is not None else None, eos_token_id=eos_t,
            dtype=d.get("dtype") or d.get("torch_dtype"), moe=moe, quant=quant, pooler=pooler, raw=dict(d),
            partial_rotary_factor=partial, fused_projections=FUSED_PROJECTIONS.get(arch, ()),
            sliding_rope_theta=local_theta,
            **{"rms_norm_eps": eps, **family, **own})

    @classmethod
    def _encoder(cls, arch: str, d: dict[str, Any]) -> "ModelConfig":
        def req(name: str) -> int:
            if d.get(name) is None:
                raise ModelConfigError(f"config field {name!r} is required but missing")
            try:
                return int(d[name])
            except (TypeError, ValueError):
                raise ModelConfigError(f"config field {name!r} has invalid value {d[name]!r}") from None

        fields = encoder_fields(arch, d, req, _labels)
        try:
            pooler = read_pooler_config(None, d, fields["encoder"].default_pooling)
        except PoolerConfigError as e:
            raise ModelConfigError(str(e)) from None
        return cls(pooler=pooler, **fields)


def model_summary(cfg: ModelConfig) -> dict[str, Any]:
    """What a served checkpoint is, for `raycluster status`: its architecture, what it serves
    (generation, embeddings, classification), how it pools, and its weight format."""
    tasks = ["token_classify"] if cfg.token_classifier else \
        (["generate"] if cfg.has_lm_head else []) + (["classify"] if cfg.labels else ["embed"])
    pooler = cfg.pooler
    q = cfg.quant
    return {"architecture": cfg.raw.get("architectures", [cfg.architecture])[0], "tasks": tasks,
            "text_only": cfg.multimodal is not None,
            "pooling": {"type": pooler.pooling_type, "normalize": pooler.normalize, "source": pooler.source,
                        "dense": [d.path for d in pooler.dense], "size": pooler.output_size(cfg.hidden_size),
                        "matryoshka": pooler.matryoshka_dimensions or pooler.matryoshka},
            "labels": list(cfg.labels), "dtype": cfg.dtype,
            "weights": ("mxfp4 experts, dequantized at load" if cfg.moe is not None and cfg.moe.mxfp4 else "dense")
                       if q is None else q.method + (f" {q.layout}" if q.layout != q.method else "")
                       + f" {q.bits}-bit {q.strategy}" + (f" g{q.group_size}" if q.group_size else "")}


def _labels(d: dict[str, Any]) -> tuple[str, ...]:
    """A classifier's label names, as transformers numbers them: `id2label` (keys 0..n-1), else
    `num_labels` (default 2) labels LABEL_i."""
    id2label = d.get("id2label")
    if id2label:
        try:
            named = {int(k): str(v) for k, v in id2label.items()}
        except (AttributeError, ValueError):
            raise ModelConfigError(f"config field 'id2label' must map label ids 0..n-1 to names, got {id2label!r}") \
                from None
        if sorted(named) != list(range(len(named))):
            raise ModelConfigError(f"config field 'id2label' must map label ids 0..n-1 to names, got {id2label!r}")
        return tuple(named[i] for i in range(len(named)))
    n = d.get("num_labels", 2)
    if not isinstance(n, int) or n < 1:
        raise ModelConfigError(f"config field 'num_labels' must be a positive int, got {n!r}")
    return tuple(f"LABEL_{i}" for i in range(n))


def _sliding_layers(arch: str, d: dict[str, Any], layers: int) -> tuple[int | None, tuple[int, ...]]:
    """(window, indices of the sliding layers) as Hugging Face's modeling code reads config.json."""
    window = d.get("sliding_window")
    if not window or arch == "LlamaForCausalLM":
        return None, ()
    try:
        window = int(window)
    except (TypeError, ValueError) as e:
        raise ModelConfigError(f"config field 'sliding_window' has invalid value {d['sliding_window']!r}") from e
    if window < 1:
        raise ModelConfigError(f"config field 'sliding_window' = {window} must be at least 1")
    if arch in ("MixtralForCausalLM", "MistralForCausalLM", "Ministral3ForCausalLM", "Phi3ForCausalLM",
                "Starcoder2ForCausalLM"):
        return window, tuple(range(layers))
    if not d.get("use_sliding_window", False):
        return None, ()
    if arch == "Qwen3MoeForCausalLM":      # transformers' Qwen3-MoE slides on every layer
        return window, tuple(range(layers))
    layer_types = d.get("layer_types")
    if layer_types is not None:
        if not isinstance(layer_types, list) or len(layer_types) != layers:
            raise ModelConfigError(f"config field 'layer_types' must list one type per layer ({layers})")
        sliding = tuple(i for i, t in enumerate(layer_types) if t == "sliding_attention")
    elif arch == "Qwen2MoeForCausalLM":    # transformers' default layer_types for Qwen2-MoE
        start = int(d.get("max_window_layers", layers))
        sliding = tuple(i for i in range(layers) if (i + 1) % 2 and i < start)
    else:
        start = int(d.get("max_window_layers", layers))
        sliding = tuple(range(start, layers))
    return (window, sliding) if sliding else (None, ())
