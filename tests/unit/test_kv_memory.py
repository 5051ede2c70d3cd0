"""The KV cache is checked against the device's free memory before anything is allocated: too
large a kv_cache_tokens is a ValueError naming it and the most that fits, not a process the
kernel kills for memory halfway through a replica's start."""

import pytest
import torch

from raycluster.engine.config import EngineConfig
from raycluster.engine.engine import LLMEngine
from raycluster.engine.kv_memory import check_kv_fits, free_memory_bytes, kv_bytes_per_token
from raycluster.model.config import ModelConfig

LLAMA3_8B = dict(architectures=["LlamaForCausalLM"], hidden_size=4096, num_attention_heads=32, num_key_value_heads=8,
                 intermediate_size=14336, num_hidden_layers=32, vocab_size=128256, max_position_embeddings=8192)


def test_llama3_8b_default_kv_is_32_gib_in_bf16():
    cfg = ModelConfig.from_dict(LLAMA3_8B)
    assert kv_bytes_per_token(cfg, torch.bfloat16) == 128 * 1024
    default = EngineConfig().kv_cache_tokens
    with pytest.raises(ValueError, match=r"^kv_cache_tokens: 262144 tokens of KV take 32\.0 GiB .* at most 147456$"):
        check_kv_fits(default, cfg, torch.bfloat16, torch.device("cpu"), free=lambda d: 20 * 2**30)
    check_kv_fits(100_000, cfg, torch.bfloat16, torch.device("cpu"), free=lambda d: 20 * 2**30)
    check_kv_fits(default, cfg, torch.bfloat16, torch.device("cpu"), free=lambda d: None)   # unknown: allowed


def test_this_hosts_free_memory_is_read():
    free = free_memory_bytes(torch.device("cpu"))
    assert free is None or free > 0


def test_an_engine_too_large_for_the_host_fails_before_allocating(loaded):
    model, _ = loaded
    with pytest.raises(ValueError, match="^kv_cache_tokens: "):
        LLMEngine(EngineConfig(kv_cache_tokens=2**40, policy="fcfs", packer="token", predictor="none"), model)
    assert kv_bytes_per_token(model.config, torch.float32) * EngineConfig().kv_cache_tokens == 512 * 2**20
