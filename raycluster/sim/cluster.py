"""A simulated cluster: the library's `RouterCore` on a virtual clock, `SimInstance`s, KV
transfers, the PLA pressure controller, and the workload client (arrivals, DAG dependencies,
per-request records).

Event kinds (see engine.EventLoop for the tie-break):
  arrival   a workload request is sent: `RouterCore.submit(RequestMeta)`
  step      an instance's step ends: `Scheduler.update`, StepReport -> `RouterCore.on_report`
  transfer  a KV handoff lands on the decode instance
  control   the pressure controller's period (only when enabled)
  wake      an idle instance's packer holds requests that fall due now (AWD's waiting window)
After each event, idle instances the router has work (or releases) for apply it and start a step.
"""

from __future__ import annotations

import dataclasses
import json
import math
import random
from pathlib import Path

from loadgen.images import ImageLoad
from loadgen.metrics import RequestRecord
from loadgen.workloads import Workload, WorkloadRequest
from raycluster.cluster.messages import RequestMeta, StepReport, WorkItem
from raycluster.cluster.router_core import RouterConfig, RouterCore
from raycluster.request import SamplingParams
from raycluster.sched.base import SLOConfig
from raycluster.sched.predictor import LinearBatchPredictor
from raycluster.sched.vision_cost import VISION, VisionCost
from raycluster.sim.engine import EventLoop
from raycluster.sim.fastpath import router_ok
from raycluster.sim.gcquiet import quiet_gc
from raycluster.sim.images import StepImages, request_images
from raycluster.sim.instance import SimInstance
from raycluster.sim.spec import SimPool, SimSpec
from raycluster.sim.step_noise import inverse_cdf

GATEWAY = "sim"
PROMPT_TOKEN = 1


def make_predictor(spec: SimSpec, pool: SimPool):
    if spec.gpu == "cpu":
        p = cpu_predictor(spec, pool)
        if spec.step_overhead_s or spec.step_overhead_per_seq_s:    # engine work outside the model forward
            x = spec.step_overhead_per_seq_s
            p = dataclasses.replace(p, overhead_s=p.overhead_s + spec.step_overhead_s,
                                    per_decode_s=p.per_decode_s + x, per_prefill_s=p.per_prefill_s + x)
        return p
    from raycluster.sched.roofline import GPUS, MODELS, RooflinePredictor
    return RooflinePredictor(GPUS[spec.gpu.upper()], MODELS[spec.model], pool.tp, pool.spp, pool.kvp,
                             mfu=spec.mfu, mbu=spec.mbu, overhead_s=spec.step_overhead_s,
                             quantization=spec.quantization)


_CPU_PRED: dict[str, LinearBatchPredictor] = {}


def cpu_predictor(spec: SimSpec, pool: SimPool | None = None) -> LinearBatchPredictor:
    """The spec's own predictor, else the profile of the real engine on this machine -- of a
    KVP / SPP / TP / SPP x TP / KVP x TP group of the pool's degrees when it has one (fitted through the
    group itself)."""
    p = spec.predictor
    if isinstance(p, dict):
        return LinearBatchPredictor(**p)
    if isinstance(p, str) and p != "auto":
        data = json.loads(Path(p).read_text())
        return LinearBatchPredictor(**data.get("predictor", data))
    kvp, spp, tp = (pool.kvp, pool.spp, pool.tp) if pool is not None else (1, 1, 1)
    key = (spec.model, kvp, spp, tp)
    if key not in _CPU_PRED:     # profile (or load the cached profile of) the model on this machine
        from raycluster.engine.engine import LLMEngine
        from raycluster.engine.config import EngineConfig
        eng = LLMEngine.from_config(EngineConfig(model=spec.model, kvp=kvp, spp=spp, tp=tp,
                                                 **{k: v for k, v in spec.engine.items()
                                                    if k in ("dtype", "num_threads")}))
        _CPU_PRED[key] = eng.predictor
        eng.close()
    return _CPU_PRED[key]


