"""One simulated engine instance: the engine's own `Scheduler` on a virtual clock.

It talks to the router exactly as `raycluster.cluster.instance.InstanceWorker` does, with the
same message dataclasses: it applies `PollReply`s between steps (work by mode full / prefill /
decode, aborts, KV releases), runs one scheduler step, and sends one `StepReport` per step
(TokenEvents, PrefillDone with a KV handle, admitted handoffs, stats with `work_seen`).

A step: `Scheduler.schedule()` -> the predictor's time for its shape (prefill chunks as
(tokens, kv_before), decode KV lengths) -> a STEP event that far in the future -> `update(out,
sampled)` with a fake token id for every request that produced a token. Requests carry
`ignore_eos` and `max_tokens` = the workload's output length, so lengths match the workload.

A move (the pressure controller gave the instance another role) takes effect between steps,
as on the real instance: it then schedules by the target pool's config (`role_configs`,
`Scheduler.reconfigure`; its KV, predictor and GPUs stay its own), and its stats report the new
role from then on.

P/D handoff: a decode work item with a KV handle starts a TRANSFER event lasting
latency + bytes / bandwidth; when it lands, the request is admitted into decoding
(`Scheduler.admit_prefilled`), or queued to recompute its prefill when KV is short (what
`LLMEngine.add_prefilled` does). Unlike the real engine, which blocks its step loop while it
pulls, the simulated instance keeps stepping during the transfer and reserves the blocks when
the transfer lands.

Held requests (AWD's waiting window, `Packer.next_release_time`): when a step comes back empty
while the packer holds requests, the instance schedules one WAKE event at the time the packer
says they fall due (the real step loop polls every 1 ms and finds them then); a newer wake-up
supersedes an older one, and one that fires while a step runs is dropped (the step's end
re-plans anyway).

Step-time variability (spec `step_noise`, off by default): each step's predicted time is
multiplied by the instance's `StepNoise.factor(now)` (sim/step_noise.py), drawn when the step
starts; decode runs are off then (cluster.coalesce), since they interpolate deterministic times.

Decode runs (speed; spec `coalesce_decode`, on by default): when an instance has only decodes
(no prefill queued or held by the packer, no transfer in flight, continuous batching, all
decodes fit max_num_seqs),
its next k decode-only steps are known in advance -- each grows every request by one token --
so they run as one event instead of k. k stops one step before the first request could finish
(that step runs normally through `Scheduler.update`) and is capped by free KV (blocks for all k
tokens are reserved up front, the unused ones given back when a run is cut). The run is cut at the next step boundary as soon as the router
has anything for this instance or a KV transfer lands, which is exactly when a step-by-step
instance would have seen it. What changes: step times inside a run are interpolated linearly
between the first and last step's predicted time (exact for LinearBatchPredictor; the roofline
is piecewise linear), the router sees the run's tokens and stats once at its end, and the KV of
all k steps is reserved while the run lasts.

Decode fast path (`fast=True`, `simulate(..., fast_decode=True)`, CLI `--decode-path fast`; runs
are off then): the scheduler is a `sim.fastpath.FastScheduler`, whose decoding requests advance
as a group. A step is still one event with the same predictor features and the same report
(stats) to the router, but group members produce no TokenEvent per step: a member's tokens
arrive with its finish event. Per-request records equal the step-by-step path's (tests/unit/
test_sim_fast.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from raycluster.cluster.messages import InstanceStats, PollReply, PrefillDone, StepReport, TokenEvent, WorkItem
from raycluster.engine.kv_manager import KVCacheManager
from raycluster.engine.prefix_cache import PrefixCachingKVManager
from raycluster.engine.sched_factory import RetiredScheduling, build_scheduler
from raycluster.request import SLO, Request, RequestStatus
from raycluster.sched.base import AllDecodes
from raycluster.sim.fastpath import GroupView, make_fast
from raycluster.sim.spec_decode import DraftingModel
from raycluster.sim.step_noise import StepNoise

if TYPE_CHECKING:
    from raycluster.sim.cluster import SimCluster
    from raycluster.sim.images import StepImages

TOKEN = 2           # the fake sampled token id (never EOS: requests ignore EOS anyway)
_RUNNING, _WAITING = RequestStatus.RUNNING, RequestStatus.WAITING     # the unfinished states


class SimKVHandle:
    """KVHandle-like plain object: what the decode side needs to time the pull."""
    __slots__ = ("request_id", "src_instance", "num_tokens", "nbytes")

    def __init__(self, request_id: str, src_instance: str, num_tokens: int, nbytes: float) -> None:
        self.request_id, self.src_instance, self.num_tokens, self.nbytes = request_id, src_instance, num_tokens, nbytes


class SimInstance:
    def __init__(self, cluster: "SimCluster", instance_id: str, role: str, engine_cfg, predictor,
                 kv_blocks: int, gpus: int, max_model_len: int, fast: bool = False,
                 role_configs: dict | None = None, images: "StepImages | None" = None) -> None:
        """`role_configs`: role -> EngineConfig of the pools it may be moved to (as InstanceWorker);
        `images`: its image encoder (sim/images.py), None when requests carry no pictures."""
        self.cluster = cluster
        self.instance_id = instance_id
        self.role = role
        self.engine_cfg = engine_cfg
        self.role_configs = role_configs or {}
        self.max_model_len = max_model_len
        self.scheduling = engine_cfg.scheduling_label()
        self.moving_to: str | None = None   # a move heard while a step ran: applied after it
        self.gpus = gpus
        self.clock = cluster.loop.clock
        self.predictor = predictor
        caching = engine_cfg.enable_prefix_caching
        self.kv = (PrefixCachingKVManager if caching else KVCacheManager)(kv_blocks, engine_cfg.block_size)
        self.scheduler = build_scheduler(engine_cfg, self.kv, self.clock, max_model_len, predictor)
        self.images = images
        if images is not None and images.cache is not None:    # the encoder budget skips what it holds
            self.scheduler.encoder_cached = images.cache
        self.retired = RetiredScheduling()          # pieces of pools it left, for a return (_move)
        # Speculative decoding (sim/spec_decode.py): None when this instance does not draft.
        sd = cluster.spec.spec_decode
        self.drafter = DraftingModel(engine_cfg.num_speculative_tokens, sd.acceptance, sd.draft_cost, sd.seed,
                                     instance_id) if engine_cfg.speculative_method != "none" else None
        # Decode group (sim/fastpath.py) instead of per-token decodes; not with prefix caching,
        # whose blocks must stay in per-request tables, nor with drafts (each request's own).
        self.fast = bool(fast) and not caching and self.drafter is None
        if self.fast:
            make_fast(self.scheduler)
        self.busy = False               # a STEP event is pending
        self.out = None                 # the SchedulerOutput running now
        self.steps = 0
        self.step_ema = 0.0
        self.busy_time = 0.0
        self.work_seen = 0
        self.transfers = 0              # KV pulls in flight to this instance
        self._pending: list[TokenEvent] = []
        self._admitted: list[str] = []
        self.run = None                 # a decode run: [reqs, k, t_first, t_last, start]
        self.runs = 0
        self._version = 0               # invalidates the STEP event of a cut run
        self.wake_at: float | None = None   # a WAKE event pending for requests the packer holds
        self.wake_token = 0             # invalidates superseded WAKE events
        noise = cluster.spec.step_noise     # step-time variability (None: the predictor's times as is)
        self.noise = StepNoise.for_instance(noise, instance_id) if noise is not None else None

    # ---- router interface (as InstanceWorker) ----------------------------------------------------
    def stats(self) -> InstanceStats:
        s, kv = self.scheduler, self.kv
        return InstanceStats(instance_id=self.instance_id, role=self.role, waiting=s.num_waiting,
                             running=len(s.decoding), kv_free_blocks=kv.num_free_blocks,
                             kv_total_blocks=kv.num_blocks, block_size=kv.block_size,
                             step_time_ema_s=self.step_ema, steps=self.steps, work_seen=self.work_seen,
                             scheduling=self.scheduling,
                             queued_tokens=s.prefill_backlog, busy_s=self.busy_time,
                             prefix_caching=kv.prefix_caching, prefix_query_tokens=getattr(kv, "query_tokens", 0),
                             prefix_hit_tokens=getattr(kv, "hit_tokens", 0))

    def apply(self, reply: PollReply) -> None:
        if reply.role:          # (moved back before a pending move took effect: nothing to do)
            self.moving_to = reply.role if reply.role != self.role else None
            if self.moving_to is not None and not self.busy:
                self._move()
        for rid in reply.aborts:
            self.scheduler.abort(rid)
        for rid in reply.releases:
            self.scheduler.release(rid)
        for item in reply.work:
            self.work_seen += 1
            self._admit(item)

    def _move(self) -> None:
        """Adopt the role the controller gave this instance, and its pool's scheduling config."""
        role, self.moving_to = self.moving_to, None
        target = self.role_configs.get(role)
        cfg = self.engine_cfg.with_scheduling_of(target) if target is not None else self.engine_cfg
        if cfg != self.engine_cfg:
            self.retired.switch(self.scheduler, self.engine_cfg, cfg, self.clock, self.max_model_len, self.predictor)
            self.engine_cfg, self.scheduling = cfg, cfg.scheduling_label()
        self.role = role

    def _request(self, item: WorkItem, prefill_only: bool = False) -> Request:
        m = item.meta
        return Request(request_id=m.request_id, prompt_token_ids=m.prompt_token_ids,
                       sampling=m.sampling,
                       arrival_time=m.arrival_time, slo=SLO(m.ttft_slo_s, m.tpot_slo_s),
                       priority=m.priority, tenant=m.tenant, app_id=m.app_id,
                       expected_output_tokens=m.sampling.max_tokens, prefill_only=prefill_only,
                       output_token_ids=list(item.output_token_ids))

    def _admit(self, item: WorkItem) -> None:
        if item.mode == "decode" and item.kv is not None and item.kv.src_instance == self.instance_id \
                and self.scheduler.adopt_parked(item.meta.request_id) is not None:
            self._admitted.append(item.meta.request_id)      # prefilled here before a move: no transfer
            return
        if item.mode == "decode" and item.kv is not None:
            self.transfers += 1
            self.cluster.start_transfer(self, item)
            return
        self.scheduler.add_request(self._request(item, prefill_only=item.mode == "prefill"))
        if item.mode == "decode":           # no KV handle: recompute here
            self._admitted.append(item.meta.request_id)

    def cached_fraction(self, item: WorkItem) -> float:
        """The share of a handoff's KV blocks this instance's prefix cache holds: a real pull
        skips them (`KVHandle.skip_blocks`). Judged when the transfer starts; the real decode
        side matches when its pull starts, which here is the same instant."""
        kv = self.scheduler.kv
        if not kv.prefix_caching or item.kv.num_tokens <= 0:
            return 0.0
        cached = kv.cached_prefix_tokens(item.meta.prompt_token_ids + list(item.output_token_ids))
        return min(1.0, cached / (-(-item.kv.num_tokens // kv.block_size) * kv.block_size))

    def transfer_done(self, item: WorkItem) -> None:
        """The KV of a handed-off request landed: admit it straight into decoding (or recompute)."""
        self.cut_run()
        self.transfers -= 1
        req = self._request(item)
        req.first_token_time = item.first_token_time     # the client's, for the TPOT pacing
        if self.scheduler.admit_prefilled(req) is None:
            self.scheduler.add_request(req)
        else:
            self.scheduler.kv_arrived(req)
        self._admitted.append(item.meta.request_id)

    # ---- stepping --------------------------------------------------------------------------------
    def try_start(self) -> bool:
        """Start a step if idle and there is work; returns whether a step is now running."""
        if self.busy:
            return True
        if self.moving_to is not None:
            self._move()
        if not self.scheduler.requests:
            if self._pending or self._admitted:
                self.report([], [])
            return False
        if self.cluster.coalesce and self.drafter is None and self._start_run():
            return True
        out = self.scheduler.schedule()
        if out.is_empty:
            # Nothing to run: blocked on KV (a release or new work wakes us), or the packer holds
            # requests back (AWD's window), which become due at a time it knows.
            self._sleep_until_release()
            if out.finished:
                self._pending += [TokenEvent(r.request_id, [], True, r.status.value) for r in out.finished]
                self.report([], [])
            return False
        decs = out.decodes
        grouped = type(decs) is GroupView
        if out.spec_tokens:
            dt = self.drafter.step_time(self.predictor, [(n, r.num_computed_tokens) for r, n in out.prefills],
                                        decs, out.spec_tokens)
        else:
            dt = self.predictor.batch_time([(n, r.num_computed_tokens) for r, n in out.prefills],
                                           decs.kv_lens if grouped else [r.num_computed_tokens for r in decs])
        if self.drafter is not None:
            dt += self.drafter.take_debt()
        if self.images is not None and out.prefills:      # the encoder runs before the text model
            dt += self.images.step_time(out.prefills)
        if self.noise is not None:
            dt *= self.noise.factor(self.clock.now())
        self.out, self.busy = out, True
        self.busy_time += dt
        self.cluster.loop.after(dt, "step", (self, self._version))
        if decs and not out.prefills and not grouped and not out.spec_tokens:
            self.scheduler.decode_selector.observe(len(out.decodes), max(r.num_computed_tokens for r in out.decodes), dt)
        self._dt = dt
        return True

    def _sleep_until_release(self) -> None:
        """The step came back empty: if the packer holds requests, wake when they fall due. The
        real step loop polls (1 ms sleeps) and finds them at about that time; here one WAKE
        event lands exactly then. A newer wake-up supersedes an older one (`wake_token`)."""
        now = self.clock.now()
        t = self.scheduler.packer.next_release_time(now)
        if t is None or t <= now or t == self.wake_at:
            return          # nothing held, or due now yet unschedulable (KV-blocked), or pending
        self.wake_at = t
        self.wake_token += 1
        self.cluster.loop.at(t, "wake", (self, self.wake_token))

    def woken(self, token: int) -> bool:
        """A WAKE event fired: True if it is the current one and the instance is idle (the
        caller then polls it); a step in flight re-plans at its end anyway."""
        if token != self.wake_token:
            return False
        self.wake_at = None
        return not self.busy

    # ---- decode runs ------------------------------------------------------------------------------
    def _start_run(self) -> bool:
        s, kv = self.scheduler, self.kv
        # Not while the packer holds requests (AWD): they fall due at a step boundary a run would
        # skip. (Held requests are also in `requests` but not `decoding`; this says it outright.)
        if (self.transfers or len(s.policy) or s.packer.num_held() or not s.decoding or type(s.decode_selector) is not AllDecodes
                or len(s.decoding) > s.config.max_num_seqs or len(s.decoding) != len(s.requests)
                or self.cluster.router.has_outbox(self.instance_id)):
            return False
        reqs = list(s.decoding.values())
        max_len = s.config.max_model_len
        left = self.cluster.max_run_steps + 1      # steps until the first request could finish
        for r in reqs:
            done = len(r.output_token_ids)
            a = r.sampling.max_tokens - done
            b = max_len - len(r.prompt_token_ids) - done
            if a < left:
                left = a
            if b < left:
                left = b
            if left < 3:
                return False
        k = left - 1
        bs = kv.block_size
        tables = kv.block_tables
        need = 0
        for r in reqs:
            table = tables.get(r.request_id)
            need += -(-(r.num_computed_tokens + k) // bs) - (len(table) if table is not None else 0)
        if need > kv.num_free_blocks:
            return False
        for r in reqs:
            kv.try_allocate(r, k)
        kv0 = [r.num_computed_tokens for r in reqs]
        t0 = self.predictor.batch_time([], kv0)
        t1 = self.predictor.batch_time([], [x + k - 1 for x in kv0])
        now = self.clock.now()
        self.run = [reqs, k, t0, t1, now]
        self.busy = True
        self.runs += 1
        self._version += 1
        self.cluster.loop.at(now + self._run_end(k), "step", (self, self._version))
        self.cluster.running_runs.add(self)
        return True

    def _run_end(self, m: int) -> float:
        """Time from the run's start to the end of its m-th step (step j takes t0 + (t1-t0) j/(k-1))."""
        _, k, t0, t1, _ = self.run
        return m * t0 + (t1 - t0) * m * (m - 1) / (2.0 * (k - 1))

    def cut_run(self) -> None:
        """Something arrived for this instance: end the run at the next step boundary."""
        if self.run is None:
            return
        reqs, k, t0, t1, start = self.run
        el = self.clock.now() - start
        lo, hi = 1, k                       # smallest m with end(m) >= elapsed
        while lo < hi:
            mid = (lo + hi) // 2
            if self._run_end(mid) >= el - 1e-12:
                hi = mid
            else:
                lo = mid + 1
        if lo >= k:
            return
        for r in reqs:
            self._trim(r, r.num_computed_tokens + lo)
        self.run[1] = lo
        self.run[3] = t0 + (t1 - t0) * (lo - 1) / (k - 1) if k > 1 else t0
        end = start + lo * t0 + (t1 - t0) * lo * (lo - 1) / (2.0 * (k - 1))
        self._version += 1
        self.cluster.loop.at(end, "step", (self, self._version))

    def _trim(self, req: Request, tokens: int) -> None:
        """Give back blocks reserved for run steps that will not happen (a cut run)."""
        table = self.kv.block_tables.get(req.request_id)
        if table is None:
            return
        keep = self.kv.blocks_needed(tokens)
        while len(table) > keep:
            self.kv.allocator.free(table.pop())

    def _finish_run(self) -> None:
        reqs, m, t0, t1, start = self.run
        self.run = None
        self.busy = False
        self.cluster.running_runs.discard(self)
        dt = self.clock.now() - start
        self.busy_time += dt
        self.steps += m
        self._dt = dt / m
        self.step_ema = self._dt if self.steps == m else 0.9 * self.step_ema + 0.1 * self._dt
        policy = self.scheduler.policy
        events = []
        toks = [TOKEN] * m
        for r in reqs:
            if r.status.finished:
                continue
            r.num_computed_tokens += m
            r.output_token_ids.extend(toks)
            policy.on_progress(r, m)
            events.append(TokenEvent(r.request_id, list(toks)))
        self.report(events, [])

    def step_done(self, version: int) -> bool:
        """A STEP event fired; False if it was stale (its run was cut)."""
        if version != self._version:
            return False
        if self.run is not None:
            self._finish_run()
            return True
        self._step_done()
        return True

    def _step_done(self) -> None:
        out, self.out, self.busy = self.out, None, False
        self.steps += 1
        self.step_ema = self._dt if self.steps == 1 else 0.9 * self.step_ema + 0.1 * self._dt
        produced: list[Request] = []
        for r, n in out.prefills:
            st = r.status
            if (st is _RUNNING or st is _WAITING) and r.num_computed_tokens + n >= r.num_tokens:
                produced.append(r)
        grouped = type(out.decodes) is GroupView
        spec, accepted, drafted = out.spec_tokens, {}, []
        if not grouped:
            for r in out.decodes:
                st = r.status
                if st is _RUNNING or st is _WAITING:
                    if spec and r.request_id in spec:
                        accepted[r.request_id] = self.drafter.accepted(len(spec[r.request_id]))
                        drafted.append((r, len(r.output_token_ids)))
                    else:
                        produced.append(r)
        done = self.scheduler.update(out, dict.fromkeys([r.request_id for r in produced], TOKEN), accepted)
        events: list[TokenEvent] = [TokenEvent(r.request_id, [], True, r.status.value) for r in out.finished]
        prefilled: list[PrefillDone] = []
        for r in produced:
            st = r.status
            if st is _RUNNING:
                events.append(TokenEvent(r.request_id, [TOKEN]))
            elif st is RequestStatus.FINISHED_PREFILLED:
                prefilled.append(PrefillDone(r.request_id, TOKEN, self._offer(r)))
            else:
                fin = st.finished
                events.append(TokenEvent(r.request_id, [TOKEN], fin, st.value if fin else None))
        if grouped:         # group members that finished: all their group tokens in one event
            for r, made in self.scheduler.group_done:
                events.append(TokenEvent(r.request_id, [TOKEN] * made, True, r.status.value))
        for r, base in drafted:
            fin = r.status.finished
            events.append(TokenEvent(r.request_id, [TOKEN] * (len(r.output_token_ids) - base), fin,
                                     r.status.value if fin else None))
        if self.drafter is not None:        # drafts for the next step, as the engine's _propose
            decoding = self.scheduler.decoding
            self.drafter.propose([r for r in [*produced, *(d[0] for d in drafted)]
                                  if r.request_id in decoding and not r.status.finished],
                                 self.predictor, self.max_model_len)
            for r in [*done, *out.finished]:
                self.drafter.forget(r.request_id)
        self.report(events, prefilled)

    def flush_group(self, records: dict) -> None:
        """End of a run (horizon): count the tokens group members made in steps that already ended,
        not yet reported, into their records, as the step-by-step path's reports would have.
        Nothing is sent to the router and the scheduler is left as it is."""
        s = self.scheduler
        toks: dict[str, int] = {}
        for rid, n in s.unreported:
            toks[rid] = toks.get(rid, 0) + n
        if s.active:
            for rid, m in s.members.items():
                toks[rid] = toks.get(rid, 0) + s.k - m[3]
        for rid, n in toks.items():
            rec = records.get(rid)
            if rec is not None and n:
                rec.num_output_tokens += n
                self.cluster.tokens_out += n

    def _offer(self, req: Request) -> SimKVHandle:
        n = req.num_tokens - 1               # KV-backed: all but the token it just sampled
        return SimKVHandle(req.request_id, self.instance_id, n, n * self.cluster.kv_bytes_per_token)

    def report(self, events: list[TokenEvent], prefilled: list[PrefillDone]) -> None:
        if self.fast and self.scheduler.unreported:      # tokens of a dissolved decode group
            self._pending += [TokenEvent(rid, [TOKEN] * n) for rid, n in self.scheduler.unreported]
            self.scheduler.unreported = []
        rep = StepReport(self.stats(), self._pending + events, prefilled, self._admitted)
        self._pending, self._admitted = [], []
        self.cluster.on_report(self, rep)
