"""Discrete-event simulator: determinism, conservation, hand-computed step timing with a
LinearBatchPredictor (mixed and P/D), the loadgen results schema, and the CLI."""

import json

import pytest

from loadgen.metrics import RequestRecord, build_results
from loadgen.workloads import Workload, WorkloadRequest, make_workload
from raycluster.clock import VirtualClock
from raycluster.engine.kv_manager import KVCacheManager
from raycluster.engine.scheduler import Scheduler, SchedulerConfig
from raycluster.request import Request, SamplingParams
from raycluster.sched.base import PolicyContext
from raycluster.sched.predictor import LinearBatchPredictor
from raycluster.sched.registry import make_policy
from raycluster.sched.token_packer import TokenBudgetPacker
from raycluster.sim.run import simulate
from raycluster.sim.spec import SimSpec

PRED = {"overhead_s": 0.01, "per_prefill_token_s": 0.001}   # prefill n tokens: 0.01 + n ms; decode: 0.01


def cpu_spec(pools=None, **kw):
    base = dict(gpu="cpu", model="tiny", policy="fcfs", predictor=PRED, kv_cache_tokens=4096,
                engine={"packer": "token", "chunk_size": 512, "max_num_batched_tokens": 512},
                pools=pools or [{"role": "mixed", "instances": 1}])
    base.update(kw)
    return SimSpec(**base)


def wl(*reqs):
    return Workload("test", {"seed": 0}, [WorkloadRequest(f"r{i}", a, p, o) for i, (a, p, o) in enumerate(reqs)])


def by_id(res):
    return {r["request_id"]: r for r in res["requests"]}


def test_single_request_hand_computed():
    res = simulate(cpu_spec(), wl((0.0, 100, 3)), check=True)
    r = by_id(res)["r0"]
    # prefill 100 tokens: 0.01 + 0.1 = 0.11 (first token); two decode steps of 0.01 each.
    assert r["ttft_s"] == pytest.approx(0.11)
    assert r["e2e_s"] == pytest.approx(0.13)
    assert r["tpot_s"] == pytest.approx(0.01)
    assert r["num_output_tokens"] == 3


def test_two_requests_share_steps():
    res = simulate(cpu_spec(), wl((0.0, 100, 3), (0.05, 50, 2)), check=True)
    r = by_id(res)
    # r1 arrives mid-step; it joins the next step: decode r0 + prefill 50 = 0.01 + 0.05 -> 0.17.
    assert r["r0"]["ttft_s"] == pytest.approx(0.11)
    assert r["r1"]["ttft_s"] == pytest.approx(0.17 - 0.05)
    # step 3 at 0.17: decode r0 (3rd token, done) + decode r1 (2nd token, done): 0.01 -> 0.18.
    assert r["r0"]["e2e_s"] == pytest.approx(0.18)
    assert r["r1"]["e2e_s"] == pytest.approx(0.18 - 0.05)


def test_pd_handoff_hand_computed():
    spec = cpu_spec(pools=[{"role": "prefill-short", "instances": 1}, {"role": "decode", "instances": 1}],
                    transfer_bw_gbs=1.0, transfer_latency_s=0.005, kv_bytes_per_token=1e6)
    res = simulate(spec, wl((0.0, 100, 3)), check=True)
    r = by_id(res)["r0"]
    assert r["ttft_s"] == pytest.approx(0.11)
    # transfer: 0.005 + 100 * 1e6 / 1e9 = 0.105; then two decode steps of 0.01.
    assert r["e2e_s"] == pytest.approx(0.11 + 0.105 + 0.02)
    assert res["meta"]["sim"]["kv_transfers"] == 1


