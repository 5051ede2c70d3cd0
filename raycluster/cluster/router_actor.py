"""The router as one named, detached Ray actor wrapping `RouterCore` (all logic lives there).

Async actor: every method runs on one event loop, and `RouterCore` methods never await, so each
call is atomic with no locks. Instances and gateways long-poll (`poll`, `pull`): a call returns
at once when something is waiting for the caller, else parks on a per-caller asyncio.Event
until work/events arrive or `timeout_s` passes. Tokens therefore travel as one batch per engine
step (instance `push`) and one batch per gateway `pull`, never one Ray call per token per request.
An instance's poll is also its heartbeat, a gateway's pull too; a background task reaps silent
instances (their work is re-queued) and silent gateways (their requests are aborted) every
second and exports queue/in-flight gauges (ray.util.metrics, "ray_" prefix on the metrics port).

The five calls on the token path (`submit`, `abort`, `pull`, `poll`, `push`) record no Ray task
events: there are several per engine step, and the GCS keeps up to 100k task events in memory
(pd.yaml under long-mix at QPS 2 took it from 56 to 331 MB in 5 minutes, 53 to 56 MB without
them); the dashboard's task list shows the other calls.

Ray restarts the actor if its process dies (`max_restarts=-1`); the new incarnation starts empty
under a new `router_id`, and instances and gateways recover their work from it (messages.py).
A redeploy hands the live router its new config (`reconfigure`, router_reconfigure.py); since Ray
re-runs `__init__` with the creation args, a named router also keeps the config last applied to
it, and the LoRA adapters served (those loaded at run time too), in the GCS key-value store
(what Serve's controller keeps its own state in), and a restarted incarnation starts from them.
`load_lora` / `unload_lora` change the adapters every instance serves (router_lora.py).
"""

from __future__ import annotations

import asyncio
import logging
import pickle
import time
import uuid
from dataclasses import asdict

import ray
from ray.experimental.internal_kv import _internal_kv_get, _internal_kv_put

from raycluster.cluster import router_autoscale
from raycluster.cluster.messages import (GatewayReply, InstanceStats, PollReply, RequestMeta,
                                         StepReport, SubmitReply)
from raycluster.cluster.router_core import QUEUES, RouterConfig, RouterCore
from raycluster.cluster.router_lora import RouterAdapters, load_everywhere, unload_everywhere
from raycluster.cluster.router_reconfigure import reconfigure
from raycluster.server.response_store import ResponseStore

log = logging.getLogger(__name__)

ROUTER_NAME = "raycluster-router"
ROUTER_NAMESPACE = "raycluster"
KV_NAMESPACE = "raycluster"     # the GCS key-value store's namespace for the routers' configs
MAX_POLL_S = 30.0       # cap on a caller's long-poll (keeps heartbeats and shutdown prompt)


