"""The step plan: what the model runs in one engine step, as a plain message.

`step_plan(out, tables)` turns a `SchedulerOutput` into a `StepPlan` (ints and lists, and the
image embeddings of prompts with images, so a parallel group's leader can post it to its workers) plus the requests whose rows are
sampled. `plan_inputs(plan, block_size)` turns a plan into the model's flat inputs and the
attention metadata (one per KV group of a hybrid cache, whose other groups' tables the plan
carries too). Token layout (kernels.metadata): prefill chunks first, request by request,
then one token per decode. A row is sampled for a request when the step computes its last known
token. A request asking for prompt log-probabilities also gets the rows of its chunk's prompt
positions (each predicts the next prompt token); those come before its sampled row, so
`sample_rows` stays increasing. A prefill chunk over a prompt's image placeholders carries the
pieces of the image's embeddings that replace theirs (`image_rows`, encoded before the plan), and
on a Qwen-VL model the chunk's and the request's later tokens' M-RoPE positions (`rope_rows`),
on Gemma 3 the rows of its images, which attend each other both ways (`bidirectional_rows`).
A decode running draft tokens (speculative decoding) takes one decode row per token, its last
one and then each draft at the next position, all on its block table and all sampled
(`DraftRows`): each row attends to the KV up to its own position, which the step writes before
attending, so the rows are causal and batch with every other decode.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kernels.metadata import AttentionMetadata, GroupedMetadata
from raycluster.engine.image_inputs import image_rows
from raycluster.engine.scheduler import SchedulerOutput
from raycluster.request import Request


@dataclass
class StepPlan:
    input_ids: list[int]
    prefill_starts: list[int]           # per prefill request: tokens computed before this chunk
    prefill_lens: list[int]             # per prefill request: tokens in this chunk
    prefill_tables: list[list[int]]
    decode_positions: list[int]         # per decode request: position of its new token
    decode_tables: list[list[int]]
    sample_rows: list[int]              # rows of the step's tokens whose logits are sampled
    # Tokens that run with a LoRA adapter: (adapter name, first token, count), in token order.
    lora_runs: list[tuple[str, int, int]] = field(default_factory=list)
    # A hybrid KV cache's groups after the first (raycluster.engine.kv_groups): each one's
    # (prefill tables, decode tables), in the order of the ones above. Empty: every group reads
    # the tables above (a plain cache; a profiling plan's synthetic tables).
    group_tables: list[tuple[list[list[int]], list[list[int]]]] = field(default_factory=list)
    # Prompt images' encoder outputs: (first row, embeddings [k, H]) written over the input
    # embeddings of k placeholder tokens (raycluster.engine.image_inputs).
    image_rows: list[tuple[int, torch.Tensor]] = field(default_factory=list)
    # Rows whose rotary positions are not their token index (Qwen-VL image prompts' M-RoPE,
    # raycluster.model.mrope): (first row, positions [k, 3]); with any, the model turns by
    # [3, T] positions, the other rows' three streams equal.
    rope_rows: list[tuple[int, torch.Tensor]] = field(default_factory=list)
    # Runs of prefill rows [lo, hi) that attend each other both ways (Gemma 3's images:
    # Request.bidirectional_spans); each lies within one request's chunk.
    bidirectional_rows: list[tuple[int, int]] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)


@dataclass
class PromptRows:
    """Rows of one request's prompt positions in a step: `count` rows from `first_row` (an index
    into the step's output rows), for positions `first_position`... (each predicts the token
    after it)."""
    request: Request
    first_position: int
    first_row: int
    count: int


@dataclass
class DraftRows:
    """The `count` output rows from `first_row` of a decode that runs drafts: row j follows its
    context and its first j drafts."""
    request: Request
    first_row: int
    count: int


def step_plan(out: SchedulerOutput, tables: dict[str, list[int]], group_tables=()
              ) -> tuple[StepPlan, list[Request | None], list[PromptRows], list[DraftRows]]:
    """The plan, the request sampled at each output row (None: a prompt or draft row), the
    prompt rows and the draft rows by request. `group_tables`: a hybrid cache's other groups'
    tables (KVCacheManager.extra_group_tables), looked up alike."""
    ids: list[int] = []
    starts, lens, p_tables, rows, reqs, prompt, lora, images, ropes, both = [], [], [], [], [], [], [], [], [], []
    for req, n in out.prefills:
        start = req.num_computed_tokens
        known = req.all_token_ids
        if req.sampling.lora_adapter is not None:
            _lora_run(lora, req.sampling.lora_adapter, len(ids), n)
        if req.sampling.images:
            images.extend(image_rows(req, start, n, len(ids)))
        if req.mrope is not None:
            ropes.append((len(ids), req.mrope.positions(start, n)))
        for a, b in req.bidirectional_spans:
            if a < start + n and start < b:
                both.append((len(ids) + max(a, start) - start, len(ids) + min(b, start + n) - start))
        ids.extend(known[start:start + n])
        starts.append(start)
        lens.append(n)
        p_tables.append(tables[req.request_id])
        end = min(start + n, req.num_prompt_tokens - 1)    # the last prompt position predicts an output
        if req.sampling.prompt_logprobs is not None and end > start:
            prompt.append(PromptRows(req, start, len(rows), end - start))
            base = len(ids) - n
            rows.extend(range(base, base + end - start))
            reqs.extend([None] * (end - start))
        if start + n == len(known) and req.pooling is None:    # a pooling request samples nothing
            rows.append(len(ids) - 1)
            reqs.append(req)
    spec, drafts = out.spec_tokens, []
    d_pos, d_tables = [], []
    for req in out.decodes:
        if spec and req.request_id in spec:
            table, pos = tables[req.request_id], req.num_computed_tokens
            run = [req.output_token_ids[-1], *spec[req.request_id]]
            drafts.append(DraftRows(req, len(rows), len(run)))
            if req.mrope is not None:
                ropes.append((len(ids), _shifted(pos, len(run), req.mrope.delta)))
            if req.sampling.lora_adapter is not None:
                _lora_run(lora, req.sampling.lora_adapter, len(ids), len(run))
            for j, token in enumerate(run):
                ids.append(token)
                d_pos.append(pos + j)
                d_tables.append(table)
                rows.append(len(ids) - 1)
                reqs.append(None)
            continue
        if req.sampling.lora_adapter is not None:
            _lora_run(lora, req.sampling.lora_adapter, len(ids), 1)
        if req.mrope is not None:
            ropes.append((len(ids), _shifted(req.num_computed_tokens, 1, req.mrope.delta)))
        ids.append(req.output_token_ids[-1])
        d_pos.append(req.num_computed_tokens)
        d_tables.append(tables[req.request_id])
        rows.append(len(ids) - 1)
        reqs.append(req)
    plan = StepPlan(ids, starts, lens, p_tables, d_pos, d_tables, rows, lora, image_rows=images, rope_rows=ropes,
                    bidirectional_rows=both)
    if group_tables:
        # Same rows: a table in the plan names its request; each group's table of that request.
        p_ids = [req.request_id for req, _ in out.prefills]
        d_ids = [req.request_id for req in out.decodes for _ in range(1 + len((spec or {}).get(req.request_id, ())))]
        plan.group_tables = [([g[r] for r in p_ids], [g[r] for r in d_ids]) for g in group_tables]
    return plan, reqs, prompt, drafts


def _shifted(position: int, n: int, delta: int) -> torch.Tensor:
    """M-RoPE positions [n, 3] of tokens from index `position` past a prompt's images."""
    return torch.arange(position + delta, position + delta + n, dtype=torch.long).view(-1, 1).repeat(1, 3)


