"""The gateway replicas' request metrics in Ray's metrics system (a `RequestMetricsSink`).

Each gateway replica serves its own `/metrics`, and a scrape through Serve's proxy lands on one
replica, so with several replicas that endpoint shows one replica's counts at a time. The same
observations also go here, to `ray.util.metrics` series tagged with the replica: every node's
Ray metrics export (which KubeRay's PodMonitor and the dashboard's Grafana read) carries every
replica's series, and `sum without (gateway)` gives the cluster's. Names and buckets are the
/metrics ones (raycluster.server.request_metrics) with the `raycluster_gateway_` prefix.
"""

from __future__ import annotations

from ray.util.metrics import Counter, Histogram

from raycluster.server.request_metrics import E2E_BUCKETS, TPOT_BUCKETS, TTFT_BUCKETS


class RayRequestMetrics:
    def __init__(self, gateway_id: str) -> None:
        self.tags = {"gateway": gateway_id}
        keys = ("gateway",)
        self.prompt_tokens = Counter("raycluster_gateway_prompt_tokens", "Prompt tokens of admitted requests",
                                     tag_keys=keys)
        self.tokens = Counter("raycluster_gateway_generated_tokens", "Generated tokens", tag_keys=keys)
        self.requests = Counter("raycluster_gateway_requests", "Finished requests by finish reason",
                                tag_keys=("gateway", "finish_reason"))
        self.ttft = Histogram("raycluster_gateway_ttft_seconds", "Time to first token",
                              boundaries=list(TTFT_BUCKETS), tag_keys=keys)
        self.tpot = Histogram("raycluster_gateway_tpot_seconds", "Time per output token after the first",
                              boundaries=list(TPOT_BUCKETS), tag_keys=keys)
        self.e2e = Histogram("raycluster_gateway_e2e_request_latency_seconds", "Arrival to last token",
                             boundaries=list(E2E_BUCKETS), tag_keys=keys)

    def admitted(self, prompt_tokens: int) -> None:
        self.prompt_tokens.inc(prompt_tokens, tags=self.tags)

    def first_token(self, ttft_s: float) -> None:
        self.ttft.observe(ttft_s, tags=self.tags)

    def finished(self, reason: str, output_tokens: int, e2e_s: float, tpot_s: float | None) -> None:
        self.requests.inc(1, tags={**self.tags, "finish_reason": reason or "unknown"})
        if output_tokens:
            self.tokens.inc(output_tokens, tags=self.tags)
        self.e2e.observe(e2e_s, tags=self.tags)
        if tpot_s is not None:
            self.tpot.observe(tpot_s, tags=self.tags)
