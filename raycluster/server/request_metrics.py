"""Per-request serving metrics of the OpenAI app: what `GET /metrics` shows, and where else they go.

`RequestMetrics` holds a prometheus_client registry: TTFT, TPOT and end-to-end latency histograms,
finished requests by finish reason, prompt and generated token counters, and the engine's queue
and KV gauges (set when /metrics is read). The app reports each request through three calls,
`admitted`, `first_token` and `finished`, which also go to every sink given (`RequestMetricsSink`).
A cluster gateway replica adds a Ray metrics sink (deployments/gateway_metrics.py): `/metrics`
answers for the one replica that served the scrape, while Ray's metrics export, which Prometheus
scrapes per node, carries every replica's series.

The same figures are also exposed under vLLM's names (`vllm:num_requests_running`,
`vllm:num_requests_waiting`, `vllm:kv_cache_usage_perc`, `vllm:prompt_tokens_total`,
`vllm:generation_tokens_total`, `vllm:request_success_total{finished_reason}`,
`vllm:time_to_first_token_seconds`, `vllm:request_time_per_output_token_seconds`,
`vllm:e2e_request_latency_seconds`, and from the engine's totals `vllm:num_preemptions_total`,
`vllm:prefix_cache_{queries,hits}_total`, `vllm:spec_decode_num_drafts_total`,
`vllm:spec_decode_num_{draft,accepted}_tokens_total`,
`vllm:spec_decode_num_accepted_tokens_per_pos_total{position}`),
labelled `model_name`, so dashboards and autoscalers written for vLLM read them unchanged. In a
cluster, waiting counts the router's queues too, and the engine totals sum every instance's.
vLLM's per-request histograms come from what the app sees of each request, on /metrics only:
`vllm:request_prompt_tokens` and `vllm:request_generation_tokens` (per finished request, vLLM's
1-2-5 buckets up to the context length), `vllm:request_params_max_tokens` and
`vllm:request_params_n` (per admitted request), `vllm:inter_token_latency_seconds` (one sample per
output token: a delivery of k tokens after a gap g is k samples of g / k) and
`vllm:request_decode_time_seconds` (first to last token), and from the engine's
first-scheduled-to-first-token time (`RequestOutput.prefill_s`, measured on the instance that
computed the prompt) `vllm:request_prefill_time_seconds`, `vllm:request_queue_time_seconds`
(the app's TTFT less that: the router's queue, the hops and the engine's queue together) and
`vllm:request_inference_time_seconds` (prefill plus decode time). A request resumed on another
instance, or whose prompt came with its KV, has no prefill time and is left out of those three.
"""

from __future__ import annotations

from typing import Protocol, Sequence

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

TTFT_BUCKETS = (.005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30, 60)
# vLLM's own buckets for the histograms only it names (vllm/v1/metrics/loggers.py).
ITL_BUCKETS = (.01, .025, .05, .075, .1, .15, .2, .3, .4, .5, .75, 1, 2.5, 5, 7.5, 10, 20, 40, 80)
REQUEST_LATENCY_BUCKETS = (.3, .5, .8, 1, 1.5, 2, 2.5, 5, 10, 15, 20, 30, 40, 50, 60, 120, 240, 480, 960, 1920, 7680)
N_BUCKETS = (1, 2, 5, 10, 20)


