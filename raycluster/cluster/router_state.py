"""The router's configuration and per-instance / per-request state records (plain dataclasses)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from raycluster.cluster.messages import InstanceStats, PollReply, RequestMeta
from raycluster.request import SLO, Request
from raycluster.sched.base import SLOConfig
from raycluster.sched.pressure import PressureConfig


class EpochClock:
    """time.time(): arrival times cross processes as wall-clock seconds (messages.py), so the
    policies' "now" must be on the same scale."""

    def now(self) -> float:
        return time.time()


@dataclass
class RouterConfig:
    policy: str = "lars"
    max_queue: int = 256              # requests waiting in the router for their first dispatch
    max_local_waiting: int = 2        # not-yet-started requests an instance may hold
    kv_reserve_frac: float = 0.0      # keep this fraction of an instance's KV free after dispatch
    initial_l_m: int = 2048
    beta_prior: float | None = None   # per-token FFN time: lets prefill samples refit L_m
    heartbeat_timeout_s: float = 10.0
    gateway_timeout_s: float = 30.0   # a gateway not pulling for this long is gone: abort its requests
    transit_timeout_s: float = 5.0    # a handed-out item counts against the instance until then
    retry_after_s: float = 1.0
    slo: SLOConfig = field(default_factory=SLOConfig)
    predictor: dict | None = None     # LinearBatchPredictor fields for the policies' context
    pressure: PressureConfig | None = None   # run the pressure controller (router_pressure.py)
    pressure_period_s: float = 5.0
    prefix_affinity: bool = True      # place prompts where their prefix is cached (instances that cache)
    decode_affinity_slack: int = 4    # ... and handoffs, unless that decode instance has this many more sequences
    # Pools autoscaled from zero: with no instance, their queue holds its requests (bounded by
    # max_queue) until one registers, instead of refusing them or routing them to another pool.
    standby_roles: tuple[str, ...] = ()
    # LoRA adapters every instance starts with (name -> path, the engines' lora_modules);
    # more come and go at run time (router_lora.py).
    lora: dict[str, str] = field(default_factory=dict)
    # The Responses API's stored responses the router keeps for every gateway (0: none; lost when
    # the router restarts): raycluster.server.response_store.
    max_stored_responses: int = 1000


