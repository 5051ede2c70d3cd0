"""Mixture-of-experts layers (Mixtral, Qwen2-MoE, Qwen3-MoE): config.json read as transformers
reads it, the block against the per-token formula, checkpoints written by transformers itself
loading and giving its logits, tensor-parallel shards of the block summing to the whole, and
LoRA adapters refused on experts but served on a MoE model's attention. (Logits and greedy
tokens against transformers: test_model_hf.py, test_engine_hf.py; groups: test_tp.py,
test_spp_tp.py, test_kvp_tp.py, test_shard_load.py.)"""

from __future__ import annotations

import random

import pytest
import torch

from raycluster.engine.config import EngineConfig
from raycluster.engine.engine import LLMEngine
from raycluster.model.config import ModelConfig, ModelConfigError
from raycluster.model.loader import load_model
from raycluster.model.lora import TARGETS, AdapterError, load_adapter
from raycluster.model.moe import SparseMoE
from raycluster.model.tiny import tiny_config, write_tiny_lora, write_tiny_model
from raycluster.parallel.shard import shard_model
from raycluster.request import SamplingParams

SMALL = dict(hidden_size=128, num_attention_heads=4, num_key_value_heads=2, intermediate_size=256,
             num_hidden_layers=4, rope_parameters={"rope_type": "default", "rope_theta": 1e6})
MIXTRAL = dict(SMALL, architectures=["MixtralForCausalLM"], intermediate_size=192)
QWEN2 = dict(SMALL, architectures=["Qwen2MoeForCausalLM"], moe_intermediate_size=96,
             shared_expert_intermediate_size=192, decoder_sparse_step=2)
QWEN3 = dict(SMALL, architectures=["Qwen3MoeForCausalLM"], head_dim=32, moe_intermediate_size=64,
             mlp_only_layers=[0, 2])


def _cfg(**over) -> ModelConfig:
    return ModelConfig.from_dict(tiny_config(**over))


# ---- config.json --------------------------------------------------------------------------------
def test_each_architecture_reads_its_experts_and_sparse_layers():
    m = _cfg(**MIXTRAL).moe
    assert (m.num_experts, m.top_k, m.intermediate_size, m.norm_topk_prob, m.layers, m.mixtral_names,
            m.shared_intermediate_size) == (4, 2, 192, True, (0, 1, 2, 3), True, 0)
    q2 = _cfg(**QWEN2)
    # decoder_sparse_step 2: layers i with (i + 1) % 2 == 0; Qwen2-MoE's weights not renormalised.
    assert (q2.moe.layers, q2.moe.norm_topk_prob, q2.moe.shared_intermediate_size, q2.moe.intermediate_size,
            q2.intermediate_size, q2.qkv_bias) == ((1, 3), False, 192, 96, 256, True)
    q3 = _cfg(**QWEN3)
    assert (q3.moe.layers, q3.moe.num_experts, q3.moe.norm_topk_prob, q3.qk_norm) == ((1, 3), 8, True, True)
    assert [q3.is_moe_layer(i) for i in range(4)] == [False, True, False, True]
    assert _cfg().moe is None and not _cfg().is_moe_layer(0)


@pytest.mark.parametrize("over,message", [
    (dict(num_experts_per_tok=5), "'num_experts_per_tok' = 5 exceeds the 4 experts"),
    (dict(num_experts_per_tok=0), "'num_experts_per_tok' = 0 must be at least 1"),
    (dict(num_local_experts="many"), "'num_local_experts' has invalid value 'many'"),
    (dict(num_local_experts=None), "'num_local_experts' has invalid value None"),
])
def test_bad_mixtral_fields_are_named(over, message):
    with pytest.raises(ModelConfigError, match=message):
        _cfg(**{**MIXTRAL, **over})


def test_bad_qwen_fields_are_named():
    with pytest.raises(ModelConfigError, match="'mlp_only_layers' must be a list"):
        _cfg(**{**QWEN3, "mlp_only_layers": "0,2"})
    with pytest.raises(ModelConfigError, match="'moe_intermediate_size' has invalid value None"):
        _cfg(**{**QWEN3, "moe_intermediate_size": None})
    with pytest.raises(ModelConfigError, match="'decoder_sparse_step' = 0"):
        _cfg(**{**QWEN2, "decoder_sparse_step": 0})


