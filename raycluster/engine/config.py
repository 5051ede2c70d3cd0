"""User-facing engine configuration (pydantic: validated once, errors name the field)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class EngineConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str = Field("tiny", description="'tiny' (the embedded checkpoint) or a checkpoint directory")
    dtype: str = Field("float32", pattern="^(float32|bfloat16|float16)$")
    device: str = "cpu"
    block_size: int = Field(16, ge=1, le=1024)
    kv_cache_tokens: int = Field(262144, ge=16, description="KV capacity in tokens (rounded down to blocks)")
    max_num_batched_tokens: int = Field(2048, ge=1)
    max_num_seqs: int = Field(128, ge=1)
    max_model_len: int | None = Field(None, ge=2, description="default: the model's context length")
    chunk_size: int | None = Field(512, ge=1, description="prefill chunk size; None: unchunked prefill")
    policy: str = "fcfs"
    seed: int = 0
    num_threads: int | None = Field(None, ge=1, description="torch intra-op threads")
