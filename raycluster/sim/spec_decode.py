"""Speculative decoding in the simulator: who drafts, what a verifying step costs, how many drafts are
accepted.

A pool drafts when its engine options turn speculative decoding on (`speculative_method` ngram,
draft_model or eagle, `num_speculative_tokens` k); the spec's `spec_decode` block says how the
drafts fare, since the simulator has no tokens to compare: each draft is accepted with probability
`acceptance`, independently, until the first rejection (the i.i.d. model of the speculative decoding
papers: 1 + a + ... + a^d tokens expected from d drafts); `draft_cost` is one draft model pass as a
fraction of a decode step of the target over the same requests (0 for n-gram lookup, ~0.05-0.1 for a
small draft model of a large target, about 1 / layers for an EAGLE head).

The instance (sim/instance.py) uses the engine's own Scheduler unchanged: after a step, each request
still decoding gets min(k, room) drafts, copies of the fake token whose number alone matters
(`propose`, the engine's room rule: within max_tokens and the context), the scheduler fits them into
the next step's budget (`SchedulerOutput.spec_tokens`), and `accepted` draws how many it keeps. A
verifying step is timed as the predictor times a prefill chunk: the request's last token and its d
drafts are 1 + d tokens on top of its context (one read of its KV, d + 1 rows of compute), plus k
draft passes over the drafting requests at `draft_cost` each. A request's first drafts also cost the
draft model's prefill of its context (`draft_cost` of the target's prefill time), charged to the
instance's next step, as the engine's proposal runs at the end of the step that made them. Not
modelled: n-gram lookups that find nothing (every request drafts k while it has room). Decode runs
and the decode fast path are off on drafting instances (every step is one event).
"""

from __future__ import annotations

import random

from raycluster.request import Request

TOKEN = 2           # the placeholder token id of drafts and accepted tokens (as sim/instance.py)


class DraftingModel:
    """One instance's draft behaviour: k, the acceptance rate, the draft pass cost, its own RNG."""

    def __init__(self, k: int, acceptance: float, draft_cost: float, seed: int, instance_id: str) -> None:
        self.k, self.acceptance, self.draft_cost = k, acceptance, draft_cost
        self.rng = random.Random(f"{seed}/spec/{instance_id}")
        self.seen: set[str] = set()     # requests whose context the draft model has prefilled
        self.debt = 0.0                 # draft prefill time not yet charged to a step

    def propose(self, reqs: list[Request], predictor, max_model_len: int) -> None:
        """Set each request's drafts for the next step (the engine's room rule); a request's
        first drafts add the draft's prefill of its context to `debt`."""
        fresh = []
        for req in reqs:
            room = min(req.sampling.max_tokens - len(req.output_token_ids), max_model_len - req.num_tokens) - 1
            req.spec_token_ids = [TOKEN] * min(self.k, room) if room > 0 else []
            if self.draft_cost and req.spec_token_ids and req.request_id not in self.seen:
                self.seen.add(req.request_id)
                fresh.append((req.num_tokens, 0))
        if fresh:
            self.debt += self.draft_cost * predictor.batch_time(fresh, [])

    def take_debt(self) -> float:
        debt, self.debt = self.debt, 0.0
        return debt

    def forget(self, request_id: str) -> None:
        self.seen.discard(request_id)

    def accepted(self, num_drafts: int) -> list[int]:
        """The tokens a request that ran `num_drafts` drafts keeps: the accepted ones and one more."""
        a, rand, p = 0, self.rng.random, self.acceptance
        while a < num_drafts and rand() < p:
            a += 1
        return [TOKEN] * (a + 1)

    def step_time(self, predictor, prefills: list[tuple[int, int]], decodes: list[Request],
                  spec: dict[str, list[int]]) -> float:
        """A step that verifies drafts: each drafting decode as a (1 + d)-token chunk on its context,
        plus the k draft passes over the drafting requests."""
        chunks = list(prefills)
        plain, drafting = [], []
        for r in decodes:
            d = spec.get(r.request_id)
            if d:
                chunks.append((1 + len(d), r.num_computed_tokens))
                drafting.append(r.num_computed_tokens)
            else:
                plain.append(r.num_computed_tokens)
        dt = predictor.batch_time(chunks, plain)
        if self.draft_cost and drafting:
            dt += self.k * self.draft_cost * predictor.batch_time([], drafting)
        return dt
