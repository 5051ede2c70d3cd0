"""Cheap checks of the cluster benchmarks' helpers and configurations (no Ray, no model)."""

from __future__ import annotations

import argparse

from raycluster.bench.cluster_bench import pct, prompts, stream_stats, summ
from raycluster.bench.cluster_convoy import CONFIGS, cluster_config, loadgen_argv
from raycluster.cluster.config import ClusterConfig


def test_percentiles_and_summary_in_ms():
    xs = [i / 1000 for i in range(1, 101)]          # 1..100 ms
    s = summ(xs)
    assert s["n"] == 100 and abs(s["p50_ms"] - 50.0) < 1.01 and abs(s["p99_ms"] - 99.0) < 1.01
    assert pct([], 50) is None


def test_prompts_are_reproducible_and_16_tokens():
    a, b = prompts(5, seed=3), prompts(5, seed=3)
    assert a == b and all(len(p) == 16 for p in a)


def test_stream_stats_counts_tokens_and_gaps():
    times = {"a": [1.0, 1.01, 1.02], "b": [1.0, 1.02]}
    st = stream_stats(times, wall=0.5, t0=0.9)
    assert st["tokens"] == 5 and st["tok_per_s"] == 10.0 and st["gap"]["n"] == 3


def test_convoy_configs_are_valid_cluster_configs():
    for name in CONFIGS:
        c = ClusterConfig(**cluster_config(name, 50.0))
        assert c.threads_per_instance == 1
        n = sum(p.instances for p in c.pools)
        assert n == (2 if name.startswith("mixed") else 3)
        first = c.engine_config(c.pools[0])
        if name.endswith("fcfs"):
            assert (c.policy, first.packer, first.chunk_size) == ("fcfs", "token", 2048)
        elif name.endswith("fcfs-np"):     # non-preemptive: a 16K-token prompt in one step
            assert (c.policy, first.packer, first.chunk_size, first.max_num_batched_tokens) == \
                ("fcfs", "token", 16384, 16384)
        else:
            assert (c.policy, first.packer) == ("lars", "medha")
        # --tpot-ms reaches every instance (the Medha step budget), pd's decode override kept
        assert all(c.engine_config(p).tpot_ms == 50.0 for p in c.pools)
        if name.startswith("pd"):
            assert c.engine_config(c.pools[-1]).packer == "token"


def test_loadgen_argv_uses_exact_token_ids_and_same_seed():
    args = argparse.Namespace(qps=2.0, duration=90.0, seed=4, long_fraction=0.05, long_tokens="4096:8192",
                              max_output_tokens=64, ttft_slo_ms=500.0, tpot_ms=50.0, long_ttft_ms_per_token=3.0)
    argv = loadgen_argv(args, "http://127.0.0.1:1", "/tmp/x.json")
    assert argv[argv.index("--long-ttft-ms-per-token") + 1] == "3.0"
    assert argv[argv.index("--ttft-slo-ms") + 1] == "500.0"
    assert argv[argv.index("--tpot-slo-ms") + 1] == "50.0"
    assert argv[argv.index("--prompt-format") + 1] == "ids"
    assert argv[argv.index("--seed") + 1] == "4" and argv[argv.index("--workload") + 1] == "long-mix"
