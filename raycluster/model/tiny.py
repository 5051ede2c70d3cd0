"""A deterministic tiny Llama checkpoint in Hugging Face format, for tests and CPU benchmarks.

write_tiny_model(path, seed=0, **overrides) writes config.json (transformers-5 style, loadable by
AutoModelForCausalLM), model.safetensors (fp32, seeded), tokenizer.json (byte-level BPE trained
on the bundled corpus) and tokenizer_config.json (bos/eos, chat template). Same arguments ->
byte-identical files. `tiny_config(**overrides)` returns the config dict for variants (other
head counts, tied embeddings, llama3 rope, Qwen2 with q/k/v biases, Mixtral / Qwen2-MoE /
Qwen3-MoE experts, Gemma / Gemma 2 / Gemma 3, Phi-3 with its fused projections, Granite, OLMo 2 / 3, Cohere / Cohere 2, GLM / GLM-4, SmolLM3, EXAONE 4, DeepSeek-V2 / V3, GLM-4.5, StarCoder2, gpt-oss, Llama 4...); an override of None removes the key.
"""

from __future__ import annotations

import functools
import json
import os
from importlib import resources

import torch
from safetensors.torch import save_file

from raycluster.model.config import ModelConfig

SPECIAL_TOKENS = ["<|bos|>", "<|eos|>", "<|pad|>", "<|user|>", "<|assistant|>", "<|system|>"]
BOS_ID, EOS_ID, PAD_ID = 0, 1, 2
TOKENIZER_VOCAB = 4096

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\\n' + message['content'] + eos_token + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)


