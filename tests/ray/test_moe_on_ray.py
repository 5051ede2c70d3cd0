"""A mixture-of-experts checkpoint served by the P/D cluster over real HTTP: a Qwen2-MoE model (shared
expert, one dense layer) whose short prompts prefill on an expert-parallel tp 2 group of Ray-actor
ranks (each reads its whole experts from the files) and hand their KV to a decode instance over
torch_dist. Greedy text equals one in-process engine's; afterwards nothing is in flight and every
instance's KV is free."""

from __future__ import annotations

import random

import pytest
from cluster_http import complete_all, drained_status, single_engine_texts
from serve_app import deployed_app

pytestmark = [pytest.mark.ray, pytest.mark.e2e]

ROUTER = "router-moe"
MOE = dict(architectures=["Qwen2MoeForCausalLM"], hidden_size=128, num_attention_heads=4, num_key_value_heads=2,
           intermediate_size=256, num_hidden_layers=3, moe_intermediate_size=96, shared_expert_intermediate_size=192,
           mlp_only_layers=[1])


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    from raycluster.model.tiny import write_tiny_model

    return write_tiny_model(tmp_path_factory.mktemp("qwen2moe"), seed=4, **MOE)


def test_a_moe_model_through_an_expert_parallel_prefill_group(ray_cluster, moe_dir):
    rng = random.Random(2)
    prompts = [[rng.randrange(6, 4000) for _ in range(n)] for n in (3, 17, 40, 90, 150, 260, 300, 420, 600, 9, 64, 130)]
    want = single_engine_texts(moe_dir, prompts, 8)
    cfg = {"model": moe_dir, "policy": "lars", "threads_per_instance": 1, "router_name": ROUTER,
           "connector": "torch_dist", "initial_l_m": 256,
           "engine": {"kv_cache_tokens": 16384, "enable_prefix_caching": True},
           "pools": [{"role": "prefill-short", "instances": 1, "engine": {
                         "tp": 2, "enable_expert_parallel": True, "group_launch": "ray"}},
                     {"role": "prefill-long", "instances": 1},
                     {"role": "decode", "instances": 1, "engine": {"policy": "fcfs", "packer": "token"}}]}
    with deployed_app(cfg, ROUTER, 300, "MoE cluster") as url:
        assert complete_all(url, prompts, 8) == want
        status = drained_status(url)
        pools = {i["role"]: i for i in status["instances"]}
        assert {r: i["layout"] for r, i in pools.items()} == {
            "prefill-short": "tp2ep", "prefill-long": "single", "decode": "single"}
        # The expert-parallel group prefilled prompts (each looked up in its prefix cache) and
        # handed their KV over. (The router may give a request to the decode instance whole
        # when the prefill pools are busier, so not every request moves KV.)
        assert pools["prefill-short"]["prefix_query_tokens"] > 0
        assert pools["decode"]["kv_pulls_ok"] >= 1 and pools["decode"]["kv_pulls_failed"] == 0