@pytest.mark.parametrize("pools", [
    [{"role": "mixed", "instances": 2}],
    [{"role": "prefill-short", "instances": 1}, {"role": "prefill-long", "instances": 1},
     {"role": "decode", "instances": 2}],
])
@pytest.mark.parametrize("policy", ["fcfs", "lars", "kairos"])
def test_conservation_every_request_finishes_once(pools, policy):
    w = make_workload("long-mix", seed=3, qps=20, num_requests=60, long_fraction=0.2,
                      long_tokens=(1024, 2048), max_output_tokens=32)
    res = simulate(cpu_spec(pools=pools, policy=policy, kv_cache_tokens=8192), w, check=True)
    assert res["summary"]["completed"] == 60 and res["summary"]["failed"] == 0
    for r in res["requests"]:
        exp = next(q for q in w if q.request_id == r["request_id"]).output_tokens
        assert r["num_output_tokens"] == exp


def test_deterministic_for_a_seed():
    w = lambda: make_workload("long-mix", seed=7, qps=15, num_requests=50, long_fraction=0.1,  # noqa: E731
                              long_tokens=(1024, 3000), max_output_tokens=40)
    spec = cpu_spec(pools=[{"role": "mixed", "instances": 2}], policy="lars",
                    engine={"packer": "medha", "max_num_batched_tokens": 2048})
    a, b = simulate(spec, w()), simulate(spec, w())
    strip = lambda res: json.dumps(res["requests"], sort_keys=True)  # noqa: E731
    assert strip(a) == strip(b)
    assert a["meta"]["sim"]["events"] == b["meta"]["sim"]["events"]


def test_dependencies_and_think_time():
    w = Workload("t", {}, [WorkloadRequest("a", 0.0, 100, 2, app_id="x"),
                           WorkloadRequest("b", 0.0, 50, 1, app_id="x", depends_on=("a",), think_s=0.5)])
    res = simulate(cpu_spec(), w, check=True)
    r = by_id(res)
    # a: 0.11 prefill + 0.01 decode -> 0.12; b sent at 0.62, prefill 0.06 -> 0.68.
    assert r["b"]["arrival_s"] == pytest.approx(0.62)
    assert r["b"]["finish_s"] == pytest.approx(0.68)
    assert res["apps"]["completion_avg_s"] == pytest.approx(0.68)


def test_results_schema_matches_loadgen():
    res = simulate(cpu_spec(), wl((0.0, 100, 3), (0.0, 3000, 2)))
    ref = build_results([RequestRecord("x", 0.0, first_token_s=0.1, finish_s=0.2, num_output_tokens=2)], {})
    assert set(res) == set(ref)
    assert set(res["summary"]) == set(ref["summary"])
    assert set(res["by_class"]["short"]) == set(ref["summary"])
    assert set(res["requests"][0]) == set(ref["requests"][0])
    assert res["meta"]["source"] == "sim"


def test_virtual_clock_scheduler_matches_hand_calculation():
    """The engine's Scheduler alone on a VirtualClock, stepped with predicted times."""
    clock = VirtualClock()
    pred = LinearBatchPredictor(**PRED)
    sched = Scheduler(SchedulerConfig(256, 8, 4096), KVCacheManager(64, 16),
                      make_policy("fcfs", PolicyContext(clock=clock)), TokenBudgetPacker(128), clock)
    sched.add_request(Request("a", [1] * 300, SamplingParams(max_tokens=2, ignore_eos=True)))
    times = []
    while sched.has_unfinished():
        out = sched.schedule()
        clock.advance(pred.batch_time([(n, r.num_computed_tokens) for r, n in out.prefills],
                                      [r.num_computed_tokens for r in out.decodes]))
        sched.update(out, {r.request_id: 2 for r, _ in out.prefills} | {r.request_id: 2 for r in out.decodes})
        times.append(round(clock.now(), 6))
    # chunks of 128, 128, 44 (0.138, 0.138, 0.054), then one decode (0.01)
    assert times == [0.138, 0.276, 0.33, 0.34]


