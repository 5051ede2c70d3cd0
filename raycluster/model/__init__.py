"""The model: HF-compatible config parsing, a from-scratch Llama-family decoder over a paged KV
cache, safetensors loading, the tokenizer, and a deterministic tiny checkpoint for tests."""

from raycluster.model.config import ModelConfig, ModelConfigError
from raycluster.model.llama import LlamaForCausalLM
from raycluster.model.loader import CheckpointError, load_model
from raycluster.model.tokenizer import IncrementalDetokenizer, Tokenizer
from raycluster.model.tiny import tiny_config, write_tiny_model

__all__ = ["ModelConfig", "ModelConfigError", "LlamaForCausalLM", "CheckpointError", "load_model",
           "Tokenizer", "IncrementalDetokenizer", "tiny_config", "write_tiny_model"]
