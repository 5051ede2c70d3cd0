"""The global router's logic, with no Ray import: admission, global queue, dispatch, token relay.

`RouterCore` is driven by four kinds of calls (the Ray actor in `router_actor.py` wraps each in
one actor method; the unit tests drive it with a `VirtualClock`):
  submit(meta) / abort(id)          from gateways
  on_poll(instance, stats)          instances ask for work (doubles as heartbeat)
  on_report(StepReport)             instances report tokens, prefill handoffs, admissions
  take_events(gateway)              gateways collect token events (one batch per call)
plus `reap(now)` for instance death and `reap_gateways(now)` for gateways that stopped pulling.

A router restart loses this state. Each registration gives the instance a new `epoch` (from
`router_id` and a counter); the instance then drops what it held, and reports made under an
older epoch are not applied. Gateways resubmit their requests with `resumed` set. What the
router relies on from instances: "Instance conventions" in `messages.py`.

Dispatch's per-instance arithmetic (slots, free KV, load order) is in `router_placement.py`;
which pools serve which queue (and which are held with no instance) in `router_pools.py`.
Queues: one Policy (by name, from the scheduling library) per pool queue: "mixed",
"prefill-short", "prefill-long", "decode". Prompts are classified short/long by the L_m boundary.
Requests re-queued after an instance died go to a per-queue `front` deque served first.
A pool in `cfg.standby_roles` (autoscaled from zero) keeps its queue while it has no instance;
its autoscaling load numbers are read from this state by `router_autoscale.py`.
"""

from __future__ import annotations

from collections import deque

from raycluster.cluster.messages import (ROLES, GatewayReply, InstanceStats, PollReply, PrefillDone,
                                         RequestMeta, StepReport, SubmitReply, TokenEvent, WorkItem)
from raycluster.cluster import router_placement as placement
from raycluster.cluster.prefix_index import PrefixIndex
from raycluster.cluster.router_placement import blocks_needed, fits, has_slot, never_fits
from raycluster.cluster.router_lora import RouterAdapters
from raycluster.cluster.router_pools import PREFILL_ROLES, PoolView
from raycluster.cluster.router_pressure import PressureLoop
from raycluster.cluster.router_state import (EpochClock, Instance, ReqState, RouterConfig, policy_request,
                                             request_placements, router_status)
from raycluster.sched.base import Clock, PolicyContext
from raycluster.sched.boundary import LengthClassifier
from raycluster.sched.predictor import LinearBatchPredictor
from raycluster.sched.registry import make_policy

QUEUES = ("decode", "prefill-short", "prefill-long", "mixed")   # dispatch order: decode frees KV


