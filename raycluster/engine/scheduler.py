"""Iteration-level scheduler of one engine instance (Orca/Sarathi continuous batching).

Every step: the decode selector picks decode-phase requests (one token each, KV grown by one
slot, preempting by recompute when blocks run out), then the packer fills the rest of the step
with prefill chunks taken in policy order. `schedule()` returns a `SchedulerOutput` (what to run);
after the model ran, `update()` advances each request by what was computed and appends sampled
tokens, returning the requests that finished. `abort()` frees a request's blocks at once.

Request states: WAITING (queued, no KV), RUNNING (holds KV blocks: prefilling, or decoding),
finished. A request needing prefill sits in the policy whether or not it holds blocks, so a more
urgent arrival can overtake a long prefill between its chunks (Medha's preemptive chunking).
"""

from __future__ import annotations

from collections.abc import Container
from dataclasses import dataclass, field
from typing import Sequence

from raycluster.engine.image_scheduling import image_rules
from raycluster.engine.kv_manager import KVCacheManager
from raycluster.request import Request, RequestStatus
from raycluster.sched.base import AllDecodes, Clock, DecodeSelector, PackLimits, Packer, Policy


@dataclass
class SchedulerOutput:
    prefills: list[tuple[Request, int]] = field(default_factory=list)   # (request, chunk tokens)
    decodes: list[Request] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)
    finished: list[Request] = field(default_factory=list)   # ended while scheduling (KV exhausted)
    # Speculative decoding: decodes that also run draft tokens this step (request id -> drafts).
    spec_tokens: dict[str, list[int]] = field(default_factory=dict)

    @property
    def num_prefill_tokens(self) -> int:
        return sum(n for _, n in self.prefills)

    @property
    def num_draft_tokens(self) -> int:
        return sum(map(len, self.spec_tokens.values()))

    @property
    def num_tokens(self) -> int:
        return self.num_prefill_tokens + len(self.decodes) + self.num_draft_tokens

    @property
    def is_empty(self) -> bool:
        return not self.prefills and not self.decodes


@dataclass
class SchedulerConfig:
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 128
    max_model_len: int = 32768
    num_spec_tokens: int = 0        # speculative decoding: draft tokens a decode may run per step
    # Image tokens one step may encode (vLLM's max_num_encoder_input_tokens); None: no limit.
    max_num_encoder_tokens: int | None = None


class _StepAllocator:
    """KV reservations for one step. When blocks run out it evicts (recompute) requests that hold
    blocks but are still inside the policy: they were not popped yet, so they rank below the
    request asking."""

    def __init__(self, sched: "Scheduler") -> None:
        self.sched = sched
        self.in_step: set[str] = set()

    def try_allocate(self, req: Request, num_new_tokens: int) -> bool:
        kv = self.sched.kv
        while not kv.try_allocate(req, num_new_tokens):
            victim = self.sched._queued_holder(exclude=self.in_step | {req.request_id})
            if victim is None:
                return False
            self.sched._preempt(victim)
        self.in_step.add(req.request_id)
        if req.status is RequestStatus.WAITING:
            req.status = RequestStatus.RUNNING
        self.sched._holders[req.request_id] = req
        return True


