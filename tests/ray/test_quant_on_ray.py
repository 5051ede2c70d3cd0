"""A quantized checkpoint served by the P/D cluster over real HTTP: the tiny model as GPTQ (4-bit,
groups of 32), its short prompts prefilled on a tp 2 group of Ray-actor ranks (each reads its
slices of the packed weights, scales and zeros from the files) running the int4 kernels, its long
prompts on an instance that dequantized the weights at load, KV handed over torch_dist to a decode
instance on the int4 kernels: one checkpoint, each pool's `quant_kernels` its own. Greedy text
equals one in-process engine's; afterwards nothing is in flight and every instance's KV is free."""

from __future__ import annotations

import random

import pytest
from cluster_http import complete_all, drained_status, single_engine_texts
from serve_app import deployed_app

pytestmark = [pytest.mark.ray, pytest.mark.e2e]

ROUTER = "router-quant"


@pytest.fixture(scope="module")
def gptq_dir(tiny_model_dir, tmp_path_factory):
    from raycluster.model.quant.write import quantize_checkpoint

    path = str(tmp_path_factory.mktemp("gptq") / "tiny-gptq")
    quantize_checkpoint(str(tiny_model_dir), path, "gptq", 32)
    return path


def test_a_quantized_model_through_pd_pools_with_their_own_kernels(ray_cluster, gptq_dir):
    rng = random.Random(3)
    prompts = [[rng.randrange(6, 4000) for _ in range(n)] for n in (3, 17, 40, 90, 150, 260, 300, 420, 600, 9, 64, 130)]
    want = single_engine_texts(gptq_dir, prompts, 8, quant_kernels="quantized")
    cfg = {"model": gptq_dir, "policy": "lars", "threads_per_instance": 1, "router_name": ROUTER,
           "connector": "torch_dist", "initial_l_m": 256,
           "engine": {"kv_cache_tokens": 16384, "quant_kernels": "quantized"},
           "pools": [{"role": "prefill-short", "instances": 1, "engine": {"tp": 2, "group_launch": "ray"}},
                     {"role": "prefill-long", "instances": 1, "engine": {"quant_kernels": "dense"}},
                     {"role": "decode", "instances": 1, "engine": {"policy": "fcfs", "packer": "token"}}]}
    with deployed_app(cfg, ROUTER, 300, "quantized cluster") as url:
        assert complete_all(url, prompts, 8) == want
        status = drained_status(url)
        pools = {i["role"]: i for i in status["instances"]}
        assert {r: i["layout"] for r, i in pools.items()} == {
            "prefill-short": "tp2", "prefill-long": "single", "decode": "single"}
        assert pools["decode"]["kv_pulls_ok"] >= 1 and pools["decode"]["kv_pulls_failed"] == 0