def tiny_config(**overrides) -> dict:
    cfg = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": TOKENIZER_VOCAB,
        "hidden_size": 256,
        "intermediate_size": 768,
        "num_hidden_layers": 4,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "hidden_act": "silu",
        "max_position_embeddings": 32768,
        "rms_norm_eps": 1e-5,
        "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0},
        "tie_word_embeddings": False,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "initializer_range": 0.02,
        "bos_token_id": BOS_ID,
        "eos_token_id": EOS_ID,
        "pad_token_id": PAD_ID,
        "use_cache": True,
        "dtype": "float32",
    }
    if overrides.get("architectures") == ["Qwen2ForCausalLM"]:
        cfg["model_type"] = "qwen2"
        for k in ("attention_bias", "mlp_bias", "head_dim"):
            cfg.pop(k)
        cfg.update(use_sliding_window=False, sliding_window=None, max_window_layers=cfg["num_hidden_layers"])
    elif overrides.get("architectures") == ["Qwen3ForCausalLM"]:
        cfg["model_type"] = "qwen3"
        cfg.pop("mlp_bias")
        cfg.update(use_sliding_window=False, sliding_window=None, max_window_layers=cfg["num_hidden_layers"])
    elif overrides.get("architectures") == ["MistralForCausalLM"]:
        cfg["model_type"] = "mistral"
        for k in ("attention_bias", "mlp_bias"):
            cfg.pop(k)
        cfg["sliding_window"] = None
    elif overrides.get("architectures") == ["Ministral3ForCausalLM"]:
        cfg["model_type"] = "ministral3"
        for k in ("attention_bias", "mlp_bias"):
            cfg.pop(k)
        # Its YaRN over a short pretraining context, so a test's prompts cross several of the
        # query factor's steps (one per 32 positions).
        cfg.update(sliding_window=None, max_position_embeddings=512, rope_parameters={
            "rope_type": "yarn", "rope_theta": 1e6, "factor": 16.0, "original_max_position_embeddings": 32,
            "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0, "llama_4_scaling_beta": 0.1})
    elif overrides.get("architectures") == ["MixtralForCausalLM"]:
        cfg["model_type"] = "mixtral"
        for k in ("attention_bias", "mlp_bias"):
            cfg.pop(k)
        # intermediate_size is each expert's
        cfg.update(sliding_window=None, num_local_experts=4, num_experts_per_tok=2, intermediate_size=384,
                   router_jitter_noise=0.0, output_router_logits=False)
    elif overrides.get("architectures") in (["Qwen2MoeForCausalLM"], ["Qwen3MoeForCausalLM"]):
        qwen2 = overrides["architectures"] == ["Qwen2MoeForCausalLM"]
        cfg["model_type"] = "qwen2_moe" if qwen2 else "qwen3_moe"
        for k in ("mlp_bias",) + (("attention_bias", "head_dim") if qwen2 else ()):
            cfg.pop(k)
        cfg.update(use_sliding_window=False, sliding_window=None, max_window_layers=cfg["num_hidden_layers"],
                   num_experts=4 if qwen2 else 8, num_experts_per_tok=2, moe_intermediate_size=192,
                   norm_topk_prob=not qwen2, decoder_sparse_step=1, mlp_only_layers=[],
                   router_aux_loss_coef=0.0, output_router_logits=False)
        if qwen2:
            cfg["shared_expert_intermediate_size"] = 384
    elif overrides.get("architectures") in (["GraniteForCausalLM"], ["GraniteMoeForCausalLM"]):
        cfg["model_type"] = "granite" if overrides["architectures"] == ["GraniteForCausalLM"] else "granitemoe"
        cfg.pop("head_dim")
        if cfg["model_type"] == "granitemoe":       # 8 experts of 96, 2 per token
            cfg.pop("mlp_bias")
            cfg.update(num_local_experts=8, num_experts_per_tok=2, intermediate_size=96, router_aux_loss_coef=0.0,
                       output_router_logits=False)
        # Multipliers away from 1 (Granite 3's are 12 / 0.22 / 1/128 / 8 at their sizes).
        cfg.update(embedding_multiplier=4.0, residual_multiplier=0.5, attention_multiplier=0.125, logits_scaling=2.0)
    elif overrides.get("architectures") in (["CohereForCausalLM"], ["Cohere2ForCausalLM"]):
        cohere2 = overrides["architectures"] == ["Cohere2ForCausalLM"]
        cfg["model_type"] = "cohere2" if cohere2 else "cohere"
        for k in ("mlp_bias", "head_dim", "rms_norm_eps"):
            cfg.pop(k)
        # A logit scale other than 1 (the released 0.0625 would flatten the tiny model's logits).
        cfg.update(layer_norm_eps=1e-5, logit_scale=0.5, tie_word_embeddings=True)
        if cohere2:
            cfg.update(sliding_window=24, sliding_window_pattern=4)
        else:
            cfg.update(use_qk_norm=False)
    elif overrides.get("architectures") in (["GlmForCausalLM"], ["Glm4ForCausalLM"]):
        cfg["model_type"] = "glm" if overrides["architectures"] == ["GlmForCausalLM"] else "glm4"
        cfg.pop("mlp_bias")
        cfg.update(attention_bias=True, rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                         "partial_rotary_factor": 0.5})
    elif overrides.get("architectures") in (["DeepseekV2ForCausalLM"], ["DeepseekV3ForCausalLM"]):
        v2 = overrides["architectures"] == ["DeepseekV2ForCausalLM"]
        cfg["model_type"] = "deepseek_v2" if v2 else "deepseek_v3"
        for k in ("mlp_bias", "head_dim"):
            cfg.pop(k)
        # Latent attention (q through a rank-64 bottleneck, a 32-wide latent, 8 rotary dims) and
        # 8 routed experts in 4 groups, 2 groups and 2 experts per token, one shared expert.
        cfg.update(num_key_value_heads=8, q_lora_rank=64, kv_lora_rank=32, qk_nope_head_dim=16,
                   qk_rope_head_dim=8, v_head_dim=16, rope_interleave=True, n_routed_experts=8,
                   num_experts_per_tok=2, n_group=4, topk_group=2, moe_intermediate_size=64, n_shared_experts=1,
                   first_k_dense_replace=1, routed_scaling_factor=2.5, norm_topk_prob=True,
                   rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
        if v2:      # softmax routing over groups by their best score; no correction bias
            cfg.update(topk_method="group_limited_greedy", norm_topk_prob=False)
            cfg.pop("rope_interleave")
    elif overrides.get("architectures") == ["Starcoder2ForCausalLM"]:
        cfg["model_type"] = "starcoder2"
        for k in ("mlp_bias", "attention_bias", "head_dim", "rms_norm_eps"):
            cfg.pop(k)
        cfg.update(use_bias=True, norm_epsilon=1e-5, hidden_act="gelu_pytorch_tanh", tie_word_embeddings=True,
                   sliding_window=None, residual_dropout=0.0, embedding_dropout=0.0)
    elif overrides.get("architectures") == ["Glm4MoeForCausalLM"]:
        cfg["model_type"] = "glm4_moe"
        cfg.pop("mlp_bias")
        cfg.update(attention_bias=True, use_qk_norm=True, n_routed_experts=8, num_experts_per_tok=2, n_group=2,
                   topk_group=1, moe_intermediate_size=64, n_shared_experts=1, first_k_dense_replace=1,
                   routed_scaling_factor=2.5, norm_topk_prob=True, num_nextn_predict_layers=0,
                   rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5})
    elif overrides.get("architectures") == ["GptOssForCausalLM"]:
        cfg["model_type"] = "gpt_oss"
        cfg.pop("mlp_bias")
        # 8 experts of 96 columns, 2 per token; a clamp that bites on the tiny activations; YaRN
        # as the released models turn it; a window shorter than the tests' prompts.
        cfg.update(attention_bias=True, num_local_experts=8, num_experts_per_tok=2, intermediate_size=96,
                   swiglu_limit=0.3, sliding_window=24, router_aux_loss_coef=0.0, output_router_logits=False,
                   rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 8.0, "beta_fast": 32.0,
                                    "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 4096})
    elif overrides.get("architectures") == ["Llama4ForCausalLM"]:
        cfg["model_type"] = "llama4_text"
        cfg.pop("mlp_bias")
        # Layers 1 and 3 without RoPE (their query temperature from position 15 on), 0 and 2 with
        # it, attending in 24-token chunks; layers 1 and 3 routed (4 experts of 96, top 1, a shared
        # expert), 0 and 2 dense MLPs of 256; llama3 RoPE on interleaved pairs.
        cfg.update(no_rope_layer_interval=2, interleave_moe_layer_step=2, num_local_experts=4, num_experts_per_tok=1,
                   intermediate_size=96, intermediate_size_mlp=256, floor_scale=16, attn_scale=0.1,
                   attn_temperature_tuning=True, use_qk_norm=True, attention_chunk_size=24,
                   router_aux_loss_coef=0.0, output_router_logits=False,
                   rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                                    "high_freq_factor": 4.0, "original_max_position_embeddings": 64})
    elif overrides.get("architectures") == ["SeedOssForCausalLM"]:
        cfg["model_type"] = "seed_oss"
        cfg.update(attention_bias=True, attention_out_bias=True, mlp_bias=False)
    elif overrides.get("architectures") == ["Ernie4_5ForCausalLM"]:
        cfg["model_type"] = "ernie4_5"
        for k in ("attention_bias", "mlp_bias"):
            cfg.pop(k)
        cfg.update(use_bias=True, tie_word_embeddings=False)
    elif overrides.get("architectures") == ["ArceeForCausalLM"]:
        cfg["model_type"] = "arcee"
        cfg.update(hidden_act="relu2")
    elif overrides.get("architectures") == ["HunYuanDenseV1ForCausalLM"]:
        cfg["model_type"] = "hunyuan_v1_dense"
        cfg.pop("mlp_bias")
        # Its "dynamic" RoPE with a fixed alpha (a stretched base).
        cfg.update(rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "alpha": 1000.0, "factor": 1.0})
    elif overrides.get("architectures") == ["ApertusForCausalLM"]:
        cfg["model_type"] = "apertus"
        cfg.pop("mlp_bias")
        cfg.update(hidden_act="xielu", rope_parameters={"rope_type": "llama3", "rope_theta": 12e6, "factor": 8.0,
                                                        "original_max_position_embeddings": 64, "low_freq_factor": 1.0,
                                                        "high_freq_factor": 4.0})
    elif overrides.get("architectures") == ["SmolLM3ForCausalLM"]:
        cfg["model_type"] = "smollm3"
        cfg.pop("head_dim")
        cfg.update(no_rope_layer_interval=2, use_sliding_window=False, sliding_window=None)
    elif overrides.get("architectures") == ["Exaone4ForCausalLM"]:
        cfg["model_type"] = "exaone4"
        for k in ("mlp_bias", "attention_bias"):
            cfg.pop(k)
        cfg.update(sliding_window=24, sliding_window_pattern=2)
    elif overrides.get("architectures") in (["Olmo2ForCausalLM"], ["Olmo3ForCausalLM"]):
        cfg["model_type"] = "olmo2" if overrides["architectures"] == ["Olmo2ForCausalLM"] else "olmo3"
        for k in ("mlp_bias", "head_dim"):
            cfg.pop(k)
        if cfg["model_type"] == "olmo3":    # a window shorter than the tests' prompts; YaRN on the full layers only
            cfg.update(sliding_window=24, max_position_embeddings=256, rope_parameters={
                "full_attention": {"rope_type": "yarn", "rope_theta": 500000.0, "factor": 4.0,
                                   "original_max_position_embeddings": 64},
                "sliding_attention": {"rope_type": "default", "rope_theta": 500000.0}})
    elif overrides.get("architectures") == ["Phi3ForCausalLM"]:
        cfg["model_type"] = "phi3"
        for k in ("attention_bias", "mlp_bias"):
            cfg.pop(k)
        cfg.update(sliding_window=None, original_max_position_embeddings=cfg["max_position_embeddings"],
                   resid_pdrop=0.0, embd_pdrop=0.0)
    elif overrides.get("architectures") in (["GemmaForCausalLM"], ["Gemma2ForCausalLM"], ["Gemma3ForCausalLM"]):
        version = {"GemmaForCausalLM": 1, "Gemma2ForCausalLM": 2, "Gemma3ForCausalLM": 3}[overrides["architectures"][0]]
        cfg["model_type"] = ("gemma", "gemma2", "gemma3_text")[version - 1]
        for k in ("mlp_bias", "hidden_act"):
            cfg.pop(k)
        cfg.update(hidden_activation="gelu_pytorch_tanh", tie_word_embeddings=True, rms_norm_eps=1e-6)
        if version >= 2:
            # A scale other than head_dim's and a window shorter than the tests' prompts.
            cfg.update(query_pre_attn_scalar=24, sliding_window=24)
        if version == 2:
            cfg.update(attn_logit_softcapping=5.0, final_logit_softcapping=100.0)   # caps that bite
        if version == 3:
            cfg.update(sliding_window_pattern=2, final_logit_softcapping=None, attn_logit_softcapping=None,
                       rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                        "full_attention": {"rope_type": "default", "rope_theta": 1e6}})
    for k, v in overrides.items():
        if v is None:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    return cfg


