"""DeepSeek-V3 (`DeepseekV3ForCausalLM`) and V2 (`DeepseekV2ForCausalLM`): multi-head latent attention served absorbed over one
latent KV head (raycluster.model.mla), grouped sigmoid routing with a correction bias and a
shared expert (raycluster.model.moe; V2's softmax routing within the groups of the best
scores). config.json read as transformers reads it; the absorbed
attention against the plain formula (every head's keys and values expanded from the latents);
the engine's greedy tokens equal to transformers' `generate` (q through its low-rank bottleneck,
and DeepSeek-V2-Lite's single q_proj); FP8 block-quantized checkpoints (the released format)
against transformers and on a TP group; a KVP group and a pipeline equal to one process; what is
refused. Logits against transformers, chunked and decoded: test_model_hf.py; tp groups (heads
split, the latent head replicated) and shards read from the file: test_tp.py, test_shard_load.py."""

from __future__ import annotations

import pytest
import torch
from family_checks import greedy_equals_transformers, kvp_engine_equals_single_engine, pipeline_equals_single_runner

from raycluster.engine.config import EngineConfig
from raycluster.engine.engine import LLMEngine
from raycluster.model.config import ModelConfig, ModelConfigError
from raycluster.model.loader import load_model
from raycluster.model.lora import AdapterError, load_adapter
from raycluster.model.tiny import tiny_config, write_tiny_lora, write_tiny_model

ARCH = ["DeepseekV3ForCausalLM"]


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory):
    path = write_tiny_model(tmp_path_factory.mktemp("dsv3"), seed=2, architectures=ARCH, num_hidden_layers=3)
    return path, load_model(path)[0]


def test_config_reads_the_latent_attention_and_the_routing():
    cfg = ModelConfig.from_dict(tiny_config(architectures=ARCH, num_hidden_layers=3))
    m = cfg.mla
    assert (m.q_lora_rank, m.kv_lora_rank, m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim) == (64, 32, 16, 8, 16)
    # The cache: one latent head as wide as the latent plus the rotary key.
    assert (cfg.num_key_value_heads, cfg.head_dim, cfg.rotary_dim, cfg.rope_interleaved) == (1, 40, 8, True)
    moe = cfg.moe
    assert moe.layers == (1, 2) and moe.deepseek and (moe.n_group, moe.topk_group, moe.routed_scaling) == (4, 2, 2.5)
    assert moe.shared_intermediate_size == 64 and moe.num_experts == 8 and moe.top_k == 2
    # q_lora_rank: an explicit null is one q_proj; absent, transformers' default rank.
    assert ModelConfig.from_dict({**tiny_config(architectures=ARCH), "q_lora_rank": None}).mla.q_lora_rank is None
    assert ModelConfig.from_dict(tiny_config(architectures=ARCH, q_lora_rank=None)).mla.q_lora_rank == 1536


@pytest.mark.parametrize("over, field", [
    (dict(kv_lora_rank=0), "kv_lora_rank"), (dict(qk_rope_head_dim=7), "qk_rope_head_dim"),
    (dict(n_group=3), "n_group"), (dict(routed_scaling_factor=-1), "routed_scaling_factor"),
    # FP8 (its own releases' format) is served; integer weights are not.
    (dict(quantization_config={"quant_method": "gptq", "bits": 4, "group_size": 32, "sym": True}),
     "quantization_config"),
])
def test_config_errors_name_the_field(over, field):
    with pytest.raises(ModelConfigError, match=field):
        ModelConfig.from_dict(tiny_config(architectures=ARCH, **over))


def test_absorbed_attention_equals_the_expanded_formula(deepseek):
    """Layer 0's attention output from the model against every head's keys and values expanded
    from the cached latents and plain causal softmax attention (fp64)."""
    _, model = deepseek
    attn, cfg = model.model.layers[0].self_attn, model.config
    m, h = cfg.mla, cfg.num_attention_heads
    x = torch.randn(21, cfg.hidden_size, generator=torch.Generator().manual_seed(0))
    pos = torch.arange(21)
    cos, sin = model.rotary.cos_sin(pos, torch.float32)
    from kernels.metadata import AttentionMetadata
    cache = torch.zeros(model.kv_cache_shape(4, 16))[0]
    meta = AttentionMetadata(21, 0, [21], [21], [[2, 0]], [], [], torch.tensor([2 * 16 + p if p < 16 else p - 16
                                                                                  for p in range(21)]), 16)
    got = attn(x, cos, sin, cache, meta, model._backend(x.device))
    # The plain formula.
    q = (attn.q_b_proj(attn.q_a_layernorm(attn.q_a_proj(x)))).view(21, h, -1).double()
    q_nope, q_pe = q.split([m.qk_nope_head_dim, m.qk_rope_head_dim], -1)
    latent, k_pe = attn.kv_a_proj_with_mqa(x).split([m.kv_lora_rank, m.qk_rope_head_dim], -1)
    kv = attn.kv_b_proj(attn.kv_a_layernorm(latent)).view(21, h, -1).double()
    k_nope, v = kv.split([m.qk_nope_head_dim, m.v_head_dim], -1)
    from raycluster.model.rope import apply_rope
    q_pe, k_pe = apply_rope(q_pe, k_pe.view(21, 1, -1).double(), cos.double(), sin.double(), True)
    k = torch.cat([k_nope, k_pe.expand(21, h, -1)], -1)
    scores = torch.einsum("qhd,khd->hqk", torch.cat([q_nope, q_pe], -1), k) * attn.scale
    scores = scores.masked_fill(torch.ones(21, 21, dtype=torch.bool).triu(1), float("-inf"))
    want = attn.o_proj(torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(21, -1).float())
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert attn.scale == pytest.approx((m.qk_nope_head_dim + m.qk_rope_head_dim) ** -0.5)


