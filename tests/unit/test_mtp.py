"""Speculative decoding with the checkpoint's own multi-token-prediction layer (`speculative_method:
mtp`, vLLM's deepseek_mtp) on DeepSeek-V3 and GLM-4.5: the layer read from the checkpoint (its
block routed as the layers before it), its draft logits equal to the composition by hand (the
embedding zeroed at position 0, enorm / hnorm, eh_proj, the block with its residual, the shared
head), the engine's greedy tokens unchanged with drafts made (one process and a tp group), and
what is refused."""

from __future__ import annotations

import random

import pytest
import torch
from safetensors.torch import load_file, save_file

from kernels import get_attention_backend
from kernels.metadata import AttentionMetadata
from raycluster.engine.config import EngineConfig
from raycluster.engine.engine import LLMEngine
from raycluster.engine_flags import speculative_config
from raycluster.model.checkpoint_files import CheckpointError
from raycluster.model.llama import DecoderLayer
from raycluster.model.loader import load_model
from raycluster.model.moe import SparseMoE
from raycluster.model.mtp import load_mtp_head
from raycluster.model.tiny import write_tiny_model
from raycluster.request import SamplingParams

ARCHS = ["DeepseekV3ForCausalLM", "Glm4MoeForCausalLM"]


@pytest.fixture(scope="module", params=ARCHS)
def checkpoint(request, tmp_path_factory):
    path = write_tiny_model(tmp_path_factory.mktemp(request.param), seed=7, architectures=[request.param],
                            num_hidden_layers=3, num_nextn_predict_layers=1)
    return path, load_model(path)[0]


def test_the_layer_is_read_from_the_checkpoint(checkpoint):
    path, model = checkpoint
    head = load_mtp_head(path, model)
    stored = load_file(f"{path}/model.safetensors")
    for name, p in head.named_parameters():
        assert torch.equal(p, stored[f"model.layers.3.{name}"]), name
    assert isinstance(head.ffn, SparseMoE) and head.first_kv_layer == 0 and head.num_kv_layers == 1


def test_draft_logits_equal_the_composition_by_hand(checkpoint):
    path, model = checkpoint
    head = load_mtp_head(path, model)
    cfg, n = model.config, 9
    block = DecoderLayer(_routed(cfg), 3)
    block.load_state_dict({k: v for k, v in head.state_dict().items() if not k.startswith(
        ("embed_tokens", "enorm", "hnorm", "eh_proj", "shared_head"))})
    ids, pos = torch.randint(6, 3000, (n,), generator=torch.Generator().manual_seed(1)), torch.arange(n)
    hidden = torch.randn(n, cfg.hidden_size, generator=torch.Generator().manual_seed(2))
    backend = get_attention_backend("cpu")
    cache = torch.zeros(model.kv_cache_shape(2, 16))[:1]
    meta = AttentionMetadata(n, 0, [n], [n], [[1]], [], [], torch.arange(16, 16 + n), 16)
    x, nxt = head(ids, pos, hidden, cache, meta, backend)
    with torch.no_grad():
        e = head.embed_tokens(ids)
        e[0] = 0                                        # position 0's embedding is masked
        want = head.eh_proj(torch.cat([head.enorm(e), head.hnorm(hidden)], -1))
        cos, sin = model.rotary.cos_sin(pos, want.dtype)
        want = block(want, cos, sin, torch.zeros_like(cache[0]), AttentionMetadata(
            n, 0, [n], [n], [[1]], [], [], torch.arange(16, 16 + n), 16), backend)
        logits = head.shared_head.head(head.shared_head.norm(want))
    torch.testing.assert_close(x, want, atol=1e-5, rtol=1e-5)
    assert nxt is x
    torch.testing.assert_close(head.compute_logits(x), logits, atol=1e-5, rtol=1e-5)


def _routed(cfg):
    """The config with the MTP layer's index among the routed layers (as MTPHead builds it)."""
    import dataclasses
    return dataclasses.replace(cfg, moe=dataclasses.replace(cfg.moe, layers=cfg.moe.layers + (3,)))


@pytest.mark.parametrize("k, tp", [(1, 1), (3, 1), (2, 2)])
def test_greedy_tokens_are_unchanged_and_drafts_made(checkpoint, k, tp, monkeypatch):
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    path, model = checkpoint
    rng = random.Random(3)
    prompts = [[rng.randrange(6, 4000) for _ in range(n)] for n in (5, 40, 90)]
    sp = SamplingParams(max_tokens=12, ignore_eos=True)
    base = dict(kv_cache_tokens=4096, policy="fcfs", packer="token", num_threads=1, group_timeout_s=30)
    want = LLMEngine(EngineConfig(**base), model).generate(prompts, sp)
    eng = LLMEngine.from_config(EngineConfig(**base, model=path, tp=tp, speculative_method="mtp",
                                             num_speculative_tokens=k)) if tp > 1 else \
        LLMEngine(EngineConfig(**base, model=path, speculative_method="mtp", num_speculative_tokens=k), model)
    try:
        assert eng.generate(prompts, sp) == want
        assert eng.spec.draft_tokens > 0
        assert eng.kv.num_free_blocks == eng.kv.num_blocks
    finally:
        eng.close()


def test_what_is_refused(tmp_path):
    plain = write_tiny_model(tmp_path / "plain", seed=7, architectures=["DeepseekV3ForCausalLM"], num_hidden_layers=2)
    model = load_model(plain)[0]
    with pytest.raises(ValueError, match="speculative_method: 'mtp' .* has none"):
        load_mtp_head(plain, model)
    broken = write_tiny_model(tmp_path / "broken", seed=7, architectures=["DeepseekV3ForCausalLM"],
                              num_hidden_layers=2, num_nextn_predict_layers=1)
    stored = load_file(f"{broken}/model.safetensors")
    save_file({k: v for k, v in stored.items() if k != "model.layers.2.eh_proj.weight"}, f"{broken}/model.safetensors")
    with pytest.raises(CheckpointError, match="model.layers.2.eh_proj.weight"):
        load_mtp_head(broken, load_model(broken)[0])
    with pytest.raises(ValueError, match="speculative_model"):
        EngineConfig(speculative_method="mtp", speculative_model="tiny")
    assert speculative_config('{"method": "deepseek_mtp", "num_speculative_tokens": 1}') == {
        "speculative_method": "mtp", "num_speculative_tokens": 1}
