"""Streaming client: sends a Workload to an OpenAI-compatible server and times every token.

Owns `ClientConfig`, `fetch_model` and `run_workload`. Data enters as a Workload (arrival
offsets, prompts, dependencies) and a config; it leaves as one `metrics.RequestRecord` per
workload request, times in seconds from the start of the run (time.perf_counter).

Per request: wait for its arrival (open loop) -> wait for its dependencies, then `think_s` ->
take a concurrency slot (closed loop: `concurrency`; open loop: `max_inflight`) -> POST
/v1/completions with stream=true, stream_options.include_usage, max_tokens=output length and
ignore_eos (with `images`, /v1/chat/completions: a user message of pictures and the prompt text) -> read the SSE stream (httpx-sse), stamping each token chunk. 429/503 are retried
after the server's Retry-After when `retry_429` is set (up to `max_retries`), else recorded as
http_error; a mid-stream `{"error": ...}` event, a dropped connection or a stream without
`[DONE]` is recorded as error; the per-request timeout as timeout. The whole run is bounded by
`run_timeout_s`: what is still pending then is recorded as timeout (sent) or not_sent.
"""

from __future__ import annotations

import asyncio
import email.utils
import json
import time
import zlib
from dataclasses import dataclass, field

import httpx
from httpx_sse import aconnect_sse

from loadgen.images import ImageLoad, ImagePool
from loadgen.metrics import OK, RequestRecord
from loadgen.workloads import Workload, WorkloadRequest


@dataclass
class ClientConfig:
    url: str                               # server base, e.g. http://127.0.0.1:8000
    model: str | None = None               # None: first entry of GET /v1/models
    timeout_s: float = 300.0               # per request, retries included
    run_timeout_s: float | None = None     # whole run; None: last arrival + timeout_s + 30
    concurrency: int | None = None         # closed loop with this many in flight
    max_inflight: int = 4096               # open-loop safety cap on concurrent streams
    retry_429: bool = False
    max_retries: int = 5
    send_extras: bool = True               # ttft_slo_ms, tpot_slo_ms, priority, tenant, app_id
    prompt_format: str = "text"            # "text" | "ids"
    id_range: tuple[int, int] = (100, 1000)
    keep_token_times: bool = True
    progress: bool = True
    api_key: str | None = None             # sent as "Authorization: Bearer <key>"
    # LoRA adapters (their names as served): each request names one, picked by its id (vLLM's
    # benchmark --lora-modules), so a trace spreads over them the same way in every run.
    lora_modules: tuple[str, ...] = ()
    # Pictures in each request (loadgen.images): a chat message of the prompt text and them,
    # posted to /v1/chat/completions.
    images: ImageLoad = field(default_factory=ImageLoad)

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


class StreamError(Exception):
    pass


def _retry_after(value: str | None, default: float = 1.0) -> float:
    """Seconds to wait from a Retry-After header (delta-seconds or HTTP-date)."""
    if not value:
        return default
    try:
        return max(0.0, float(value))
    except ValueError:
        try:
            dt = email.utils.parsedate_to_datetime(value)
            return max(0.0, dt.timestamp() - time.time())
        except (TypeError, ValueError):
            return default


async def fetch_model(url: str, timeout_s: float = 10.0, headers: dict[str, str] | None = None) -> str:
    async with httpx.AsyncClient(base_url=url, timeout=timeout_s, headers=headers) as c:
        r = await c.get("/v1/models")
        r.raise_for_status()
        data = r.json().get("data") or []
        if not data:
            raise RuntimeError(f"{url}/v1/models lists no model; pass --model")
        return data[0]["id"]


def request_model(req: WorkloadRequest, cfg: ClientConfig, model: str) -> str:
    """The model a request names: `model`, or with `cfg.lora_modules` one of them by its id."""
    if not cfg.lora_modules:
        return model
    return cfg.lora_modules[zlib.crc32(req.request_id.encode()) % len(cfg.lora_modules)]