def corpus_text() -> str:
    return resources.files("raycluster.model").joinpath("data/corpus.txt").read_text(encoding="utf-8")


@functools.lru_cache(maxsize=1)
def _tokenizer_json() -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_VOCAB, min_frequency=1, special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(corpus_text().split("\n\n"), trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(
        single="<|bos|> $A", pair="<|bos|> $A <|bos|> $B:1", special_tokens=[("<|bos|>", BOS_ID)])
    return tok.to_str(pretty=True)


def _init_weights(cfg: dict, seed: int) -> dict[str, torch.Tensor]:
    from raycluster.model.llama import LlamaForCausalLM

    mc = ModelConfig.from_dict(cfg)
    with torch.device("meta"):
        shapes = {n: tuple(p.shape) for n, p in LlamaForCausalLM(mc).named_parameters()}
        if cfg.get("num_nextn_predict_layers"):       # DeepSeek-V3's / GLM-4.5's MTP layer after the decoder's
            from raycluster.model.mtp import MTPHead
            mtp = f"model.layers.{mc.num_hidden_layers}."
            shapes.update({mtp + n: tuple(p.shape) for n, p in MTPHead(mc, None, 0).named_parameters()})
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name in sorted(shapes):
        shape = shapes[name]
        if name.endswith("norm.weight") and mc.gemma is not None:
            t = 0.1 * torch.randn(shape, generator=g)       # Gemma's norms scale by 1 + weight
        elif name.endswith("norm.weight"):
            # Near-one norms: exercised by the HF comparison, harmless for the output.
            t = 1.0 + 0.1 * torch.randn(shape, generator=g)
        elif name.endswith(".bias"):
            t = 0.02 * torch.randn(shape, generator=g)
        elif name == "model.embed_tokens.weight":
            # Unit-scale embeddings keep token identity strong against the small block updates,
            # so greedy output varies with the input instead of collapsing to one token.
            t = torch.randn(shape, generator=g)
        elif name.endswith(("q_proj.weight", "k_proj.weight")):
            t = 0.1 * torch.randn(shape, generator=g)  # sharper attention than std 0.02
        elif name.endswith("e_score_correction_bias"):
            t = 0.1 * torch.randn(shape, generator=g)     # enough to change some choices
        elif name.endswith("act_fn.alpha_p"):        # xIELU as transformers initialises it
            t = torch.log(torch.expm1(torch.tensor([0.8])))
        elif name.endswith("act_fn.alpha_n"):
            t = torch.log(torch.expm1(torch.tensor([0.3])))
        elif name.endswith("act_fn.beta"):
            t = torch.tensor(0.5)
        elif name.endswith("act_fn.eps"):
            t = torch.tensor(-1e-6)
        elif name.endswith("self_attn.sinks"):
            t = torch.randn(shape, generator=g)          # sinks that take a real share of each softmax
        elif name.endswith(("mlp.gate.weight", "block_sparse_moe.gate.weight", "mlp.router.weight",
                            "feed_forward.router.weight", "router.layer.weight")):
            # A decisive router: rounding differences never flip which experts a token takes.
            t = 0.2 * torch.randn(shape, generator=g)
        else:
            t = 0.02 * torch.randn(shape, generator=g)
        out[name] = t.contiguous()
    if cfg.get("num_nextn_predict_layers"):       # as released, its embedding and head copy the model's
        out[mtp + "embed_tokens.weight"] = out["model.embed_tokens.weight"].clone()
        out[mtp + "shared_head.head.weight"] = out.get("lm_head.weight", out["model.embed_tokens.weight"]).clone()
    return _fused(out, mc) if mc.fused_projections else out


def _fused(tensors: dict[str, torch.Tensor], mc: ModelConfig) -> dict[str, torch.Tensor]:
    """The fused layout (Phi-3: each layer's q/k/v rows as one qkv_proj, gate/up rows as one
    gate_up_proj; GLM: gate_up_proj only)."""
    out = dict(tensors)
    for i in range(mc.num_hidden_layers):
        for fused, parts in (("self_attn.qkv_proj", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
                             ("mlp.gate_up_proj", ("mlp.gate_proj", "mlp.up_proj"))):
            if fused.rpartition(".")[2] not in mc.fused_projections:
                continue
            out[f"model.layers.{i}.{fused}.weight"] = torch.cat(
                [out.pop(f"model.layers.{i}.{p}.weight") for p in parts]).contiguous()
    return out


def write_tiny_model(path: str | os.PathLike, seed: int = 0, nulls: tuple[str, ...] = (), **overrides) -> str:
    """`nulls`: config fields written as JSON null (an override of None removes a field)."""
    path = os.fspath(path)
    os.makedirs(path, exist_ok=True)
    cfg = {**tiny_config(**overrides), **dict.fromkeys(nulls)}
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2, sort_keys=True)
        f.write("\n")
    save_file(_init_weights(cfg, seed), os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(path, "tokenizer.json"), "w", encoding="utf-8") as f:
        f.write(_tokenizer_json())
    tok_cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<|bos|>",
        "eos_token": "<|eos|>",
        "pad_token": "<|pad|>",
        "add_bos_token": True,
        "model_max_length": cfg["max_position_embeddings"],
        "chat_template": CHAT_TEMPLATE,
    }
    with open(os.path.join(path, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump(tok_cfg, f, indent=2, sort_keys=True)
        f.write("\n")
    return path


# Image-text wrappers of a tiny text checkpoint: (model_type, text model_type, the text
# architecture, a tiny vision tower's config, extra top-level fields).
_MULTIMODAL = {
    "Gemma3ForConditionalGeneration": ("gemma3", "gemma3_text", "Gemma3ForCausalLM", {
        "model_type": "siglip_vision_model", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
        "num_attention_heads": 2, "image_size": 28, "patch_size": 14},
        {"mm_tokens_per_image": 4, "image_token_index": 5, "boi_token_index": 3, "eoi_token_index": 4}),
    "Mistral3ForConditionalGeneration": ("mistral3", "mistral", "MistralForCausalLM", {
        "model_type": "pixtral", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
        "num_attention_heads": 2, "image_size": 28, "patch_size": 14, "head_dim": 16},
        {"image_token_index": 5, "spatial_merge_size": 2}),
    "LlavaForConditionalGeneration": ("llava", "llama", "LlamaForCausalLM", {
        "model_type": "clip_vision_model", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
        "num_attention_heads": 2, "image_size": 28, "patch_size": 14, "projection_dim": 32},
        {"image_token_index": 5}),
    "Llama4ForConditionalGeneration": ("llama4", "llama4_text", "Llama4ForCausalLM", {
        "model_type": "llama4_vision_model", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
        "num_attention_heads": 2, "image_size": 28, "patch_size": 14, "vision_output_dim": 32,
        "projector_input_dim": 32, "projector_output_dim": 32},
        {"image_token_index": 5, "boi_token_index": 3, "eoi_token_index": 4}),
    "Qwen2VLForConditionalGeneration": ("qwen2_vl", "qwen2_vl_text", "Qwen2ForCausalLM", {
        "model_type": "qwen2_vl", "depth": 1, "embed_dim": 32, "hidden_size": 256, "num_heads": 2, "mlp_ratio": 2},
        {"image_token_id": 5, "video_token_id": 6, "vision_start_token_id": 3, "vision_end_token_id": 4}),
    "Qwen2_5_VLForConditionalGeneration": ("qwen2_5_vl", "qwen2_5_vl_text", "Qwen2ForCausalLM", {
        "model_type": "qwen2_5_vl", "depth": 1, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2,
        "out_hidden_size": 256, "fullatt_block_indexes": [0]},
        {"image_token_id": 5, "video_token_id": 6, "vision_start_token_id": 3, "vision_end_token_id": 4}),
    "Qwen3VLMoeForConditionalGeneration": ("qwen3_vl_moe", "qwen3_vl_moe_text", "Qwen3MoeForCausalLM", {
        "model_type": "qwen3_vl_moe", "depth": 1, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2,
        "out_hidden_size": 256, "deepstack_visual_indexes": [0], "num_position_embeddings": 16},
        {"image_token_id": 5, "video_token_id": 6, "vision_start_token_id": 3, "vision_end_token_id": 4}),
    "Qwen3VLForConditionalGeneration": ("qwen3_vl", "qwen3_vl_text", "Qwen3ForCausalLM", {
        "model_type": "qwen3_vl", "depth": 1, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2,
        "out_hidden_size": 256, "deepstack_visual_indexes": [0], "num_position_embeddings": 16},
        {"image_token_id": 5, "video_token_id": 6, "vision_start_token_id": 3, "vision_end_token_id": 4}),
}
# Where each wrapper's released files keep the text model: under `language_model.`, or (Qwen2.5-VL)
# a flat config and plain names beside `visual.`; Qwen3-VL's are transformers 5's layout.
_RELEASED = {"Qwen2VLForConditionalGeneration": "flat", "Qwen2_5_VLForConditionalGeneration": "flat",
             "Qwen3VLForConditionalGeneration": "transformers5", "Qwen3VLMoeForConditionalGeneration": "transformers5"}
# Their multimodal RoPE sections (half-dims of the tiny heads: 16 of 32 dims).
_MROPE = {"Qwen2VLForConditionalGeneration": {"type": "mrope", "mrope_section": [4, 6, 6]},
          "Qwen2_5_VLForConditionalGeneration": {"type": "mrope", "mrope_section": [4, 6, 6]},
          "Qwen3VLForConditionalGeneration": {"rope_type": "default", "mrope_section": [6, 5, 5],
                                              "mrope_interleaved": True},
          "Qwen3VLMoeForConditionalGeneration": {"rope_type": "default", "mrope_section": [6, 5, 5],
                                                 "mrope_interleaved": True}}


# Text models a wrapper may hold besides its usual one (`text_architecture`): their model_type.
_OTHER_TEXT_TYPES = {"Ministral3ForCausalLM": "ministral3"}


def write_tiny_multimodal(path: str | os.PathLike, arch: str, seed: int = 0, layout: str = "released",
                          text_architecture: str | None = None, **overrides) -> str:
    """The tiny text checkpoint of `arch`'s text model wrapped as `arch` (an image-text model):
    config.json nesting it under `text_config` beside a tiny vision config, its tensors under
    `language_model.` (`layout` "released", as the hub's files and transformers' save_pretrained
    write them; Qwen2.5-VL's released files: a flat config, plain names beside `visual.`) or
    `model.language_model.` ("transformers5", the head as `lm_head.`), plus one vision tensor (the
    rest of the tower left out: a text-only server never reads it). `text_architecture`: another
    text model than the wrapper's usual one (Ministral 3 in Mistral 3)."""
    model_type, text_type, text_arch, vision, extra = _MULTIMODAL[arch]
    if text_architecture is not None:
        text_type, text_arch = _OTHER_TEXT_TYPES[text_architecture], text_architecture
    path = write_tiny_model(path, seed, architectures=[text_arch], **overrides)
    with open(os.path.join(path, "config.json")) as f:
        text = {k: v for k, v in json.load(f).items() if k != "architectures"}
    if arch in _MROPE:
        theta = text.pop("rope_parameters", {}).get("rope_theta", 1e6)
        text.update(rope_theta=theta, rope_scaling=_MROPE[arch])
    style = _RELEASED.get(arch, "language_model") if layout == "released" else layout
    config = {"architectures": [arch], "model_type": model_type, "vision_config": vision, "dtype": "float32", **extra}
    if style == "flat":
        config.update({k: v for k, v in text.items() if k != "model_type"})
    else:
        config["text_config"] = {**text, "model_type": text_type}
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)
    from safetensors.torch import load_file
    tensors = load_file(os.path.join(path, "model.safetensors"))
    if arch == "Qwen3VLMoeForConditionalGeneration":
        tensors = _stacked_experts(tensors)
    tower = "visual.blocks.0.norm1.weight" if arch in _MROPE else "vision_tower.vision_model.post_layernorm.weight"
    if style == "language_model":
        out = {"language_model." + k: v for k, v in tensors.items()}
    elif style == "flat":
        out = dict(tensors)
    else:
        out = {("model.language_model." + k[len("model."):]) if k.startswith("model.") else k: v
               for k, v in tensors.items()}
        tower = "model." + tower
    out[tower] = torch.ones(vision.get("embed_dim", vision["hidden_size"]))
    save_file(out, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    return path


def _stacked_experts(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Each sparse layer's experts as Qwen3-VL-MoE stores them: gate_up_proj [E, H, 2I] (gate
    columns, then up) and down_proj [E, I, H]."""
    out, experts = {}, {}
    for name, t in tensors.items():
        head, sep, rest = name.partition(".mlp.experts.")
        if not sep:
            out[name] = t
            continue
        e, proj = rest.split(".")[:2]
        experts.setdefault(head, {})[(int(e), proj)] = t
    for head, parts in experts.items():
        n = 1 + max(e for e, _ in parts)
        out[f"{head}.mlp.experts.gate_up_proj"] = torch.stack(
            [torch.cat([parts[(e, "gate_proj")].t(), parts[(e, "up_proj")].t()], dim=-1) for e in range(n)]).contiguous()
        out[f"{head}.mlp.experts.down_proj"] = torch.stack([parts[(e, "down_proj")].t() for e in range(n)]).contiguous()
    return out


def write_tiny_lora(path: str | os.PathLike, model_dir: str | os.PathLike, seed: int = 0, rank: int = 8,
                    alpha: float = 16.0, targets: tuple[str, ...] = ("q_proj", "v_proj", "o_proj", "down_proj"),
                    std: float = 0.05, use_rslora: bool = False) -> str:
    """A seeded LoRA adapter for the checkpoint in `model_dir`, in PEFT's format
    (adapter_config.json, adapter_model.safetensors with `base_model.model.` keys). Unlike PEFT's
    initialisation (B = 0), both A and B are random, so the adapter changes the output. The MLP
    targets are left out of a mixture-of-experts layer."""
    from raycluster.model.loader import load_config
    from raycluster.model.lora import _shapes, target_group

    cfg = load_config(os.fspath(model_dir))
    shapes = _shapes(cfg)
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(cfg.num_hidden_layers):
        for module in targets:
            if target_group(module) == "mlp" and cfg.is_moe_layer(layer):
                continue        # a sparse layer's experts take no adapter
            out_dim, in_dim = shapes[module]        # a fused model's fused projections too (Phi-3)
            key = f"base_model.model.model.layers.{layer}.{target_group(module)}.{module}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, in_dim, generator=gen) * std
            tensors[f"{key}.lora_B.weight"] = torch.randn(out_dim, rank, generator=gen) * std
    path = os.fspath(path)
    os.makedirs(path, exist_ok=True)
    save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump({"peft_type": "LORA", "r": rank, "lora_alpha": alpha, "target_modules": list(targets),
                   "lora_dropout": 0.0, "bias": "none", "fan_in_fan_out": False, "use_rslora": use_rslora,
                   "use_dora": False, "task_type": "CAUSAL_LM", "base_model_name_or_path": os.fspath(model_dir)},
                  f, indent=2, sort_keys=True)
    return path