@ray.remote(num_cpus=0, max_concurrency=1000)
class RouterActor:
    def __init__(self, cfg: RouterConfig | dict | None = None, reap_interval_s: float = 1.0) -> None:
        if isinstance(cfg, dict):
            cfg = RouterConfig(**cfg)
        ctx = ray.get_runtime_context()
        name, self._actor_id = ctx.get_actor_name(), ctx.get_actor_id()
        self._cfg_key = f"router-config/{ctx.namespace}/{name}" if name else None
        adapters = None
        if self._cfg_key is not None:
            saved = _internal_kv_get(self._cfg_key, namespace=KV_NAMESPACE)
            saved_by, saved_cfg, saved_adapters = (*pickle.loads(saved), None)[:3] if saved else (None, None, None)
            if saved_by == self._actor_id:      # this actor restarted (its id stays): the last state
                cfg, adapters = saved_cfg, saved_adapters
            else:                               # a new router under this name: its creation args
                self._save_config(cfg or RouterConfig())
        # EpochClock: time.time() like arrivals. A fresh id per incarnation (restarts included),
        # sorting by start time, so a gateway can tell the newer of two routers.
        router_id = f"{time.time_ns():016x}-{uuid.uuid4().hex[:6]}"
        self.core = RouterCore(cfg or RouterConfig(), router_id=router_id)
        if adapters is not None:
            self.core.adapters = RouterAdapters(self.core.cfg.lora, restored=adapters)
        self.responses = ResponseStore(self.core.cfg.max_stored_responses)
        self._inst_ev: dict[str, asyncio.Event] = {}
        self._gw_ev: dict[str, asyncio.Event] = {}
        self._reap_interval_s = reap_interval_s
        self._bg: asyncio.Task | None = None
        self._ctl: asyncio.Task | None = None
        self._metrics = _Metrics()

    def _save_config(self, cfg: RouterConfig, adapters: dict[str, str] | None = None) -> None:
        """Keep `cfg` and the adapters served (None: the config's own) for a restart."""
        if self._cfg_key is not None:
            _internal_kv_put(self._cfg_key, pickle.dumps((self._actor_id, cfg, adapters)), overwrite=True,
                             namespace=KV_NAMESPACE)

    def _ensure_bg(self) -> None:
        # The loop exists only once a method runs, so the reaper starts lazily.
        if self._bg is None or self._bg.done():
            self._bg = asyncio.get_running_loop().create_task(self._reaper())
        if self.core.pressure is not None and (self._ctl is None or self._ctl.done()):
            self._ctl = asyncio.get_running_loop().create_task(self._control())

    async def _reaper(self) -> None:
        while True:
            await asyncio.sleep(self._reap_interval_s)
            try:
                dead = self.core.reap()
                gone = self.core.reap_gateways()
                if gone:
                    log.warning("router: gateways %s stopped pulling; their requests aborted", gone)
                if dead:
                    log.warning("router: instances %s missed heartbeats; their requests re-queued", dead)
                    for iid in dead:
                        ev = self._inst_ev.pop(iid, None)
                        if ev is not None:
                            ev.set()            # a poll parked for a dead id returns (empty)
                self._wake()
                self._metrics.update(self.core)
            except Exception:                   # the reaper must outlive any one bad state
                log.exception("router: reap failed")

    async def _control(self) -> None:
        """The pressure controller's period: a move lands in the instance's outbox, so waking
        parked polls delivers it at once."""
        while True:
            await asyncio.sleep(self.core.cfg.pressure_period_s)
            if self.core.pressure is None:
                return                          # a redeploy turned the controller off
            try:
                for mv in self.core.pressure.step(self.core, self.core.clock.now()):
                    log.info("router: controller moved %s from %s to %s", mv["instance"], mv["from"], mv["to"])
                self._wake()
            except Exception:                   # like the reaper: never let one tick end the loop
                log.exception("router: control tick failed")

    def _wake(self) -> None:
        """Wake parked long-polls whose caller now has something waiting."""
        for iid, ev in self._inst_ev.items():
            if self.core.has_outbox(iid):
                ev.set()
        for gid, ev in self._gw_ev.items():
            if self.core.has_events(gid):
                ev.set()

    @staticmethod
    async def _wait(ev: asyncio.Event, timeout_s: float) -> None:
        try:
            await asyncio.wait_for(ev.wait(), timeout=max(0.0, min(timeout_s, MAX_POLL_S)))
        except asyncio.TimeoutError:
            pass

    # ------------------------------------------------------------- gateway side
    @ray.method(enable_task_events=False)
    async def submit(self, meta: RequestMeta) -> SubmitReply:
        self._ensure_bg()
        reply = self.core.submit(meta)
        self._wake()
        return reply

    @ray.method(enable_task_events=False)
    async def abort(self, request_id: str) -> bool:
        ok = self.core.abort(request_id)
        self._wake()
        return ok

    @ray.method(enable_task_events=False)
    async def pull(self, gateway_id: str, timeout_s: float = 0.5) -> GatewayReply:
        self._ensure_bg()
        if not self.core.has_events(gateway_id) and timeout_s > 0:
            ev = self._gw_ev.setdefault(gateway_id, asyncio.Event())
            ev.clear()
            await self._wait(ev, timeout_s)
        return self.core.take_events(gateway_id)

    # ------------------------------------------------------------- instance side
    @ray.method(enable_task_events=False)
    async def poll(self, instance_id: str, stats: InstanceStats, timeout_s: float = 0.5) -> PollReply:
        self._ensure_bg()
        reply = self.core.on_poll(instance_id, stats)
        self._wake()                            # dispatch may have filled other outboxes
        if _empty(reply) and timeout_s > 0:
            ev = self._inst_ev.setdefault(instance_id, asyncio.Event())
            ev.clear()                          # no await since on_poll: no wake-up is lost
            await self._wait(ev, timeout_s)
            reply = self.core.take_outbox(instance_id)
        return reply

    @ray.method(enable_task_events=False)
    async def push(self, report: StepReport) -> None:
        self._ensure_bg()
        self.core.on_report(report)
        self._wake()

    # ------------------------------------------------------------- deployment
    async def reconfigure(self, cfg: RouterConfig) -> list[str]:
        """Apply a redeployed config (every `build_app` sends it); returns the fields that changed."""
        changed = reconfigure(self.core, cfg)
        self.responses.resize(self.core.cfg.max_stored_responses)
        if changed:
            self._save_config(cfg, dict(self.core.adapters.served))
            log.info("router: config changed: %s", ", ".join(changed))
            self._ensure_bg()                   # the controller may be on now
            self._wake()
        return changed

    async def drain_instance(self, instance_id: str) -> bool:
        """The instance is stopping: no new work for it (`RouterCore.drain_instance`)."""
        return self.core.drain_instance(instance_id)

    async def expect_instances(self, roles: list[str], for_s: float) -> None:
        """A deploy is starting these pools' instances (`RouterCore.expect_instances`)."""
        self.core.expect_instances(roles, for_s)

    # ------------------------------------------------------------- LoRA adapters
    async def lora_adapters(self) -> dict[str, str]:
        """The adapters requests may name now (name -> path)."""
        return dict(self.core.adapters.served)

    async def load_lora(self, name: str, path: str, timeout_s: float = 120.0) -> dict:
        """Have every instance load the adapter (`router_lora.load_everywhere`)."""
        self._ensure_bg()
        reply = await load_everywhere(self.core, name, path, timeout_s, wake=self._wake)
        if reply["ok"]:
            self._save_config(self.core.cfg, dict(self.core.adapters.served))
        return reply

    async def unload_lora(self, name: str) -> dict:
        """New requests may no longer name it (`router_lora.unload_everywhere`)."""
        reply = unload_everywhere(self.core, name, wake=self._wake)
        if reply["ok"]:
            self._save_config(self.core.cfg, dict(self.core.adapters.served))
        return reply

    # ------------------------------------------------------------- stored responses
    async def put_response(self, response_id: str, record: dict) -> None:
        """Keep a Responses API response for every gateway (raycluster.server.response_store)."""
        self.responses.put(response_id, record)

    async def get_response(self, response_id: str) -> dict | None:
        return self.responses.get(response_id)

    async def delete_response(self, response_id: str) -> bool:
        return self.responses.delete(response_id)

    async def cancel_response(self, response_id: str) -> dict | None:
        """Mark a background response cancelled; the gateway replica running it sees that through
        `response_statuses` and aborts its request."""
        return self.responses.cancel(response_id)

    async def response_statuses(self, response_ids: list[str]) -> dict[str, str | None]:
        return self.responses.statuses(response_ids)

    async def append_response_events(self, response_id: str, events: list[str], done: bool = False) -> None:
        """A streamed background response's next events, for clients resuming its stream anywhere."""
        self.responses.append_events(response_id, events, done)

    async def response_events_after(self, response_id: str, after: int) -> tuple[list[str], bool] | None:
        return self.responses.events_after(response_id, after)

    # ------------------------------------------------------------- inspection
    async def status(self) -> dict:
        st = self.core.status()
        st["config"] = asdict(self.core.cfg)
        st["stored_responses"] = len(self.responses)
        return st

    async def inflight(self) -> int:
        return self.core.inflight()

    async def autoscale_stats(self, instance_id: str, role: str) -> dict:
        """A pool replica's autoscaling metrics (its `record_autoscaling_stats`)."""
        return router_autoscale.instance_stats(self.core, instance_id, role)

    async def pool_autoscale_stats(self, role: str) -> dict:
        """A whole pool's load: what Serve's policy probes while the pool has no running replica."""
        return router_autoscale.pool_stats(self.core, role)

    async def placements(self) -> dict:
        return self.core.placements()

    async def remove_instance(self, instance_id: str) -> None:
        self.core.remove_instance(instance_id)
        self._wake()


