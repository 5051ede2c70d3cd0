"""Serve the cluster app on a Ray cluster of two nodes (two raylets on this host, both on
127.0.0.1): a prefill pool whose instance leads an spp2 group and a decode pool whose instance
leads a tp2 group, both placed STRICT_SPREAD, so each group's two ranks run on different nodes.
Prints one JSON line: the greedy texts served over HTTP, the single-engine texts, each
instance's layout and ranks' Ray node ids (from `/v1/cluster/status`), and the nodes' ids.

Run by tests/ray/test_group_spans_nodes.py in a process of its own (a pytest process already
holds the session's one-node Ray). Usage: python two_node_groups.py MODEL_DIR
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time

import httpx

from raycluster.ports import free_port

LAYOUTS = {"tp2": {"tp": 2}, "spp2": {"spp": 2, "spp_micro_tokens": 32}}
PROMPTS = [[(7 * i + 3 * j) % 3000 + 6 for j in range(n)] for i, n in enumerate((40, 150, 9))]
MAX_TOKENS = 12


def single_engine_texts(model_dir: str) -> list[str]:
    from raycluster.engine.config import EngineConfig
    from raycluster.engine.engine import LLMEngine
    from raycluster.model.loader import load_model
    from raycluster.model.tokenizer import Tokenizer
    from raycluster.request import SamplingParams

    model, mcfg = load_model(model_dir)
    tok = Tokenizer(model_dir, mcfg.eos_token_id)
    engine = LLMEngine(EngineConfig(policy="fcfs", packer="token", predictor="none", kv_cache_tokens=2048, num_threads=1),
                       model, tok)
    out = engine.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True), max_steps=500)
    return [tok.decode(ids) for ids in out]


def serve_pd(model_dir: str, url: str) -> dict:
    """P/D app: prefill on an spp2 group, decode on a tp2 group, both placed STRICT_SPREAD; KV
    over torch_dist on the nodes' addresses. Returns the served texts and each instance's nodes."""
    import ray
    from ray import serve

    from deployments.app import build_app
    from deployments.launcher import wait_healthy

    spread = {"instances": 1, "num_cpus": 1, "placement_strategy": "STRICT_SPREAD"}
    group = {"group_launch": "ray", "group_host": "node"}
    args = {"model": model_dir, "policy": "fcfs", "router_name": "router-2n", "threads_per_instance": 1,
            "connector": "torch_dist", "connector_host": "node",
            "engine": {"kv_cache_tokens": 2048, "packer": "token", "predictor": "none"},
            "pools": [{"role": "prefill-short", **spread, "engine": {**group, **LAYOUTS["spp2"]}},
                      {"role": "decode", **spread, "engine": {**group, **LAYOUTS["tp2"]}}]}
    serve.run(build_app(args), name="raycluster", route_prefix="/", blocking=False)
    try:
        if not wait_healthy(url + "/health", 240):
            raise RuntimeError("the app was not healthy within 240 s")
        texts = []
        with httpx.Client(timeout=60) as client:
            for p in PROMPTS:
                r = client.post(url + "/v1/completions", json={"prompt": p, "max_tokens": MAX_TOKENS,
                                                               "temperature": 0, "ignore_eos": True})
                r.raise_for_status()
                texts.append(r.json()["choices"][0]["text"])
            deadline = time.monotonic() + 30
            while True:       # each instance reports its stats on its next poll
                insts = client.get(url + "/v1/cluster/status").json().get("instances", [])
                if len(insts) == 2 and all(i.get("nodes") for i in insts) or time.monotonic() > deadline:
                    break
                time.sleep(0.5)
        return {"texts": texts, "instances": {i["role"]: {"layout": i["layout"], "nodes": i["nodes"]}
                                              for i in insts}}
    finally:
        serve.delete("raycluster")
        ray.kill(ray.get_actor("router-2n", namespace="raycluster"))


def main(model_dir: str) -> None:
    # Before Ray is imported: a driver on a one-host cluster dials 127.0.0.1 as given, instead of
    # swapping it for the host's routable address (where nothing listens here).
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    import ray
    from ray import serve
    from ray.cluster_utils import Cluster

    t0 = time.monotonic()
    want = single_engine_texts(model_dir)
    env = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}
    temp_dir = tempfile.mkdtemp(prefix="rc2n", dir="/tmp")
    # Ray's Cluster writes the head's address to $RAY_TMPDIR/ray/ray_current_cluster (default
    # /tmp/ray, which need not exist on a fresh machine): keep that file in our own temp dir.
    os.environ["RAY_TMPDIR"] = temp_dir
    os.makedirs(os.path.join(temp_dir, "ray"), exist_ok=True)
    node = {"num_cpus": 3, "node_ip_address": "127.0.0.1", "object_store_memory": 200 * 1024 * 1024}
    cluster = Cluster(initialize_head=True, head_node_args={**node, "include_dashboard": False,
                                                            "temp_dir": temp_dir})
    try:
        cluster.add_node(**node)
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, runtime_env={"env_vars": env}, namespace="raycluster")
        node_ids = sorted(n["NodeID"] for n in ray.nodes() if n["Alive"])
        url_port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": url_port})
        print(f"two nodes up after {time.monotonic() - t0:.1f} s", file=sys.stderr, flush=True)
        res = serve_pd(model_dir, f"http://127.0.0.1:{url_port}")
        print(f"served after {time.monotonic() - t0:.1f} s", file=sys.stderr, flush=True)
        print(json.dumps({**res, "want": want, "cluster_nodes": node_ids}), flush=True)
        serve.shutdown()
    finally:
        ray.shutdown()
        cluster.shutdown()
        print(f"down after {time.monotonic() - t0:.1f} s", file=sys.stderr, flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