def build_payload(req: WorkloadRequest, cfg: ClientConfig, model: str, pool: ImagePool | None = None) -> dict:
    """The request's body: a completion of its prompt, or with `pool` (its images) a chat message
    of the pictures and the prompt's text."""
    common = {"model": request_model(req, cfg, model), "max_tokens": req.output_tokens, "ignore_eos": True,
              "temperature": 0.0, "stream": True, "stream_options": {"include_usage": True}}
    if pool is not None and (cfg.images.per_request or cfg.images.videos):
        if cfg.prompt_format == "ids":
            raise ValueError("requests with images are chat messages: use prompt_format text")
        # Videos and pictures first, then the question (as LLaVA's and Qwen's templates lay a turn out).
        parts = [{"type": "video_url", "video_url": {"url": url}} for url in pool.video_urls_for(req.request_id)]
        parts += [{"type": "image_url", "image_url": {"url": url}} for url in pool.urls_for(req.request_id)]
        parts.append({"type": "text", "text": req.prompt_text()})
        body = {**common, "messages": [{"role": "user", "content": parts}]}
    else:
        prompt = req.prompt_token_ids(cfg.id_range) if cfg.prompt_format == "ids" else req.prompt_text()
        body = {**common, "prompt": prompt}
    if cfg.send_extras:
        extras = {"ttft_slo_ms": req.ttft_slo_ms, "tpot_slo_ms": req.tpot_slo_ms,
                  "priority": req.priority, "tenant": req.tenant, "app_id": req.app_id}
        body.update({k: v for k, v in extras.items() if v is not None})
    return body


async def _stream(client: httpx.AsyncClient, body: dict, rec: RequestRecord, cfg: ClientConfig,
                  clock, deadline: float) -> None:
    """One request, retries included; fills `rec` (status stays None until decided)."""
    while True:
        route = "/v1/chat/completions" if "messages" in body else "/v1/completions"
        async with aconnect_sse(client, "POST", route, json=body) as es:
            resp = es.response
            if resp.status_code != 200:
                text = (await resp.aread()).decode(errors="replace")[:300]
                rec.http_status = resp.status_code
                wait = _retry_after(resp.headers.get("retry-after"))
                if (cfg.retry_429 and resp.status_code in (429, 503) and rec.retries < cfg.max_retries
                        and clock() + wait < deadline):
                    rec.retries += 1
                    await asyncio.sleep(wait)
                    continue
                rec.status, rec.error = "http_error", f"HTTP {resp.status_code}: {text}"
                return
            rec.http_status = 200
            times: list[float] = []
            usage_tokens = None
            got_done = False
            async for sse in es.aiter_sse():
                if sse.data.strip() == "[DONE]":
                    got_done = True
                    break
                obj = json.loads(sse.data)
                if obj.get("error"):
                    raise StreamError(f"server error event: {json.dumps(obj['error'])[:300]}")
                choices = obj.get("choices") or []
                if choices:
                    c = choices[0]
                    text = c.get("text")
                    if text is None:
                        text = (c.get("delta") or {}).get("content")
                    # A finish-only chunk with no text is not a token.
                    if text or c.get("finish_reason") is None:
                        now = clock()
                        if rec.first_token_s is None:
                            rec.first_token_s = now
                        times.append(now)
                usage = obj.get("usage")
                if usage and usage.get("completion_tokens") is not None:
                    usage_tokens = int(usage["completion_tokens"])
                    if usage.get("prompt_tokens") is not None:
                        rec.server_prompt_tokens = int(usage["prompt_tokens"])
            rec.finish_s = clock()
            rec.token_times_s = times if cfg.keep_token_times else None
            rec.num_output_tokens = usage_tokens if usage_tokens is not None else len(times)
            if not got_done:
                raise StreamError("stream ended without [DONE]")
            rec.status = OK
            return


