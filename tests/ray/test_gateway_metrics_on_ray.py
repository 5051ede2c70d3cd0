"""The gateway's Ray metrics sink (deployments/gateway_metrics.py): what a replica records
reaches the node's Ray metrics export with its gateway tag, exactly, summable over replicas."""

from __future__ import annotations

import time
import urllib.request

import pytest

pytestmark = pytest.mark.ray


def _export(port: int) -> dict[tuple[str, str], float]:
    """{(sample name, gateway tag): value} of the raycluster_gateway_* series (buckets left out)."""
    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    out: dict[tuple[str, str], float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name.startswith("ray_raycluster_gateway_") and "le" not in s.labels:
                key = (s.name + (f"[{s.labels['finish_reason']}]" if "finish_reason" in s.labels else ""),
                       s.labels.get("gateway", ""))
                out[key] = out.get(key, 0.0) + s.value
    return out


def test_two_replicas_series_reach_the_export(ray_cluster):
    import ray

    @ray.remote(num_cpus=0)
    class Replica:
        def __init__(self, gid: str) -> None:
            from deployments.gateway_metrics import RayRequestMetrics
            self.m = RayRequestMetrics(gid)

        def serve(self, prompt: int, out: int, reason: str) -> None:
            self.m.admitted(prompt)
            self.m.first_token(0.02)
            self.m.finished(reason, out, 0.5, 0.01 if out > 1 else None)

    a, b = Replica.remote("gw-a"), Replica.remote("gw-b")
    ray.get([a.serve.remote(30, 4, "length"), a.serve.remote(12, 1, "stop"), b.serve.remote(7, 2, "length")])
    port = ray.nodes()[0]["MetricsExportPort"]
    want = {("ray_raycluster_gateway_prompt_tokens_total", "gw-a"): 42.0,
            ("ray_raycluster_gateway_prompt_tokens_total", "gw-b"): 7.0,
            ("ray_raycluster_gateway_generated_tokens_total", "gw-a"): 5.0,
            ("ray_raycluster_gateway_requests_total[length]", "gw-a"): 1.0,
            ("ray_raycluster_gateway_requests_total[stop]", "gw-a"): 1.0,
            ("ray_raycluster_gateway_requests_total[length]", "gw-b"): 1.0,
            ("ray_raycluster_gateway_ttft_seconds_count", "gw-a"): 2.0,
            ("ray_raycluster_gateway_tpot_seconds_count", "gw-a"): 1.0,   # one request of 1 token: no gap
            ("ray_raycluster_gateway_e2e_request_latency_seconds_count", "gw-b"): 1.0}
    deadline, got = time.monotonic() + 60, {}
    while time.monotonic() < deadline:          # the export reports every few seconds
        got = _export(port)
        if all(got.get(k) == v for k, v in want.items()):
            break
        time.sleep(1.0)
    assert {k: got.get(k) for k in want} == want
    ray.kill(a)
    ray.kill(b)
