"""The from-scratch model vs transformers (fp32, eager attention) on the tiny checkpoint and
variants, and chunked prefill/decode through the paged cache vs one unchunked prefill."""

import pytest
import torch

from kernels.metadata import AttentionMetadata
from raycluster.model import load_model, write_tiny_model

torch.set_num_threads(2)
HF_ATOL, HF_RTOL = 1e-4, 1e-5  # fp32 vs fp32: observed ~1e-6 abs; tied variants have |logits| ~ 300
CHUNK_ATOL, CHUNK_RTOL = 1e-4, 1e-5  # same maths, different summation order across chunks

# Phi-4-mini-style LongRoPE over 3/4 of each head (12 of 16 rotary pairs' factors), a 32-token
# pretraining context: the 80-token prompts here are past it, so the long factors apply.
PHI_SHORT = [round(1.0 + 0.05 * i, 3) for i in range(12)]
PHI_LONG = [round(1.0 + 0.8 * i, 3) for i in range(12)]
LONGROPE = {"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75, "short_factor": PHI_SHORT,
            "long_factor": PHI_LONG, "original_max_position_embeddings": 32}
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
VARIANTS = {
    "tiny": {},
    "mha_tied_llama3": dict(num_attention_heads=4, num_key_value_heads=4, head_dim=48,
                            tie_word_embeddings=True, rope_parameters=LLAMA3_ROPE, num_hidden_layers=2),
    "gqa4_linear_bias": dict(num_attention_heads=8, num_key_value_heads=2, head_dim=16,
                             attention_bias=True, mlp_bias=True, num_hidden_layers=2,
                             rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0}),
    "qwen2": dict(architectures=["Qwen2ForCausalLM"], hidden_size=128, num_attention_heads=4,
                  num_key_value_heads=1, intermediate_size=256, num_hidden_layers=2,
                  tie_word_embeddings=True, rope_parameters={"rope_type": "default", "rope_theta": 1e6}),
    # Qwen3: RMSNorm on every query and key head before RoPE; biases on q/k/v and o_proj.
    "qwen3_bias": dict(architectures=["Qwen3ForCausalLM"], hidden_size=128, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=48, intermediate_size=256, num_hidden_layers=2,
                       attention_bias=True, rope_parameters={"rope_type": "default", "rope_theta": 1e6}),
    # YaRN over an original context shorter than the prompt (the ramp spans middle dimensions).
    "qwen2_yarn": dict(architectures=["Qwen2ForCausalLM"], hidden_size=128, num_attention_heads=4,
                       num_key_value_heads=2, intermediate_size=256, num_hidden_layers=2,
                       rope_parameters={"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0,
                                        "original_max_position_embeddings": 32}),
    # Sliding windows shorter than the prompt (80 tokens): Mistral's on every layer; Qwen2's on
    # the layers from max_window_layers on (layer 1 of 2), the first layer attending in full.
    "mistral_window": dict(architectures=["MistralForCausalLM"], sliding_window=24, num_hidden_layers=2,
                           rope_parameters={"rope_type": "default", "rope_theta": 1e6}),
    "qwen2_window": dict(architectures=["Qwen2ForCausalLM"], hidden_size=128, num_attention_heads=4,
                         num_key_value_heads=2, intermediate_size=256, num_hidden_layers=2,
                         use_sliding_window=True, sliding_window=19, max_window_layers=1,
                         rope_parameters={"rope_type": "default", "rope_theta": 1e6}),
    # Routed experts (raycluster.model.moe): Mixtral's 4 experts, top 2, on every layer (with a
    # window); Qwen2-MoE's shared expert on the sparse layer 1 only (decoder_sparse_step 2), its
    # top-2 weights not renormalised; Qwen3-MoE's 8 experts with layer 1 dense (mlp_only_layers).
    "mixtral_window": dict(architectures=["MixtralForCausalLM"], sliding_window=24, num_hidden_layers=2,
                           rope_parameters={"rope_type": "default", "rope_theta": 1e6}),
    "qwen2_moe": dict(architectures=["Qwen2MoeForCausalLM"], hidden_size=128, num_attention_heads=4,
                      num_key_value_heads=2, intermediate_size=256, num_hidden_layers=2, decoder_sparse_step=2,
                      moe_intermediate_size=96, shared_expert_intermediate_size=192),
    "qwen3_moe": dict(architectures=["Qwen3MoeForCausalLM"], hidden_size=128, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=48, intermediate_size=256, num_hidden_layers=3,
                      moe_intermediate_size=64, mlp_only_layers=[1]),
    # Gemma (raycluster.model.gemma_config): (1 + w) norms, scaled embeddings, GELU-tanh, tied.
    # Gemma 2: sandwich norms, query_pre_attn_scalar, attention and final soft caps, even layers
    # sliding. Gemma 3: q/k norms, its sliding layers' own RoPE base (transformers 5's nested
    # rope_parameters; the legacy file's rope_local_base_freq and a linear-scaled global RoPE).
    "gemma": dict(architectures=["GemmaForCausalLM"], num_hidden_layers=2),
    # Phi-3: q/k/v and gate/up stored fused (split at load); LongRoPE with partial rotary, the
    # long set (context 256 past the original 32) or the short one (the context within it); a
    # window on every layer.
    "phi3": dict(architectures=["Phi3ForCausalLM"], num_hidden_layers=2),
    # Granite: embedding, residual and attention multipliers and a logits divisor (tied).
    "granite": dict(architectures=["GraniteForCausalLM"], num_hidden_layers=2, tie_word_embeddings=True),
    # Granite MoE: the multipliers, and 8 stacked experts (input_linear / output_linear), top 2.
    "granite_moe": dict(architectures=["GraniteMoeForCausalLM"], num_hidden_layers=2),
    # Seed-OSS (o_proj's bias apart), Ernie 4.5 (biases everywhere, interleaved RoPE), Arcee
    # (an ungated ReLU-squared MLP).
    "seed_oss": dict(architectures=["SeedOssForCausalLM"], num_hidden_layers=2),
    "ernie4_5": dict(architectures=["Ernie4_5ForCausalLM"], num_hidden_layers=2),
    "arcee": dict(architectures=["ArceeForCausalLM"], num_hidden_layers=2),
    # Apertus: its learnt xIELU in an ungated MLP, per-head q/k norms, llama3 RoPE.
    "apertus": dict(architectures=["ApertusForCausalLM"], num_hidden_layers=2),
    # Hunyuan dense: per-head q/k norms after RoPE; its "dynamic" RoPE of a fixed alpha.
    "hunyuan": dict(architectures=["HunYuanDenseV1ForCausalLM"], num_hidden_layers=2),
    # Ministral 3: Mistral's layers, YaRN over a 32-token pretraining context and queries scaled by
    # 1 + beta ln(1 + floor(position / 32)) past it (beta raised from 0.1 so the factor shows).
    "ministral3": dict(architectures=["Ministral3ForCausalLM"], num_hidden_layers=2,
                       rope_parameters={"rope_type": "yarn", "rope_theta": 1e6, "factor": 16.0,
                                        "original_max_position_embeddings": 32, "beta_fast": 32.0, "beta_slow": 1.0,
                                        "mscale": 1.0, "mscale_all_dim": 1.0, "llama_4_scaling_beta": 0.8}),
    # OLMo 2: norms after each block's output only, q/k norms across all heads.
    "olmo2": dict(architectures=["Olmo2ForCausalLM"], num_hidden_layers=2),
    # OLMo 3: OLMo 2's layers, three sliding of every four, YaRN on the full layer only.
    "olmo3": dict(architectures=["Olmo3ForCausalLM"], num_hidden_layers=4),
    # Cohere: bias-free LayerNorm, attention and MLP side by side, interleaved RoPE, a logit
    # scale; Command R+'s per-head q/k norms; Cohere 2's sliding layers and full layers without RoPE.
    "cohere": dict(architectures=["CohereForCausalLM"], num_hidden_layers=2),
    "cohere_qk_norm": dict(architectures=["CohereForCausalLM"], num_hidden_layers=2, use_qk_norm=True,
                           tie_word_embeddings=False),
    "cohere2": dict(architectures=["Cohere2ForCausalLM"], num_hidden_layers=4),
    # GLM-4: gate/up stored fused, q/k/v biases, RoPE on interleaved pairs of each head's first
    # half; GLM-4-0414's norms after attention and the MLP too.
    "glm": dict(architectures=["GlmForCausalLM"], num_hidden_layers=2),
    "glm4": dict(architectures=["Glm4ForCausalLM"], num_hidden_layers=2),
    # Layers without RoPE: SmolLM3's every second one here; EXAONE 4's full-attention layers
    # between its sliding ones (with post-block norms and per-head q/k norms).
    "smollm3": dict(architectures=["SmolLM3ForCausalLM"], num_hidden_layers=4),
    "exaone4": dict(architectures=["Exaone4ForCausalLM"], num_hidden_layers=4),
    # DeepSeek-V3: latent attention (raycluster.model.mla; the cache holds one latent head) with
    # a YaRN RoPE and its mscale, grouped routing with a correction bias, a shared expert, layer 0
    # dense.
    "deepseek_v3": dict(architectures=["DeepseekV3ForCausalLM"], num_hidden_layers=3, max_position_embeddings=256,
                        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                         "original_max_position_embeddings": 64, "mscale": 1.0,
                                         "mscale_all_dim": 0.707, "beta_fast": 32, "beta_slow": 1}),
    # DeepSeek-V2: softmax routing within the groups of the best scores, never renormalised.
    "deepseek_v2": dict(architectures=["DeepseekV2ForCausalLM"], num_hidden_layers=3),
    # GLM-4.5: GQA with q/k/v biases, per-head q/k norms and half-width RoPE; DeepSeek-V3's routing.
    "glm4_moe": dict(architectures=["Glm4MoeForCausalLM"], num_hidden_layers=3),
    # StarCoder2: biases everywhere, LayerNorm with bias, an ungated GELU MLP; a window on every layer.
    "starcoder2": dict(architectures=["Starcoder2ForCausalLM"], num_hidden_layers=2),
    "starcoder2_window": dict(architectures=["Starcoder2ForCausalLM"], num_hidden_layers=2, sliding_window=24,
                              tie_word_embeddings=False),
    "phi3_longrope": dict(architectures=["Phi3ForCausalLM"], num_hidden_layers=2, max_position_embeddings=256,
                          original_max_position_embeddings=32, tie_word_embeddings=True, rope_parameters=LONGROPE),
    "phi3_longrope_short": dict(architectures=["Phi3ForCausalLM"], num_hidden_layers=2, max_position_embeddings=128,
                                original_max_position_embeddings=128, tie_word_embeddings=True,
                                rope_parameters={**LONGROPE, "original_max_position_embeddings": 128}),
    "phi3_window": dict(architectures=["Phi3ForCausalLM"], num_hidden_layers=2, sliding_window=24,
                        tie_word_embeddings=True),
    "gemma2": dict(architectures=["Gemma2ForCausalLM"], num_hidden_layers=3),
    # gpt-oss: attention sinks, even layers sliding, YaRN, biases on attention; 8 stacked experts
    # behind a biased router, a clamped SwiGLU (interleaved gate / up). Every layer full, no
    # attention biases: sinks on full layers alone.
    "gpt_oss": dict(architectures=["GptOssForCausalLM"], num_hidden_layers=2),
    # Llama 4: interleaved llama3 RoPE, weightless q/k norms on RoPE layers, NoPE layers with their
    # query temperature, routed layers (top 1, the score on the expert's input, a shared expert)
    # between dense ones; Scout's every layer routed, two experts per token.
    "llama4": dict(architectures=["Llama4ForCausalLM"], num_hidden_layers=4),
    "llama4_scout": dict(architectures=["Llama4ForCausalLM"], num_hidden_layers=2, interleave_moe_layer_step=1,
                         num_experts_per_tok=2),
    "gpt_oss_full": dict(architectures=["GptOssForCausalLM"], num_hidden_layers=3, layer_types=["full_attention"] * 3,
                         attention_bias=False),
    "gemma3": dict(architectures=["Gemma3ForCausalLM"], num_hidden_layers=3),
    "gemma3_legacy_rope": dict(architectures=["Gemma3ForCausalLM"], num_hidden_layers=2, rope_parameters=None,
                               rope_theta=1e6, rope_local_base_freq=500.0,
                               rope_scaling={"rope_type": "linear", "factor": 4.0}),
}