def test_cli_writes_results(tmp_path):
    from raycluster.sim.cli import main
    spec = tmp_path / "c.yaml"
    spec.write_text("gpu: a100\nmodel: llama-3-8b\npolicy: lars\nslo: {ttft_ms: 2000, tpot_ms: 100, ttft_scale: 5}\n"
                    "pools:\n  - {role: mixed, instances: 1, tp: 8, spp: 2, kvp: 1}\n")
    out = tmp_path / "r.json"
    assert main(["--cluster", str(spec), "--workload", "chat", "--qps", "2", "--num-requests", "20",
                 "--seed", "1", "--out", str(out), "--quiet"]) == 0
    res = json.loads(out.read_text())
    assert res["summary"]["completed"] == 20 and res["meta"]["spec"]["pools"][0]["spp"] == 2


def test_bad_spec_names_the_field():
    with pytest.raises(ValueError, match="pools"):
        SimSpec(gpu="a100", pools=[{"role": "decode", "instances": 1}])
    with pytest.raises(ValueError, match="model"):
        SimSpec(gpu="a100", model="gpt-9")
    SimSpec(gpu="cpu", pools=[{"role": "mixed", "tp": 2, "spp": 2}])       # SPP x TP the CPU engine runs
    SimSpec(gpu="cpu", pools=[{"role": "mixed", "tp": 2, "kvp": 2}])       # and KVP x TP
    SimSpec(gpu="cpu", pools=[{"role": "mixed", "kvp": 2, "spp": 2}])      # and KVP x SPP
    SimSpec(gpu="cpu", pools=[{"role": "mixed", "kvp": 2, "spp": 2, "tp": 2}])   # and all three
    with pytest.raises(ValueError, match="spec_decode: the decode pool drafts .speculative_method 'ngram'."):
        SimSpec(gpu="a100", pools=[{"role": "prefill-short", "instances": 1},
                                   {"role": "decode", "instances": 1, "engine": {"speculative_method": "ngram"}}])
    with pytest.raises(ValueError, match="engine.lora_modules .mixed pool.: the simulator does not model LoRA"):
        SimSpec(gpu="a100", engine={"lora_modules": ["a=/x"]}, pools=[{"role": "mixed", "instances": 1}])


def test_a_moe_model_needs_the_gpus_its_every_expert_fills():
    """Mixtral 8x7B's 93 GB of bf16 weights (every expert stays resident) do not fit one 80 GB
    H100; over tp 2 the rest of the memory holds its KV (4 KB per token per layer)."""
    from raycluster.sim.cluster import kv_tokens

    spec = SimSpec(gpu="h100", model="mixtral-8x7b", pools=[{"role": "mixed", "tp": 2}])
    got = kv_tokens(spec, spec.pools[0], spec.engine_config(spec.pools[0]))
    free = 2 * 80e9 * spec.gpu_memory_utilization - 46.70e9 * 2
    assert got == pytest.approx(free / (2 * 2 * 32 * 8 * 128), rel=1e-3)
    spec = SimSpec(gpu="h100", model="mixtral-8x7b", pools=[{"role": "mixed", "tp": 1}])
    with pytest.raises(ValueError, match="mixtral-8x7b does not fit in 1 x H100"):
        kv_tokens(spec, spec.pools[0], spec.engine_config(spec.pools[0]))


def test_cpu_kvp_pool_holds_every_ranks_kv():
    from raycluster.sim.cluster import kv_tokens

    spec = SimSpec(gpu="cpu", engine={"kv_cache_tokens": 4096}, pools=[{"role": "mixed", "kvp": 3}])
    assert kv_tokens(spec, spec.pools[0], spec.engine_config(spec.pools[0])) == 3 * 4096
    # A TP rank holds its heads of every token: the instance holds kv_cache_tokens in all.
    spec = SimSpec(gpu="cpu", engine={"kv_cache_tokens": 4096}, pools=[{"role": "mixed", "tp": 2}])
    assert kv_tokens(spec, spec.pools[0], spec.engine_config(spec.pools[0])) == 4096
    # SPP x TP: each rank holds its layers and heads of every token, so again kv_cache_tokens in all.
    spec = SimSpec(gpu="cpu", engine={"kv_cache_tokens": 4096}, pools=[{"role": "mixed", "tp": 2, "spp": 2}])
    assert kv_tokens(spec, spec.pools[0], spec.engine_config(spec.pools[0])) == 4096
    # KVP x TP: each KVP rank (a TP group) holds kv_cache_tokens of its tokens, as the engine's
    # striped pool does (kvp x kv_cache_tokens in all: tests/unit/test_kvp_tp.py).
    spec = SimSpec(gpu="cpu", engine={"kv_cache_tokens": 4096}, pools=[{"role": "mixed", "tp": 2, "kvp": 2}])
    assert kv_tokens(spec, spec.pools[0], spec.engine_config(spec.pools[0])) == 2 * 4096


