"""Runs one scheduled step on the model: owns the KV tensor, builds the flat varlen inputs and the
attention metadata from a `SchedulerOutput`, and returns the logits rows to sample from.

Token layout follows kernels.metadata: prefill chunks first (request by request), then one token
per decode. A row is sampled for a request when the step computes its last known token.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.metadata import AttentionMetadata
from raycluster.engine.kv_manager import KVCacheManager
from raycluster.engine.scheduler import SchedulerOutput
from raycluster.request import Request


@dataclass
class StepLogits:
    logits: torch.Tensor            # [n_sampled, vocab]
    requests: list[Request]         # the request of each row


class ModelRunner:
    def __init__(self, model, kv: KVCacheManager, dtype: torch.dtype = torch.float32,
                 device: str | torch.device = "cpu") -> None:
        self.model = model
        self.kv = kv
        self.device = torch.device(device)
        self.kv_cache = torch.zeros(model.kv_cache_shape(kv.num_blocks, kv.block_size),
                                    dtype=dtype, device=self.device)

    def kv_bytes_per_token(self) -> int:
        per_block = self.kv_cache[:, 0].numel() * self.kv_cache.element_size()
        return per_block // self.kv.block_size

    def _slots(self, table: list[int], start: int, end: int) -> torch.Tensor:
        bs = self.kv.block_size
        pos = torch.arange(start, end)
        blocks = torch.tensor(table, dtype=torch.long)[pos // bs]
        return blocks * bs + pos % bs

    def execute(self, out: SchedulerOutput) -> StepLogits:
        tokens: list[int] = []
        positions: list[torch.Tensor] = []
        slots: list[torch.Tensor] = []
        sample_rows: list[int] = []
        sample_reqs: list[Request] = []
        q_lens, p_kv_lens, p_tables = [], [], []
        tables = self.kv.block_tables
        for req, n in out.prefills:
            start = req.num_computed_tokens
            end = start + n
            known = req.all_token_ids
            tokens.extend(known[start:end])
            positions.append(torch.arange(start, end))
            table = tables[req.request_id]
            slots.append(self._slots(table, start, end))
            q_lens.append(n)
            p_kv_lens.append(end)
            p_tables.append(table)
            if end == len(known):
                sample_rows.append(len(tokens) - 1)
                sample_reqs.append(req)
        d_kv_lens, d_tables, d_pos = [], [], []
        bs = self.kv.block_size
        for req in out.decodes:
            pos = req.num_computed_tokens
            tokens.append(req.output_token_ids[-1])
            table = tables[req.request_id]
            d_pos.append(pos)
            d_kv_lens.append(pos + 1)
            d_tables.append(table)
            sample_rows.append(len(tokens) - 1)
            sample_reqs.append(req)
        if out.decodes:
            positions.append(torch.tensor(d_pos, dtype=torch.long))
            slots.append(torch.tensor([t[p // bs] * bs + p % bs for t, p in zip(d_tables, d_pos)],
                                      dtype=torch.long))
        meta = AttentionMetadata(
            num_prefill_tokens=sum(q_lens), num_decode_tokens=len(out.decodes),
            prefill_query_lens=q_lens, prefill_kv_lens=p_kv_lens, prefill_block_tables=p_tables,
            decode_kv_lens=d_kv_lens, decode_block_tables=d_tables,
            slot_mapping=torch.cat(slots).to(self.device), block_size=bs)
        input_ids = torch.tensor(tokens, dtype=torch.long, device=self.device)
        hidden = self.model(input_ids, torch.cat(positions).to(self.device), self.kv_cache, meta)
        rows = torch.tensor(sample_rows, dtype=torch.long, device=self.device)
        logits = self.model.compute_logits(hidden.index_select(0, rows)) if sample_rows else \
            hidden.new_empty((0, 0))
        return StepLogits(logits=logits.float(), requests=sample_reqs)