async def run_workload(workload: Workload, cfg: ClientConfig) -> list[RequestRecord]:
    """Send every request of `workload`; returns records in workload order."""
    model = cfg.model or await fetch_model(cfg.url, headers=cfg.headers())
    pool = ImagePool(cfg.images) if cfg.images.per_request or cfg.images.videos else None
    reqs = list(workload)
    records = {r.request_id: RequestRecord(
        r.request_id, arrival_s=r.arrival_s, klass=r.klass, tenant=r.tenant, app_id=r.app_id,
        app_type=r.app_type, prompt_tokens=r.prompt_tokens, expected_output_tokens=r.output_tokens,
        ttft_slo_ms=r.ttft_slo_ms, tpot_slo_ms=r.tpot_slo_ms, status=None,
        model=request_model(r, cfg, model)) for r in reqs}
    done = {r.request_id: asyncio.Event() for r in reqs}
    closed = cfg.concurrency is not None
    sem = asyncio.Semaphore(cfg.concurrency if closed else cfg.max_inflight)
    last_arrival = max((r.arrival_s for r in reqs), default=0.0)
    run_timeout = cfg.run_timeout_s if cfg.run_timeout_s is not None else (
        (0.0 if closed else last_arrival) + cfg.timeout_s + 30.0)
    bar = None
    if cfg.progress:
        from tqdm import tqdm
        bar = tqdm(total=len(reqs), unit="req", desc="loadgen", leave=False)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=256)
    timeout = httpx.Timeout(cfg.timeout_s, connect=min(cfg.timeout_s, 30.0))

    async with httpx.AsyncClient(base_url=cfg.url, limits=limits, timeout=timeout, headers=cfg.headers()) as client:
        t0 = time.perf_counter()  # after the client exists: building it (TLS context) takes ~50 ms
        clock = lambda: time.perf_counter() - t0  # noqa: E731

        async def one(req: WorkloadRequest) -> None:
            rec = records[req.request_id]
            try:
                if not closed:
                    await asyncio.sleep(max(0.0, req.arrival_s - clock()))
                for dep in req.depends_on:
                    await done[dep].wait()
                    if records[dep].status != OK:
                        rec.status, rec.error = "dep_failed", f"dependency {dep} {records[dep].status}"
                        rec.arrival_s = clock()
                        return
                if req.think_s:
                    await asyncio.sleep(req.think_s)
                if req.depends_on or closed:
                    rec.arrival_s = clock()  # ready time; for roots in open loop: scheduled time
                async with sem:
                    rec.send_s = clock()
                    body = build_payload(req, cfg, model, pool)
                    try:
                        async with asyncio.timeout(cfg.timeout_s):
                            await _stream(client, body, rec, cfg, clock, rec.send_s + cfg.timeout_s)
                    except TimeoutError:
                        rec.status, rec.error = "timeout", f"no completion within {cfg.timeout_s}s"
                    except (StreamError, httpx.HTTPError, json.JSONDecodeError) as e:
                        rec.status, rec.error = "error", f"{type(e).__name__}: {e}"[:400]
                    if rec.status != OK and rec.finish_s is None:
                        rec.finish_s = clock()
            finally:
                done[req.request_id].set()
                if bar is not None:
                    bar.update(1)

        tasks = [asyncio.create_task(one(r)) for r in reqs]
        _, pending = await asyncio.wait(tasks, timeout=run_timeout)
        for t in pending:
            t.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
    if bar is not None:
        bar.close()
    for rec in records.values():
        if rec.status is None:
            rec.status = "timeout" if rec.send_s is not None else "not_sent"
            rec.error = rec.error or f"run timeout ({run_timeout:.1f}s) reached"
    return [records[r.request_id] for r in reqs]


def run(workload: Workload, cfg: ClientConfig) -> list[RequestRecord]:
    """Blocking wrapper around `run_workload`."""
    return asyncio.run(run_workload(workload, cfg))
