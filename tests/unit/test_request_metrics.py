"""RequestMetrics (raycluster.server.request_metrics): what /metrics counts, and the same calls
forwarded to every sink (a gateway's Ray metrics sink is one)."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from raycluster.server.request_metrics import RequestMetrics, buckets_1_2_5


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


def test_the_same_figures_under_vllms_names():
    m = RequestMetrics(model_name="house")
    m.admitted(40)
    m.first_token(0.03)
    m.finished("length", 5, 0.4, 0.09)
    m.admitted(3)
    m.finished("abort", 0, 0.2, None)
    stats = {"waiting": 2, "running": 1, "kv_used_blocks": 3, "kv_total_blocks": 12, "router_queued": 4,
             "preemptions": 7, "prefix_queries": 640, "prefix_hits": 96, "spec_drafts": 50, "spec_accepted": 21,
             "spec_runs": 13, "spec_accepted_per_pos": [10, 7, 4]}
    text = m.render(stats).decode()
    got = {(s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name"))): s.value
           for f in text_string_to_metric_families(text) for s in f.samples if s.name.startswith("vllm:")}
    assert all(s.labels.get("model_name") == "house" for f in text_string_to_metric_families(text)
               for s in f.samples if s.name.startswith("vllm:"))
    assert got[("vllm:num_requests_waiting", ())] == 6          # the router's queue counts as waiting
    assert got[("vllm:num_requests_running", ())] == 1 and got[("vllm:kv_cache_usage_perc", ())] == 0.25
    assert got[("vllm:prompt_tokens_total", ())] == 43 and got[("vllm:generation_tokens_total", ())] == 5
    assert got[("vllm:request_success_total", (("finished_reason", "length"),))] == 1
    assert got[("vllm:request_success_total", (("finished_reason", "abort"),))] == 1
    assert got[("vllm:time_to_first_token_seconds_count", ())] == 1
    assert got[("vllm:request_time_per_output_token_seconds_sum", ())] == 0.09
    assert got[("vllm:e2e_request_latency_seconds_count", ())] == 2
    for name, value in (("num_preemptions", 7), ("prefix_cache_queries", 640), ("prefix_cache_hits", 96),
                        ("spec_decode_num_draft_tokens", 50), ("spec_decode_num_accepted_tokens", 21),
                        ("spec_decode_num_drafts", 13)):
        assert got[(f"vllm:{name}_total", ())] == value
    assert [got[("vllm:spec_decode_num_accepted_tokens_per_pos_total", (("position", str(j)),))]
            for j in range(3)] == [10, 7, 4]
    # Totals an engine does not keep (no prefix caching, no drafts) are left out, not zero.
    bare = m.render({"waiting": 0, "running": 0, "kv_used_blocks": 0, "kv_total_blocks": 1}).decode()
    assert "vllm:prefix_cache_hits_total" not in bare and "vllm:num_requests_running" in bare


def test_a_cluster_gateways_stats_sum_its_instances(tmp_path):
    from raycluster.cluster.client import ClusterClient

    client = ClusterClient(submit=None, abort=None, pull=None, status=None, tokenizer=None, max_model_len=64,
                           vocab_size=10, eos_token_ids=(), gateway_id="g")
    inst = {"waiting": 1, "running": 2, "kv_total_blocks": 10, "kv_free_blocks": 4, "preemptions": 3,
            "prefix_query_tokens": 100, "prefix_hit_tokens": 40, "spec_draft_tokens": 9, "spec_accepted_tokens": 5,
            "spec_drafts": 3, "spec_accepted_per_pos": [3, 2]}
    # A third instance drafting 3 per run; one that does not draft at all.
    client._last_status = {"queues": {"mixed": 3, "decode": 1}, "instances": [
        inst, dict(inst, waiting=2, spec_accepted_per_pos=[2, 1, 1]), {"kv_total_blocks": 0}]}
    s = client.stats()
    assert (s["waiting"], s["router_queued"], s["running"], s["kv_used_blocks"], s["kv_total_blocks"]) == \
        (3, 4, 4, 12, 20)
    assert (s["preemptions"], s["prefix_queries"], s["prefix_hits"], s["spec_drafts"], s["spec_accepted"]) == \
        (6, 200, 80, 18, 10)
    assert s["spec_runs"] == 6 and s["spec_accepted_per_pos"] == [5, 3, 1]


def test_vllms_per_request_histograms():
    """Prompt and generation lengths per finished request, max_tokens and n per admitted one,
    one inter-token sample per token (a delivery of 3 tokens after 0.3 s: 3 samples of 0.1 s),
    decode time; vLLM's buckets (1-2-5 up to the context length)."""
    assert buckets_1_2_5(1000) == (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000)
    assert buckets_1_2_5(4096)[-1] == 2000
    m = RequestMetrics(model_name="m", max_model_len=4096, sinks=[_Sink()])
    m.admitted(80, max_tokens=7, n=2)
    m.first_token(0.05, prefill_s=0.0375)
    m.first_token(0.1)              # no prefill time (its prompt came with its KV, say)
    m.tokens_after(0.3, 3)
    m.tokens_after(0.02, 1)
    m.finished("length", 5, 0.5, 0.08, prompt_tokens=40, decode_s=0.32, prefill_s=0.0375)
    m.finished("length", 1, 0.1, None, prompt_tokens=40, decode_s=0.0)
    assert m.sinks[0].calls[0] == ("admitted", 80)          # the sinks get what they always got
    text = m.render({"waiting": 0, "running": 0, "kv_used_blocks": 0, "kv_total_blocks": 1}).decode()
    got = {(s.name, s.labels.get("le")): s.value for f in text_string_to_metric_families(text) for s in f.samples}
    assert got[("vllm:request_params_n_count", None)] == 1 and got[("vllm:request_params_n_sum", None)] == 2
    assert got[("vllm:request_params_max_tokens_bucket", "10.0")] == 1
    assert got[("vllm:request_params_max_tokens_bucket", "5.0")] == 0
    assert got[("vllm:request_prompt_tokens_count", None)] == 2 and got[("vllm:request_prompt_tokens_sum", None)] == 80
    assert got[("vllm:request_prompt_tokens_bucket", "50.0")] == 2
    assert got[("vllm:request_prompt_tokens_bucket", "20.0")] == 0
    assert got[("vllm:request_prompt_tokens_bucket", "2000.0")] == 2
    assert got[("vllm:request_generation_tokens_sum", None)] == 6
    assert got[("vllm:request_generation_tokens_bucket", "1.0")] == 1
    assert got[("vllm:inter_token_latency_seconds_count", None)] == 4
    assert abs(got[("vllm:inter_token_latency_seconds_sum", None)] - 0.32) < 1e-9
    assert got[("vllm:inter_token_latency_seconds_bucket", "0.01")] == 0
    assert got[("vllm:inter_token_latency_seconds_bucket", "0.025")] == 1      # the 0.02 s one
    assert got[("vllm:inter_token_latency_seconds_bucket", "0.1")] == 4
    assert got[("vllm:request_decode_time_seconds_count", None)] == 2
    assert got[("vllm:request_decode_time_seconds_bucket", "0.3")] == 1
    # Queue time = TTFT - prefill time; inference time = prefill + decode time.
    assert got[("vllm:request_prefill_time_seconds_count", None)] == 1
    assert got[("vllm:request_prefill_time_seconds_sum", None)] == 0.0375
    assert got[("vllm:request_queue_time_seconds_count", None)] == 1
    assert abs(got[("vllm:request_queue_time_seconds_sum", None)] - 0.0125) < 1e-12
    assert got[("vllm:request_inference_time_seconds_count", None)] == 1
    assert abs(got[("vllm:request_inference_time_seconds_sum", None)] - 0.3575) < 1e-12
