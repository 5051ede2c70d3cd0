"""Per-step attention metadata: the contract between the engine (which fills it) and the
attention backends (which consume it).

Token layout in a step: all prefill-chunk tokens first (request by request), then one token per
decode request. Derived tensors (block/offset indices, padded block tables, masks) are built once
per step by `prepare()` and cached on the object, so the per-layer backend call does no Python
work proportional to the number of tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class AttentionMetadata:
    num_prefill_tokens: int
    num_decode_tokens: int
    prefill_query_lens: list[int]  # per prefill request, tokens in this chunk
    prefill_kv_lens: list[int]  # per prefill request, KV length after this chunk
    prefill_block_tables: list[list[int]]
    decode_kv_lens: list[int]  # per decode request, KV length including the new token
    decode_block_tables: list[list[int]]
    slot_mapping: torch.Tensor  # int64 [T]: block_id * block_size + offset of each new K/V
    block_size: int
    # Backend-private derived state (torch tensors, flashinfer plan markers); built once per step.
    cache: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self) -> None:
        if len(self.prefill_query_lens) != len(self.prefill_kv_lens) or len(
            self.prefill_query_lens
        ) != len(self.prefill_block_tables):
            raise ValueError("prefill_query_lens, prefill_kv_lens, prefill_block_tables differ in length")
        if len(self.decode_kv_lens) != len(self.decode_block_tables):
            raise ValueError("decode_kv_lens and decode_block_tables differ in length")
        if sum(self.prefill_query_lens) != self.num_prefill_tokens:
            raise ValueError("sum(prefill_query_lens) != num_prefill_tokens")
        if len(self.decode_kv_lens) != self.num_decode_tokens:
            raise ValueError("one decode token per decode request expected")
        for q, kv in zip(self.prefill_query_lens, self.prefill_kv_lens):
            if q > kv:
                raise ValueError(f"prefill query_len {q} > kv_len {kv}")

    @property
    def num_tokens(self) -> int:
        return self.num_prefill_tokens + self.num_decode_tokens

    @property
    def num_prefills(self) -> int:
        return len(self.prefill_query_lens)

    @property
    def num_decodes(self) -> int:
        return len(self.decode_kv_lens)

    def prepare(self, device: torch.device | str | None = None) -> dict[str, Any]:
        """Build (once) the index tensors the torch backend needs; returns the cache dict."""
        c = self.cache
        if c.get("torch_prepared"):
            return c
        device = torch.device(device) if device is not None else self.slot_mapping.device
        bs = self.block_size
        slots = self.slot_mapping.to(device=device, dtype=torch.long)
        c["slot_block"] = torch.div(slots, bs, rounding_mode="floor")
        c["slot_offset"] = slots % bs
        # Prefill: per request, (tokens of KV written before this chunk, ids of blocks up to kv_len).
        pre = []
        for q, kv, bt in zip(self.prefill_query_lens, self.prefill_kv_lens, self.prefill_block_tables):
            nb = -(-kv // bs)
            if len(bt) < nb:
                raise ValueError(f"block table of {len(bt)} blocks too short for kv_len {kv}")
            pre.append((kv - q, torch.tensor(bt[:nb], dtype=torch.long, device=device)))
        c["prefill_prefix"] = pre
        if self.num_decodes:
            max_nb = max(-(-kv // bs) for kv in self.decode_kv_lens)
            table = torch.zeros(self.num_decodes, max_nb, dtype=torch.long)
            for i, (kv, bt) in enumerate(zip(self.decode_kv_lens, self.decode_block_tables)):
                nb = -(-kv // bs)
                if len(bt) < nb:
                    raise ValueError(f"block table of {len(bt)} blocks too short for kv_len {kv}")
                table[i, :nb] = torch.tensor(bt[:nb], dtype=torch.long)
            kv_lens = torch.tensor(self.decode_kv_lens, dtype=torch.long)
            c["decode_table"] = table.to(device)
            # True where a padded KV position is past the request's length.
            c["decode_pad_mask"] = (torch.arange(max_nb * bs)[None, :] >= kv_lens[:, None]).to(device)
        c["torch_prepared"] = True
        return c