class _PrefixMatchingQueue:
    """The policy as the packer sees it with prefix caching on: a request popped for its first
    chunk first takes the cached blocks of its prefix (ones registered while it waited), so the
    packer sizes its chunk over what is left. The policy is not told: cached tokens are no
    service to charge (VTC, Justitia), and remaining-work estimates (Kairos, SRJF) are re-read
    from the request at its next push or progress report."""

    def __init__(self, sched: "Scheduler") -> None:
        self.sched = sched

    def pop(self) -> Request | None:
        req = self.sched.policy.pop()
        if req is not None:
            self.sched._take_cached_prefix(req)
        return req

    def push(self, req: Request) -> None:
        self.sched.policy.push(req)

    def __len__(self) -> int:
        return len(self.sched.policy)


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager, policy: Policy, packer: Packer,
                 clock: Clock, decode_selector: DecodeSelector | None = None) -> None:
        self.config = config
        self.kv = kv
        self.policy = policy
        self.packer = packer
        self.clock = clock
        self.decode_selector = decode_selector or AllDecodes()
        self.requests: dict[str, Request] = {}
        self.decoding: dict[str, Request] = {}      # decode phase, in admission order
        self._holders: dict[str, Request] = {}      # hold KV blocks, in admission order
        self.parked: dict[str, Request] = {}        # prefill-only requests whose KV awaits handoff
        self.preempted_total = 0
        # Prompt (or recompute) tokens not yet computed, over requests still needing prefill: the
        # instance's prefill backlog, reported to the router. Kept incrementally because the
        # simulator reads it every report; `prefill_backlog_slow` is the definition.
        self.prefill_backlog = 0
        # Digests of images the runner's EncoderCache holds (no encoder budget); the engine sets it.
        self.encoder_cached: Container[bytes] = ()

    # ---- interface -------------------------------------------------------------------------
    def add_request(self, req: Request) -> None:
        if req.request_id in self.requests:
            raise ValueError(f"request_id {req.request_id!r} is already in use")
        req.status = RequestStatus.WAITING
        self.requests[req.request_id] = req
        self.prefill_backlog += req.num_tokens - req.num_computed_tokens
        if self.kv.prefix_caching:
            # A prefix cached already: the policy orders it by the shorter remainder.
            self._take_cached_prefix(req)
        self.policy.push(req)

    def abort(self, request_id: str) -> Request | None:
        req = self.requests.get(request_id)
        if req is None:
            return self.release(request_id)
        self._finish(req, RequestStatus.FINISHED_ABORTED)
        return req

    def admit_prefilled(self, req: Request) -> tuple[list[int], int] | None:
        """Admit a request whose KV is computed elsewhere straight into decoding: reserve blocks
        for all its tokens but the last one sampled (the prompt, and on a resumed request the
        tokens before it too). Returns (the blocks the caller must fill, how many leading blocks
        it need not: with prefix caching, the ones this engine has cached already), or None when
        KV is short. `kv_arrived` registers the filled blocks in the prefix cache."""
        if req.request_id in self.requests:
            raise ValueError(f"request_id {req.request_id!r} is already in use")
        req.num_computed_tokens = 0
        n = req.num_tokens - 1
        cached = self.kv.match_prefix(req) if self.kv.prefix_caching else 0
        req.num_computed_tokens = cached
        if not self.kv.try_allocate(req, n - cached):
            self.kv.withdraw(req.request_id)
            req.num_computed_tokens = 0
            return None
        req.num_computed_tokens = n
        req.status = RequestStatus.RUNNING
        self.requests[req.request_id] = req
        self._holders[req.request_id] = req
        self.decoding[req.request_id] = req
        skip = self.kv.handoff_skip(cached // self.kv.block_size)
        return self.kv.handoff_table(req.request_id)[skip:], skip

    def kv_arrived(self, req: Request) -> None:
        """The KV `admit_prefilled` reserved is filled: make its full blocks findable."""
        if self.kv.prefix_caching:
            self.kv.cache_full_blocks(req, req.num_computed_tokens)

    def cancel_admission(self, req: Request) -> None:
        """Undo `admit_prefilled` (the KV never arrived): free its blocks, forget it."""
        self.kv.free(req.request_id)
        for table in (self.requests, self._holders, self.decoding):
            table.pop(req.request_id, None)
        req.status = RequestStatus.WAITING
        req.num_computed_tokens = 0

    def adopt_parked(self, request_id: str) -> Request | None:
        """Decode a request this engine prefilled and parked, in place: the instance has moved
        to the decode pool, so its handoff lands here and no KV needs to move."""
        req = self.parked.pop(request_id, None)
        if req is None:
            return None
        req.prefill_only, req.status, req.finish_time = False, RequestStatus.RUNNING, None
        for table in (self.requests, self._holders, self.decoding):
            table[request_id] = req
        return req

    def release(self, request_id: str) -> Request | None:
        """Free the KV of a parked prefill-only request (handed off, or its lease ran out)."""
        req = self.parked.pop(request_id, None)
        if req is not None:
            self.kv.free(request_id)
        return req

    def reconfigure(self, config: SchedulerConfig, policy: Policy, packer: Packer,
                    decode_selector: DecodeSelector) -> None:
        """Swap limits, policy, packer and decode selector between steps (the instance moved to
        a pool that schedules differently). Requests waiting for prefill move to the new policy:
        first those the old packer held (in the order it took them), then the old policy's in
        its pop order, each pushed in turn so the new policy's ties keep that order. Decoding,
        parked and KV-holding requests, their KV and `prefill_backlog` stay as they are: no
        request enters or leaves."""
        # Requests aborted while the packer held them are gone from `requests`: dropped here.
        waiting = [r for r in self.packer.release_held() if self.requests.get(r.request_id) is r]
        while (req := self.policy.pop()) is not None:
            waiting.append(req)
        self.config, self.policy, self.packer, self.decode_selector = config, policy, packer, decode_selector
        for req in waiting:
            policy.push(req)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        alloc = _StepAllocator(self)
        now = self.clock.now()
        selected = self.decode_selector.select(list(self.decoding.values()), now)
        if len(selected) > self.config.max_num_seqs:
            selected = selected[: self.config.max_num_seqs]
        # Hot path: a decode whose next token fits in the blocks it holds needs no allocation
        # (what KVCacheManager.try_allocate would find); only the others go the slow way.
        tables, bs, in_step, decodes = self.kv.block_tables, self.kv.block_size, alloc.in_step, out.decodes
        running = RequestStatus.RUNNING
        for req in selected:
            if req.status is not running:
                continue                # preempted while making room for an earlier decode
            table = tables.get(req.request_id)
            if table is not None and req.num_computed_tokens < len(table) * bs:
                in_step.add(req.request_id)
                decodes.append(req)
            elif self._allocate_decode(req, selected, alloc, out):
                decodes.append(req)
        budget = self.config.max_num_batched_tokens
        if self.config.num_spec_tokens and decodes:
            budget -= self._schedule_drafts(out, budget - len(decodes))
        limits = PackLimits(budget, self.config.max_num_seqs)
        queue = _PrefixMatchingQueue(self) if self.kv.prefix_caching else self.policy
        out.prefills = self.packer.plan(out.decodes, queue, limits, alloc)
        out.prefills = image_rules(out.prefills, self.config.max_num_encoder_tokens, alloc, self.policy,
                                   self.encoder_cached)
        for req, _ in out.prefills:
            if req.first_scheduled_time is None:
                req.first_scheduled_time = now
        return out

    def _schedule_drafts(self, out: SchedulerOutput, budget: int) -> int:
        """Let decodes with drafts run them this step, in decode order, while the token budget
        lasts and their KV can grow without evicting anyone (a draft is never worth a
        preemption). Returns the draft tokens scheduled."""
        used = 0
        k_max = self.config.num_spec_tokens
        for req in out.decodes:
            drafts = req.spec_token_ids
            if not drafts:
                continue
            k = min(len(drafts), k_max, budget - used)
            if k <= 0:
                break
            if self.kv.try_allocate(req, 1 + k):
                out.spec_tokens[req.request_id] = drafts[:k]
                used += k
        return used

    def update(self, out: SchedulerOutput, sampled: dict[str, int],
               accepted: dict[str, list[int]] | None = None) -> list[Request]:
        """Advance requests by the step `out` that ran; `sampled` maps request id -> new token for
        every request whose known tokens are now all computed; `accepted`, for the decodes that
        ran drafts (`out.spec_tokens`), the drafts kept plus the token after them
        (`Sampler.verify`): appended one by one until one ends the request. Returns finished
        requests."""
        now = self.clock.now()
        if self.kv.prefix_caching:
            self._cache_blocks(out)
        finished = self._advance_prefills(out.prefills, sampled, now)
        # Decodes: `_append` and `_stop_status` inlined (same order of effects); this loop runs
        # once per decoding request per step.
        on_progress, max_len = self.policy.on_progress, self.config.max_model_len
        running, waiting = RequestStatus.RUNNING, RequestStatus.WAITING
        spec = out.spec_tokens
        for req in out.decodes:
            st = req.status
            if st is not running and st is not waiting:
                continue        # finished (aborted while the step ran)
            if spec and req.request_id in spec:
                if self._advance_spec(req, accepted[req.request_id], now):
                    finished.append(req)
                continue
            req.num_computed_tokens += 1
            on_progress(req, 1)
            token = sampled[req.request_id]
            out_ids = req.output_token_ids
            out_ids.append(token)
            if req.first_token_time is None:
                req.first_token_time = now
            sp = req.sampling
            if not sp.ignore_eos and token in req.eos_token_ids:
                status = RequestStatus.FINISHED_STOPPED
            elif token in sp.stop_token_ids:
                status = RequestStatus.FINISHED_STOPPED
            elif len(out_ids) >= sp.max_tokens or len(req.prompt_token_ids) + len(out_ids) >= max_len:
                status = RequestStatus.FINISHED_LENGTH
            else:
                continue
            self._finish(req, status)
            finished.append(req)
        if self.kv.releases_window:     # a sliding-window model's blocks no later query sees
            self.kv.release_outside_window([r for r, _ in out.prefills] + out.decodes)
        return finished

    def _take_cached_prefix(self, req: Request) -> int:
        """Give a request that holds no KV yet the cached blocks of its prefix; it holds them
        from now on and prefills the rest. Like any queued holder it can lose them to a more
        urgent request's allocation, and then recomputes from scratch. Returns the tokens."""
        if req.num_computed_tokens or req.request_id in self.kv.block_tables \
                or req.sampling.prompt_logprobs is not None \
                or req.pooling not in (None, "last"):   # these need every position's logits / hidden state
            return 0
        hit = self.kv.match_prefix(req)
        if hit:
            req.num_computed_tokens = req.num_cached_tokens = hit
            req.status = RequestStatus.RUNNING
            self._holders[req.request_id] = req
            self.prefill_backlog -= hit
        return hit

    def _cache_blocks(self, out: SchedulerOutput) -> None:
        """Register the blocks the step `out` filled, before `update` lets requests finish and
        free them, so a finished request's prefix stays findable."""
        kv, bs = self.kv, self.kv.block_size
        for req, n in out.prefills:
            if not req.status.finished:
                kv.cache_full_blocks(req, req.num_computed_tokens + n)
        for req in out.decodes:
            if not req.status.finished and (req.num_computed_tokens + 1) % bs == 0 \
                    and req.request_id not in out.spec_tokens:        # those: _advance_spec
                kv.cache_full_blocks(req, req.num_computed_tokens + 1)

    def _advance_spec(self, req: Request, tokens: list[int], now: float) -> bool:
        """A decode that ran drafts: each token appended makes the KV of the one before it valid
        (the last sampled token, then each accepted draft). Returns whether it finished."""
        bs = self.kv.block_size
        for token in tokens:
            req.num_computed_tokens += 1
            self.policy.on_progress(req, 1)
            if self.kv.prefix_caching and req.num_computed_tokens % bs == 0:
                self.kv.cache_full_blocks(req, req.num_computed_tokens)
            if self._append(req, token, now):
                return True
        return False

    def _advance_prefills(self, prefills: list[tuple[Request, int]], sampled: dict[str, int],
                          now: float) -> list[Request]:
        """`update` for the prefill chunks of a step (the simulator's decode group calls it
        alone); returns the requests that finished."""
        finished: list[Request] = []
        for req, n in prefills:
            if req.status.finished:
                continue        # aborted while the step ran
            req.num_computed_tokens += n
            self.prefill_backlog -= n
            self.policy.on_progress(req, n)
            if req.num_computed_tokens < req.num_tokens:
                self.policy.push(req)
                continue
            self.decoding[req.request_id] = req
            if req.pooling is not None:
                # A pooling request ends with its prompt, its vector its only output (no token:
                # vLLM's pooling runner); never parked, there is nothing to decode.
                req.first_token_time = now
                self._finish(req, RequestStatus.FINISHED_STOPPED)
                finished.append(req)
            elif self._append(req, sampled[req.request_id], now):
                finished.append(req)
            elif req.prefill_only:
                self._park(req)
                finished.append(req)
        return finished

    def finish(self, request_id: str, status: RequestStatus) -> None:
        """End a request for a reason the engine detected (e.g. a stop string)."""
        req = self.requests.get(request_id)
        if req is not None:
            self._finish(req, status)

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    @property
    def num_waiting(self) -> int:
        return len(self.policy) + self.packer.num_held()

    @property
    def num_running(self) -> int:
        return len(self._holders)

    def prefill_backlog_slow(self) -> int:
        """What `prefill_backlog` tracks, summed from scratch (tests check the two agree)."""
        return sum(r.num_tokens - r.num_computed_tokens for rid, r in self.requests.items()
                   if rid not in self.decoding)

    # ---- internals -------------------------------------------------------------------------
    def _append(self, req: Request, token: int, now: float) -> bool:
        req.output_token_ids.append(token)
        if req.first_token_time is None:
            req.first_token_time = now
        status = self._stop_status(req, token)
        if status is not None:
            self._finish(req, status)
            return True
        return False

    def _stop_status(self, req: Request, token: int) -> RequestStatus | None:
        sp = req.sampling
        if not sp.ignore_eos and token in req.eos_token_ids:
            return RequestStatus.FINISHED_STOPPED
        if token in sp.stop_token_ids:
            return RequestStatus.FINISHED_STOPPED
        if len(req.output_token_ids) >= sp.max_tokens or req.num_tokens >= self.config.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def _finish(self, req: Request, status: RequestStatus) -> None:
        self._retire(req, status)
        self.kv.free(req.request_id)

    def _park(self, req: Request) -> None:
        """Finish a prefill-only request but keep its blocks for the decode instance to pull."""
        self._retire(req, RequestStatus.FINISHED_PREFILLED)
        self.parked[req.request_id] = req

    def _retire(self, req: Request, status: RequestStatus) -> None:
        rid = req.request_id
        if rid in self.requests and rid not in self.decoding:     # ended before its prefill did
            self.prefill_backlog -= req.num_tokens - req.num_computed_tokens
        req.status = status
        req.finish_time = self.clock.now()
        for table in (self.requests, self.decoding, self._holders):
            table.pop(req.request_id, None)
        self.policy.remove(req.request_id)
        self.policy.on_finish(req)

    def _allocate_decode(self, req: Request, selected: Sequence[Request], alloc: _StepAllocator,
                         out: SchedulerOutput) -> bool:
        while not self.kv.try_allocate(req, 1):
            victim = self._decode_victim(req)
            if victim is None:
                # Alone and out of blocks: this request can never grow, so it ends here.
                self._finish(req, RequestStatus.FINISHED_LENGTH)
                out.finished.append(req)
                return False
            self._preempt(victim)
            out.preempted.append(victim.request_id)
            if victim is req:
                return False                # it ranks below every other holder: it waits
            if victim in out.decodes:
                out.decodes.remove(victim)
        alloc.in_step.add(req.request_id)
        return True

    def _decode_victim(self, asking: Request) -> Request | None:
        """Who gives up its KV so the decode `asking` can grow: the policy's choice (e.g. the
        lowest priority), else the latest queued holder, else the latest other decode."""
        others = [r for r in self._holders.values() if r is not asking]
        if not others:
            return None
        chosen = self.policy.preemption_victim(asking, others)
        if chosen is not None:
            return chosen
        return self._queued_holder(exclude={asking.request_id}) or self._latest_decode(asking)

    def _queued_holder(self, exclude: set[str]) -> Request | None:
        """The latest-admitted request that holds blocks but is waiting in the policy."""
        for rid in reversed(self._holders):
            if rid not in exclude and rid not in self.decoding:
                return self._holders[rid]
        return None

    def _latest_decode(self, asking: Request) -> Request | None:
        for rid in reversed(self.decoding):
            if rid != asking.request_id:
                return self.decoding[rid]
        return None

    def _preempt(self, req: Request) -> None:
        """Preempt by recompute: drop its KV; it re-enters the policy and later recomputes
        prompt + generated tokens as one prefill."""
        self.kv.free(req.request_id)
        self._holders.pop(req.request_id, None)
        was_decoding = self.decoding.pop(req.request_id, None) is not None
        # Its whole context is prefill work again (a queued holder loses the chunks it had done).
        self.prefill_backlog += req.num_tokens if was_decoding else req.num_computed_tokens
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        req.status = RequestStatus.WAITING
        self.preempted_total += 1
        if was_decoding:
            self.policy.push(req)