def _lora_run(runs: list[tuple[str, int, int]], name: str, first: int, count: int) -> None:
    """Append tokens [first, first + count) on adapter `name`, merged with the last run if it
    is the same adapter and ends where they start."""
    if runs and runs[-1][0] == name and runs[-1][1] + runs[-1][2] == first:
        runs[-1] = (name, runs[-1][1], runs[-1][2] + count)
    else:
        runs.append((name, first, count))


def _slots(table: list[int], start: int, end: int, bs: int) -> torch.Tensor:
    pos = torch.arange(start, end)
    return torch.tensor(table, dtype=torch.long)[pos // bs] * bs + pos % bs


def _metadata(plan: StepPlan, prefill_tables: list[list[int]], decode_tables: list[list[int]], bs: int,
              device) -> AttentionMetadata:
    """The plan's metadata over these block tables (slots addressing their block ids)."""
    slots = [_slots(table, start, start + n, bs)
             for start, n, table in zip(plan.prefill_starts, plan.prefill_lens, prefill_tables)]
    if plan.decode_positions:
        slots.append(torch.tensor([t[p // bs] * bs + p % bs for t, p in zip(decode_tables, plan.decode_positions)],
                                  dtype=torch.long))
    spans = None
    if plan.bidirectional_rows:
        # Each request's runs, in its chunk's own rows.
        firsts = [sum(plan.prefill_lens[:r]) for r in range(len(plan.prefill_lens))]
        spans = [[(lo - f, hi - f) for lo, hi in plan.bidirectional_rows if f <= lo < f + n]
                 for f, n in zip(firsts, plan.prefill_lens)]
    return AttentionMetadata(
        prefill_spans=spans,
        num_prefill_tokens=sum(plan.prefill_lens), num_decode_tokens=len(plan.decode_positions),
        prefill_query_lens=list(plan.prefill_lens),
        prefill_kv_lens=[s + n for s, n in zip(plan.prefill_starts, plan.prefill_lens)],
        prefill_block_tables=prefill_tables, decode_kv_lens=[p + 1 for p in plan.decode_positions],
        decode_block_tables=decode_tables, slot_mapping=torch.cat(slots).to(device), block_size=bs)


def plan_inputs(plan: StepPlan, block_size: int, device: torch.device | str = "cpu", groups=None
                ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata | GroupedMetadata]:
    """(input_ids [T], positions [T] (or [3, T] with `rope_rows`), metadata) of a plan; slots
    address the plan's block ids.
    `groups` (a hybrid cache's KVGroups): metadata per group (`GroupedMetadata`)."""
    positions = [torch.arange(start, start + n) for start, n in zip(plan.prefill_starts, plan.prefill_lens)]
    if plan.decode_positions:
        positions.append(torch.tensor(plan.decode_positions, dtype=torch.long))
    meta = _metadata(plan, plan.prefill_tables, plan.decode_tables, block_size, device)
    if groups is not None:
        others = plan.group_tables or [(plan.prefill_tables, plan.decode_tables)] * (groups.num_groups - 1)
        meta = GroupedMetadata([meta, *(_metadata(plan, p, d, block_size, device) for p, d in others)],
                               groups.group_of, groups.slot_of)
    input_ids = torch.tensor(plan.input_ids, dtype=torch.long, device=device)
    flat = torch.cat(positions)
    if plan.rope_rows:
        flat = flat.view(1, -1).repeat(3, 1)
        for row, p in plan.rope_rows:
            flat[:, row:row + p.shape[0]] = p.t()
    return input_ids, flat.to(device), meta
