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


def write_tiny_lora(path: str | os.PathLike, model_dir: str | os.PathLike, seed: int = 0, rank: int = 8,
                    alpha: float = 16.0, targets: tuple[str, ...] = ("q_proj", "v_proj", "o_proj", "down_proj"),
                    std: float = 0.05, use_rslora: bool = False, layers_prefix: str = "model.layers") -> str:
    """A seeded LoRA adapter for the checkpoint in `model_dir`, in PEFT's format
    (adapter_config.json, adapter_model.safetensors with `base_model.model.` keys). Unlike PEFT's
    initialisation (B = 0), both A and B are random, so the adapter changes the output. The MLP
    targets are left out of a mixture-of-experts layer. `layers_prefix`: where the decoder layers
    are named (an image-text model's `model.language_model.layers`, whose adapter config then
    targets the language model's projections only, by a regex, as PEFT users restrict it)."""
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
            key = f"base_model.model.{layers_prefix}.{layer}.{target_group(module)}.{module}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, in_dim, generator=gen) * std
            tensors[f"{key}.lora_B.weight"] = torch.randn(out_dim, rank, generator=gen) * std
    path = os.fspath(path)
    os.makedirs(path, exist_ok=True)
    save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        chosen = list(targets) if layers_prefix == "model.layers" else rf".*language_model.*\.({'|'.join(targets)})"
        json.dump({"peft_type": "LORA", "r": rank, "lora_alpha": alpha, "target_modules": chosen,
                   "lora_dropout": 0.0, "bias": "none", "fan_in_fan_out": False, "use_rslora": use_rslora,
                   "use_dora": False, "task_type": "CAUSAL_LM", "base_model_name_or_path": os.fspath(model_dir)},
                  f, indent=2, sort_keys=True)
    return path