def run_chunks(model, ids, chunks, block_size=16, table=None):
    """Prefill `ids` in the given chunk sizes through a fresh paged cache (blocks in reverse
    order so block ids differ from positions); returns logits of every token."""
    n = len(ids)
    nblocks = -(-n // block_size) + 2
    table = table or list(range(nblocks))[::-1]
    cache = torch.zeros(model.kv_cache_shape(nblocks, block_size))
    out, pos = [], 0
    for c in chunks:
        slots = torch.tensor([table[p // block_size] * block_size + p % block_size for p in range(pos, pos + c)])
        meta = AttentionMetadata(c, 0, [c], [pos + c], [table], [], [], slots, block_size)
        h = model(torch.tensor(ids[pos:pos + c]), torch.arange(pos, pos + c), cache, meta)
        out.append(model.compute_logits(h))
        pos += c
    assert pos == n
    return torch.cat(out), cache, table


def _prompt(n, vocab, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n,), generator=g).tolist()


@pytest.fixture(scope="module")
def variant_dirs(tmp_path_factory, tiny_model_dir):
    dirs = {"tiny": tiny_model_dir}
    for name, over in VARIANTS.items():
        if name != "tiny":
            dirs[name] = write_tiny_model(tmp_path_factory.mktemp(name), seed=1, **over)
    return dirs


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_logits_match_transformers(variant, variant_dirs):
    transformers = pytest.importorskip("transformers")
    path = variant_dirs[variant]
    model, cfg = load_model(path)
    ids = _prompt(80, 2000)
    ours, _, _ = run_chunks(model, ids, [len(ids)])
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                           attn_implementation="eager")
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    assert ref.shape == ours.shape
    torch.testing.assert_close(ours, ref, atol=HF_ATOL, rtol=HF_RTOL)
    if variant == "tiny":
        # Not degenerate: logits vary across positions.
        assert len(set(ours.argmax(-1).tolist())) > 10


@pytest.mark.parametrize("variant", ["tiny", "mha_tied_llama3", "qwen2", "qwen3_bias", "mistral_window",
                                     "qwen2_window", "mixtral_window", "qwen2_moe", "qwen3_moe", "gemma2", "gemma3",
                                     "phi3_longrope", "phi3_window", "granite", "olmo2", "olmo3",
                                     "cohere_qk_norm", "cohere2", "glm4", "smollm3", "exaone4", "deepseek_v3",
                                     "deepseek_v2", "glm4_moe", "starcoder2_window", "gpt_oss", "llama4",
                                     "granite_moe", "seed_oss", "ernie4_5", "arcee", "apertus", "hunyuan",
                                     "ministral3"])
def test_chunked_prefill_and_decode_match_unchunked(variant, variant_dirs):
    model, cfg = load_model(variant_dirs[variant])
    ids = _prompt(1 + 7 + 64 + 20, 2000, seed=3)
    full, _, _ = run_chunks(model, ids, [len(ids)])
    for chunks in ([1, 7, 64, 20], [7, 7, 7, 71], [64, 28]):
        got, _, _ = run_chunks(model, ids, chunks, block_size=16)
        torch.testing.assert_close(got, full, atol=CHUNK_ATOL, rtol=CHUNK_RTOL)
    # Decode the last 10 tokens one at a time, two requests batched with different kv lens.
    bs = 16
    a, b = ids, ids[:50]
    la, lb = len(a) - 10, len(b) - 10
    _, cache_a, ta = run_chunks(model, a[:la], [la], block_size=bs)
    _, cache_b, tb = run_chunks(model, b[:lb], [lb], block_size=bs)
    # Put both requests into one cache: b's blocks after a's.
    na = cache_a.shape[1]
    cache = torch.cat([cache_a, torch.zeros_like(cache_a[:, :2]), cache_b], dim=1)
    tb = [x + na + 2 for x in tb]
    ta = ta + [na, na + 1]  # room to grow
    tb = tb + [na + 2 + cache_b.shape[1] + i for i in range(2)]
    cache = torch.cat([cache, torch.zeros_like(cache[:, :2])], dim=1)
    dec_a, dec_b = [], []
    for step in range(10):
        pa, pb = la + step, lb + step
        slots = torch.tensor([ta[pa // bs] * bs + pa % bs, tb[pb // bs] * bs + pb % bs])
        meta = AttentionMetadata(0, 2, [], [], [], [pa + 1, pb + 1], [ta, tb], slots, bs)
        h = model(torch.tensor([a[pa], b[pb]]), torch.tensor([pa, pb]), cache, meta)
        lg = model.compute_logits(h)
        dec_a.append(lg[0])
        dec_b.append(lg[1])
    full_b, _, _ = run_chunks(model, b, [len(b)])
    torch.testing.assert_close(torch.stack(dec_a), full[la:], atol=CHUNK_ATOL, rtol=CHUNK_RTOL)
    torch.testing.assert_close(torch.stack(dec_b), full_b[lb:], atol=CHUNK_ATOL, rtol=CHUNK_RTOL)


def test_mixed_prefill_and_decode_step(variant_dirs):
    """One step holding a prefill chunk of request A and a decode token of request B."""
    model, _ = load_model(variant_dirs["tiny"])
    bs = 16
    a = _prompt(40, 2000, seed=5)
    b = _prompt(30, 2000, seed=6)
    full_a, _, _ = run_chunks(model, a, [40])
    full_b, _, _ = run_chunks(model, b, [30])
    ta, tb = [0, 1, 2], [3, 4]
    cache = torch.zeros(model.kv_cache_shape(5, bs))
    # Step 1: A's first 33 tokens, B's first 29 tokens as two prefills.
    slots = [ta[p // bs] * bs + p % bs for p in range(33)] + [tb[p // bs] * bs + p % bs for p in range(29)]
    meta = AttentionMetadata(62, 0, [33, 29], [33, 29], [ta, tb], [], [], torch.tensor(slots), bs)
    model(torch.tensor(a[:33] + b[:29]), torch.tensor(list(range(33)) + list(range(29))), cache, meta)
    # Step 2: A's remaining 7 tokens (prefill chunk) + B's last token (decode).
    slots = [ta[p // bs] * bs + p % bs for p in range(33, 40)] + [tb[29 // bs] * bs + 29 % bs]
    meta = AttentionMetadata(7, 1, [7], [40], [ta], [30], [tb], torch.tensor(slots), bs)
    h = model(torch.tensor(a[33:] + b[29:]), torch.tensor(list(range(33, 40)) + [29]), cache, meta)
    lg = model.compute_logits(h)
    torch.testing.assert_close(lg[:7], full_a[33:], atol=CHUNK_ATOL, rtol=CHUNK_RTOL)
    torch.testing.assert_close(lg[7], full_b[29], atol=CHUNK_ATOL, rtol=CHUNK_RTOL)


@pytest.mark.parametrize("params", [
    {"factor": 4.0, "original_max_position_embeddings": 4096},
    {"factor": 8.0, "original_max_position_embeddings": 2048, "beta_fast": 16, "beta_slow": 2, "truncate": False},
    {"factor": 40.0, "original_max_position_embeddings": 4096, "mscale": 1.0, "mscale_all_dim": 0.707},
    {"factor": 2.0, "original_max_position_embeddings": 8192, "attention_factor": 1.25},
])
def test_yarn_frequencies_and_attention_factor_equal_transformers(params):
    """YaRN's inverse frequencies and cos/sin factor against transformers' own computation, for
    the plain form and its DeepSeek-style (mscale) and explicit-factor variants."""
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from raycluster.model.rope import compute_inv_freq, yarn_attention_factor

    rope = {"rope_type": "yarn", "rope_theta": 1e6, **params}
    hf_cfg = transformers.Qwen2Config(hidden_size=1024, num_attention_heads=8, max_position_embeddings=32768,
                                      rope_parameters=dict(rope))
    want_freq, want_factor = ROPE_INIT_FUNCTIONS["yarn"](hf_cfg, "cpu")
    torch.testing.assert_close(compute_inv_freq(128, 1e6, rope), want_freq, atol=0, rtol=1e-6)
    assert yarn_attention_factor(rope) == pytest.approx(want_factor, rel=1e-12)


def test_a_scaled_rope_sets_the_served_context_as_vllm():
    from raycluster.model.config import ModelConfig

    base = dict(architectures=["LlamaForCausalLM"], hidden_size=64, num_attention_heads=4, vocab_size=100,
                intermediate_size=128, num_hidden_layers=1, max_position_embeddings=32768)
    assert ModelConfig.from_dict(base).max_model_len == 32768
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}
    assert ModelConfig.from_dict({**base, "rope_scaling": yarn}).max_model_len == 131072
    linear = {"type": "linear", "factor": 2.0}
    assert ModelConfig.from_dict({**base, "rope_scaling": linear}).max_model_len == 65536
    assert ModelConfig.from_dict({**base, "max_position_embeddings": 131072,
                                  "rope_scaling": {**LLAMA3_ROPE, "original_max_position_embeddings": 8192}}
                                 ).max_model_len == 131072
