"""Draft tokens from an EAGLE head (vLLM's speculative `method: eagle` / `eagle3`) on the
target's own features: `EagleProposer` answers the proposer interface (`observe`,
`propose_batch`, `forget`).

The head (raycluster.model.eagle, .eagle3) keeps its KV in the target's blocks, in the runner's
`head_kv_cache` (extra layers of a single process's KV tensor; a TP leader's own tensor of
whole heads, which it stages with its blocks), and needs the target's feature at every position it covers: the
final hidden state for EAGLE-1, the residual streams entering three layers for EAGLE-3 (fused by
the head's `combine`). So it runs at two points of an engine step:

- `observe(out, sampled, accepted)`, after sampling and verification and before the scheduler
  updates anything: the runner kept the step's features (`runner.last_hidden` or `last_aux`, one
  row per token of the step in `step_plan`'s order: prefill chunks, then each decode's rows). For every
  position p the step computed whose feature is final -- a prefill chunk's positions, a decode's
  position, and of a decode that ran drafts its position plus those of the drafts it kept -- the
  head runs one row (feature at p, token at p + 1) at position p, in one batch laid out as
  prefill chunks over the requests' own block tables. That writes the head's KV there (so a
  prefill instance hands it over with the prompt's) and, from a request's last row, gives the
  first draft and the hidden state the next pass feeds back.
- `propose_batch(requests, rooms)`, after the update, for the requests still decoding: the first
  draft from `observe`, then k - 1 passes of one decode row per request, each feeding the
  previous pass's hidden state and draft at the next position. Those positions lie past what the
  target has computed, so the request's table first grows to hold them (vLLM's lookahead slots;
  a full pool means one draft); the next `observe` overwrites them with what the target kept.

Nothing is kept across steps but the first drafts: a request whose feature was not seen (a
step that ran it without `observe`) has no draft until its next step. The target verifies the
drafts as it verifies any (`Sampler.verify`): output is unchanged, only the speed differs.
"""

from __future__ import annotations

import torch

from kernels import get_attention_backend
from raycluster.engine.scheduler import SchedulerOutput
from raycluster.parallel.plan import StepPlan, plan_inputs
from raycluster.request import Request


class EagleProposer:
    def __init__(self, head, runner, k: int) -> None:
        """`runner`: the target's `ModelRunner` or `TPRunner` (its leader holds the whole hidden
        states), whose `head_kv_cache` holds the head's layers under the engine's block ids;
        told here to keep each step's hidden states."""
        self.head, self.runner, self.k = head, runner, k
        self.kv = runner.kv
        runner.keep_hidden = True
        runner.aux_layers = head.aux_layers
        self.backend = get_attention_backend(runner.device)
        self._first: dict[str, tuple[int, torch.Tensor]] = {}    # request id -> (draft 1, its feature)

    def forget(self, request_id: str) -> None:
        self._first.pop(request_id, None)

    def observe(self, out: SchedulerOutput, sampled: dict[str, int], accepted: dict[str, list[int]]) -> None:
        """Run the head over the step's positions whose features are final (module docstring)."""
        self._first = {}
        hidden = self.runner.last_aux if self.head.aux_layers else self.runner.last_hidden
        if out.is_empty or hidden is None:
            return
        rows: list[int] = []            # the step's hidden rows the head reads, in its own order
        ids, starts, lens, tables, last, drafting = [], [], [], [], [], []
        tables_of, row = self.kv.block_tables, 0

        def chunk(req: Request, start: int, nxt: list[int], first_row: int, sampled_one: bool) -> None:
            if not nxt:
                return
            ids.extend(nxt)
            rows.extend(range(first_row, first_row + len(nxt)))
            starts.append(start)
            lens.append(len(nxt))
            tables.append(tables_of[req.request_id])
            if sampled_one:             # it got a token now: its last row drafts
                last.append(len(ids) - 1)
                drafting.append(req.request_id)

        for req, n in out.prefills:
            start, tokens = req.num_computed_tokens, req.all_token_ids
            nxt = tokens[start + 1:start + n + 1]
            token = sampled.get(req.request_id)
            done = len(nxt) < n and token is not None   # the chunk ends the known tokens: its row sampled
            chunk(req, start, nxt + [token] if done else nxt, row, done)
            row += n
        for req in out.decodes:
            rid = req.request_id
            spec = out.spec_tokens.get(rid)
            kept = accepted.get(rid) if spec else [sampled[rid]] if rid in sampled else None
            if kept:
                chunk(req, req.num_computed_tokens, kept, row, True)
            row += 1 + len(spec or ())
        if not ids:
            return
        plan = StepPlan(ids, starts, lens, tables, [], [], last)
        features = self.head.combine(hidden.index_select(0, torch.tensor(rows, dtype=torch.long,
                                                                         device=hidden.device)))
        for_logits, fed_back = self._run(plan, features)
        if not last:
            return
        index = torch.tensor(last, dtype=torch.long, device=fed_back.device)
        drafts = self.head.compute_logits(for_logits.index_select(0, index)).argmax(dim=-1).tolist()
        fed_back = fed_back.index_select(0, index)
        for j, rid in enumerate(drafting):
            self._first[rid] = (drafts[j], fed_back[j:j + 1])

    def propose_batch(self, requests: list[Request], rooms: list[int]) -> list[list[int]]:
        """Up to min(k, room) drafts for each request (room: tokens it may still draft)."""
        out: list[list[int]] = [[] for _ in requests]
        live = []           # (index in out, request, drafts it may make, the hidden state it feeds back)
        for i, (req, room) in enumerate(zip(requests, rooms)):
            first = self._first.get(req.request_id)
            if first is None or room < 1:
                continue
            out[i].append(first[0])
            k = min(self.k, room)
            # Passes 2..k write the head's KV at positions num_tokens - 1 ... num_tokens + k - 3.
            if k > 1 and self.kv.try_allocate(req, k - 1):
                live.append((i, req, k, first[1]))
        for j in range(1, self.k):
            live = [e for e in live if e[2] > j]
            if not live:
                break
            plan = StepPlan([out[i][-1] for i, *_ in live], [], [], [], [req.num_tokens - 2 + j for _, req, *_ in live],
                            [self.kv.block_tables[req.request_id] for _, req, *_ in live], list(range(len(live))))
            for_logits, fed_back = self._run(plan, torch.cat([e[3] for e in live]))
            for r, token in enumerate(self.head.compute_logits(for_logits).argmax(dim=-1).tolist()):
                out[live[r][0]].append(token)
            live = [(i, req, k, fed_back[r:r + 1]) for r, (i, req, k, _) in enumerate(live)]
        return out

    def _run(self, plan: StepPlan, features: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The head over a plan: (rows for its logits, hidden states to feed back)."""
        input_ids, positions, meta = plan_inputs(plan, self.kv.block_size, self.runner.device)
        return self.head(input_ids, positions, features, self.runner.head_kv_cache, meta, self.backend)