class Transit(dict):
    """An instance's in-transit items, rid -> (steps then, time, blocks, tokens), with running
    totals of the blocks and tokens: dispatch reads both for every candidate instance, while
    items come and go a few times per hand-out. The totals are int sums, so exact in any order.
    Only these mutators keep them: item assignment, `del`, `pop`, `clear`."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = 0
        self.tokens = 0

    def __setitem__(self, rid: str, item: tuple[int, float, int, int]) -> None:
        old = dict.get(self, rid)
        if old is not None:
            self.blocks -= old[2]
            self.tokens -= old[3]
        dict.__setitem__(self, rid, item)
        self.blocks += item[2]
        self.tokens += item[3]

    def __delitem__(self, rid: str) -> None:
        self.pop(rid)

    _MISSING = object()

    def pop(self, rid: str, default=_MISSING):
        item = dict.pop(self, rid, None)
        if item is None:
            if default is Transit._MISSING:
                raise KeyError(rid)
            return default
        self.blocks -= item[2]
        self.tokens -= item[3]
        return item

    def clear(self) -> None:
        dict.clear(self)
        self.blocks = self.tokens = 0

    def settle(self, steps: int, work_seen: int | None, sent: int, now: float,
               timeout_s: float) -> None:
        """Forget items the instance's stats now include. Exact when the instance reports
        `work_seen` (items it has applied, ever; `sent` were handed out, ever, oldest first
        here); otherwise two completed steps after the hand-out (work is applied between
        steps) or `timeout_s` are taken as proof."""
        if work_seen is not None:
            while self and len(self) > sent - work_seen:
                del self[next(iter(self))]
            return
        for rid in [r for r, (s0, t0, _, _) in self.items() if steps >= s0 + 2 or now - t0 > timeout_s]:
            del self[rid]

    def update(self, *args, **kwargs) -> None:
        raise TypeError("Transit: assign items one by one (the totals follow only them)")

    setdefault = popitem = update

    def __reduce__(self):
        return Transit, (), None, None, iter(self.items())     # copies rebuild the totals item by item


@dataclass
class Instance:
    instance_id: str
    role: str
    stats: InstanceStats
    last_seen: float
    outbox: PollReply = field(default_factory=PollReply)
    running: set[str] = field(default_factory=set)   # request ids whose current work is here
    # Items handed out that its stats may not show yet: rid -> (steps then, time, blocks, tokens).
    transit: Transit = field(default_factory=Transit)
    sent: int = 0                     # work items handed out, ever
    moving_to: str | None = None      # role the controller gave it, until its stats carry it
    busy_mark: tuple[float, float] | None = None     # (time, stats.busy_s) at the last control tick
    epoch: str = ""                   # this registration (PollReply.epoch)
    draining: bool = False            # stopping: gets no new work, finishes what it has
    lora_sent: int = 0                # the version of the LoRA adapter table it was sent last

    def transit_sum(self, k: int) -> int:
        t = self.transit
        if k == 2:
            return t.blocks
        if k == 3:
            return t.tokens
        return sum(v[k] for v in t.values())


def instance_summary(i: Instance, now: float) -> dict:
    """One instance as `raycluster status` shows it."""
    s = i.stats
    return {"id": i.instance_id, "role": i.role, "layout": s.layout, "scheduling": s.scheduling, "nodes": s.nodes,
            "waiting": s.waiting, "running": s.running,
            "queued_tokens": s.queued_tokens, "assigned": len(i.running),
            "kv_free_blocks": s.kv_free_blocks, "kv_total_blocks": s.kv_total_blocks,
            "kv_usage": 1 - s.kv_free_blocks / s.kv_total_blocks if s.kv_total_blocks else None,
            "prefix_caching": s.prefix_caching, "prefix_query_tokens": s.prefix_query_tokens,
            "prefix_hit_tokens": s.prefix_hit_tokens, "kv_pulls_ok": s.kv_pulls_ok,
            "kv_pulls_failed": s.kv_pulls_failed, "kv_pull_blocks": s.kv_pull_blocks, "kv_pull_s": s.kv_pull_s,
            "spec_draft_tokens": s.spec_draft_tokens, "spec_accepted_tokens": s.spec_accepted_tokens,
            "spec_drafts": s.spec_drafts, "spec_accepted_per_pos": s.spec_accepted_per_pos,
            "preemptions": s.preemptions, "lora_adapters": s.lora_adapters, "lora_failed": s.lora_failed,
            "encoder_cache_queries": s.encoder_cache_queries, "encoder_cache_hits": s.encoder_cache_hits,
            "last_seen_s_ago": now - i.last_seen, "draining": i.draining}


def router_status(core, queues: tuple[str, ...]) -> dict:
    """What `raycluster status` and GET /v1/cluster/status show of a RouterCore."""
    now = core.clock.now()
    fitted = core.classifier.boundary is not None
    return {
        "router_id": core.router_id,
        "policy": core.cfg.policy,
        "queues": {q: len(core.policies[q]) + len(core.front[q]) for q in queues},
        "queue_depth": core.queue_depth(), "max_queue": core.cfg.max_queue,
        "inflight": core.inflight(),
        "l_m": core.classifier.l_m(),
        "l_m_source": "fitted" if fitted else (
            "initial" if core.cfg.beta_prior is not None
            else "initial (no beta_prior: prefill samples cannot be fitted)"),
        "instances": [instance_summary(i, now) for i in core.instances.values()],
        "dead_instances": list(core.dead[-32:]),
        "resumed": core.resumed,        # requests re-queued from instances that went away
        "lora_adapters": dict(core.adapters.served),
        "lora_loading": sorted(core.adapters.loading),
        "controller": None if core.pressure is None else {
            "period_s": core.cfg.pressure_period_s, "moves": core.pressure.moves[-8:]},
    }


def request_placements(requests: dict[str, "ReqState"]) -> dict[str, dict]:
    """Where each request is (`RouterCore.placements`: queue or instance, mode, parked KV)."""
    return {rid: {"queue": st.queue, "instance": st.instance, "mode": st.mode,
                  "kv_at": st.kv_at, "delivered": len(st.delivered), "class": st.length_class}
            for rid, st in requests.items()}


def policy_request(meta: RequestMeta, now: float) -> Request:
    """The `Request` the router's policies order for a submitted request."""
    return Request(
        request_id=meta.request_id, prompt_token_ids=list(meta.prompt_token_ids),
        sampling=meta.sampling,       # read-only here (RequestMeta owns it)
        arrival_time=meta.arrival_time or now, slo=SLO(ttft_s=meta.ttft_slo_s, tpot_s=meta.tpot_slo_s),
        priority=meta.priority, tenant=meta.tenant, app_id=meta.app_id)


@dataclass
class ReqState:
    meta: RequestMeta
    req: Request                      # what the policies order
    length_class: str                 # short | long
    delivered: list[int] = field(default_factory=list)
    queue: str | None = None          # queue it waits in, None when dispatched
    instance: str | None = None       # instance running its current work item
    mode: str | None = None
    kv: object = None                 # KVHandle parked on a prefill instance
    kv_at: str | None = None          # that prefill instance
    policies: set[str] = field(default_factory=set)   # queues whose policy saw it
    prefix_keys: tuple[int, list] | None = None        # (block size, its prompt's block keys), once asked
    cached_tokens: int = 0            # of its prompt, probably cached where it was sent (prefill work saved)