class RouterCore:
    def __init__(self, cfg: RouterConfig | None = None, clock: Clock | None = None,
                 router_id: str = "router") -> None:
        self.cfg = cfg or RouterConfig()
        self.router_id = router_id              # unique per incarnation in a cluster (the actor's)
        self._registrations = 0
        self.clock = clock or EpochClock()
        pred = LinearBatchPredictor(**self.cfg.predictor) if self.cfg.predictor else None
        # One context per queue: they share clock, predictor and SLOs; `num_servers` is the
        # queue's own (the instances serving it, kept current as instances come and go).
        self.ctxs = {q: PolicyContext(clock=self.clock, predictor=pred, slo=self.cfg.slo) for q in QUEUES}
        self.policies = {q: make_policy(self.cfg.policy, self.ctxs[q]) for q in QUEUES}
        self.front: dict[str, deque[str]] = {q: deque() for q in QUEUES}
        self.classifier = LengthClassifier(initial_l_m=self.cfg.initial_l_m,
                                           beta_prior=self.cfg.beta_prior)
        self.instances: dict[str, Instance] = {}
        self.pools = PoolView(self)             # which pools serve which queue, from `instances`
        self.prefix_index = PrefixIndex()       # prompts sent to each prefix-caching instance
        # PLA pressure controller; its owner calls `pressure.step(self, now)` every period.
        self.pressure = PressureLoop(self.cfg.pressure) if self.cfg.pressure is not None else None
        self.requests: dict[str, ReqState] = {}
        self.gateways: dict[str, list[TokenEvent]] = {}
        self.gateway_seen: dict[str, float] = {}        # last submit or pull, per gateway
        self.dead: list[str] = []
        self.resumed = 0                                # requests re-queued from a removed instance
        self.adapters = RouterAdapters(self.cfg.lora)   # LoRA adapters served (and loading, unloading)

    # ---------------------------------------------------------------- topology
    @property
    def predictor(self):
        return self.ctxs["mixed"].predictor

    def set_predictor(self, predictor) -> None:
        """The batch-time model every queue's policy plans with (the simulator sets its own)."""
        for c in self.ctxs.values():
            c.predictor = predictor

    def topology_changed(self) -> None:
        """Instances came, left or changed role, or the held pools changed: recount servers."""
        self.pools.changed()
        for q, c in self.ctxs.items():
            c.num_servers = max(1, len(self.pools.alive(*self.pools.serving_roles(q))))

    def expect_instances(self, roles: list[str], for_s: float) -> None:
        """A deploy is (re)starting instances of `roles`: for `for_s` those pools count as present
        even with no instance up, so a request arriving in the gap waits in its queue (bounded by
        max_queue) instead of being refused for "no instances"."""
        self.pools.expect(roles, for_s)
        self.topology_changed()

    # ---------------------------------------------------------------- admission
    def queue_depth(self) -> int:
        """Requests waiting for their first dispatch (the admission bound); decode handoffs
        are already admitted work and do not count."""
        return sum(len(self.policies[q]) + len(self.front[q]) for q in QUEUES if q != "decode")

    def submit(self, meta: RequestMeta) -> SubmitReply:
        self.gateway_seen[meta.gateway_id] = self.clock.now()
        depth = self.queue_depth()
        # Decided from counters only: no tokenization or KV allocation happens for a rejection.
        if not self.instances and not any(self.pools.held(r) for r in ROLES):
            return SubmitReply(False, self.cfg.retry_after_s, "no instances", depth)
        if depth >= self.cfg.max_queue and not meta.resumed:
            return SubmitReply(False, self.cfg.retry_after_s, "queue full", depth, self.router_id)
        if meta.request_id in self.requests:
            return SubmitReply(False, 0.0, "duplicate request id", depth, self.router_id)
        adapter = meta.sampling.lora_adapter
        if adapter is not None and adapter not in self.adapters.served:
            return SubmitReply(False, 0.0, f"`{adapter}` does not exist (not a LoRA adapter served here)", depth,
                               self.router_id, invalid_field="model")
        n = len(meta.prompt_token_ids)
        # (With a held pool at zero instances, its KV size is not known yet: dispatch decides.)
        if self.instances and not self.pools.awaiting_first() and all(
                placement.tokens_never_fit(n + len(meta.output_token_ids), i, self.cfg.kv_reserve_frac)
                for i in self.instances.values()):
            # Never servable here (not a transient overload): no Retry-After.
            return SubmitReply(False, 0.0, "prompt too long for any instance's KV cache", depth, self.router_id)
        st = ReqState(meta=meta, req=policy_request(meta, self.clock.now()),
                      length_class=self.classifier.classify(n))
        if meta.output_token_ids:               # resumed: the client has these already
            st.delivered = list(meta.output_token_ids)
            st.req.output_token_ids = st.delivered
            st.req.first_token_time = self.clock.now()
        self.requests[meta.request_id] = st
        self._enqueue(st, self.pools.route(st.length_class), front=meta.resumed)
        self.dispatch()
        return SubmitReply(True, queue_depth=self.queue_depth(), router_id=self.router_id)

    def _enqueue(self, st: ReqState, queue: str, front: bool = False) -> None:
        st.queue, st.instance, st.mode = queue, None, None
        if queue != "decode":
            st.req.num_computed_tokens = 0      # (re)computed from scratch wherever it lands
        if front:
            self.front[queue].append(st.meta.request_id)
        else:
            st.policies.add(queue)
            self.policies[queue].push(st.req)

    # ---------------------------------------------------------------- dispatch
    def _pop(self, queue: str) -> ReqState | None:
        fr = self.front[queue]
        while fr:
            st = self.requests.get(fr.popleft())
            if st is not None and st.queue == queue:
                return st
        req = self.policies[queue].pop()
        return self.requests[req.request_id] if req is not None else None

    def _push_back(self, st: ReqState, queue: str, from_front: bool) -> None:
        if from_front:
            self.front[queue].appendleft(st.meta.request_id)
        else:
            self.policies[queue].push(st.req)

    def dispatch(self) -> int:
        """Hand queued work to instances with a free local slot and enough KV; returns the
        number of items placed. Order within a queue is the policy's (front deque first)."""
        placed, reserve = 0, self.cfg.kv_reserve_frac
        if (self.front["decode"] or len(self.policies["decode"])) and not self.pools.alive("decode"):
            self._dissolve_decode_queue()
        for queue in QUEUES:
            if not (self.front[queue] or len(self.policies[queue])):
                continue                        # nothing queued (the common case per report)
            roles, slots = self.pools.serving_roles(queue), self.cfg.max_local_waiting
            # Placing an item changes no instance's slot but its target's: cands is kept, not redone.
            cands = placement.with_slot(self.pools.alive(*roles), slots) if roles else []
            while cands and (self.front[queue] or len(self.policies[queue])):
                from_front = bool(self.front[queue])
                st = self._pop(queue)
                if st is None:
                    break
                fit = [i for i in cands if fits(st, i, self.requests, reserve)]
                if not fit:
                    if all(never_fits(st, i, reserve) for i in self.pools.alive(*roles)):
                        self._deliver(st, TokenEvent(st.meta.request_id, [], True, "error",
                                                     "prompt does not fit in any instance's KV cache"))
                        continue
                    self._push_back(st, queue, from_front)   # head of line waits for KV: order kept
                    break
                inst = placement.pick(st, fit, self.requests, reserve, self.prefix_index if self.cfg.prefix_affinity
                                      else None, self.cfg.decode_affinity_slack)
                self._assign(st, inst)
                placed += 1
                if not has_slot(inst, slots):
                    cands.remove(inst)
        return placed

    def _assign(self, st: ReqState, inst: Instance) -> None:
        mode = self.pools.mode_for(inst)
        kv = st.kv if mode == "decode" else None
        inst.outbox.work.append(WorkItem(meta=st.meta, mode=mode, output_token_ids=list(st.delivered),
                                         kv=kv, first_token_time=st.req.first_token_time))
        st.queue, st.instance, st.mode = None, inst.instance_id, mode
        inst.running.add(st.meta.request_id)
        placement.sent(self.prefix_index, st, inst, mode)

    def _dissolve_decode_queue(self) -> None:
        """No decode pool left: handoffs waiting for one are recomputed through a prefill or
        mixed pool from prompt + delivered tokens; their parked KV is released."""
        pol, waiting = self.policies["decode"], []
        while self.front["decode"]:
            st = self.requests.get(self.front["decode"].popleft())
            if st is not None and st.queue == "decode":
                waiting.append(st)
        while (req := pol.pop()) is not None:
            waiting.append(self.requests[req.request_id])
        for st in waiting:
            self._release_kv(st)
            self._enqueue(st, self.pools.route(st.length_class), front=True)

    # ---------------------------------------------------------------- instances
    def on_poll(self, instance_id: str, stats: InstanceStats) -> PollReply:
        self._touch(instance_id, stats)
        self.dispatch()
        return self.take_outbox(instance_id)

    def take_outbox(self, instance_id: str) -> PollReply:
        inst = self.instances.get(instance_id)
        if inst is None:
            return PollReply()
        reply, inst.outbox = inst.outbox, PollReply()
        reply.epoch = inst.epoch                # in every reply: a lost one must not matter
        table = self.adapters.table_for(inst)
        if table is not None:
            reply.lora, reply.lora_version = table, self.adapters.version
        now = self.clock.now()
        for w in reply.work:
            st = self.requests.get(w.meta.request_id)
            inst.sent += 1
            inst.transit[w.meta.request_id] = (inst.stats.steps, now, blocks_needed(st, inst) if st else 0,
                                               placement.prefill_tokens(w.meta, self.requests))
        return reply

    def move_instance(self, instance_id: str, role: str) -> None:
        """Move an instance between the prefill pools and the decode pool: dispatch treats it as
        `role` from now on; its next poll reply tells it, and it adopts that pool's scheduling."""
        inst = self.instances[instance_id]
        movable = (*PREFILL_ROLES, "decode")
        if role not in movable or inst.role not in movable:
            raise ValueError(f"move {instance_id!r} ({inst.role}) to {role!r}: only between {movable}")
        inst.role = inst.moving_to = inst.outbox.role = role
        self.topology_changed()

    def has_outbox(self, instance_id: str) -> bool:
        inst = self.instances.get(instance_id)
        o = inst.outbox if inst else None
        return bool(o and (o.work or o.aborts or o.releases or o.role or o.shutdown or self.adapters.pending(inst)))

    def _touch(self, instance_id: str, stats: InstanceStats) -> Instance:
        now = self.clock.now()
        inst = self.instances.get(instance_id)
        if inst is None:
            if stats.role not in ROLES:
                raise ValueError(f"instance {instance_id!r}: unknown role {stats.role!r}; one of {ROLES}")
            # Whatever it holds is unknown here (a restarted router) or re-queued already (a
            # reaped instance): a new epoch tells it to drop that work.
            self._registrations += 1
            inst = self.instances[instance_id] = Instance(instance_id, stats.role, stats, now,
                                                          epoch=f"{self.router_id}.{self._registrations}")
            inst.sent = stats.work_seen or 0    # items applied before count against nothing here
            self.prefix_index.forget(instance_id)
            self.topology_changed()
        if inst.moving_to is not None:          # stats from before the move reached it: keep ours
            if stats.role == inst.moving_to:
                inst.moving_to = None
        elif stats.role in ROLES and inst.role != stats.role:
            inst.role = stats.role
            self.topology_changed()
        inst.stats, inst.last_seen = stats, now
        inst.transit.settle(stats.steps, getattr(stats, "work_seen", None), inst.sent, now,
                            self.cfg.transit_timeout_s)
        return inst

    def reap(self, now: float | None = None) -> list[str]:
        """Declare instances unseen for heartbeat_timeout_s dead and re-queue their work."""
        now = self.clock.now() if now is None else now
        dead = [i for i, inst in self.instances.items()
                if now - inst.last_seen > self.cfg.heartbeat_timeout_s]
        for iid in dead:
            self.remove_instance(iid)
        return dead

    def drain_instance(self, instance_id: str) -> bool:
        """The instance is stopping (Serve scales it down or replaces it): it gets no new work
        while it finishes what it has; `remove_instance` follows. False for an unknown id."""
        inst = self.instances.get(instance_id)
        if inst is not None:
            inst.draining = True
        return inst is not None

    def remove_instance(self, instance_id: str) -> None:
        """Forget an instance (dead, drained, or replaced: replicas come back with new ids).
        Its requests resume elsewhere from prompt + delivered tokens, ahead of the policy order."""
        inst = self.instances.pop(instance_id, None)
        self.prefix_index.forget(instance_id)
        if inst is None:
            return
        self.topology_changed()
        self.dead.append(instance_id)
        for st in self.requests.values():
            if st.kv_at == instance_id:          # parked KV is gone with it
                st.kv, st.kv_at = None, None
                if st.queue == "decode":         # its handoff can no longer be pulled
                    self._remove_queued(st)
                    self._enqueue(st, self.pools.route(st.length_class), front=True)
        for rid in sorted(inst.running, key=lambda r: self.requests[r].req.arrival_time
                          if r in self.requests else 0.0):
            st = self.requests.get(rid)
            if st is None or st.instance != instance_id:
                continue
            self.resumed += 1
            if st.mode == "decode" and st.kv_at in self.instances:
                self._enqueue(st, "decode", front=True)     # KV still parked: hand it off again
            else:
                self._release_kv(st)
                self._enqueue(st, self.pools.route(st.length_class), front=True)
        self.dispatch()

    # ---------------------------------------------------------------- reports
    def on_report(self, report: StepReport) -> None:
        iid = report.stats.instance_id
        inst = self._touch(iid, report.stats)
        if report.epoch is not None and report.epoch != inst.epoch:
            return                              # made before the instance dropped that work
        # One iteration per request per engine step: `_deliver` inlined.
        requests, transit, policies, gateways = self.requests, inst.transit, self.policies, self.gateways
        for ev in report.events:
            rid = ev.request_id
            st = requests.get(rid)
            if st is None or st.instance != iid:
                if st is not None:               # stale owner (reaped, then came back): stop it
                    inst.outbox.aborts.append(rid)
                continue
            if transit:
                transit.pop(rid, None)           # it ran: stats include it
            # The event goes to the gateway as it came (not copied): a report is handed over
            # whole (deserialized from a Ray call, or built fresh by the simulator).
            toks = ev.token_ids
            delivered = st.delivered
            delivered.extend(toks)
            st.req.output_token_ids = delivered
            if toks:
                n = len(toks)
                for q in st.policies:
                    policies[q].on_progress(st.req, n)
            gw = gateways.get(st.meta.gateway_id)
            if gw is None:
                gateways[st.meta.gateway_id] = [ev]
            else:
                gw.append(ev)
            if ev.finished:
                self._drop(st)
        for pd in report.prefilled:
            st = self.requests.get(pd.request_id)
            if st is None or st.instance != iid:
                inst.outbox.releases.append(pd.request_id)    # nobody will pull that KV
                continue
            inst.transit.pop(pd.request_id, None)
            self._prefill_done(st, inst, pd)
        for rid in report.admitted:
            inst.transit.pop(rid, None)
            st = self.requests.get(rid)
            if st is not None and st.kv_at is not None:
                self._release_kv(st)
        for length, history, seconds in report.prefill_samples:
            self.classifier.add_total(int(length), int(history), float(seconds))
        self.dispatch()

    def _prefill_done(self, st: ReqState, inst: Instance, pd: PrefillDone) -> None:
        rid, kv = st.meta.request_id, pd.kv
        inst.running.discard(rid)
        sp = st.meta.sampling
        length = len(st.delivered) + 1 >= sp.max_tokens
        done = length or pd.first_token in sp.stop_token_ids     # as the engine decides
        ev = TokenEvent(rid, [pd.first_token], done, ("length" if length else "stop") if done else None,
                        logprobs=pd.logprobs, num_cached_tokens=pd.num_cached_tokens,
                        prompt_logprobs=pd.prompt_logprobs, prefill_s=pd.prefill_s)
        if done:
            if kv is not None:
                inst.outbox.releases.append(rid)
            self._deliver(st, ev)
            return
        if st.mode == "prefill":
            # The prompt is computed: set it before the policies hear of the first token, so
            # that their remaining-work estimates (Kairos' queue ahead) drop this prompt.
            st.req.num_computed_tokens = st.req.num_tokens
        self._deliver(st, ev)
        if st.mode != "prefill":
            inst.running.add(rid)       # a "full" item decodes where it is
            return
        st.kv, st.kv_at = (kv, inst.instance_id) if kv is not None else (None, None)
        # A decode item from the delivered tokens: with kv None the decode side recomputes.
        self._enqueue(st, "decode")

    def _deliver(self, st: ReqState, ev: TokenEvent) -> None:
        if ev.token_ids and st.req.first_token_time is None:
            st.req.first_token_time = self.clock.now()
        st.delivered.extend(ev.token_ids)
        st.req.output_token_ids = st.delivered
        for q in st.policies:
            if ev.token_ids:
                self.policies[q].on_progress(st.req, len(ev.token_ids))
        self.gateways.setdefault(st.meta.gateway_id, []).append(ev)
        if ev.finished:
            self._drop(st)

    # ---------------------------------------------------------------- request end
    def _remove_queued(self, st: ReqState) -> None:
        if st.queue is not None:
            self.policies[st.queue].remove(st.meta.request_id)
            try:
                self.front[st.queue].remove(st.meta.request_id)
            except ValueError:
                pass
            st.queue = None

    def _release_kv(self, st: ReqState) -> None:
        src = self.instances.get(st.kv_at) if st.kv_at else None
        if src is not None:
            src.outbox.releases.append(st.meta.request_id)
        st.kv, st.kv_at = None, None

    def _drop(self, st: ReqState) -> None:
        """Forget a finished/aborted request: queues, instance sets, parked KV, policy accounts."""
        rid = st.meta.request_id
        self._remove_queued(st)
        self._release_kv(st)
        if (inst := self.instances.get(st.instance) if st.instance else None) is not None:
            inst.running.discard(rid)
            inst.transit.pop(rid, None)
            placement.finished(self.prefix_index, st, inst)
        for q in st.policies:
            self.policies[q].on_finish(st.req)
        self.requests.pop(rid, None)
        if self.adapters.retiring() and st.meta.sampling.lora_adapter is not None:
            self.collect_adapters()

    def collect_adapters(self) -> bool:
        """Unloaded LoRA adapters no request uses any more leave the instances' table."""
        return self.adapters.collect({st.meta.sampling.lora_adapter for st in self.requests.values()})

    def abort(self, request_id: str) -> bool:
        """Client gone: stop the work wherever it is; nothing more reaches the gateway."""
        st = self.requests.get(request_id)
        if st is None:
            return False
        inst = self.instances.get(st.instance) if st.instance else None
        if inst is not None:
            kept = [w for w in inst.outbox.work if w.meta.request_id != request_id]
            if len(kept) == len(inst.outbox.work):
                inst.outbox.aborts.append(request_id)   # already handed out: tell the instance
            inst.outbox.work = kept
        self._drop(st)
        self.dispatch()
        return True

    # ---------------------------------------------------------------- gateways, status
    def take_events(self, gateway_id: str) -> GatewayReply:
        self.gateway_seen[gateway_id] = self.clock.now()
        return GatewayReply(self.gateways.pop(gateway_id, []), self.queue_depth(), self.cfg.max_queue,
                            self.router_id)

    def reap_gateways(self, now: float | None = None) -> list[str]:
        """Gateways silent for gateway_timeout_s (a replica that died or was replaced) have no
        client left to stream to: abort their requests and drop their undelivered events."""
        now = self.clock.now() if now is None else now
        gone = [g for g, t in self.gateway_seen.items() if now - t > self.cfg.gateway_timeout_s]
        for gid in gone:
            for rid in [r for r, st in self.requests.items() if st.meta.gateway_id == gid]:
                self.abort(rid)
            self.gateways.pop(gid, None)
            del self.gateway_seen[gid]
        return gone

    def has_events(self, gateway_id: str) -> bool:
        return bool(self.gateways.get(gateway_id))

    def inflight(self) -> int:
        return len(self.requests)

    def placements(self) -> dict[str, dict]:
        return request_placements(self.requests)

    def status(self) -> dict:
        return router_status(self, QUEUES)
