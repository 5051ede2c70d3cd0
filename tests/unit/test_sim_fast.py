"""The simulator's decode fast path (sim/fastpath.py) gives the exact path's results.

Exact path = every step through `Scheduler.schedule/update` (coalesce_decode off, no decode
group); fast path = decodes advance as a group. On the golden specs and on random small specs
(policies the group accepts and ones it refuses, KV tight enough to preempt, P/D transfers),
every per-request record must be equal (floats within 1e-9 s; in practice bit-identical) and
the step/preemption/transfer counters the same; KV bookkeeping must be consistent at the end.
"""

from __future__ import annotations

import math
import random

import pytest

from loadgen.workloads import make_workload
from raycluster.sim.run import simulate
from raycluster.sim.spec import SimSpec
from tests.unit.test_sim_golden import CASES

COUNTERS = ("steps", "preemptions", "kv_transfers", "output_tokens", "virtual_end_s")


def assert_same(spec: dict, wl: dict, horizon_s: float | None = None) -> dict:
    spec = {**spec, "coalesce_decode": False}
    exact = simulate(SimSpec(**spec), make_workload(**wl), horizon_s=horizon_s)
    fast = simulate(SimSpec(**spec), make_workload(**wl), horizon_s=horizon_s, fast_decode=True,
                    check=horizon_s is None)
    assert len(exact["requests"]) == len(fast["requests"])
    for a, b in zip(exact["requests"], fast["requests"]):
        assert a.keys() == b.keys()
        for k in a:
            x, y = a[k], b[k]
            if isinstance(x, float) and isinstance(y, float):
                assert math.isclose(x, y, rel_tol=0, abs_tol=1e-9), (a["request_id"], k, x, y)
            else:
                assert x == y, (a["request_id"], k, x, y)
    se, sf = exact["meta"]["sim"], fast["meta"]["sim"]
    for k in COUNTERS:
        assert se[k] == sf[k], k
    assert se["decode_path"] == "stepwise"
    return sf


@pytest.mark.parametrize("name", sorted(CASES))
def test_fast_path_matches_exact_on_golden_specs(name):
    spec, wl = CASES[name]
    sf = assert_same(spec, wl)
    assert sf["decode_path"] == "fast" and sf["group_steps"] > 0


def random_case(seed: int) -> tuple[dict, dict]:
    rng = random.Random(seed)
    policy = rng.choice(["lars", "fcfs", "edf", "srpt", "lrs", "lars", "vtc"])
    packer = rng.choice(["medha", "token"])
    pd = rng.random() < 0.3
    pools = ([{"role": "prefill-short", "instances": rng.randint(1, 2)}, {"role": "decode", "instances": rng.randint(1, 2)}]
             if pd else [{"role": "mixed", "instances": rng.randint(1, 3)}])
    spec = {"gpu": "cpu", "model": "tiny", "policy": policy, "kv_cache_tokens": rng.choice([2048, 3072, 8192, 65536]),
            "predictor": {"overhead_s": 0.004, "per_prefill_token_s": 1e-4, "per_attn_pair_s": 1e-9,
                          "per_decode_s": 2e-4, "per_decode_kv_s": 1e-6},
            "engine": {"packer": packer, "chunk_size": 512, "max_num_batched_tokens": 1024,
                       "max_num_seqs": rng.choice([8, 32, 32])},
            "pools": pools}
    wl = dict(name=rng.choice(["chat", "tenants"]), seed=seed, qps=rng.choice([10, 30]), num_requests=80,
              max_output_tokens=rng.choice([40, 200]))
    return spec, wl


@pytest.mark.parametrize("seed", range(10))
def test_fast_path_matches_exact_on_random_specs(seed):
    spec, wl = random_case(seed)
    sf = assert_same(spec, wl)
    if spec["policy"] == "vtc":       # charges decode tokens: the group is refused, exact path runs
        assert sf["decode_path"] == "stepwise" and sf["group_steps"] == 0


def test_kairos_selector_falls_back_to_exact():
    spec, wl = random_case(1)
    spec["engine"] = {**spec["engine"], "decode_selector": "kairos", "packer": "medha"}
    sf = assert_same(spec, wl)
    assert sf["group_steps"] == 0


def test_fast_path_matches_exact_at_a_horizon():
    """Cut mid-run at saturation: requests still decoding time out with the tokens made so far."""
    spec, _ = CASES["speed-128xh100"]
    sf = assert_same(spec, dict(name="chat", seed=3, qps=700, duration=1.0), horizon_s=1.5)
    assert sf["virtual_end_s"] <= 1.5
