"""The gateway's view of the cluster: the generation backend that `raycluster.server.app` serves.

`ClusterClient` turns a validated, tokenized request into a `RequestMeta`, submits it to the
router, and yields `RequestOutput`s as token events arrive. One long-poll loop per gateway
replica pulls every event for this gateway from the router in batches and fans them out to
per-request queues, so no Ray call is made per token per request. Text, stop strings and the
local admission check (the router's last reported queue depth) live here, before any
tokenization. The router is reached through async callables, so tests can fake it.

LoRA adapters: the names are the router's (`RouterCore.adapters`); this keeps the last ones it
heard and asks again when a request names one it does not know (`refresh_lora_adapters`), so an
adapter loaded through another gateway replica is served here at once. Loads and unloads
(`LoRACalls`) go to the router, which answers once every instance has the adapter.

Router restarts: router ids sort by start time. When replies come from a newer router than the
one that accepted a request, the request is resubmitted under a new id with the tokens its
client already has (`RequestMeta.resumed`), and its stream goes on where it stopped. If the
router stays unreachable for `router_wait_s`, waiting requests fail with 503 (or an "error"
finish once tokens were sent).

Backlogs: events queued for a request while its reader was busy go out as one output (tokens
and logprobs concatenated), so a slow client or a busy gateway costs one SSE chunk per read, not
one per engine step (vLLM's RequestOutputCollector does the same).

Images: a request's pixels go to the router as handles (`share_images`, Ray's `ray.put`): the
router and every instance the request visits pass a few bytes, and only the instance that
encodes the image fetches it. A resubmitted request keeps its handles.

Aborts: a request whose client is gone is aborted from a task of its own (`_abort_soon`), not
from the request generator's closing code: that code often runs inside a task being cancelled,
and under Starlette's disconnect listener (an anyio cancel scope) every await there is cancelled
again, so an awaited abort never reached the router. As a backstop, a token event for a request
nobody here listens to any more aborts it too (an abort lost on the way would otherwise leave
it decoding to max_tokens).
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import itertools
import logging
import time
import uuid
from typing import Any, AsyncIterator, Awaitable, Callable

import torch

from raycluster.cluster.messages import GatewayReply, RequestMeta, SubmitReply, TokenEvent
from raycluster.engine.engine import InvalidRequestError, RequestOutput, validate_request
from raycluster.engine.text import TextStream
from raycluster.model.lora import AdapterBusy, AdapterError, AdapterNotFound
from raycluster.request import SLO, SamplingParams
from raycluster.server.protocol import OverloadedError

log = logging.getLogger(__name__)

_RESUBMIT = object()      # queue marker: the router that accepted the request is gone
_LOST = object()          # queue marker: no router answered for router_wait_s


def _stop_token(token: int, sp: SamplingParams, eos_token_ids: tuple[int, ...]) -> bool:
    """Whether `token` is one the engine stops on (EOS unless ignored, or a stop token id)."""
    return token in sp.stop_token_ids or (not sp.ignore_eos and token in eos_token_ids)


def _coalesce(ev: TokenEvent, q: asyncio.Queue) -> tuple[TokenEvent, object | None]:
    """Merge the token events queued behind `ev` into one (as vLLM's RequestOutputCollector
    does): when the reader fell behind (a slow client, a busy gateway), it gets one output per
    read, not one per engine step, so a backlog costs one SSE chunk. Stops at a marker or an
    error event, which is returned second, to be handled after the merged one."""
    while not ev.finished and not q.empty():
        nxt = q.get_nowait()
        if not isinstance(nxt, TokenEvent) or nxt.finish_reason == "error":
            return ev, nxt
        lps = None if ev.logprobs is None and nxt.logprobs is None else (ev.logprobs or []) + (nxt.logprobs or [])
        ev = TokenEvent(ev.request_id, ev.token_ids + nxt.token_ids, nxt.finished, nxt.finish_reason, nxt.error,
                        lps, max(ev.num_cached_tokens, nxt.num_cached_tokens),
                        ev.prompt_logprobs if ev.prompt_logprobs is not None else nxt.prompt_logprobs,
                        ev.prefill_s if ev.prefill_s is not None else nxt.prefill_s, nxt.embedding)
    return ev, None


@dataclasses.dataclass
class LoRACalls:
    """The router's LoRA adapter calls (RouterActor's `lora_adapters`, `load_lora`, `unload_lora`)."""
    names: Callable[[], Awaitable[dict[str, str]]]
    load: Callable[[str, str], Awaitable[dict]]
    unload: Callable[[str], Awaitable[dict]]


class ClusterClient:
    def __init__(self, submit: Callable[[RequestMeta], Awaitable[SubmitReply]],
                 abort: Callable[[str], Awaitable[None]],
                 pull: Callable[[str, float], Awaitable[GatewayReply]],
                 status: Callable[[], Awaitable[dict]],
                 tokenizer, max_model_len: int, vocab_size: int, eos_token_ids: tuple[int, ...],
                 gateway_id: str | None = None, pull_timeout_s: float = 0.5,
                 router_wait_s: float = 30.0, lora: LoRACalls | None = None,
                 lora_modules: dict[str, str] | None = None, share_images: Callable[[Any], Any] | None = None) -> None:
        """`lora`: the router's adapter calls (None: the adapters stay `lora_modules`, the
        instances' configured ones, name -> path). `share_images`: a pixel tensor -> the handle
        the request carries instead (None: the tensor itself)."""
        self._submit, self._abort, self._pull, self._status = submit, abort, pull, status
        self._share_images = share_images
        self._lora = lora
        self._lora_paths = dict(lora_modules or {})
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self.gateway_id = gateway_id or f"gw-{uuid.uuid4().hex[:8]}"
        self.pull_timeout_s = pull_timeout_s
        self._ids = itertools.count()
        self._queues: dict[str, asyncio.Queue] = {}     # by the id the router knows it under
        self._accepted_by: dict[str, str] = {}          # that id -> the router id that took it
        self._newest_router = ""                        # the newest router id seen (ids sort by start)
        self.router_wait_s = router_wait_s
        self.resubmitted = 0
        self._pull_task: asyncio.Task | None = None
        self.queue_depth = 0
        self.max_queue = 0
        self._last_status: dict = {}
        self._aborting: dict[str, asyncio.Task] = {}    # aborts in flight (held: the loop keeps tasks weakly)

    # ---- backend interface used by raycluster.server.app -------------------------------------
    def lora_adapters(self) -> dict[str, str]:
        return dict(self._lora_paths)

    async def refresh_lora_adapters(self) -> dict[str, str]:
        if self._lora is not None:
            self._lora_paths = dict(await self._lora.names())
        return self.lora_adapters()

    async def load_lora(self, name: str, path: str) -> None:
        await self._lora_change(self._lora.load(name, path) if self._lora else None)

    async def unload_lora(self, name: str) -> None:
        await self._lora_change(self._lora.unload(name) if self._lora else None)

    async def _lora_change(self, call: Awaitable[dict] | None) -> None:
        if call is None:
            raise AdapterError("this gateway reaches no router that loads adapters")
        reply = await call
        await self.refresh_lora_adapters()
        if not reply.get("ok"):
            kind = AdapterNotFound if reply.get("not_found") else AdapterBusy if reply.get("busy") else AdapterError
            raise kind(reply.get("error", "failed"))

    def admit(self) -> None:
        if self.max_queue and self.queue_depth >= self.max_queue:
            raise OverloadedError(f"router queue is full ({self.queue_depth} waiting)", retry_after_s=1.0)

    def next_id(self, prefix: str = "req") -> str:
        return f"{prefix}-{self.gateway_id}-{next(self._ids)}"

    def stats(self) -> dict:
        s = self._last_status
        instances = s.get("instances", [])
        return {"in_flight_here": len(self._queues), "queue_depth": self.queue_depth,
                "resubmitted": self.resubmitted,
                "policy": s.get("policy"), "instances": len(instances),
                "waiting": sum(i.get("waiting", 0) for i in instances),
                "running": sum(i.get("running", 0) for i in instances),
                "kv_used_blocks": sum(i.get("kv_total_blocks", 0) - i.get("kv_free_blocks", 0) for i in instances),
                "kv_total_blocks": sum(i.get("kv_total_blocks", 0) for i in instances),
                "router_queued": sum((s.get("queues") or {}).values()),
                "preemptions": sum(i.get("preemptions", 0) for i in instances),
                "prefix_queries": sum(i.get("prefix_query_tokens", 0) for i in instances),
                "prefix_hits": sum(i.get("prefix_hit_tokens", 0) for i in instances),
                "spec_drafts": sum(i.get("spec_draft_tokens", 0) for i in instances),
                "spec_accepted": sum(i.get("spec_accepted_tokens", 0) for i in instances),
                "spec_runs": sum(i.get("spec_drafts", 0) for i in instances),
                "mm_cache_queries": sum(i.get("encoder_cache_queries", 0) for i in instances),
                "mm_cache_hits": sum(i.get("encoder_cache_hits", 0) for i in instances),
                "spec_accepted_per_pos": _sum_by_position(i.get("spec_accepted_per_pos") or [] for i in instances)}

    async def health(self) -> tuple[bool, dict]:
        """Healthy once the router answers and at least one instance has registered, or the
        router has a pool that scales from zero (its requests wait for its first instance)."""
        self._ensure_pulling()
        try:
            status = await self.refresh_status()
        except Exception as e:
            return False, {"error": f"router unreachable: {e}"}
        stats = self.stats()
        return stats["instances"] > 0 or bool((status.get("config") or {}).get("standby_roles")), stats

    async def refresh_status(self) -> dict:
        self._last_status = await self._status()
        return self._last_status

    def prometheus_text(self) -> str:
        """Per-pool and per-instance gauges from the router's last status, and this gateway's
        resubmissions after router restarts."""
        s = self._last_status
        lines = ["# TYPE raycluster_gateway_resubmitted_total counter",
                 f"raycluster_gateway_resubmitted_total {self.resubmitted}",
                 "# TYPE raycluster_router_queue_depth gauge"]
        for pool, depth in sorted(s.get("queues", {}).items()):
            lines.append(f'raycluster_router_queue_depth{{pool="{pool}"}} {depth}')
        lines.append("# TYPE raycluster_instance_kv_usage gauge")
        for inst in s.get("instances", []):
            total = max(1, inst.get("kv_total_blocks", 0))
            usage = 1 - inst.get("kv_free_blocks", 0) / total
            lines.append(f'raycluster_instance_kv_usage{{instance="{inst.get("id")}",'
                         f'pool="{inst.get("role")}"}} {usage:.4f}')
        lines.append("# TYPE raycluster_instance_waiting gauge")
        for inst in s.get("instances", []):
            lines.append(f'raycluster_instance_waiting{{instance="{inst.get("id")}",'
                         f'pool="{inst.get("role")}"}} {inst.get("waiting", 0)}')
        lines.append("# TYPE raycluster_instance_prefill_backlog_tokens gauge")
        for inst in s.get("instances", []):
            lines.append(f'raycluster_instance_prefill_backlog_tokens{{instance="{inst.get("id")}",'
                         f'pool="{inst.get("role")}"}} {inst.get("queued_tokens", 0)}')
        # vLLM's prefix-cache counters (in tokens), for instances that cache prefixes.
        for name, key in (("queries", "prefix_query_tokens"), ("hits", "prefix_hit_tokens")):
            lines.append(f"# TYPE raycluster_instance_prefix_cache_{name}_total counter")
            for inst in s.get("instances", []):
                if inst.get("prefix_caching"):
                    lines.append(f'raycluster_instance_prefix_cache_{name}_total{{instance="{inst.get("id")}",'
                                 f'pool="{inst.get("role")}"}} {inst.get(key, 0)}')
        # P/D handoffs on the decode side: KV pulled vs recomputed after a failed pull (vLLM's
        # NIXL connector counts the same), and what the pulls moved and took.
        decode_side = [i for i in s.get("instances", []) if i.get("kv_pulls_ok") or i.get("kv_pulls_failed")]
        lines.append("# TYPE raycluster_instance_kv_pulls_total counter")
        for inst in decode_side:
            for outcome, key in (("ok", "kv_pulls_ok"), ("recomputed", "kv_pulls_failed")):
                lines.append(f'raycluster_instance_kv_pulls_total{{instance="{inst.get("id")}",'
                             f'pool="{inst.get("role")}",outcome="{outcome}"}} {inst.get(key, 0)}')
        for name, key in (("kv_pull_blocks_total", "kv_pull_blocks"), ("kv_pull_seconds_total", "kv_pull_s")):
            lines.append(f"# TYPE raycluster_instance_{name} counter")
            for inst in decode_side:
                lines.append(f'raycluster_instance_{name}{{instance="{inst.get("id")}",'
                             f'pool="{inst.get("role")}"}} {inst.get(key, 0)}')
        # Speculative decoding (vLLM's spec_decode_num_draft_tokens / num_accepted_tokens).
        drafting = [i for i in s.get("instances", []) if i.get("spec_draft_tokens")]
        for name, key in (("draft", "spec_draft_tokens"), ("accepted", "spec_accepted_tokens")):
            lines.append(f"# TYPE raycluster_instance_spec_decode_{name}_tokens_total counter")
            for inst in drafting:
                lines.append(f'raycluster_instance_spec_decode_{name}_tokens_total{{instance="{inst.get("id")}",'
                             f'pool="{inst.get("role")}"}} {inst.get(key, 0)}')
        return "\n".join(lines) + "\n"

    async def generate(self, request_id: str, prompt_token_ids: list[int], sampling: SamplingParams, *,
                       slo: SLO | None = None, priority: int = 0, tenant: str = "default",
                       app_id: str | None = None) -> AsyncIterator[RequestOutput]:
        validate_request(prompt_token_ids, sampling, self.max_model_len, self.vocab_size)
        slo = slo or SLO()
        # The meta gets its own copy: the caller may reuse its object (n choices share one).
        if self._share_images is not None and sampling.images:
            # Off the event loop: putting a large image copies megabytes (other streams go on).
            sampling = await asyncio.to_thread(self._shared, sampling)
        meta = RequestMeta(request_id, self.gateway_id, list(prompt_token_ids), copy.deepcopy(sampling),
                           ttft_slo_s=slo.ttft_s, tpot_slo_s=slo.tpot_s, priority=priority, tenant=tenant,
                           app_id=app_id, arrival_time=time.time())
        self._ensure_pulling()
        q: asyncio.Queue = asyncio.Queue()
        live, out_ids, done, cached = request_id, [], False, 0
        try:
            reply = await self._place(meta, q)
            self.queue_depth = reply.queue_depth
            if not reply.accepted and reply.invalid_field:
                done = True
                raise InvalidRequestError(reply.invalid_field, reply.reason)
            if not reply.accepted:
                done = True
                raise OverloadedError(reply.reason or "cluster is busy", reply.retry_after_s,
                                      503 if "no instances" in reply.reason else 429)
            text = (TextStream.of(self.tokenizer, prompt_token_ids, meta.sampling)
                    if self.tokenizer else None)
            pending = None
            while True:
                ev, pending = (pending, None) if pending is not None else (await q.get(), None)
                if isinstance(ev, TokenEvent):
                    ev, pending = _coalesce(ev, q)
                if ev is _RESUBMIT or ev is _LOST:
                    self._forget(live)
                    if ev is _RESUBMIT:
                        self.resubmitted += 1
                        live = f"{request_id}~{self.resubmitted}"
                        meta = dataclasses.replace(meta, request_id=live, output_token_ids=list(out_ids),
                                                   resumed=True)
                        reply = await self._place(meta, q)
                    if ev is _LOST or not reply.accepted:
                        done = True
                        why = "router unavailable" if ev is _LOST else f"resubmission refused: {reply.reason}"
                        if not out_ids:
                            raise OverloadedError(why, 1.0, 503)
                        ev = TokenEvent(request_id, [], True, "error", why)
                    else:
                        continue
                if ev.finish_reason == "error" and not out_ids:
                    done = True
                    field, _, msg = (ev.error or "request failed").partition(": ")
                    raise InvalidRequestError(field if msg else "request", msg or field)
                delta, stopped = "", False
                # As vLLM v1: an EOS or stop token id that ended the request adds no text unless
                # include_stop_str_in_output (a stop string the instance found ends in text).
                last_is_stop = ev.finished and ev.finish_reason == "stop" and bool(ev.token_ids) and \
                    not meta.sampling.include_stop_str_in_output and _stop_token(ev.token_ids[-1], meta.sampling,
                                                                                 self.eos_token_ids)
                for k, tok in enumerate(ev.token_ids):
                    out_ids.append(tok)
                    if text is not None and not (last_is_stop and k == len(ev.token_ids) - 1):
                        d, stopped = text.add(tok)
                        delta += d
                        if stopped:
                            break
                finished = ev.finished or stopped
                reason = "stop" if stopped else ev.finish_reason
                if finished and text is not None and not stopped:
                    delta += text.flush()
                done = ev.finished          # a gateway-side stop string still needs an abort
                cached = max(cached, ev.num_cached_tokens)
                yield RequestOutput(request_id, list(ev.token_ids), delta, finished, reason,
                                    len(prompt_token_ids), len(out_ids), ev.logprobs, cached, ev.prompt_logprobs,
                                    ev.prefill_s, ev.embedding if finished else None)
                if finished:
                    return
        finally:
            self._forget(live)
            if not done:
                await asyncio.shield(self._abort_soon(live))     # a cancel here leaves the abort running

    def _abort_soon(self, request_id: str) -> asyncio.Task:
        """Send the router an abort from a task of its own (one per request at a time)."""
        task = self._aborting.get(request_id)
        if task is None:
            task = asyncio.get_running_loop().create_task(self._send_abort(request_id))
            self._aborting[request_id] = task
            task.add_done_callback(lambda _: self._aborting.pop(request_id, None))
        return task

    async def _send_abort(self, request_id: str) -> None:
        try:
            await self._abort(request_id)
        except Exception as e:      # router restarting: it does not know the request
            log.warning("gateway %s: abort of %s failed: %s", self.gateway_id, request_id, e)

    def _shared(self, sampling: SamplingParams) -> SamplingParams:
        """`sampling` with its images' pixels as `share_images` handles (a copy; the same object
        when there is nothing to share)."""
        if not any(isinstance(im.pixel_values, torch.Tensor) for im in sampling.images):
            return sampling
        return dataclasses.replace(sampling, images=[
            dataclasses.replace(im, pixel_values=self._share_images(im.pixel_values))
            if isinstance(im.pixel_values, torch.Tensor) else im for im in sampling.images])

    async def _place(self, meta: RequestMeta, q: asyncio.Queue) -> SubmitReply:
        """Submit, retrying while the router restarts (and, for a resumed request, until
        instances have registered with it again), for up to router_wait_s."""
        self._queues[meta.request_id] = q
        deadline = time.monotonic() + self.router_wait_s
        while True:
            try:
                reply = await self._submit(meta)
                if reply.accepted or not (meta.resumed and "no instances" in reply.reason):
                    break
            except Exception as e:
                reply = SubmitReply(False, 1.0, f"no instances: router unreachable ({e})")
            if time.monotonic() >= deadline:
                break
            await asyncio.sleep(0.2)
        if reply.accepted:
            if reply.router_id < self._newest_router:    # that router was replaced meanwhile
                q.put_nowait(_RESUBMIT)
            else:
                self._accepted_by[meta.request_id] = reply.router_id
                self._newest_router = reply.router_id
        return reply

    def _forget(self, live_id: str) -> None:
        self._queues.pop(live_id, None)
        self._accepted_by.pop(live_id, None)

    # ---- the event pump -----------------------------------------------------------------------
    def _ensure_pulling(self) -> None:
        if self._pull_task is None or self._pull_task.done():
            self._pull_task = asyncio.get_running_loop().create_task(self._pull_loop())

    async def _pull_loop(self) -> None:
        last_status, failing_since = 0.0, None
        while True:
            try:
                reply = await self._pull(self.gateway_id, self.pull_timeout_s)
            except Exception as e:       # router restarting: keep the loop alive
                log.warning("gateway %s: pull failed: %s", self.gateway_id, e)
                now = time.monotonic()
                failing_since = failing_since or now
                if now - failing_since > self.router_wait_s:
                    for q in list(self._queues.values()):
                        q.put_nowait(_LOST)
                    self._queues.clear()
                    failing_since = now
                await asyncio.sleep(0.5)
                continue
            failing_since = None
            if reply.router_id > self._newest_router:
                self._newest_router = reply.router_id
                stale = [rid for rid, by in self._accepted_by.items() if by < reply.router_id]
                if stale:
                    log.warning("gateway %s: router restarted; resubmitting %d requests",
                                self.gateway_id, len(stale))
                for rid in stale:
                    self._accepted_by.pop(rid)
                    q = self._queues.get(rid)
                    if q is not None:
                        q.put_nowait(_RESUBMIT)
            self.queue_depth, self.max_queue = reply.queue_depth, reply.max_queue
            for ev in reply.events:
                q = self._queues.get(ev.request_id)
                if q is not None:
                    q.put_nowait(ev)
                elif not ev.finished:       # its generator is gone and the router did not hear
                    self._abort_soon(ev.request_id)
            if time.monotonic() - last_status > 2.0:
                last_status = time.monotonic()
                try:
                    await self.refresh_status()
                except Exception:
                    pass


def _sum_by_position(lists) -> list[int]:
    """Element-wise sum of lists of any lengths (instances may draft different numbers of tokens)."""
    out: list[int] = []
    for counts in lists:
        out.extend([0] * (len(counts) - len(out)))
        for j, c in enumerate(counts):
            out[j] += c
    return out
