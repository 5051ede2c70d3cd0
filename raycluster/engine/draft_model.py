"""Draft tokens for speculative decoding from a smaller model (vLLM's `method: draft_model`).

`DraftModelProposer.propose_batch(requests, rooms)` runs after a step, on the requests that
got tokens and keep decoding, and returns each one's greedy continuation under the draft
model, up to `k` tokens. The target model then checks the drafts in its next step exactly as
it checks n-gram drafts (`Sampler.verify`): greedy output is unchanged and sampled output keeps
its distribution, since a greedy draft is one token, not a distribution.

The draft model keeps its own paged KV cache (its own tensor, block allocator and block table
per request, nothing shared with the target's). A request's draft KV is valid for its first
`done` tokens. A proposal runs k forward passes over the whole batch: the first catches each
request up (its tokens from `done` to its last, sampled one: the prompt on the first proposals,
as prefill chunks within the step's token budget, then the few tokens the target accepted last
step, as decode rows) and drafts d1 from its last row; pass j feeds d_{j-1} as a decode row at
the next position. Afterwards `done` is the request's token count: the KV written for the
drafts is overwritten by the next catch-up, so rejected drafts need no rollback.

A request whose draft KV does not fit gets no drafts this step; when that happens, the draft
KV of requests outside the batch (preempted, handed off, finished) is dropped first and rebuilt
by a later catch-up if they decode again. `forget` drops a request's draft KV when it ends.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kernels import get_attention_backend
from raycluster.engine.kv_manager import BlockAllocator
from raycluster.parallel.plan import StepPlan, plan_inputs
from raycluster.request import Request


@dataclass
class _DraftState:
    table: list[int] = field(default_factory=list)
    done: int = 0               # tokens whose draft KV is written and valid


class DraftModelProposer:
    def __init__(self, model, k: int, num_blocks: int, block_size: int, device: torch.device | str = "cpu",
                 dtype: torch.dtype = torch.float32, max_model_len: int | None = None,
                 max_catchup_tokens: int = 1 << 30) -> None:
        """`max_model_len`: the draft's context; a request past it gets no drafts (as vLLM).
        `max_catchup_tokens`: prompt tokens the draft prefills per call (the target's step
        budget), so a long prompt's catch-up never stalls a step for long."""
        self.model, self.k, self.block_size = model, k, block_size
        self.max_model_len = max_model_len or model.config.max_model_len
        self.max_catchup_tokens = max_catchup_tokens
        self.device = torch.device(device)
        self.kv_cache = torch.zeros(model.kv_cache_shape(num_blocks, block_size), dtype=dtype, device=self.device)
        self.allocator = BlockAllocator(num_blocks)
        self.backend = get_attention_backend(self.device, torch_only=model.config.torch_attention_only)
        self.states: dict[str, _DraftState] = {}

    def observe(self, out, sampled: dict[str, int], accepted: dict[str, list[int]]) -> None:
        pass                        # catches up from the tokens, in propose_batch

    def forget(self, request_id: str) -> None:
        state = self.states.pop(request_id, None)
        if state is not None:
            self.allocator.free_all(state.table)

    def propose_batch(self, requests: list[Request], rooms: list[int]) -> list[list[int]]:
        """Up to min(k, room) drafts for each request (room: tokens it may still draft)."""
        out: list[list[int]] = [[] for _ in requests]
        # The draft feeds its tokens and drafts but the last: positions up to num_tokens + k - 2.
        batch = [(i, r, min(self.k, room, self.max_model_len + 1 - r.num_tokens))
                 for i, (r, room) in enumerate(zip(requests, rooms))]
        batch = [(i, r, k) for i, r, k in batch if k > 0]
        batch = [(i, r, k) for i, r, k in batch if self._reserve(r, k, {q.request_id for q in requests})]
        if not batch:
            return out
        with torch.inference_mode():
            # Pass 1: catch up every request to its last token; its last row drafts d1. A short
            # catch-up (what the target accepted) runs as decode rows on the request's table,
            # which share one KV gather; a long one (the prompt, at first) as a prefill chunk,
            # at most `max_catchup_tokens` of them per call: a request whose chunk stops short of
            # its last token drafts nothing now and goes on from there next time.
            ids, starts, lens, tables, rows = [], [], [], [], []
            d_ids, d_pos, d_tables, d_rows = [], [], [], []
            prefilled, decoded = [], []
            budget = self.max_catchup_tokens
            for entry in batch:
                req = entry[1]
                state, tokens = self.states[req.request_id], req.all_token_ids
                start = min(state.done, len(tokens) - 1)      # at least the last token, for its row
                if len(tokens) - start <= self.k + 1:
                    d_ids.extend(tokens[start:])
                    d_pos.extend(range(start, len(tokens)))
                    d_tables.extend([state.table] * (len(tokens) - start))
                    d_rows.append(len(d_ids) - 1)
                    decoded.append(entry)
                    continue
                n = min(len(tokens) - start, budget)
                if n <= 0:
                    continue
                budget -= n
                ids.extend(tokens[start:start + n])
                starts.append(start)
                lens.append(n)
                tables.append(state.table)
                if start + n < len(tokens):
                    state.done = start + n                      # part of its catch-up only
                    continue
                rows.append(len(ids) - 1)
                prefilled.append(entry)
            drafting = prefilled + decoded
            plan = StepPlan(ids + d_ids, starts, lens, tables, d_pos, d_tables, rows + [len(ids) + r for r in d_rows])
            if not plan.input_ids:
                return out
            for (i, req, _), token in zip(drafting, self._run(plan)):
                out[i].append(token)
                self.states[req.request_id].done = req.num_tokens
            # Passes 2..k: each request still drafting feeds its last draft at the next position.
            for j in range(1, max((k for _, _, k in drafting), default=0)):
                live = [(i, req) for i, req, k in drafting if k > j]
                plan = StepPlan([out[i][-1] for i, _ in live], [], [], [],
                                [req.num_tokens + j - 1 for _, req in live],
                                [self.states[req.request_id].table for _, req in live], list(range(len(live))))
                for (i, _), token in zip(live, self._run(plan)):
                    out[i].append(token)
        return out

    def _reserve(self, req: Request, k: int, batch_ids: set[str]) -> bool:
        """Grow the request's draft table to hold its tokens and k - 1 drafts (the last draft
        is never fed back); on a full pool, first drop the draft KV of requests outside the batch."""
        state = self.states.setdefault(req.request_id, _DraftState())
        need = -(-(req.num_tokens + k - 1) // self.block_size) - len(state.table)
        if need <= 0:
            return True
        if not self.allocator.can_allocate(need):
            for rid in [r for r in self.states if r not in batch_ids]:
                self.forget(rid)
            if not self.allocator.can_allocate(need):
                return False
        state.table.extend(self.allocator.allocate_for(state.table, need))
        return True

    def _run(self, plan: StepPlan) -> list[int]:
        """The draft model's greedy token after each of the plan's sampled rows."""
        input_ids, positions, meta = plan_inputs(plan, self.block_size, self.device)
        hidden = self.model(input_ids, positions, self.kv_cache, meta, backend=self.backend)
        rows = hidden.index_select(0, torch.tensor(plan.sample_rows, dtype=torch.long, device=hidden.device))
        return self.model.compute_logits(rows).argmax(dim=-1).tolist()
