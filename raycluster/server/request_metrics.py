"""Per-request serving metrics of the OpenAI app: what `GET /metrics` shows, and where else they go.

`RequestMetrics` holds a prometheus_client registry: TTFT, TPOT and end-to-end latency histograms,
finished requests by finish reason, prompt and generated token counters, and the engine's queue
and KV gauges (set when /metrics is read). The app reports each request through three calls,
`admitted`, `first_token` and `finished`, which also go to every sink given (`RequestMetricsSink`).
A cluster gateway replica adds a Ray metrics sink (deployments/gateway_metrics.py): `/metrics`
answers for the one replica that served the scrape, while Ray's metrics export, which Prometheus
scrapes per node, carries every replica's series.
"""

from __future__ import annotations

from typing import Protocol, Sequence

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

TTFT_BUCKETS = (.005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30, 60)
TPOT_BUCKETS = (.001, .0025, .005, .01, .025, .05, .1, .25, .5, 1)
E2E_BUCKETS = (.05, .1, .25, .5, 1, 2.5, 5, 10, 30, 60, 120, 300)


class RequestMetricsSink(Protocol):
    def admitted(self, prompt_tokens: int) -> None: ...

    def first_token(self, ttft_s: float) -> None: ...

    def finished(self, reason: str, output_tokens: int, e2e_s: float, tpot_s: float | None) -> None: ...


class RequestMetrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self, sinks: Sequence[RequestMetricsSink] = ()) -> None:
        self.sinks = list(sinks)
        self.registry = r = CollectorRegistry()
        self.requests = Counter("raycluster_requests", "Finished requests", ["finish_reason"], registry=r)
        self.tokens = Counter("raycluster_generated_tokens", "Generated tokens", registry=r)
        self.prompt_tokens = Counter("raycluster_prompt_tokens", "Prompt tokens of admitted requests (each choice's)",
                                     registry=r)
        self.e2e = Histogram("raycluster_e2e_request_latency_seconds", "Arrival to last token", registry=r,
                             buckets=E2E_BUCKETS)
        self.ttft = Histogram("raycluster_ttft_seconds", "Time to first token", registry=r, buckets=TTFT_BUCKETS)
        self.tpot = Histogram("raycluster_tpot_seconds", "Time per output token after the first", registry=r,
                              buckets=TPOT_BUCKETS)
        self.waiting = Gauge("raycluster_queue_waiting", "Requests waiting for prefill", registry=r)
        self.running = Gauge("raycluster_queue_running", "Requests holding KV", registry=r)
        self.kv_usage = Gauge("raycluster_kv_usage", "Fraction of KV blocks in use", registry=r)

    def admitted(self, prompt_tokens: int) -> None:
        self.prompt_tokens.inc(prompt_tokens)
        for s in self.sinks:
            s.admitted(prompt_tokens)

    def first_token(self, ttft_s: float) -> None:
        self.ttft.observe(ttft_s)
        for s in self.sinks:
            s.first_token(ttft_s)

    def finished(self, reason: str, output_tokens: int, e2e_s: float, tpot_s: float | None) -> None:
        """`tpot_s`: None for a request of one output token (no gap to time)."""
        self.requests.labels(reason).inc()
        self.tokens.inc(output_tokens)
        self.e2e.observe(e2e_s)
        if tpot_s is not None:
            self.tpot.observe(tpot_s)
        for s in self.sinks:
            s.finished(reason, output_tokens, e2e_s, tpot_s)

    def render(self, engine_stats: dict) -> bytes:
        """The Prometheus text of this registry, the engine's gauges set from `engine_stats`."""
        self.waiting.set(engine_stats["waiting"])
        self.running.set(engine_stats["running"])
        self.kv_usage.set(engine_stats["kv_used_blocks"] / max(1, engine_stats["kv_total_blocks"]))
        return generate_latest(self.registry)
