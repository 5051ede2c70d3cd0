"""`KVHandle`: what a prefill instance hands out for a request's parked KV (plain values only).

Kept free of torch (element sizes by dtype name), so the router, which relays handles between
instances, starts without importing torch: a restarted router is back sooner.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

_ITEMSIZE = {"float64": 8, "float32": 4, "bfloat16": 2, "float16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1,
             "int8": 1, "uint8": 1}


@dataclass
class KVHandle:
    request_id: str
    src_instance: str
    src_block_ids: list[int]
    num_tokens: int
    # Per-block layout of the source: (L, 2, B, Hkv, D) and the dtype name; checked on pull.
    block_shape: tuple[int, ...]
    dtype: str
    # Connector-specific, plain values only (nixl: agent name/metadata/addresses;
    # torch_dist: the source's store host/port/nonce; object_store: the ObjectRef of the blocks).
    extra: dict[str, Any] = field(default_factory=dict)
    # Set by the decode side only: the leading source blocks it already holds (its own prefix
    # cache), which a pull skips. The offer itself always covers every block.
    skip_blocks: int = 0

    @property
    def pull_block_ids(self) -> list[int]:
        """The source blocks a pull moves."""
        return self.src_block_ids[self.skip_blocks:]

    @property
    def nbytes(self) -> int:
        """Bytes a pull moves (the blocks after `skip_blocks`)."""
        size = _ITEMSIZE.get(self.dtype)
        if size is None:                  # a dtype not listed: ask torch (imported only then)
            import torch
            size = torch.tensor([], dtype=getattr(torch, self.dtype)).element_size()
        n = len(self.pull_block_ids) * size
        for s in self.block_shape:
            n *= s
        return n
