"""The gateway's view of the cluster: the generation backend that `raycluster.server.app` serves.

`ClusterClient` turns a validated, tokenized request into a `RequestMeta`, submits it to the
router, and yields `RequestOutput`s as token events arrive. One long-poll loop per gateway
replica pulls every event for this gateway from the router in batches and fans them out to
per-request queues, so no Ray call is made per token per request. Text, stop strings and the
local admission check (the router's last reported queue depth) live here, before any
tokenization. The router is reached through three async callables, so tests can fake it.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
import uuid
from typing import AsyncIterator, Awaitable, Callable

from raycluster.cluster.messages import GatewayReply, RequestMeta, SubmitReply, TokenEvent
from raycluster.engine.engine import InvalidRequestError, RequestOutput, validate_request
from raycluster.engine.text import TextStream
from raycluster.request import SLO, SamplingParams
from raycluster.server.protocol import OverloadedError

log = logging.getLogger(__name__)


class ClusterClient:
    def __init__(self, submit: Callable[[RequestMeta], Awaitable[SubmitReply]],
                 abort: Callable[[str], Awaitable[None]],
                 pull: Callable[[str, float], Awaitable[GatewayReply]],
                 status: Callable[[], Awaitable[dict]],
                 tokenizer, max_model_len: int, vocab_size: int, eos_token_ids: tuple[int, ...],
                 gateway_id: str | None = None, pull_timeout_s: float = 0.5) -> None:
        self._submit, self._abort, self._pull, self._status = submit, abort, pull, status
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self.gateway_id = gateway_id or f"gw-{uuid.uuid4().hex[:8]}"
        self.pull_timeout_s = pull_timeout_s
        self._ids = itertools.count()
        self._queues: dict[str, asyncio.Queue] = {}
        self._pull_task: asyncio.Task | None = None
        self.queue_depth = 0
        self.max_queue = 0
        self._last_status: dict = {}

    # ---- backend interface used by raycluster.server.app -------------------------------------
    def admit(self) -> None:
        if self.max_queue and self.queue_depth >= self.max_queue:
            raise OverloadedError(f"router queue is full ({self.queue_depth} waiting)", retry_after_s=1.0)

    def next_id(self, prefix: str = "req") -> str:
        return f"{prefix}-{self.gateway_id}-{next(self._ids)}"

    def stats(self) -> dict:
        s = self._last_status
        instances = s.get("instances", [])
        return {"in_flight_here": len(self._queues), "queue_depth": self.queue_depth,
                "policy": s.get("policy"), "instances": len(instances),
                "waiting": sum(i.get("waiting", 0) for i in instances),
                "running": sum(i.get("running", 0) for i in instances),
                "kv_used_blocks": sum(i.get("kv_total_blocks", 0) - i.get("kv_free_blocks", 0) for i in instances),
                "kv_total_blocks": sum(i.get("kv_total_blocks", 0) for i in instances)}

    async def health(self) -> tuple[bool, dict]:
        """Healthy once the router answers and at least one instance has registered."""
        self._ensure_pulling()
        try:
            await self.refresh_status()
        except Exception as e:
            return False, {"error": f"router unreachable: {e}"}
        stats = self.stats()
        return stats["instances"] > 0, stats

    async def refresh_status(self) -> dict:
        self._last_status = await self._status()
        return self._last_status

    def prometheus_text(self) -> str:
        """Per-pool and per-instance gauges from the router's last status."""
        s = self._last_status
        lines = ["# TYPE raycluster_router_queue_depth gauge"]
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
        return "\n".join(lines) + "\n"

    async def generate(self, request_id: str, prompt_token_ids: list[int], sampling: SamplingParams, *,
                       slo: SLO | None = None, priority: int = 0, tenant: str = "default",
                       app_id: str | None = None) -> AsyncIterator[RequestOutput]:
        validate_request(prompt_token_ids, sampling, self.max_model_len, self.vocab_size)
        slo = slo or SLO()
        meta = RequestMeta(request_id, self.gateway_id, list(prompt_token_ids), sampling.max_tokens,
                           sampling.temperature, sampling.top_p, sampling.top_k, sampling.seed,
                           list(sampling.stop_token_ids), sampling.ignore_eos, slo.ttft_s, slo.tpot_s,
                           priority, tenant, app_id, time.time())
        self._ensure_pulling()
        q: asyncio.Queue = asyncio.Queue()
        self._queues[request_id] = q
        done = False
        try:
            reply = await self._submit(meta)
            self.queue_depth = reply.queue_depth
            if not reply.accepted:
                done = True
                raise OverloadedError(reply.reason or "cluster is busy", reply.retry_after_s,
                                      503 if "no instances" in reply.reason else 429)
            text = TextStream(self.tokenizer, prompt_token_ids, sampling.stop) if self.tokenizer else None
            n_out = 0
            while True:
                ev: TokenEvent = await q.get()
                if ev.finish_reason == "error" and n_out == 0:
                    done = True
                    field, _, msg = (ev.error or "request failed").partition(": ")
                    raise InvalidRequestError(field if msg else "request", msg or field)
                delta, stopped = "", False
                for tok in ev.token_ids:
                    n_out += 1
                    if text is not None:
                        d, stopped = text.add(tok)
                        delta += d
                        if stopped:
                            break
                finished = ev.finished or stopped
                reason = "stop" if stopped else ev.finish_reason
                if finished and text is not None and not stopped:
                    delta += text.flush()
                done = ev.finished          # a gateway-side stop string still needs an abort
                yield RequestOutput(request_id, list(ev.token_ids), delta, finished, reason,
                                    len(prompt_token_ids), n_out)
                if finished:
                    return
        finally:
            self._queues.pop(request_id, None)
            if not done:
                await self._abort(request_id)

    # ---- the event pump -----------------------------------------------------------------------
    def _ensure_pulling(self) -> None:
        if self._pull_task is None or self._pull_task.done():
            self._pull_task = asyncio.get_running_loop().create_task(self._pull_loop())

    async def _pull_loop(self) -> None:
        last_status = 0.0
        while True:
            try:
                reply = await self._pull(self.gateway_id, self.pull_timeout_s)
            except Exception as e:       # router restarting: keep the loop alive
                log.warning("gateway %s: pull failed: %s", self.gateway_id, e)
                await asyncio.sleep(0.5)
                continue
            self.queue_depth, self.max_queue = reply.queue_depth, reply.max_queue
            for ev in reply.events:
                q = self._queues.get(ev.request_id)
                if q is not None:
                    q.put_nowait(ev)
            if time.monotonic() - last_status > 2.0:
                last_status = time.monotonic()
                try:
                    await self.refresh_status()
                except Exception:
                    pass