def buckets_1_2_5(max_value: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to `max_value` (vLLM's build_1_2_5_buckets)."""
    out, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_value:
                return tuple(out)
            out.append(m * scale)
        scale *= 10
TPOT_BUCKETS = (.001, .0025, .005, .01, .025, .05, .1, .25, .5, 1)
E2E_BUCKETS = (.05, .1, .25, .5, 1, 2.5, 5, 10, 30, 60, 120, 300)


class RequestMetricsSink(Protocol):
    def admitted(self, prompt_tokens: int) -> None: ...

    def first_token(self, ttft_s: float) -> None: ...

    def finished(self, reason: str, output_tokens: int, e2e_s: float, tpot_s: float | None) -> None: ...


class RequestMetrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self, sinks: Sequence[RequestMetricsSink] = (), model_name: str = "model",
                 max_model_len: int = 32768) -> None:
        self.sinks = list(sinks)
        self.model_name = model_name
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
        self.vllm = _VllmNames(r, model_name, max_model_len)

    def admitted(self, prompt_tokens: int, max_tokens: int | None = None, n: int = 1) -> None:
        """`prompt_tokens`: of every choice; `max_tokens`, `n`: the request's parameters (vLLM's
        request_params histograms; not sent to the sinks)."""
        self.prompt_tokens.inc(prompt_tokens)
        self.vllm.prompt_tokens.inc(prompt_tokens)
        if max_tokens is not None:
            self.vllm.max_tokens.observe(max_tokens)
            self.vllm.n.observe(n)
        for s in self.sinks:
            s.admitted(prompt_tokens)

    def tokens_after(self, gap_s: float, tokens: int) -> None:
        """`tokens` output tokens arrived `gap_s` after the previous ones (not the first)."""
        for _ in range(tokens):
            self.vllm.itl.observe(gap_s / tokens)

    def first_token(self, ttft_s: float, prefill_s: float | None = None) -> None:
        """`prefill_s`: the engine's first-scheduled-to-first-token time, when it has one
        (vLLM's prefill and queue time histograms only; not sent to the sinks)."""
        self.ttft.observe(ttft_s)
        self.vllm.ttft.observe(ttft_s)
        if prefill_s is not None:
            self.vllm.prefill_time.observe(prefill_s)
            self.vllm.queue_time.observe(max(0.0, ttft_s - prefill_s))
        for s in self.sinks:
            s.first_token(ttft_s)

    def finished(self, reason: str, output_tokens: int, e2e_s: float, tpot_s: float | None,
                 prompt_tokens: int | None = None, decode_s: float | None = None,
                 prefill_s: float | None = None) -> None:
        """`tpot_s`: None for a request of one output token (no gap to time). `prompt_tokens`,
        `decode_s` (first to last token) and `prefill_s` feed vLLM's per-request histograms only."""
        self.requests.labels(reason).inc()
        self.tokens.inc(output_tokens)
        self.e2e.observe(e2e_s)
        v = self.vllm
        v.success.labels(self.model_name, reason).inc()
        v.generation_tokens.inc(output_tokens)
        v.e2e.observe(e2e_s)
        v.generation_length.observe(output_tokens)
        if prompt_tokens is not None:
            v.prompt_length.observe(prompt_tokens)
        if decode_s is not None:
            v.decode_time.observe(decode_s)
            if prefill_s is not None:
                v.inference_time.observe(prefill_s + decode_s)
        if tpot_s is not None:
            self.tpot.observe(tpot_s)
            v.tpot.observe(tpot_s)
        for s in self.sinks:
            s.finished(reason, output_tokens, e2e_s, tpot_s)

    def render(self, engine_stats: dict) -> bytes:
        """The Prometheus text of this registry, the engine's gauges set from `engine_stats`."""
        self.waiting.set(engine_stats["waiting"])
        self.running.set(engine_stats["running"])
        usage = engine_stats["kv_used_blocks"] / max(1, engine_stats["kv_total_blocks"])
        self.kv_usage.set(usage)
        v = self.vllm
        v.waiting.set(engine_stats["waiting"] + engine_stats.get("router_queued", 0))
        v.running.set(engine_stats["running"])
        v.kv_usage.set(usage)
        return generate_latest(self.registry) + v.totals(engine_stats)


# Engine totals kept by the engine (or summed over a cluster's instances), not by the app:
# written as counter lines from the stats at each scrape.
_TOTALS = (("num_preemptions", "preemptions", "Requests preempted (recomputed later)"),
           ("prefix_cache_queries", "prefix_queries", "Prompt tokens looked up in the prefix cache"),
           ("prefix_cache_hits", "prefix_hits", "Of those, tokens found cached"),
           ("mm_cache_queries", "mm_cache_queries", "Images looked up in the image encoder's cache"),
           ("mm_cache_hits", "mm_cache_hits", "Of those, found (not encoded again)"),
           ("spec_decode_num_drafts", "spec_runs", "Runs of draft tokens verified (speculative decoding)"),
           ("spec_decode_num_draft_tokens", "spec_drafts", "Draft tokens run (speculative decoding)"),
           ("spec_decode_num_accepted_tokens", "spec_accepted", "Of those, accepted"))


class _VllmNames:
    """vLLM's metric names over the same observations (module docstring)."""

    def __init__(self, r: CollectorRegistry, model_name: str, max_model_len: int) -> None:
        self.model_name = model_name
        label = {"model_name": model_name}
        lengths = buckets_1_2_5(max_model_len)

        def histogram(name: str, doc: str, buckets) -> Histogram:
            return Histogram(name, doc, ["model_name"], registry=r, buckets=buckets).labels(**label)
        self.prompt_length = histogram("vllm:request_prompt_tokens", "Prompt tokens per request", lengths)
        self.generation_length = histogram("vllm:request_generation_tokens", "Generated tokens per request", lengths)
        self.max_tokens = histogram("vllm:request_params_max_tokens", "max_tokens of each request", lengths)
        self.n = histogram("vllm:request_params_n", "n of each request", N_BUCKETS)
        self.itl = histogram("vllm:inter_token_latency_seconds", "Time between output tokens", ITL_BUCKETS)
        self.decode_time = histogram("vllm:request_decode_time_seconds", "First to last token per request",
                                     REQUEST_LATENCY_BUCKETS)
        self.prefill_time = histogram("vllm:request_prefill_time_seconds", "First scheduled to first token",
                                      REQUEST_LATENCY_BUCKETS)
        self.queue_time = histogram("vllm:request_queue_time_seconds", "Arrival to first scheduled",
                                    REQUEST_LATENCY_BUCKETS)
        self.inference_time = histogram("vllm:request_inference_time_seconds", "First scheduled to last token",
                                        REQUEST_LATENCY_BUCKETS)
        self.running = Gauge("vllm:num_requests_running", "Requests running", ["model_name"], registry=r).labels(**label)
        self.waiting = Gauge("vllm:num_requests_waiting", "Requests waiting", ["model_name"], registry=r).labels(**label)
        self.kv_usage = Gauge("vllm:kv_cache_usage_perc", "KV cache usage (1 = full)", ["model_name"],
                              registry=r).labels(**label)
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prefill tokens processed", ["model_name"],
                                     registry=r).labels(**label)
        self.generation_tokens = Counter("vllm:generation_tokens", "Generation tokens processed", ["model_name"],
                                         registry=r).labels(**label)
        self.success = Counter("vllm:request_success", "Finished requests", ["model_name", "finished_reason"],
                               registry=r)
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Time to first token", ["model_name"],
                              registry=r, buckets=TTFT_BUCKETS).labels(**label)
        self.tpot = Histogram("vllm:request_time_per_output_token_seconds", "Time per output token, per request",
                              ["model_name"], registry=r, buckets=TPOT_BUCKETS).labels(**label)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "Arrival to last token", ["model_name"],
                             registry=r, buckets=E2E_BUCKETS).labels(**label)

    def totals(self, stats: dict) -> bytes:
        lines = []
        for name, key, doc in _TOTALS:
            if key in stats:
                lines += [f"# HELP vllm:{name}_total {doc}", f"# TYPE vllm:{name}_total counter",
                          f'vllm:{name}_total{{model_name="{self.model_name}"}} {stats[key]}']
        per_pos = stats.get("spec_accepted_per_pos")
        if per_pos:
            name = "vllm:spec_decode_num_accepted_tokens_per_pos_total"
            lines += [f"# HELP {name} Accepted draft tokens by their position in the run",
                      f"# TYPE {name} counter"]
            lines += [f'{name}{{model_name="{self.model_name}",position="{j}"}} {c}' for j, c in enumerate(per_pos)]
        return ("\n".join(lines) + "\n").encode() if lines else b""