def _empty(r: PollReply) -> bool:
    return not (r.work or r.aborts or r.releases or r.role or r.shutdown or r.lora is not None)


class _Metrics:
    """Gauges for the Ray dashboard / Prometheus; absent metrics support must not break routing."""

    def __init__(self) -> None:
        try:
            from ray.util.metrics import Gauge
            self.queue = Gauge("raycluster_router_queue_depth", "requests queued in the router per pool",
                               tag_keys=("pool",))
            self.inflight = Gauge("raycluster_router_inflight", "requests admitted and not finished")
            self.instances = Gauge("raycluster_router_instances", "live instances per role",
                                   tag_keys=("role",))
        except Exception:                       # pragma: no cover - metrics are best effort
            log.exception("router: metrics disabled")
            self.queue = None

    def update(self, core: RouterCore) -> None:
        if self.queue is None:
            return
        st = core.status()
        for q in QUEUES:
            self.queue.set(st["queues"][q], tags={"pool": q})
        self.inflight.set(st["inflight"])
        roles: dict[str, int] = {}
        for i in st["instances"]:
            roles[i["role"]] = roles.get(i["role"], 0) + 1
        for role in ("mixed", "prefill-short", "prefill-long", "decode"):
            self.instances.set(roles.get(role, 0), tags={"role": role})


def get_or_create_router(cfg: RouterConfig | None = None, name: str = ROUTER_NAME,
                         namespace: str = ROUTER_NAMESPACE):
    """The cluster's router handle: created detached on first use, the same actor afterwards
    (a later caller's `cfg` is ignored when the actor exists: `reconfigure` applies one).
    Restarted whenever it dies, with the config last applied; `ray.kill` (no_restart) ends it."""
    return RouterActor.options(name=name, namespace=namespace, lifetime="detached", max_restarts=-1,
                               get_if_exists=True).remote(cfg)