def kv_bytes_per_token(spec: SimSpec) -> float:
    if spec.kv_bytes_per_token:
        return spec.kv_bytes_per_token
    if spec.gpu != "cpu":
        from raycluster.sched.roofline import MODELS
        return MODELS[spec.model].kv_bytes_per_token()
    try:
        cfg = json.loads((Path(spec.model) / "config.json").read_text())
        heads = cfg["num_attention_heads"]
        d = cfg.get("head_dim") or cfg["hidden_size"] // heads
        return 2.0 * 4 * cfg["num_hidden_layers"] * cfg.get("num_key_value_heads", heads) * d
    except (OSError, KeyError, ValueError):
        return 4096.0


def kv_tokens(spec: SimSpec, pool: SimPool, engine_cfg) -> int:
    if spec.kv_cache_tokens:
        return spec.kv_cache_tokens
    if spec.gpu == "cpu":
        # Every KVP rank holds kv_cache_tokens of its own tokens; a TP rank holds kv_cache_tokens
        # of its heads of every token, so a TP instance holds kv_cache_tokens in all (and a
        # KVP x TP one, whose KVP ranks are TP groups, kv_cache_tokens per KVP rank; SPP stages
        # hold other layers of the same tokens, so KVP x SPP (x TP) holds kv_cache_tokens per KVP rank too).
        return engine_cfg.kv_cache_tokens * pool.kvp
    from raycluster.sched.roofline import GPUS, MODELS, QUANTIZATIONS
    g, m = GPUS[spec.gpu.upper()], MODELS[spec.model]
    # Resident weights: the decoder layers in the checkpoint's format, embedding and lm_head in bf16.
    weights = m.resident_bytes(QUANTIZATIONS[spec.quantization])
    free = g.memory_bytes * pool.gpus_per_instance * spec.gpu_memory_utilization - weights
    if free <= 0:
        quant = f" ({spec.quantization})" if spec.quantization != "none" else ""
        raise ValueError(f"pools: {m.name}{quant} does not fit in {pool.gpus_per_instance} x {g.name}")
    # A TP rank holds max(1, kv_heads / tp) KV heads of each token: past tp = kv_heads every head
    # is replicated on tp / kv_heads ranks (as vLLM and the engine place them), each a full copy.
    replicas = max(1, pool.tp // m.kv_heads)
    return int(free // (m.kv_bytes_per_token() * replicas))


def dispatch_latencies(spec: SimSpec, workload: Workload) -> dict[str, float]:
    """Per-request dispatch latency drawn from spec.dispatch_noise, in workload order from one seeded
    stream (so a request's draw does not depend on event order); {} without it (every request
    then waits spec.dispatch_latency_s)."""
    dn = spec.dispatch_noise
    if dn is None:
        return {}
    rng = random.Random(f"{dn.seed}/dispatch")
    return {r.request_id: inverse_cdf(dn.quantiles, rng.random()) for r in workload}


class SimCluster:
    def __init__(self, spec: SimSpec, workload: Workload, fast_decode: bool = False,
                 images: ImageLoad | None = None) -> None:
        """`images`: pictures in every request (the load generator's --images; needs spec.vision)."""
        self.spec = spec
        self.images = images if images is not None and images.per_request else None
        if self.images is not None and spec.vision is None:
            raise ValueError("images: the spec names no vision tower (vision: clip-vit-l-336 | siglip-so400m-896)")
        self.loop = EventLoop()
        self.kv_bytes_per_token = kv_bytes_per_token(spec)
        rcfg = {"policy": spec.policy, "max_queue": 1 << 40, "heartbeat_timeout_s": math.inf,
                "transit_timeout_s": math.inf,
                "slo": SLOConfig(spec.slo.ttft_ms, spec.slo.tpot_ms, spec.slo.ttft_scale),
                "pressure": spec.controller.pressure(), "pressure_period_s": spec.controller.period_s,
                **spec.router}
        self.router = RouterCore(RouterConfig(**rcfg), self.loop.clock)
        self.instances: dict[str, SimInstance] = {}
        # Decode fast path (sim/fastpath.py): only where every router policy ignores decode progress.
        self.fast_decode = bool(fast_decode) and router_ok(self.router)
        # What an instance the controller moves to a role schedules by: that role's (first) pool's config.
        role_configs: dict = {}
        for pool in spec.pools:
            role_configs.setdefault(pool.role, spec.engine_config(pool))
        n = 0
        for pool in spec.pools:
            ecfg = spec.engine_config(pool)
            pred = make_predictor(spec, pool)
            if self.router.predictor is None:
                self.router.set_predictor(pred)         # the router's policies plan with the same model
            blocks = kv_tokens(spec, pool, ecfg) // ecfg.block_size
            for _ in range(pool.instances):
                iid = f"{pool.role}-{n}"
                n += 1
                self.instances[iid] = SimInstance(self, iid, pool.role, ecfg, pred, blocks,
                                                  pool.gpus_per_instance, spec.max_model_len,
                                                  fast=self.fast_decode, role_configs=role_configs,
                                                  images=self._step_images(pool, ecfg))
        # Prefix caching needs the prompts' real token ids (the ones `loadgen run --prompt-format
        # ids` sends for the same workload); otherwise every prompt is one repeated token.
        self.token_ids = any(spec.engine_config(p).enable_prefix_caching for p in spec.pools)
        self.loop.on("arrival", self._arrival)
        self.loop.on("step", self._step)
        self.loop.on("transfer", self._transfer)
        self.loop.on("control", self._control)
        self.loop.on("wake", self._wake_instance)
        # Workload client state.
        self.workload = workload
        self.wreqs: dict[str, WorkloadRequest] = {r.request_id: r for r in workload}
        self.records: dict[str, RequestRecord] = {}
        self.children: dict[str, list[str]] = {}
        self.deps_left: dict[str, int] = {}
        self.done = 0
        self.tokens_out = 0
        self.transfers_done = 0
        self.transfer_bytes = 0.0
        self.moves: list[dict] = []
        self._waking = False
        # The group supersedes runs; step noise too (a run interpolates deterministic step times).
        self.coalesce = spec.coalesce_decode and not self.fast_decode and spec.step_noise is None
        self.max_run_steps = spec.max_run_steps
        self.running_runs: set[SimInstance] = set()
        self.dispatch = dispatch_latencies(spec, workload)
        arrivals = []
        for r in workload:
            self.records[r.request_id] = RequestRecord(
                r.request_id, arrival_s=r.arrival_s, klass=r.klass, tenant=r.tenant, app_id=r.app_id,
                app_type=r.app_type, prompt_tokens=r.prompt_tokens, expected_output_tokens=r.output_tokens,
                ttft_slo_ms=r.ttft_slo_ms, tpot_slo_ms=r.tpot_slo_ms, status="not_sent")
            live = [d for d in r.depends_on if d in self.wreqs]
            self.deps_left[r.request_id] = len(live)
            for d in live:
                self.children.setdefault(d, []).append(r.request_id)
            if not live:      # dispatch_latency_s: serving path from client send to router submit
                arrivals.append((r.arrival_s + self.dispatch.get(r.request_id, spec.dispatch_latency_s),
                                 "arrival", r.request_id))
        self.loop.preload(arrivals)     # as loop.at for each, in this order
        for inst in self.instances.values():      # register (first poll doubles as heartbeat)
            inst.apply(self.router.on_poll(inst.instance_id, inst.stats()))
        if spec.controller.enabled:
            self.loop.after(spec.controller.period_s, "control", None)

    def _step_images(self, pool: SimPool, ecfg) -> StepImages | None:
        """An instance's image encoder (None without images): the pool's GPUs time it."""
        if self.images is None:
            return None
        from raycluster.sched.roofline import GPUS, MODELS
        cost = VisionCost(GPUS[self.spec.gpu.upper()], VISION[self.spec.vision], MODELS[self.spec.model].hidden,
                          pool.tp, self.spec.mfu, self.spec.mbu)
        return StepImages(cost, ecfg.encoder_cache_tokens)

    # ---- client side -----------------------------------------------------------------------------
    def _arrival(self, rid: str) -> None:
        r, rec = self.wreqs[rid], self.records[rid]
        now = self.loop.clock.now()
        rec.arrival_s = rec.send_s = now - self.dispatch.get(rid, self.spec.dispatch_latency_s) if r.depends_on \
            else r.arrival_s
        rec.status = "sent"
        ids = r.prompt_token_ids() if self.token_ids else [PROMPT_TOKEN] * r.prompt_tokens
        pictures = []
        if self.images is not None:         # the pictures before the text, as loadgen's messages
            marks, pictures = request_images(rid, self.images, VISION[self.spec.vision])
            ids = marks + ids
        meta = RequestMeta(request_id=rid, gateway_id=GATEWAY, prompt_token_ids=ids,
                           sampling=SamplingParams(max_tokens=r.output_tokens, ignore_eos=True, images=pictures),
                           ttft_slo_s=r.ttft_slo_ms / 1000.0 if r.ttft_slo_ms is not None else None,
                           tpot_slo_s=r.tpot_slo_ms / 1000.0 if r.tpot_slo_ms is not None else None,
                           priority=r.priority, tenant=r.tenant, app_id=r.app_id, arrival_time=now)
        reply = self.router.submit(meta)
        if not reply.accepted:
            rec.status, rec.error, rec.http_status, rec.finish_s = "http_error", reply.reason, 429, now
            self._finished(rid, ok=False)
        self._wake()

    def _drain_gateway(self) -> None:
        evs = self.router.gateways.pop(GATEWAY, None)
        if not evs:
            return
        now = self.loop.clock.now()
        records, out = self.records, 0
        for ev in evs:
            rec = records[ev.request_id]
            n = len(ev.token_ids)
            if n:
                if rec.first_token_s is None:
                    rec.first_token_s = now
                rec.num_output_tokens += n
                out += n
            if ev.finished:
                rec.finish_s = now
                ok = ev.finish_reason in ("stop", "length")
                rec.status = "ok" if ok else "error"
                rec.error = None if ok else (ev.error or ev.finish_reason)
                self._finished(ev.request_id, ok)
        self.tokens_out += out

    def _finished(self, rid: str, ok: bool) -> None:
        self.done += 1
        for child in self.children.get(rid, ()):
            if not ok:
                crec = self.records[child]
                crec.status, crec.finish_s = "dep_failed", self.loop.clock.now()
                self._finished(child, ok=False)
                continue
            self.deps_left[child] -= 1
            if self.deps_left[child] == 0:
                self.loop.after(self.wreqs[child].think_s + self.dispatch.get(child, self.spec.dispatch_latency_s),
                                "arrival", child)

    # ---- instances ---------------------------------------------------------------------------------
    def on_report(self, inst: SimInstance, rep: StepReport) -> None:
        self.router.on_report(rep)
        self._drain_gateway()
        self._wake()

    def _step(self, payload) -> None:
        inst, version = payload
        if not inst.step_done(version):
            return
        if not inst.busy:
            self._poll(inst)

    def _wake_instance(self, payload) -> None:
        inst, token = payload
        if inst.woken(token):
            self._poll(inst)

    def _poll(self, inst: SimInstance) -> None:
        if self.router.has_outbox(inst.instance_id):
            inst.apply(self.router.take_outbox(inst.instance_id))
        inst.try_start()

    def _wake(self) -> None:
        """Idle instances with work waiting at the router take it and start stepping."""
        if self._waking:
            return
        self._waking = True
        try:
            if self.running_runs:
                for inst in sorted(self.running_runs, key=lambda i: i.instance_id):
                    if self.router.has_outbox(inst.instance_id):
                        inst.cut_run()
            again = True
            while again:
                again = False
                for inst in self.instances.values():
                    if not inst.busy and self.router.has_outbox(inst.instance_id):
                        inst.apply(self.router.take_outbox(inst.instance_id))
                        inst.try_start()
                        again = True
        finally:
            self._waking = False

    # ---- KV transfers ------------------------------------------------------------------------------
    def transfer_bw(self, src: SimInstance | None, dst: SimInstance) -> float:
        if self.spec.transfer_bw_gbs:
            return self.spec.transfer_bw_gbs * 1e9
        if self.spec.gpu == "cpu":
            return 10e9
        from raycluster.sched.roofline import GPUS
        gpus = min(dst.gpus, src.gpus if src else dst.gpus)
        return GPUS[self.spec.gpu.upper()].internode_bw * gpus

    def start_transfer(self, dst: SimInstance, item: WorkItem) -> None:
        h = item.kv
        src = self.instances.get(h.src_instance)
        nbytes = h.nbytes * (1.0 - dst.cached_fraction(item))
        dt = self.spec.transfer_latency_s + nbytes / self.transfer_bw(src, dst)
        self.transfer_bytes += nbytes
        self.loop.after(dt, "transfer", (dst, item))

    def _transfer(self, payload) -> None:
        dst, item = payload
        self.transfers_done += 1
        dst.transfer_done(item)
        if not dst.busy:
            if not dst.try_start():
                dst.report([], [])

    # ---- PLA pressure controller ---------------------------------------------------------------------
    def _control(self, _) -> None:
        """The router's own controller tick (cluster/router_pressure.py), as the router actor runs
        it; a moved instance hears of it at once here (the actor wakes its parked poll)."""
        now = self.loop.clock.now()
        for mv in self.router.pressure.step(self.router, now):
            self._moved(self.instances[mv["instance"]], mv["to"])
        if self.done < len(self.records) and len(self.loop):     # other events pending: keep going
            self.loop.after(self.spec.controller.period_s, "control", None)

    def move(self, instance_id: str, role: str) -> None:
        """Move an instance to another pool now, as a controller tick deciding so would."""
        self.router.move_instance(instance_id, role)
        self._moved(self.instances[instance_id], role)

    def _moved(self, inst: SimInstance, role: str) -> None:
        """The router moved `inst`: it hears at once (it adopts the move between steps)."""
        self.moves.append({"t": self.loop.clock.now(), "instance": inst.instance_id, "to": role})
        inst.cut_run()
        inst.apply(self.router.on_poll(inst.instance_id, inst.stats()))
        inst.try_start()
        self._wake()

    # ---- run -------------------------------------------------------------------------------------
    def run(self, horizon_s: float | None = None) -> None:
        total = len(self.records)
        with quiet_gc():          # the cyclic GC out of the hot loop (sim/gcquiet.py; no effect on results)
            self.loop.run(until=horizon_s, stop=lambda: self.done >= total)
        now = self.loop.clock.now()
        if self.fast_decode:      # tokens decode groups made but not yet reported (horizon hit)
            for inst in self.instances.values():
                if inst.fast:
                    inst.flush_group(self.records)
        for rec in self.records.values():
            if rec.status in ("sent", "not_sent"):
                rec.status = "timeout" if rec.status == "sent" else "not_sent"
                rec.finish_s = now if rec.status == "timeout" else None

    def check_conservation(self) -> None:
        """Every instance's KV is free and its scheduler empty; the router holds nothing."""
        for inst in self.instances.values():
            inst.kv.check()
            assert inst.kv.num_free_blocks == inst.kv.num_blocks, f"{inst.instance_id}: KV not all free"
            assert not inst.scheduler.requests and not inst.scheduler.parked, f"{inst.instance_id}: requests left"
            assert not getattr(inst.scheduler, "bag", None), f"{inst.instance_id}: decode group blocks left"
        assert not self.router.requests, "router still tracks requests"
