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
        """Build (once) the index tensors the torch backend needs; returns the cache dict.

        Keys (all on `device`):
          slot_block, slot_offset  int64 [T]: block id / offset of each new K/V (as before).
          slot_row                 int64 [T]: row of each new K in kv_layer viewed as
                                   [N * 2 * B, Hkv * D] (its V is B rows further on).
          prefill_prefix           per prefill request (tokens before this chunk, block ids up to kv_len).
          prefill_prefix_rows      per prefill request, rows of kv_layer viewed as [N * 2, B * Hkv * D]
                                   holding the K blocks then the V blocks of its earlier KV.
          decode_buckets           list of DecodeBucket: decode requests grouped by KV length (so a
                                   bucket pads little) with their gather rows and additive pad mask.
          decode_table, decode_pad_mask  the single padded layout of all decode requests (kept for
                                   callers that want it; built lazily by `decode_padded()`).
        """
        c = self.cache
        if c.get("torch_prepared"):
            return c
        device = torch.device(device) if device is not None else self.slot_mapping.device
        bs = self.block_size
        slots = self.slot_mapping.to(device=device, dtype=torch.long)
        c["slot_block"] = torch.div(slots, bs, rounding_mode="floor")
        c["slot_offset"] = slots % bs
        c["slot_row"] = c["slot_block"] * (2 * bs) + c["slot_offset"]
        # Prefill: per request, (tokens of KV written before this chunk, ids of blocks up to kv_len).
        pre, prows = [], []
        for q, kv, bt in zip(self.prefill_query_lens, self.prefill_kv_lens, self.prefill_block_tables):
            nb = -(-kv // bs)
            if len(bt) < nb:
                raise ValueError(f"block table of {len(bt)} blocks too short for kv_len {kv}")
            ids = torch.tensor(bt[:nb], dtype=torch.long)
            prefix = kv - q
            pre.append((prefix, ids.to(device)))
            pids = ids[:-(-prefix // bs)] if prefix > 0 else ids[:0]
            prows.append(torch.cat([pids * 2, pids * 2 + 1]).to(device))
        c["prefill_prefix"] = pre
        c["prefill_prefix_rows"] = prows
        if self.num_decodes:
            nbs = []
            for kv, bt in zip(self.decode_kv_lens, self.decode_block_tables):
                nb = -(-kv // bs)
                if len(bt) < nb:
                    raise ValueError(f"block table of {len(bt)} blocks too short for kv_len {kv}")
                nbs.append(nb)
            c["decode_buckets"] = [self._decode_bucket(part, device)
                                   for part in bucket_by_length(nbs, bs, DECODE_BUCKET_OVERHEAD_TOKENS)]
        c["torch_prepared"] = True
        return c

    def _decode_bucket(self, reqs: list[int], device) -> "DecodeBucket":
        bs = self.block_size
        lens = [self.decode_kv_lens[i] for i in reqs]
        nb = max(-(-kv // bs) for kv in lens)
        table = torch.zeros(len(reqs), nb, dtype=torch.long)
        for j, i in enumerate(reqs):
            n = -(-self.decode_kv_lens[i] // bs)
            table[j, :n] = torch.tensor(self.decode_block_tables[i][:n], dtype=torch.long)
        kv_lens = torch.tensor(lens, dtype=torch.long)
        pad = torch.arange(nb * bs)[None, :] >= kv_lens[:, None]
        mask = None
        if bool(pad.any()):
            mask = torch.zeros(len(reqs), 1, 1, nb * bs).masked_fill_(pad[:, None, None, :], float("-inf")).to(device)
        flat = table.flatten()
        identity = reqs == list(range(self.num_decodes))
        return DecodeBucket(
            index=None if identity else torch.tensor(reqs, dtype=torch.long, device=device),
            table=table.to(device), rows=torch.cat([flat * 2, flat * 2 + 1]).to(device),
            num_blocks=nb, mask=mask, pad=pad.to(device))

    def decode_padded(self, device=None) -> tuple[torch.Tensor, torch.Tensor]:
        """All decode requests in one padded layout: (block table [Td, nb_max], pad mask [Td, L])."""
        c = self.cache
        if "decode_table" not in c:
            bs = self.block_size
            max_nb = max(-(-kv // bs) for kv in self.decode_kv_lens)
            table = torch.zeros(self.num_decodes, max_nb, dtype=torch.long)
            for i, (kv, bt) in enumerate(zip(self.decode_kv_lens, self.decode_block_tables)):
                nb = -(-kv // bs)
                table[i, :nb] = torch.tensor(bt[:nb], dtype=torch.long)
            kv_lens = torch.tensor(self.decode_kv_lens, dtype=torch.long)
            c["decode_table"] = table.to(device)
            c["decode_pad_mask"] = (torch.arange(max_nb * bs)[None, :] >= kv_lens[:, None]).to(device)
        return c["decode_table"], c["decode_pad_mask"]


# Fixed cost of one decode bucket (index ops + a kernel launch) in padded-KV-token units; a bucket
# is split off only when the padding it saves is worth more than this.
DECODE_BUCKET_OVERHEAD_TOKENS = 1024


@dataclass
class DecodeBucket:
    index: torch.Tensor | None  # positions of its requests in the decode batch (None: all, in order)
    table: torch.Tensor  # int64 [n, num_blocks] block ids, padded with block 0
    rows: torch.Tensor  # int64 [2 * n * num_blocks]: K block rows then V block rows of kv_layer.view(N*2, -1)
    num_blocks: int
    mask: torch.Tensor | None  # additive fp32 [n, 1, 1, num_blocks * B] (-inf past each length), None if no padding
    pad: torch.Tensor  # bool [n, num_blocks * B], True past each request's length


def bucket_by_length(num_blocks: list[int], block_size: int, overhead_tokens: int) -> list[list[int]]:
    """Split requests (given their KV lengths in blocks) into groups of similar length minimising
    sum over groups of (overhead + size * longest * block_size): a DP over the sorted lengths.
    Returns lists of request indices; each list is in ascending length order."""
    order = sorted(range(len(num_blocks)), key=num_blocks.__getitem__)
    lens = [num_blocks[i] * block_size for i in order]
    n = len(lens)
    best = [0.0] + [float("inf")] * n
    cut = [0] * (n + 1)
    for j in range(1, n + 1):
        top = lens[j - 1]
        bj, cj = float("inf"), 0
        for i in range(j):
            c = best[i] + overhead_tokens + (j - i) * top
            if c < bj:
                bj, cj = c, i
        best[j], cut[j] = bj, cj
    parts = []
    j = n
    while j > 0:
        parts.append(order[cut[j]:j])
        j = cut[j]
    return parts[::-1]
