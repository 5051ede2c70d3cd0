"""One engine instance inside the cluster: pulls work from the router, steps, reports back.

`InstanceWorker` owns an `LLMEngine` and a KV connector and runs four threads:
- the poll thread long-polls the router (`poll_fn(instance_id, stats, timeout) -> PollReply`,
  which doubles as the heartbeat) and queues each reply;
- the compile thread compiles the structured-output patterns of new work the engine has not
  seen (seconds, for a big schema over a big vocabulary) before its reply reaches the step
  thread, which must not stall on one; replies keep their order (`_deliver`);
- the step thread applies replies between steps (a move to another pool, new work by mode
  full / prefill / decode, aborts, KV releases, expired leases), runs `engine.step()`, and
  queues one `StepReport` per step with every request's new tokens, prefill handoffs and
  admissions;
- the push thread sends queued reports through `push_fn` one call at a time (merging reports
  that queued meanwhile), because an async actor does not run calls in arrival order and
  tokens must reach the router in the order they were made.
A poll reply with a new `epoch` (the router restarted, or reaped this instance and re-queued its
work) makes the step thread drop every request, parked KV and offer it holds before applying
the reply; each report carries the epoch it was made under.
A poll reply with a LoRA adapter table (router_lora.py) goes by the compile thread, which reads
the adapters the engine lacks; the step thread then makes the engine serve exactly that table
before it applies the reply's work, and the stats report what it serves and could not load.
A poll reply with a new `role` (the pressure controller moved the instance) makes the step
thread adopt that pool's scheduling config (`role_configs`, `LLMEngine.reconfigure_scheduling`)
before it applies the reply's work; the role and scheduling it reports change together then.
Work whose images arrive as handles (the gateway's `share_images`) has its pixels fetched on the
poll thread (`fetch_images`) before the reply is queued.
No Ray import: the Serve deployment passes the functions, so tests can drive it directly.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import time
from typing import Callable

import torch

from raycluster.cluster.messages import (InstanceStats, PollReply, PrefillDone, StepReport, TokenEvent,
                                         WorkItem)
from raycluster.engine.config import EngineConfig
from raycluster.engine.engine import LLMEngine
from raycluster.engine.guided import constraint_of
from raycluster.engine.stat_log import StatLogger
from raycluster.model.lora import AdapterError
from raycluster.kv_transfer.base import KVConnector, KVTransferError, KVTransferUnquiesced, pull_with_fallback
from raycluster.request import SLO

log = logging.getLogger(__name__)

PollFn = Callable[[str, InstanceStats, float], PollReply]
PushFn = Callable[[StepReport], None]


class InstanceWorker:
    def __init__(self, engine: LLMEngine, role: str, instance_id: str, poll_fn: PollFn, push_fn: PushFn,
                 connector: KVConnector | None = None, transfer_timeout_s: float = 10.0,
                 on_transfer_failure: str = "recompute", poll_timeout_s: float = 0.5,
                 role_configs: dict[str, EngineConfig] | None = None, nodes: list[str] | None = None,
                 stat_logger: StatLogger | None = None, fetch_images: Callable[[list], list] | None = None) -> None:
        """`role_configs`: the engine config of each pool this instance may be moved to (a role
        missing there keeps the scheduling the instance has). `nodes`: where its ranks run (stats).
        `fetch_images`: the pixel tensors of the gateway's handles (raycluster.cluster.client's
        `share_images`), in order; None: work carries the tensors themselves.
        `stat_logger`: fed every step and idle tick of the step thread (periodic stats lines)."""
        self.engine = engine
        self.role = role
        self.role_configs = dict(role_configs or {})
        self.instance_id = instance_id
        self.nodes = list(nodes or [])
        self.poll_fn = poll_fn
        self.push_fn = push_fn
        self.connector = connector
        self.port = engine.runner.port      # the KV the connector wraps (a group's: staged copies)
        self.transfer_timeout_s = transfer_timeout_s
        self.on_transfer_failure = on_transfer_failure
        self.poll_timeout_s = poll_timeout_s
        self.stat_logger = stat_logger
        self.fetch_images = fetch_images
        self._replies: queue.Queue[PollReply] = queue.Queue()
        self._to_compile: queue.Queue[PollReply] = queue.Queue()
        self._compile_backlog = 0                # replies on the compile thread (under its lock)
        self._compile_lock = threading.Lock()
        self._stop = threading.Event()
        self.fatal: str | None = None            # why this worker stopped for good (fail closed)
        self._step_ema = 0.0
        self.steps = 0
        self.offer_failures = 0                  # KV offers that raised (the decode side recomputed)
        self.busy_s = 0.0
        self._admitted: list[str] = []
        self._work_seen = 0
        self._pending: list[TokenEvent] = []     # events made outside a step (errors, aborts)
        self._reports: queue.Queue[StepReport] = queue.Queue()
        self._epoch: str | None = None           # applied by the step thread, stamped on reports
        self._polled_epoch: str | None = None    # last seen by the poll thread
        # LoRA adapters: the router table's version applied, the ones of it that failed (name ->
        # error), what the engine serves (a copy the poll thread may read), and adapters the
        # compile thread read for a table (version -> name -> adapter or the error).
        self._lora_version, self._lora_failed = -1, {}
        self._lora_paths = engine.lora.paths()
        self._lora_read: dict[int, dict] = {}
        self._threads = [threading.Thread(target=self._poll_loop, name=f"{instance_id}-poll", daemon=True),
                         threading.Thread(target=self._step_loop, name=f"{instance_id}-step", daemon=True),
                         threading.Thread(target=self._push_loop, name=f"{instance_id}-push", daemon=True),
                         threading.Thread(target=self._compile_loop, name=f"{instance_id}-compile", daemon=True)]

    def start(self) -> "InstanceWorker":
        for t in self._threads:
            t.start()
        return self

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout)

    def drain(self, timeout_s: float, quiet_s: float = 1.0) -> bool:
        """Wait, up to `timeout_s`, until this instance holds nothing (`_holds_nothing`) for
        `quiet_s` in a row: work the router handed out before it was told to drain arrives
        within a poll. The router gives it no new work meanwhile (`RouterCore.drain_instance`).
        True if it emptied."""
        deadline, quiet_since = time.monotonic() + timeout_s, None
        while not self._stop.is_set():
            now = time.monotonic()
            if not self._holds_nothing():
                quiet_since = None
            elif quiet_since is None:
                quiet_since = now
            elif now - quiet_since >= quiet_s:
                return True
            if now >= deadline:
                return False
            time.sleep(0.05)
        return False

    def _holds_nothing(self) -> bool:
        """No request running or waiting, no KV parked for a decode instance to pull, no reply
        to apply and no report to send."""
        eng = self.engine
        return not (eng.has_unfinished() or eng.scheduler.parked or self._replies.qsize()
                    or self._to_compile.qsize() or self._compile_backlog or self._reports.qsize()
                    or self._pending or self._admitted)

    def stats(self) -> InstanceStats:
        eng, kv = self.engine, self.engine.kv
        pulls = getattr(self.connector, "pull_counts", None) or {}
        kv_free, kv_total = kv.placement_blocks()
        cache = eng.runner.image_cache
        return InstanceStats(
            instance_id=self.instance_id, role=self.role, waiting=eng.scheduler.num_waiting,
            running=len(eng.scheduler.decoding), kv_free_blocks=kv_free, kv_total_blocks=kv_total,
            block_size=kv.block_size, step_time_ema_s=self._step_ema, steps=self.steps, busy_s=self.busy_s,
            queued_tokens=eng.scheduler.prefill_backlog,
            connector=(self.connector.local_descriptor() or {}) if self.connector else {},
            work_seen=self._work_seen, layout=eng.runner.layout, scheduling=eng.config.scheduling_label(),
            nodes=self.nodes, prefix_caching=kv.prefix_caching,
            prefix_query_tokens=getattr(kv, "query_tokens", 0), prefix_hit_tokens=getattr(kv, "hit_tokens", 0),
            kv_pulls_ok=pulls.get("ok", 0), kv_pulls_failed=pulls.get("failed", 0),
            kv_pull_blocks=pulls.get("blocks", 0), kv_pull_s=pulls.get("seconds", 0.0),
            spec_draft_tokens=eng.spec.draft_tokens, spec_accepted_tokens=eng.spec.accepted_tokens,
            spec_drafts=eng.spec.drafts, spec_accepted_per_pos=list(eng.spec.accepted_per_pos),
            preemptions=eng.scheduler.preempted_total, lora_adapters=list(self._lora_paths),
            encoder_cache_queries=cache.hits + cache.misses if cache is not None else 0,
            encoder_cache_hits=cache.hits if cache is not None else 0,
            kv_groups=kv.groups.num_groups if kv.groups is not None else 1, kv_released_blocks=kv.released_total,
            lora_failed=dict(self._lora_failed), lora_version=self._lora_version)

    # ---- threads ---------------------------------------------------------------------------
    def _poll_loop(self) -> None:
        while not self._stop.is_set():
            try:
                reply = self.poll_fn(self.instance_id, self.stats(), self.poll_timeout_s)
            except Exception as e:          # router restarting: back off, keep heartbeating
                log.warning("%s: poll failed: %s", self.instance_id, e)
                self._stop.wait(0.5)
                continue
            if (reply.work or reply.aborts or reply.releases or reply.role or reply.lora is not None
                    or reply.epoch != self._polled_epoch):
                self._polled_epoch = reply.epoch
                if self.fetch_images is not None and any(w.meta.sampling.images for w in reply.work):
                    reply = dataclasses.replace(reply, work=[self._with_pixels(w) for w in reply.work])
                self._deliver(reply)
            if reply.shutdown:
                self._stop.set()

    def _with_pixels(self, item: WorkItem) -> WorkItem:
        """`item` with its images' pixels fetched (the router passed handles). A fetch that fails
        leaves the handles: the engine then refuses the request, naming the image."""
        images = item.meta.sampling.images
        handles = [k for k, im in enumerate(images) if not isinstance(im.pixel_values, torch.Tensor)]
        if not handles:
            return item
        try:
            pixels = self.fetch_images([images[k].pixel_values for k in handles])
        except Exception as e:      # an object lost with its owner (the gateway's node died)
            log.warning("%s: fetching the images of %s failed: %s", self.instance_id, item.meta.request_id, e)
            return item
        fetched = list(images)
        for k, px in zip(handles, pixels):
            fetched[k] = dataclasses.replace(images[k], pixel_values=px)
        sampling = dataclasses.replace(item.meta.sampling, images=fetched)
        return dataclasses.replace(item, meta=dataclasses.replace(item.meta, sampling=sampling))

    def _deliver(self, reply: PollReply) -> None:
        """Queue a reply for the step thread. One with a pattern to compile goes by the compile
        thread, and so does every reply after it until that thread is idle: an abort must not
        overtake the work it aborts."""
        with self._compile_lock:
            if self._compile_backlog or reply.lora is not None or \
                    any(not self.engine.pattern_ready(w.meta.sampling) for w in reply.work):
                self._compile_backlog += 1
                self._to_compile.put(reply)
                return
        self._replies.put(reply)

    def _compile_loop(self) -> None:
        while not self._stop.is_set():
            try:
                reply = self._to_compile.get(timeout=0.2)
            except queue.Empty:
                continue
            try:
                if reply.lora is not None:
                    self._lora_read[reply.lora_version] = self._read_adapters(reply.lora)
                for item in reply.work:
                    constraint = constraint_of(item.meta.sampling)
                    if constraint is not None:
                        try:
                            self.engine.guided_decoding().index(constraint)
                        except ValueError:
                            pass    # admitting it answers the request with the error
            except Exception:       # a compiler bug: the same, but this thread must live on
                log.exception("%s: compiling a pattern failed", self.instance_id)
            finally:                # else every later reply would wait here for good
                self._replies.put(reply)
                with self._compile_lock:
                    self._compile_backlog -= 1

    def _step_loop(self) -> None:
        while not self._stop.is_set():
            idle = not self.engine.has_unfinished()
            try:
                self._apply(self._replies.get(timeout=0.1) if idle else self._replies.get_nowait())
                while True:
                    self._apply(self._replies.get_nowait())
            except queue.Empty:
                pass
            except KVTransferUnquiesced as e:
                # Blocks of this KV may still be written by a transfer nobody can stop: serve
                # nothing more from it. Every thread stops (no more heartbeats, so the router
                # resumes this instance's requests elsewhere) and check_health reports it, so
                # Serve replaces the replica with fresh memory.
                log.critical("%s: failing closed: %s", self.instance_id, e)
                self.fatal = str(e)
                self._stop.set()
                return
            self._expire_leases()
            if self.engine.has_unfinished():
                try:
                    self._step()
                except Exception:       # a bug must not leave requests hanging silently
                    log.exception("%s: engine step failed; failing its requests", self.instance_id)
                    self._fail_all("engine step failed")
            else:
                if self._pending or self._admitted:
                    self._report([], [])
                if self.stat_logger is not None:
                    self.stat_logger.observe(self.engine, None)

    # ---- applying router replies -------------------------------------------------------------
    def _read_adapters(self, table: dict[str, str]) -> dict:
        """Read (off the step thread) the adapters of `table` the engine does not serve from
        that path."""
        served, out = dict(self._lora_paths), {}
        for name, path in table.items():
            if served.get(name) != path:
                try:
                    out[name] = self.engine.read_lora(name, path)
                except Exception as e:     # reported to the router, which fails the load
                    out[name] = e
        return out

    def _apply_lora(self, table: dict[str, str], version: int) -> None:
        """Serve exactly `table`: unload what it lacks (running requests finish on it), add
        what was read for it; record what could not be loaded."""
        eng, read, failed = self.engine, self._lora_read.pop(version, None), {}
        if read is None:                   # (a reply that skipped the compile thread)
            read = self._read_adapters(table)
        for name in eng.lora.names():
            if name not in table or eng.lora.adapters[name].path != table[name]:
                eng.unload_lora(name)
        for name, got in read.items():
            if name not in table or name in eng.lora:
                continue
            try:
                if isinstance(got, Exception):
                    raise got
                eng.lora.add(got)
            except Exception as e:
                if not isinstance(e, AdapterError):
                    log.exception("%s: loading LoRA adapter %r failed", self.instance_id, name)
                failed[name] = str(e)
        self._lora_paths, self._lora_failed, self._lora_version = eng.lora.paths(), failed, version

    def _apply(self, reply: PollReply) -> None:
        if reply.epoch is not None and reply.epoch != self._epoch:
            self._drop_all()
            self._epoch = reply.epoch
        if reply.lora is not None:
            self._apply_lora(reply.lora, reply.lora_version)
        if reply.role and reply.role != self.role:
            self._move(reply.role)
        for rid in reply.aborts:
            self.engine.abort_request(rid)
            if self.connector is not None:
                self.connector.release(rid)
                self.port.unstage(rid)
        for rid in reply.releases:
            if self.connector is not None:
                self.connector.release(rid)
                self.port.unstage(rid)
            self.engine.release(rid)
        sched = self.engine.scheduler
        for item in reply.work:
            self._work_seen += 1
            rid = item.meta.request_id
            held = rid in sched.requests or rid in sched.parked     # (a duplicate id: keep that one)
            try:
                self._admit(item)
            except KVTransferUnquiesced:
                raise
            except Exception as e:
                # Invalid input (ValueError) or a bug, ours or a connector's: answer this request,
                # free what its admission reserved (a handoff's blocks) and keep serving.
                if not held:
                    self.engine.abort_request(rid)
                if not isinstance(e, ValueError):
                    log.exception("%s: admitting %r failed", self.instance_id, rid)
                self._pending.append(TokenEvent(rid, [], True, "error", str(e) if isinstance(e, ValueError)
                                                else f"admission failed: {type(e).__name__}: {e}"))

    def _move(self, role: str) -> None:
        """The controller moved this instance to `role`: schedule as that pool's engines do."""
        target = self.role_configs.get(role)
        if target is None:
            log.warning("%s: moved to %s, whose engine config it was not given: keeps its scheduling",
                        self.instance_id, role)
        elif self.engine.reconfigure_scheduling(target):
            log.info("%s: moved to %s, now schedules %s", self.instance_id, role,
                     self.engine.config.scheduling_label())
        self.role = role

    def _admit(self, item: WorkItem) -> None:
        m = item.meta       # the engine gets m.sampling itself: it never writes a request's SamplingParams
        kwargs = dict(slo=SLO(m.ttft_slo_s, m.tpot_slo_s), priority=m.priority, tenant=m.tenant,
                      app_id=m.app_id, arrival_time=self.engine.clock.now() - max(0.0, time.time() - m.arrival_time))
        if item.mode == "decode" and item.kv is not None and item.kv.src_instance == self.instance_id \
                and self.engine.adopt_parked(m.request_id):
            # Prefilled here before this instance moved to the decode pool: decode in place.
            self.connector.release(m.request_id)
            self._admitted.append(m.request_id)
        elif item.mode == "decode" and item.kv is not None and self.connector is not None:
            handle = item.kv
            if item.first_token_time is not None:     # router epoch time -> this engine's clock
                kwargs["first_token_time"] = self.engine.clock.now() - max(0.0, time.time() - item.first_token_time)
            self.engine.add_prefilled(
                m.request_id, m.prompt_token_ids, item.output_token_ids, m.sampling,
                lambda dst, skip: self.port.receive(dst, lambda ids: pull_with_fallback(
                    self.connector, dataclasses.replace(handle, skip_blocks=skip), ids,
                    self.transfer_timeout_s, self.on_transfer_failure)), **kwargs)
            self._admitted.append(m.request_id)
        else:
            self.engine.add_request(m.request_id, m.prompt_token_ids, m.sampling,
                                    prefill_only=item.mode == "prefill",
                                    output_token_ids=item.output_token_ids or None, **kwargs)
            if item.mode == "decode":        # no KV handle: recompute here
                self._admitted.append(m.request_id)

    def _drop_all(self) -> None:
        """Forget all work: the router that handed it out is gone or has re-queued it."""
        sched = self.engine.scheduler
        dropped = len(sched.requests) + len(sched.parked)
        for rid in list(sched.requests):
            self.engine.abort_request(rid)
        offered = self.connector.offered_ids() if self.connector is not None else []
        for rid in offered:
            self.connector.release(rid)
            self.port.unstage(rid)
        for rid in list(sched.parked):
            self.engine.release(rid)
        self._pending, self._admitted = [], []
        if dropped or offered:
            log.warning("%s: new router epoch: dropped %d requests and %d KV offers",
                        self.instance_id, dropped, len(offered))

    def _expire_leases(self) -> None:
        if self.connector is None:
            return
        for rid in self.connector.expire():
            self.engine.release(rid)
            self.port.unstage(rid)

    # ---- stepping and reporting ----------------------------------------------------------------
    def _step(self) -> None:
        result = self.engine.step()
        if not result.outputs and result.num_prefill_tokens == 0 and result.num_decode_tokens == 0:
            time.sleep(0.001)       # the packer is holding requests back (AWD window): don't spin
        self.steps += 1
        self.busy_s += result.duration_s
        self._step_ema = result.duration_s if self.steps == 1 else 0.9 * self._step_ema + 0.1 * result.duration_s
        if self.stat_logger is not None:
            self.stat_logger.observe(self.engine, result)
        events, prefilled = [], []
        for out in result.outputs:
            if out.finish_reason == "prefilled":
                try:
                    kv = self._offer(out.request_id)
                except KVTransferError as e:        # on_transfer_failure="fail"
                    events.append(TokenEvent(out.request_id, [], True, "error", str(e)))
                    continue
                prefilled.append(PrefillDone(out.request_id, out.new_token_ids[0], kv,
                                             out.logprobs, out.num_cached_tokens, out.prompt_logprobs, out.prefill_s))
            else:
                events.append(TokenEvent(out.request_id, list(out.new_token_ids), out.finished, out.finish_reason,
                                         logprobs=out.logprobs, num_cached_tokens=out.num_cached_tokens,
                                         prompt_logprobs=out.prompt_logprobs, prefill_s=out.prefill_s,
                                         embedding=out.embedding))
        self._report(events, prefilled)

    def _offer(self, request_id: str):
        """The KV handle of a prefilled request's parked blocks, or None: nothing to offer, or
        the offer failed and the decode side recomputes the prefill (on_transfer_failure
        "recompute"; with "fail" a KVTransferError ends the request in an error). Either way a
        failed offer frees what it held: it must not stall the step or strand the request."""
        try:
            return self._offer_blocks(request_id)
        except Exception as e:
            self.port.unstage(request_id)
            self.engine.release(request_id)
            self.offer_failures += 1
            log.warning("%s: KV offer of %r failed (%s: %s); %s", self.instance_id, request_id,
                        type(e).__name__, e, "failing it" if self.on_transfer_failure == "fail"
                        else "its decode instance recomputes the prefill",
                        exc_info=self.offer_failures == 1)      # the traceback once
            if self.on_transfer_failure == "fail":
                raise KVTransferError(f"KV offer of {request_id!r} failed: {type(e).__name__}: {e}") from e
            return None

    def _offer_blocks(self, request_id: str):
        blocks = self.engine.parked_blocks(request_id)
        ids = self.port.stage(request_id, blocks) if self.connector is not None and blocks else None
        if ids is None:                 # nothing to offer: the decode side recomputes
            self.engine.release(request_id)
            return None
        n = self.engine.scheduler.parked[request_id].num_tokens - 1    # KV-backed: all but the sampled token
        if self.port.copies:            # a group's blocks were copied out: free them now
            self.engine.release(request_id)
        return self.connector.offer(request_id, ids, n)

    def _report(self, events: list[TokenEvent], prefilled: list[PrefillDone]) -> None:
        self._reports.put(StepReport(self.stats(), self._pending + events, prefilled, self._admitted,
                                     epoch=self._epoch))
        self._pending, self._admitted = [], []

    def _push_loop(self) -> None:
        while not self._stop.is_set():
            try:
                batch = [self._reports.get(timeout=0.2)]
            except queue.Empty:
                continue
            while True:
                try:
                    batch.append(self._reports.get_nowait())
                except queue.Empty:
                    break
            last = batch[-1]
            batch = [r for r in batch if r.epoch == last.epoch]   # older epochs: not applied anyway
            merged = StepReport(last.stats, [e for r in batch for e in r.events],
                                [p for r in batch for p in r.prefilled], [a for r in batch for a in r.admitted],
                                epoch=last.epoch)
            for attempt in range(3):
                try:
                    self.push_fn(merged)
                    break
                except Exception as e:      # router restarting: retry, then give up on this batch
                    log.warning("%s: push failed (attempt %d): %s", self.instance_id, attempt + 1, e)
                    self._stop.wait(0.5)

    def _fail_all(self, why: str) -> None:
        """End every request this instance holds that nobody else will end: those it runs, and
        those the failed step parked but never offered (a successful step offers each one it
        parks, or frees it; an offered one is the decode side's now)."""
        offered = set(self.connector.offered_ids()) if self.connector is not None else set()
        for rid in list(self.engine.scheduler.requests):
            self.engine.abort_request(rid)
            self._pending.append(TokenEvent(rid, [], True, "error", why))
        for rid in [r for r in self.engine.scheduler.parked if r not in offered]:
            self.port.unstage(rid)
            self.engine.release(rid)
            self._pending.append(TokenEvent(rid, [], True, "error", why))
        self._report([], [])
