"""RequestMetrics (raycluster.server.request_metrics): what /metrics counts, and the same calls
forwarded to every sink (a gateway's Ray metrics sink is one)."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from raycluster.server.request_metrics import RequestMetrics


class _Sink:
    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def admitted(self, prompt_tokens):
        self.calls.append(("admitted", prompt_tokens))

    def first_token(self, ttft_s):
        self.calls.append(("first_token", ttft_s))

    def finished(self, reason, output_tokens, e2e_s, tpot_s):
        self.calls.append(("finished", reason, output_tokens, e2e_s, tpot_s))


def test_observations_reach_the_registry_and_every_sink():
    sinks = [_Sink(), _Sink()]
    m = RequestMetrics(sinks)
    m.admitted(40)
    m.first_token(0.03)
    m.finished("length", 5, 0.4, 0.09)
    m.admitted(3)
    m.first_token(0.2)
    m.finished("stop", 1, 0.2, None)
    assert sinks[0].calls == sinks[1].calls == [
        ("admitted", 40), ("first_token", 0.03), ("finished", "length", 5, 0.4, 0.09),
        ("admitted", 3), ("first_token", 0.2), ("finished", "stop", 1, 0.2, None)]
    text = m.render({"waiting": 2, "running": 1, "kv_used_blocks": 3, "kv_total_blocks": 12}).decode()
    got = {(s.name, tuple(sorted(s.labels.items()))): s.value
           for f in text_string_to_metric_families(text) for s in f.samples}
    assert got[("raycluster_prompt_tokens_total", ())] == 43
    assert got[("raycluster_generated_tokens_total", ())] == 6
    assert got[("raycluster_requests_total", (("finish_reason", "length"),))] == 1
    assert got[("raycluster_ttft_seconds_count", ())] == 2
    assert got[("raycluster_tpot_seconds_count", ())] == 1          # the 1-token request has no gap
    assert abs(got[("raycluster_e2e_request_latency_seconds_sum", ())] - 0.6) < 1e-9
    assert got[("raycluster_e2e_request_latency_seconds_bucket", (("le", "0.25"),))] == 1
    assert got[("raycluster_kv_usage", ())] == 0.25 and got[("raycluster_queue_waiting", ())] == 2