def test_sliding_layers_follow_transformers_for_the_moe_models():
    # Mixtral as Mistral (every layer); Qwen3-MoE every layer once use_sliding_window is set;
    # Qwen2-MoE without layer_types: the even layers below max_window_layers.
    assert _cfg(**MIXTRAL, sliding_window=64).sliding_layers == (0, 1, 2, 3)
    assert _cfg(**QWEN3, sliding_window=64).sliding_layers == ()
    assert _cfg(**QWEN3, sliding_window=64, use_sliding_window=True).sliding_layers == (0, 1, 2, 3)
    assert _cfg(**QWEN2, sliding_window=64, use_sliding_window=True, max_window_layers=3).sliding_layers == (0, 2)


# ---- the block against the formula -----------------------------------------------------------------
def _per_token(block: SparseMoE, x: torch.Tensor, norm: bool) -> torch.Tensor:
    """Each token alone: softmax over the router's logits, its top k experts, their weights
    (renormalised when `norm`), the weighted sum of those experts' outputs, plus the shared
    expert scaled by sigmoid(its gate)."""
    out = []
    for row in x:
        probs = torch.softmax(row @ block.gate.weight.t(), dim=-1)
        w, ids = probs.topk(block.top_k)
        w = w / w.sum() if norm else w
        y = sum(wi * block.experts[str(int(e))](row[None])[0] for wi, e in zip(w, ids))
        if block.shared_expert is not None:
            y = y + torch.sigmoid(row @ block.shared_expert_gate.weight[0]) * block.shared_expert(row[None])[0]
        out.append(y)
    return torch.stack(out)


@pytest.mark.parametrize("over", [MIXTRAL, QWEN2, QWEN3], ids=["mixtral", "qwen2-moe", "qwen3-moe"])
def test_the_block_is_the_per_token_formula(over):
    cfg = _cfg(**over)
    torch.manual_seed(0)
    block = SparseMoE(cfg)
    for p in block.parameters():
        torch.nn.init.normal_(p, std=0.2)
    x = torch.randn(37, cfg.hidden_size)
    with torch.no_grad():
        got = block(x)
        want = _per_token(block, x, cfg.moe.norm_topk_prob)
        ids = block.route(x)[1]
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert len(set(ids.flatten().tolist())) == cfg.moe.num_experts      # every expert takes some tokens
    with torch.no_grad():
        one = block(x[:1])                     # a decode row alone: same as in the batch
    torch.testing.assert_close(one, got[:1], atol=1e-5, rtol=1e-5)


# ---- checkpoints written by transformers --------------------------------------------------------------
@pytest.mark.parametrize("arch", ["Mixtral", "Qwen2Moe", "Qwen3Moe"])
def test_a_checkpoint_saved_by_transformers_loads_and_gives_its_logits(arch, tmp_path):
    """transformers 5 keeps each expert fused in memory but saves the hub's per-expert names:
    our loader reads its files strictly (every tensor a parameter of ours) and matches it."""
    transformers = pytest.importorskip("transformers")
    from test_model_hf import run_chunks
    kw = dict(vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, num_experts_per_tok=2)
    if arch == "Mixtral":
        kw.update(num_local_experts=4)
    else:
        kw.update(num_experts=4, moe_intermediate_size=48)
        if arch == "Qwen2Moe":
            kw.update(shared_expert_intermediate_size=80)
    config = getattr(transformers, f"{arch}Config")(**kw)
    torch.manual_seed(0)
    hf = getattr(transformers, f"{arch}ForCausalLM")(config).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("gate.weight") and "proj" not in name:
                p.normal_(std=0.5)              # a decisive router (HF initialises it at zero for Qwen)
    hf.save_pretrained(tmp_path)
    model, cfg = load_model(tmp_path)
    assert cfg.moe is not None
    ids = torch.randint(0, 512, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    ours = run_chunks(model, ids, [40])[0]
    hf.config._attn_implementation = "eager"
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-5)