def test_engine_greedy_tokens_equal_transformers_generate(deepseek):
    greedy_equals_transformers(*deepseek, [(4, 10), (35, 8), (70, 6)], seed=14)


@pytest.mark.parametrize("arch", ["DeepseekV3ForCausalLM", "DeepseekV2ForCausalLM"])
def test_v2_lite_style_single_q_proj_equals_transformers(tmp_path, arch):
    path = write_tiny_model(tmp_path, seed=3, nulls=("q_lora_rank",), architectures=[arch], num_hidden_layers=2)
    model, cfg = load_model(path)
    assert cfg.mla.q_lora_rank is None and hasattr(model.model.layers[0].self_attn, "q_proj")
    greedy_equals_transformers(path, model, [(10, 10), (50, 8)], seed=15)


def test_v2_routes_by_softmax_within_the_best_groups():
    cfg = ModelConfig.from_dict(tiny_config(architectures=["DeepseekV2ForCausalLM"], num_hidden_layers=3))
    assert cfg.moe.deepseek == "v2" and (cfg.moe.n_group, cfg.moe.topk_group) == (4, 2) and not cfg.moe.norm_topk_prob
    greedy = ModelConfig.from_dict(tiny_config(architectures=["DeepseekV2ForCausalLM"], topk_method="greedy"))
    assert greedy.moe.n_group == 1
    with pytest.raises(ModelConfigError, match="topk_method"):
        ModelConfig.from_dict(tiny_config(architectures=["DeepseekV2ForCausalLM"], topk_method="noaux_tc"))


def test_a_pipeline_gives_the_single_runners_hidden_rows(deepseek, monkeypatch):
    pipeline_equals_single_runner(deepseek[1], monkeypatch)


def test_a_kvp_engine_gives_the_single_engines_tokens(deepseek, monkeypatch):
    kvp_engine_equals_single_engine(deepseek[1], monkeypatch)


def test_lora_is_refused_by_name(deepseek, tmp_path):
    _, model = deepseek
    tiny = write_tiny_model(tmp_path / "llama", num_hidden_layers=1)
    adapter = write_tiny_lora(tmp_path / "lora", tiny)
    with pytest.raises(AdapterError, match="latent attention"):
        load_adapter(adapter, model.config, "x")


def test_the_cache_holds_one_latent_head_per_token(deepseek):
    _, model = deepseek
    assert model.kv_cache_shape(10, 16) == (3, 10, 2, 16, 1, 40)
    eng = LLMEngine(EngineConfig(kv_cache_tokens=1024, policy="fcfs", packer="token"), model)
    # 3 layers x (keys + values) x 40 fp32 numbers: 960 bytes a token, where expanded per-head
    # keys and values (8 heads x (24 + 16)) would take 3 x 8 x 40 x 4 = 3840.
    assert eng.runner.kv_bytes_per_token() == 960


@pytest.fixture(scope="module")
def deepseek_fp8(deepseek, tmp_path_factory):
    """The tiny checkpoint in DeepSeek-V3's released format: FP8 weights in 8 x 8 blocks with
    `weight_scale_inv`, the router, norms, embedding and head dense."""
    from raycluster.model.quant.write import quantize_checkpoint

    path = str(tmp_path_factory.mktemp("dsv3-fp8"))
    quantize_checkpoint(deepseek[0], path, "fp8-block", 8)
    return path, load_model(path, quant_kernels="quantized")[0]


def test_an_fp8_checkpoint_equals_transformers(deepseek, deepseek_fp8):
    """Dequantized at load (the absorbed kv_b_proj reads the dense weight): transformers' own FP8
    dequantization gives the same logits, which differ from the unquantized model's."""
    transformers = pytest.importorskip("transformers")
    from test_model_hf import _prompt, run_chunks

    from raycluster.model.quant.linear import QuantLinear

    path, model = deepseek_fp8
    attn = model.model.layers[1].self_attn
    assert isinstance(attn.kv_b_proj, QuantLinear) and isinstance(attn.q_a_proj, QuantLinear)
    assert isinstance(model.model.layers[1].mlp.experts["0"].down_proj, QuantLinear)
    assert type(model.model.layers[1].mlp.gate).__name__ == "DeepseekRouter"
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = _prompt(60, 2000)
    got, _, _ = run_chunks(model, ids, [60])
    with torch.no_grad():
        want = hf(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-5)
    dense, _, _ = run_chunks(deepseek[1], ids, [60])
    assert (dense - want).abs().max() > 1e-3


def test_an_fp8_checkpoint_on_a_tp_group(deepseek_fp8):
    """Each rank reads its heads' rows of the FP8 projections and their block scales."""
    from test_tp import BASE, BS, _close, same_as_single_runner

    from raycluster.model.loader import load_config
    from raycluster.parallel.factory import build_runner
    from raycluster.parallel.shard import Checkpoint

    path, model = deepseek_fp8
    runner = build_runner(EngineConfig(**{**BASE, "kv_cache_tokens": 64 * BS, "tp": 2, "quant_kernels": "quantized"}),
                          Checkpoint(path, load_config(path), "quantized"), torch.float32)
    try:
        same_as_single_runner(model, runner)
    finally:
        _close(runner)


def test_raycluster_quantize_writes_deepseek_as_fp8_only(deepseek, tmp_path):
    from raycluster.model.quant.write import quantize_checkpoint

    with pytest.raises(ValueError, match="beyond FP8"):
        quantize_checkpoint(deepseek[0], str(tmp_path / "q"), "w4a16", 32)
