"""Runs an `LLMEngine` on its own thread and exposes it to asyncio code.

Requests and aborts enter through a thread-safe inbox that the step thread drains between
steps; each step's outputs go back to the event loop in one `call_soon_threadsafe` call and are
fanned out to per-request queues. `generate()` yields `RequestOutput`s until the request
finishes; if the consumer stops early (client disconnect), the request is aborted and its KV
freed. A structured output's pattern is compiled in a worker thread before the request enters
the inbox, so the step thread never stalls on a compile. LoRA adapters loaded at run time are
read in a worker thread too, and enter (or leave) the engine through the inbox between steps.
"""

from __future__ import annotations

import asyncio
import itertools
import queue
import threading
from dataclasses import dataclass
from typing import AsyncIterator

from raycluster.engine.engine import LLMEngine, RequestOutput
from raycluster.engine.guided import constraint_of
from raycluster.engine.stat_log import StatLogger
from raycluster.request import SLO, SamplingParams


@dataclass
class _Add:
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    slo: SLO
    priority: int
    tenant: str
    app_id: str | None
    out: asyncio.Queue
    loop: asyncio.AbstractEventLoop


@dataclass
class _Abort:
    request_id: str


@dataclass
class _LoRAChange:
    """Add `adapter` (a LoRAAdapter) or, with adapter None, unload `name`; the outcome (None or
    the exception) goes to `done` on `loop`."""
    name: str
    adapter: object | None
    done: asyncio.Future
    loop: asyncio.AbstractEventLoop