# ---- tensor parallelism -----------------------------------------------------------------------------
@pytest.mark.parametrize("over,tp", [(MIXTRAL, 2), (QWEN2, 4), (QWEN3, 2)], ids=["mixtral", "qwen2-moe", "qwen3-moe"])
def test_tp_shards_of_a_sparse_layer_sum_to_the_whole_block(over, tp, tmp_path):
    """Every rank routes every token alike (the router is whole on each) and holds a slice of
    every expert: the ranks' unreduced outputs sum to the whole block's."""
    model, cfg = load_model(write_tiny_model(tmp_path, seed=2, **over))
    layer = cfg.moe.layers[0]
    shards = [shard_model(model, r, tp) for r in range(tp)]
    x = torch.randn(23, cfg.hidden_size, generator=torch.Generator().manual_seed(0))
    whole = model.model.layers[layer].ffn
    parts = [s.model.layers[layer].ffn for s in shards]
    for p in parts:
        assert p.gate.weight.shape == whole.gate.weight.shape
        down = p.experts["0"].w2 if cfg.moe.mixtral_names else p.experts["0"].down_proj
        assert down.weight.shape[1] * tp == cfg.moe.intermediate_size
    with torch.no_grad():
        torch.testing.assert_close(sum(p(x) for p in parts), whole(x), atol=1e-5, rtol=1e-5)


# ---- LoRA -----------------------------------------------------------------------------------------------
def test_lora_on_experts_is_refused_and_on_attention_is_served(tmp_path):
    path = write_tiny_model(tmp_path / "m", seed=3, **QWEN2)          # layers 1, 3 sparse; 0, 2 dense
    model, cfg = load_model(path)
    # write_tiny_lora leaves the sparse layers' MLP out: down_proj only on layers 0 and 2.
    ok = write_tiny_lora(tmp_path / "ok", path, seed=1, targets=("q_proj", "v_proj", "down_proj"))
    adapter = load_adapter(ok, cfg, "ok")
    assert {(i, m) for i, m in adapter.weights if m == "down_proj"} == {(0, "down_proj"), (2, "down_proj")}
    # One a PEFT run on a dense model's names would write, on a sparse layer: refused, named.
    from safetensors.torch import load_file, save_file
    tensors = load_file(f"{ok}/adapter_model.safetensors")
    for ab, shape in (("A", (8, 256)), ("B", (128, 8))):
        tensors[f"base_model.model.model.layers.1.mlp.down_proj.lora_{ab}.weight"] = torch.zeros(shape)
    save_file(tensors, f"{ok}/adapter_model.safetensors")
    with pytest.raises(AdapterError, match="layers.1.mlp.down_proj.* a mixture-of-experts layer"):
        load_adapter(ok, cfg, "bad")
    # An attention-only adapter on the MoE model gives the merged model's tokens.
    attn = write_tiny_lora(tmp_path / "attn", path, seed=2, targets=("q_proj", "v_proj", "o_proj"))
    base = dict(policy="fcfs", packer="token", predictor="none", kv_cache_tokens=4096)
    rng = random.Random(0)
    prompts = [[rng.randrange(6, 4000) for _ in range(n)] for n in (5, 40, 17)]
    sp = SamplingParams(max_tokens=10, ignore_eos=True)
    eng = LLMEngine(EngineConfig(**base, lora_modules=[f"attn={attn}"]), model)
    got = eng.generate(prompts, SamplingParams(max_tokens=10, ignore_eos=True, lora_adapter="attn"))
    merged, _ = load_model(path)
    for (layer, module), (a, b) in load_adapter(attn, cfg, "ref").weights.items():
        with torch.no_grad():
            getattr(getattr(merged.model.layers[layer], TARGETS[module]), module).weight += b @ a
    want = LLMEngine(EngineConfig(**base), merged).generate(prompts, sp)
    plain = LLMEngine(EngineConfig(**base), model).generate(prompts, sp)
    assert got == want and got != plain