@pytest.mark.parametrize("pools", [
    [{"role": "mixed", "instances": 1}],
    [{"role": "prefill-short", "instances": 1}, {"role": "decode", "instances": 1}],
])
def test_decode_runs_match_step_by_step(pools):
    """Coalesced decode runs give the same per-request times as stepping one by one (exact with
    a linear predictor and one instance per pool; with several, the router ranks instances on
    KV figures it sees once per run, which can change a placement), with far fewer events."""
    pred = {"overhead_s": 0.01, "per_prefill_token_s": 0.001, "per_decode_s": 0.0005, "per_decode_kv_s": 1e-6}
    w = make_workload("chat", seed=5, qps=8, num_requests=80, max_output_tokens=200)
    a = simulate(cpu_spec(pools=pools, predictor=pred, coalesce_decode=True), w, check=True)
    b = simulate(cpu_spec(pools=pools, predictor=pred, coalesce_decode=False), w, check=True)
    for ra, rb in zip(a["requests"], b["requests"]):
        assert ra["request_id"] == rb["request_id"]
        for k in ("first_token_s", "finish_s"):
            assert ra[k] == pytest.approx(rb[k], abs=1e-9), (ra["request_id"], k)
    assert a["meta"]["sim"]["steps"] == b["meta"]["sim"]["steps"]
    assert a["meta"]["sim"]["events"] < b["meta"]["sim"]["events"]


def test_pressure_controller_moves_an_instance_to_the_loaded_pool():
    pools = [{"role": "prefill-short", "instances": 2}, {"role": "prefill-long", "instances": 2},
             {"role": "decode", "instances": 1}]
    spec = cpu_spec(pools=pools, kv_cache_tokens=65536,
                    controller={"enabled": True, "period_s": 0.5, "cooldown_s": 1.0})
    w = make_workload("chat", seed=1, qps=40, num_requests=200, max_output_tokens=8)
    res = simulate(spec, w, check=True)
    moves = res["meta"]["sim"]["moves"]
    assert moves and moves[0]["to"] == "prefill-short"
    assert res["summary"]["completed"] == 200


def test_decode_balancing_lends_a_prefill_instance_to_a_starved_decode_pool():
    """One decode instance behind three prefill ones, long outputs: with `decode` balancing the
    controller moves a prefill instance to the decode pool (it decodes the KV it parked in place)
    and TPOT attainment rises on the same trace."""
    pools = [{"role": "prefill-short", "instances": 1}, {"role": "prefill-long", "instances": 2},
             {"role": "decode", "instances": 1}]
    w = make_workload("chat", seed=1, qps=20, num_requests=200, max_output_tokens=256)
    runs = {}
    for decode in (False, True):
        spec = cpu_spec(pools=pools, kv_cache_tokens=8192, router={"max_local_waiting": 4},
                        controller={"enabled": True, "period_s": 0.5, "cooldown_s": 1.0, "decode": decode})
        runs[decode] = simulate(spec, w, check=True)
        assert runs[decode]["summary"]["completed"] == 200
    to = [m["to"] for m in runs[True]["meta"]["sim"]["moves"]]
    assert "decode" in to and "decode" not in [m["to"] for m in runs[False]["meta"]["sim"]["moves"]]
    assert runs[True]["summary"]["tpot_slo_attainment"] > runs[False]["summary"]["tpot_slo_attainment"] + 0.2