class AsyncEngine:
    def __init__(self, engine: LLMEngine, stat_logger: StatLogger | None = None) -> None:
        """`stat_logger`: fed every step and idle tick of the step thread (periodic stats lines)."""
        self.engine = engine
        self.stat_logger = stat_logger
        self._inbox: queue.Queue = queue.Queue()
        self._queues: dict[str, tuple[asyncio.Queue, asyncio.AbstractEventLoop]] = {}
        self._ids = itertools.count()
        self._stop = threading.Event()
        self._lora_paths = engine.lora.paths()      # what requests may name (the step thread updates it)
        self._thread = threading.Thread(target=self._run, name="engine-steps", daemon=True)
        self._thread.start()
        self.steps = 0

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    async def health(self) -> tuple[bool, dict]:
        return self._thread.is_alive(), self.stats()

    def admit(self) -> None:
        """One engine queues without bound: the HTTP layer never rejects for load here."""

    def prometheus_text(self) -> str:
        """Speculative decoding's counters, when the engine drafts (vLLM's
        spec_decode_num_draft_tokens / num_accepted_tokens)."""
        eng = self.engine
        if eng.proposer is None:
            return ""
        return (f"# TYPE raycluster_spec_decode_draft_tokens_total counter\n"
                f"raycluster_spec_decode_draft_tokens_total {eng.spec.draft_tokens}\n"
                f"# TYPE raycluster_spec_decode_accepted_tokens_total counter\n"
                f"raycluster_spec_decode_accepted_tokens_total {eng.spec.accepted_tokens}\n")

    # ---- LoRA adapters at run time --------------------------------------------------------------
    def lora_adapters(self) -> dict[str, str]:
        return dict(self._lora_paths)

    async def refresh_lora_adapters(self) -> dict[str, str]:
        return self.lora_adapters()

    async def load_lora(self, name: str, path: str) -> None:
        """Read the adapter off the step thread, then add it between steps (AdapterError, or
        AdapterNotFound for a path with no adapter, naming the problem)."""
        adapter = await asyncio.to_thread(self.engine.read_lora, name, path)
        await self._lora_change(name, adapter)

    async def unload_lora(self, name: str) -> None:
        await self._lora_change(name, None)

    async def _lora_change(self, name: str, adapter) -> None:
        loop = asyncio.get_running_loop()
        done = loop.create_future()
        self._inbox.put(_LoRAChange(name, adapter, done, loop))
        err = await done
        if err is not None:
            raise err

    def next_id(self, prefix: str = "req") -> str:
        return f"{prefix}-{next(self._ids)}"

    async def generate(self, request_id: str, prompt_token_ids: list[int], sampling: SamplingParams,
                       *, slo: SLO | None = None, priority: int = 0, tenant: str = "default",
                       app_id: str | None = None) -> AsyncIterator[RequestOutput]:
        """Validation errors (InvalidRequestError) are raised before the first output."""
        q: asyncio.Queue = asyncio.Queue()
        constraint = constraint_of(sampling)
        if constraint is not None:
            try:        # cached in the engine; a failure is raised again (fast) by add_request
                await asyncio.to_thread(self.engine.guided_decoding().index, constraint)
            except ValueError:
                pass
        self._inbox.put(_Add(request_id, prompt_token_ids, sampling, slo or SLO(), priority, tenant,
                             app_id, q, asyncio.get_running_loop()))
        finished = False
        try:
            while True:
                item = await q.get()
                if isinstance(item, Exception):
                    raise item
                yield item
                if item.finished:
                    finished = True
                    return
        finally:
            if not finished:
                self._inbox.put(_Abort(request_id))

    def shutdown(self) -> None:
        self._stop.set()
        self._inbox.put(None)
        self._thread.join(timeout=10)

    def stats(self) -> dict:
        eng = self.engine
        kv = eng.kv
        out = {"waiting": eng.scheduler.num_waiting, "running": eng.scheduler.num_running,
               "kv_used_blocks": kv.num_blocks - kv.num_free_blocks, "kv_total_blocks": kv.num_blocks,
               "steps": self.steps, "preemptions": eng.scheduler.preempted_total}
        if kv.prefix_caching:
            out.update(prefix_queries=kv.query_tokens, prefix_hits=kv.hit_tokens)
        cache = eng.runner.image_cache
        if cache is not None:
            out.update(mm_cache_queries=cache.hits + cache.misses, mm_cache_hits=cache.hits)
        if eng.proposer is not None:
            out.update(spec_drafts=eng.spec.draft_tokens, spec_accepted=eng.spec.accepted_tokens,
                       spec_runs=eng.spec.drafts, spec_accepted_per_pos=list(eng.spec.accepted_per_pos))
        return out

    # ---- step thread -----------------------------------------------------------------------
    def _drain(self, block: bool) -> None:
        while True:
            try:
                item = self._inbox.get(block=block, timeout=0.5 if block else None)
            except queue.Empty:
                return
            block = False
            if item is None:
                return
            if isinstance(item, _Add):
                try:
                    self.engine.add_request(item.request_id, item.prompt_token_ids, item.sampling,
                                            slo=item.slo, priority=item.priority, tenant=item.tenant,
                                            app_id=item.app_id)
                    self._queues[item.request_id] = (item.out, item.loop)
                except Exception as e:      # a bad request must never kill the step thread
                    item.loop.call_soon_threadsafe(item.out.put_nowait, e)
            elif isinstance(item, _LoRAChange):
                err = None
                try:
                    if item.adapter is None:
                        self.engine.unload_lora(item.name)
                    else:
                        self.engine.lora.add(item.adapter)
                except Exception as e:
                    err = e
                self._lora_paths = self.engine.lora.paths()
                item.loop.call_soon_threadsafe(_settle, item.done, err)
            else:
                self.engine.abort_request(item.request_id)
                self._queues.pop(item.request_id, None)

    def _run(self) -> None:
        while not self._stop.is_set():
            self._drain(block=not self.engine.has_unfinished())
            if not self.engine.has_unfinished():
                if self.stat_logger is not None:
                    self.stat_logger.observe(self.engine, None)
                continue
            result = self.engine.step()
            self.steps += 1
            if self.stat_logger is not None:
                self.stat_logger.observe(self.engine, result)
            by_loop: dict[asyncio.AbstractEventLoop, list] = {}
            for out in result.outputs:
                target = self._queues.get(out.request_id)
                if target is None:
                    continue
                if out.finished:
                    del self._queues[out.request_id]
                by_loop.setdefault(target[1], []).append((target[0], out))
            for loop, items in by_loop.items():
                loop.call_soon_threadsafe(_deliver, items)


def _settle(done: asyncio.Future, err: Exception | None) -> None:
    if not done.done():
        done.set_result(err)


def _deliver(items: list) -> None:
    for q, out in items:
        q.put_nowait(out)
