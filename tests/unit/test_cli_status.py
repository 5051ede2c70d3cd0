"""`raycluster status`'s table, from a router status JSON: exact lines, including the decode
instances' KV pulls (moved vs recomputed, and the mean cost of a pull) and a sliding-window model's KV
tables (hybrid groups, blocks given back)."""

from __future__ import annotations

from raycluster.cli_status import format_status

STATUS = {
    "policy": "lars", "inflight": 3, "queues": {"prefill-short": 1}, "router_id": "r1",
    "instances": [
        {"id": "prefill-short-a", "role": "prefill-short", "scheduling": "fcfs/awd", "waiting": 1,
         "queued_tokens": 120, "running": 0, "kv_total_blocks": 200, "kv_free_blocks": 150,
         "prefix_caching": True, "prefix_query_tokens": 400, "prefix_hit_tokens": 100},
        {"id": "decode-b", "role": "decode", "scheduling": "fcfs/token", "waiting": 0, "queued_tokens": 0,
         "running": 2, "kv_total_blocks": 100, "kv_free_blocks": 100, "prefix_caching": False,
         "kv_pulls_ok": 4, "kv_pulls_failed": 1, "kv_pull_blocks": 90, "kv_pull_s": 0.01},
        {"id": "decode-c", "role": "decode", "scheduling": "fcfs/token", "kv_total_blocks": 10,
         "kv_free_blocks": 10, "kv_pulls_ok": 0, "kv_pulls_failed": 2},
    ],
}


def test_status_table_shows_each_instance_and_its_kv_pulls():
    lines = format_status(STATUS).splitlines()
    assert lines[0] == "policy lars   in flight 3   queues {'prefill-short': 1}   router r1"
    assert lines[2].startswith("prefill-short-a") and lines[2].split()[-2:] == ["25.0%", "25.0%"]
    assert lines[3].startswith("decode-b") and lines[3].split()[-2:] == ["0.0%", "off"]
    assert lines[4] == "  kv pulls: 4 ok (90 blocks, 2.5 ms per pull), 1 failed and recomputed"
    assert lines[6] == "  kv pulls: 0 ok (0 blocks), 2 failed and recomputed"
    assert len(lines) == 7          # no pull line for an instance that pulled nothing
    # The router's stored Responses API responses, when it reports them.
    assert format_status({**STATUS, "stored_responses": 12}).splitlines()[0].endswith("router r1   stored responses 12")


def test_status_shows_the_lora_adapters_and_instances_that_could_not_load_one():
    status = {**STATUS, "lora_adapters": {"sql": "/a/sql"}, "lora_loading": ["chat"],
              "instances": [{**STATUS["instances"][1], "lora_failed": {"chat": "chat: no adapter found at /b"}}]}
    lines = format_status(status).splitlines()
    assert lines[1] == "LoRA adapters: sql (/a/sql); loading chat"
    assert lines[5] == "  LoRA adapter chat not loaded: chat: no adapter found at /b"


def test_status_names_the_served_model_its_tasks_pooling_and_weights(tiny_model_dir, st_dense_dir, classifiers):
    from raycluster.model.config import ModelConfig, model_summary
    from raycluster.model.loader import load_config

    def line(cfg, name="m"):
        return format_status({**STATUS, "model": {"name": name, **model_summary(cfg)}}).splitlines()[1]

    assert line(load_config(tiny_model_dir), "tiny") == \
        "model tiny (LlamaForCausalLM): generate + embed; last pooling, normalised, 256 dims; weights dense (float32)"
    assert line(load_config(st_dense_dir)) == ("model m (LlamaModel): embed; mean pooling, normalised, 2_Dense, "
                                               "3_Dense, 64 dims; weights dense (float32)")
    assert line(load_config(classifiers["sentiment"])) == (
        "model m (LlamaForSequenceClassification): classify; labels negative, neutral, positive; last pooling, "
        "normalised, 256 dims; weights dense (float32)")
    gptq = {**load_config(tiny_model_dir).raw, "dtype": "bfloat16",
            "quantization_config": {"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": False,
                                    "sym": True}}
    assert line(ModelConfig.from_dict(gptq)).endswith("weights gptq 4-bit group g32 (bfloat16)")


def test_status_shows_a_sliding_window_models_kv_tables():
    hybrid = {**STATUS["instances"][1], "kv_pulls_ok": 0, "kv_pulls_failed": 0, "kv_groups": 2,
              "kv_released_blocks": 37}
    sliding = {**hybrid, "id": "decode-d", "kv_groups": 1, "kv_released_blocks": 5}
    lines = format_status({**STATUS, "instances": [hybrid, sliding, STATUS["instances"][0]]}).splitlines()
    assert lines[3] == "  kv cache: hybrid, 2 layer groups, 37 blocks given back out of the window"
    assert lines[5] == "  kv cache: one table, 5 blocks given back out of the window"
    assert len(lines) == 7          # nothing for an instance whose every layer attends fully
