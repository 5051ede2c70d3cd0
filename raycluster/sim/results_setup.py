"""The experiments behind docs/results.md: cluster specs, workloads, and the simulation jobs.

`jobs_for(name, quick)` lists one section's jobs (plain dicts: key, spec, workload options);
`run_one(job)` runs one in the simulator and returns its summary, the entry stored in
docs/figures/data.json. Rendering lives in `results_render`, the command in `results_doc`.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np

from loadgen.workloads import Workload, WorkloadRequest, make_workload

DOCS = Path(__file__).resolve().parents[2] / "docs"

# ---------------------------------------------------------------------------------------------
# experiment setups


def medha_spec(cfg: str) -> dict:
    base = {"gpu": "a100", "model": "llama-3-8b", "slo": {"ttft_ms": 2000, "tpot_ms": 100, "ttft_scale": 5},
            "pools": [{"role": "mixed", "instances": 1, "tp": 8, "spp": 2, "kvp": 1}],
            "router": {"max_local_waiting": 100000}}
    token = {"packer": "token", "max_num_batched_tokens": 2048, "max_num_seqs": 256, "long_threshold": 8192}
    engine, policy = {
        "np-fcfs": ({**token, "chunk_size": None}, "fcfs"),
        "chunked-fcfs": ({**token, "chunk_size": 2048}, "fcfs"),
        "edf": ({**token, "chunk_size": 2048}, "edf"),
        "lars": ({**token, "chunk_size": 2048}, "lars"),
        "lars+mp": ({"packer": "medha", "max_num_batched_tokens": 65536, "max_num_seqs": 256,
                     "long_threshold": 8192}, "lars"),
    }[cfg]
    return {**base, "engine": engine, "policy": policy}


MEDHA_CFGS = ["np-fcfs", "chunked-fcfs", "edf", "lars", "lars+mp"]
MEDHA_EDF_CFGS = ["chunked-fcfs", "edf", "lars"]
MEDHA_EDF_DURATION_S = 1800
MEDHA_LABEL = {"np-fcfs": "FCFS non-preemptive", "chunked-fcfs": "FCFS chunked (2048)", "edf": "EDF chunked",
               "lars": "LARS chunked", "lars+mp": "LARS + multi-prefill (Medha packer)"}


# Kairos: the seed's trace has a pronounced long tail whose longest prefills approach the 8 s
# TTFT SLO (128K tokens ~ 8.8 s there). Here the long class is 8K-40K tokens: 0.85-6.5 s of
# isolated prefill on one A100 (roofline), so every request can meet its SLO alone while one or
# two long prompts ahead of a short one can break it under FCFS (head-of-line blocking).
KAIROS_LONG_TOKENS = (8192, 40960)
# Prefill (TTFT) sweep: every QPS point over several seeds and a 600 s arrival window (~3000-6000
# requests per run), so a verdict on "100% attainment" does not rest on a handful of requests of
# one 120 s trace. The decode comparison (slack-guided vs continuous) keeps one seed and 120 s:
# the slack-guided selector costs 10-20x the wall time of a continuous-batching run. The prefill
# sweep stops at QPS 10: over 600 s, 12 is deep overload for every order (attainment 0.03-0.26)
# and the slowest point to simulate.
KAIROS_DURATION_S = 600
KAIROS_SEEDS = (2, 3, 4)
KAIROS_QPS = [2, 3, 4, 5, 6, 6.5, 7, 8, 9, 10]
KAIROS_DECODE_SEED = 2
KAIROS_DECODE_DURATION_S = 120
KAIROS_DECODE_QPS = [2, 4, 6, 7, 8, 9, 10, 12]
# key -> (prefill policy, decode selector, chunk_size). The seed's scheduler runs on each prefill
# instance (router hands requests out at once: max_local_waiting); Alg. 1 fills one fixed chunk
# budget C per step in urgency order (chunk_size = budget = C). Its baseline (DistServe) runs FCFS
# over whole prompts; "fcfs" (same chunking as urgency) isolates the ordering.
KAIROS_CFGS = {"fcfs-whole/all": ("fcfs", "all", None), "fcfs/all": ("fcfs", "all", 8192),
               "kairos/all": ("kairos", "all", 8192), "kairos/kairos": ("kairos", "kairos", 8192)}
KAIROS_PREFILL_CFGS = ["fcfs-whole/all", "fcfs/all", "kairos/all"]      # the TTFT sweep
KAIROS_DECODE_CFGS = ["kairos/all", "kairos/kairos"]                   # the TPOT comparison


def kairos_spec(policy: str, selector: str, chunk: int | None = 8192) -> dict:
    return {"gpu": "a100", "model": "llama-3-8b", "policy": policy,
            "slo": {"ttft_ms": 8000, "tpot_ms": 50, "ttft_scale": 5},
            "engine": {"packer": "token", "chunk_size": chunk, "max_num_batched_tokens": 8192, "max_num_seqs": 256},
            "router": {"max_local_waiting": 100000},
            "pools": [{"role": "prefill-short", "instances": 4},
                      {"role": "decode", "instances": 4, "engine": {"decode_selector": selector}}]}


def justitia_workload(mice_s: float, mice_qps: float, seed: int) -> Workload:
    rng = np.random.default_rng(seed)
    # The elephant: a chain of 4 calls (each sent when the previous one finished).
    # Every application is its own tenant: VTC (fair sharing between tenants) is the seed's
    # application-level fair-sharing baseline; with one shared tenant it would be plain FCFS.
    reqs = [WorkloadRequest(f"E{i}", 0.0, 6000, 1500, tenant="elephant", app_id="elephant", app_type="elephant",
                            depends_on=(f"E{i - 1}",) if i else ()) for i in range(4)]
    t, i = 0.5, 0
    while t < 0.5 + mice_s:
        reqs.append(WorkloadRequest(f"m{i}", float(t), int(rng.integers(100, 400)), int(rng.integers(50, 200)),
                                    tenant=f"mouse{i}", app_id=f"mouse{i}", app_type="mouse"))
        i += 1
        t += float(rng.exponential(1.0 / mice_qps))
    return Workload("elephant+mice", {"seed": seed, "mice_s": mice_s, "mice_qps": mice_qps}, reqs)


# Justitia micro-benchmark: the elephant's calls and a mice stream at about what the instance
# serves (SRJF starves the elephant for as long as the stream lasts).
JUSTITIA_MICE_QPS = 12.0
# justitia: M measured (the policy's default); justitia-kv: M = the seed's KV capacity per iteration.
JUSTITIA_POLS = ["srjf", "justitia", "justitia-kv", "vtc", "fcfs"]
# Mixed application workload (loadgen `apps`: Justitia's 72/26/2% small/medium/large mix), in
# applications per second on the same instance.
JUSTITIA_APPS_QPS = [1.0, 1.5, 1.75, 2.0]
JUSTITIA_APPS_DURATION_S = 300


def justitia_spec(policy: str) -> dict:
    return {"gpu": "a100", "model": "llama-3-8b", "policy": policy,
            "engine": {"packer": "token", "chunk_size": 2048, "max_num_batched_tokens": 2048, "max_num_seqs": 16},
            "pools": [{"role": "mixed", "instances": 1, "tp": 1}]}


def pla_spec(kind: str) -> dict:
    pools = {"single": [{"role": "prefill-short", "instances": 4}],
             "split": [{"role": "prefill-short", "instances": 2}, {"role": "prefill-long", "instances": 2}],
             "static8": [{"role": "prefill-short", "instances": 4}, {"role": "prefill-long", "instances": 4}],
             "ctrl8": [{"role": "prefill-short", "instances": 4}, {"role": "prefill-long", "instances": 4}]}[kind]
    dec = 4 if kind in ("single", "split") else 6
    return {"gpu": "a100", "model": "llama-3-8b", "policy": "fcfs",
            "slo": {"ttft_ms": 2000, "tpot_ms": 100, "ttft_scale": 5},
            "engine": {"packer": "token", "chunk_size": 2048, "max_num_batched_tokens": 4096, "max_num_seqs": 256},
            "router": {"initial_l_m": 4096},
            "controller": {"enabled": kind == "ctrl8", "period_s": 2.0, "cooldown_s": 10.0},
            "pools": pools + [{"role": "decode", "instances": dec}]}


def speed_spec() -> dict:
    # 128 H100s: 16 instances of Llama-3-70B at TP8, mixed pools, Medha packer, LARS.
    return {"gpu": "h100", "model": "llama-3-70b", "policy": "lars",
            "engine": {"packer": "medha", "max_num_batched_tokens": 8192, "max_num_seqs": 256},
            "pools": [{"role": "mixed", "instances": 16, "tp": 8}]}


# ---------------------------------------------------------------------------------------------
# one run (in a worker process)


def simulate_kv_capacity_justitia(spec, wl) -> dict:
    """`simulate`, with every Justitia policy given the seed's M (the KV cache it serves from:
    an instance's own cache, the router the sum over instances) instead of measuring it. The
    spec has no field for policy options, so the policies are configured after the cluster is
    built (same objects, same run otherwise)."""
    import time as _time

    from loadgen.metrics import build_results
    from raycluster.sched.policies.justitia import JustitiaPolicy
    from raycluster.sim.cluster import SimCluster

    t0 = _time.perf_counter()
    cluster = SimCluster(spec, wl)
    total = 0
    for inst in cluster.instances.values():
        cap = inst.kv.num_blocks * inst.kv.block_size
        total += cap
        if isinstance(inst.scheduler.policy, JustitiaPolicy):
            inst.scheduler.policy.set_kv_capacity(cap)
    for pol in cluster.router.policies.values():
        if isinstance(pol, JustitiaPolicy):
            pol.set_kv_capacity(total)
    cluster.run(None)
    wall = _time.perf_counter() - t0
    sim = {"events": cluster.loop.processed, "wall_s": wall, "virtual_end_s": cluster.loop.clock.now(),
           "steps": sum(i.steps for i in cluster.instances.values()), "kv_capacity_tokens": total}
    return build_results(list(cluster.records.values()), {"source": "sim", "sim": sim})


def ttft_misses(requests: list[dict]) -> dict:
    """Per request class: how many missed the TTFT SLO, their prompt lengths and TTFTs (the
    requests records of `build_results`; warm-up requests excluded as in the summary)."""
    out = {}
    for r in requests:
        if r.get("warmup"):
            continue
        c = out.setdefault(r["klass"], {"n": 0, "misses": 0, "prompt": [], "ttft": []})
        c["n"] += 1
        if not r["ttft_ok"]:
            c["misses"] += 1
            c["prompt"].append(r["prompt_tokens"])
            if r["ttft_s"] is not None:
                c["ttft"].append(r["ttft_s"])
    for c in out.values():
        p, t = c.pop("prompt"), c.pop("ttft")
        c.update(prompt_min=min(p, default=None), prompt_max=max(p, default=None),
                 ttft_min_s=min(t, default=None), ttft_max_s=max(t, default=None),
                 ttft_p50_s=float(np.median(t)) if t else None)
    return out


def run_one(job: dict) -> dict:
    from raycluster.sim.run import simulate
    from raycluster.sim.spec import SimSpec

    spec = SimSpec(**job["spec"])
    if job.get("custom") == "speed-window":
        from raycluster.sim.speed import measure
        warm, until = job["window"]
        runs = [measure(spec, path, "chat", job["key"][2], 6, warm, until) for path in ("fast", "exact")]
        return {"key": job["key"], "runs": runs, "sim": {"wall_s": sum(r["wall_s"] for r in runs)}}
    if job.get("custom") == "justitia":
        wl = justitia_workload(**job["wl"])
    else:
        wl = make_workload(**job["wl"])
    if job.get("tenant_per_app"):
        # VTC shares between tenants: one tenant per application makes it application-level fair
        # sharing, the seed's VTC baseline.
        wl = Workload(wl.name, wl.params, [dataclasses.replace(r, tenant=r.app_id or r.request_id) for r in wl])
    if job.get("justitia_m") == "kv":
        res = simulate_kv_capacity_justitia(spec, wl)
    else:
        res = simulate(spec, wl, horizon_s=job.get("horizon"))
    out = {"key": job["key"], "summary": res["summary"], "by_class": res["by_class"], "apps": res["apps"],
           "sim": res["meta"]["sim"], "num_requests": len(wl)}
    if job.get("custom") == "justitia":
        el = [r for r in res["requests"] if r["app_id"] == "elephant"]
        out["elephant_completion_s"] = (max(r["finish_s"] for r in el) - min(r["arrival_s"] for r in el)
                                        if all(r["status"] == "ok" for r in el) else None)
        mice = [r["e2e_s"] for r in res["requests"] if r["app_type"] == "mouse" and r["e2e_s"] is not None]
        out["mice_completion_avg_s"] = float(np.mean(mice)) if mice else None
    if job.get("ttft_misses"):
        out["ttft_misses"] = ttft_misses(res["requests"])
    return out


def jobs_for(name: str, quick: bool) -> list[dict]:
    jobs = []
    if name == "prefix":
        from raycluster.sim.results_prefix import prefix_jobs      # it imports this module
        return prefix_jobs(quick)
    if name == "spec-decode":
        from raycluster.sim.results_spec import spec_jobs          # it imports this module
        return spec_jobs(quick)
    if name == "medha":
        qps = [0.25, 0.75, 1.25, 1.75] if quick else [0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 1.75]
        dur = 200 if quick else 400
        for q in qps:
            for c in MEDHA_CFGS:
                jobs.append({"key": ["medha", c, q], "spec": medha_spec(c),
                             "wl": dict(name="long-mix", seed=1, qps=q, duration=dur, long_fraction=0.05,
                                        long_tokens=(128 * 1024, 1024 * 1024), ttft_slo_ms=2000, tpot_slo_ms=100)})
    elif name == "medha-edf":
        # Same replica and workload as "medha", over a 30-minute arrival window: long prompts'
        # deadlines (1 ms/token: 128-1000 s) pass while shorts still arrive (the seed profiles
        # for up to 60 minutes); the 400 s window of "medha" ends before any can.
        for q in ([0.25, 1.75] if quick else [0.25, 0.75, 1.25, 1.75]):
            for c in MEDHA_EDF_CFGS:
                jobs.append({"key": ["medha-edf", c, q], "spec": medha_spec(c),
                             "wl": dict(name="long-mix", seed=1, qps=q, duration=600 if quick else MEDHA_EDF_DURATION_S,
                                        long_fraction=0.05, long_tokens=(128 * 1024, 1024 * 1024), ttft_slo_ms=2000,
                                        tpot_slo_ms=100)})
    elif name == "kairos":
        # key: ["kairos", config, qps, seed, part]: part "prefill" is the TTFT sweep over seeds,
        # "decode" the one-seed TPOT comparison ("kairos/all" runs in both, on different windows).
        # The decode runs (the slowest) first, so the two workers finish together.
        runs = [(c, q, KAIROS_DECODE_SEED, 30 if quick else KAIROS_DECODE_DURATION_S, "decode")
                for q in ([4, 10] if quick else KAIROS_DECODE_QPS) for c in KAIROS_DECODE_CFGS]
        runs += [(c, q, s, 30 if quick else KAIROS_DURATION_S, "prefill") for q in ([4, 8, 10] if quick else KAIROS_QPS)
                 for s in (KAIROS_SEEDS[:2] if quick else KAIROS_SEEDS) for c in KAIROS_PREFILL_CFGS]
        for key, q, seed, dur, part in runs:
            pol, sel, chunk = KAIROS_CFGS[key]
            jobs.append({"key": ["kairos", key, q, seed, part], "spec": kairos_spec(pol, sel, chunk), "ttft_misses": True,
                         "wl": dict(name="long-mix", seed=seed, qps=q, duration=dur, long_fraction=0.1,
                                    long_tokens=KAIROS_LONG_TOKENS, ttft_slo_ms=8000, tpot_slo_ms=50,
                                    long_ttft_ms_per_token=0.0)})
    elif name == "justitia":
        for mice_s in ([30, 120] if quick else [30, 60, 120, 240, 480, 960]):
            for pol in JUSTITIA_POLS:
                job = {"key": ["justitia", pol, mice_s], "spec": justitia_spec(pol.split("-")[0]), "custom": "justitia",
                       "wl": dict(mice_s=mice_s, mice_qps=JUSTITIA_MICE_QPS, seed=3)}
                if pol == "justitia-kv":
                    job["justitia_m"] = "kv"
                jobs.append(job)
    elif name == "justitia-apps":
        for q in ([1.5, 2.0] if quick else JUSTITIA_APPS_QPS):
            for pol in JUSTITIA_POLS:
                job = {"key": ["justitia-apps", pol, q], "spec": justitia_spec(pol.split("-")[0]), "tenant_per_app": True,
                       "wl": dict(name="apps", seed=3, qps=q, duration=60 if quick else JUSTITIA_APPS_DURATION_S)}
                if pol == "justitia-kv":
                    job["justitia_m"] = "kv"
                jobs.append(job)
    elif name == "pla":
        for q in ([4, 10] if quick else [2, 4, 6, 8, 10, 12]):
            for kind in ("single", "split"):
                jobs.append({"key": ["pla", kind, q], "spec": pla_spec(kind),
                             "wl": dict(name="long-mix", seed=4, qps=q, duration=60 if quick else 120,
                                        long_fraction=0.2, long_tokens=(4096, 32768), ttft_slo_ms=2000,
                                        tpot_slo_ms=100, long_ttft_ms_per_token=0.5)})
        for q in ([20, 40] if quick else [16, 24, 32, 40, 48]):
            for kind in ("static8", "ctrl8"):
                jobs.append({"key": ["pla", kind, q], "spec": pla_spec(kind),
                             "wl": dict(name="long-mix", seed=5, qps=q, duration=60 if quick else 120,
                                        long_fraction=0.05, long_tokens=(4096, 32768), ttft_slo_ms=2000,
                                        tpot_slo_ms=100, long_ttft_ms_per_token=0.5)})
    elif name == "speed":
        # Saturation: ~1000 chat requests/s is near what 16 x (70B, TP8, H100) serve by the roofline
        # (256-sequence decode batches of ~10 ms, ~340 output tokens per request).
        q = 1000.0
        jobs.append({"key": ["speed", "128xh100", q], "spec": speed_spec(),
                     "wl": dict(name="chat", seed=6, qps=q, duration=2 if quick else 5)})
        # Steady state at ~saturation, start-up and drain excluded (raycluster.sim.speed): the
        # per-simulated-hour figure to quote. One job runs both decode paths, alternating.
        jobs.append({"key": ["speed", "window", 700.0], "custom": "speed-window", "spec": speed_spec(),
                     "window": (5.0, 10.0) if quick else (10.0, 20.0)})
    return jobs


EXPERIMENTS = ["medha", "medha-edf", "kairos", "justitia", "justitia-apps", "pla", "prefix", "spec-decode", "speed",
               "sim-to-real"]
