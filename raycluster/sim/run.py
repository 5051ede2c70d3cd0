"""Workload -> simulated cluster -> per-request records -> the loadgen results JSON.

`simulate(spec, workload)` returns the same dict `loadgen run` writes (loadgen.metrics.
build_results), with meta.source = "sim" and the simulator's own counters under meta.sim
(events, events_per_s, wall_s, virtual end time, steps, preemptions, KV transfers, moves).
"""

from __future__ import annotations

import time

from loadgen.images import ImageLoad
from loadgen.metrics import build_results
from loadgen.workloads import Workload
from raycluster.sim.cluster import SimCluster
from raycluster.sim.spec import SimSpec


def with_decode_path(spec: SimSpec, decode_path: str) -> SimSpec:
    """The spec as the CLIs' `--decode-path` runs it: exact turns decode runs off (fast is
    `simulate(..., fast_decode=True)`; default leaves the spec's coalesce_decode)."""
    return spec.model_copy(update={"coalesce_decode": False}) if decode_path == "exact" else spec


def simulate(spec: SimSpec, workload: Workload, *, horizon_s: float | None = None, seed: int | None = None,
             warmup_s: float = 0.0, warmup_requests: int = 0, check: bool = False,
             meta: dict | None = None, fast_decode: bool = False, images: ImageLoad | None = None) -> dict:
    """`images`: pictures in every request (the load generator's --images; needs spec.vision)."""
    t0 = time.perf_counter()
    cluster = SimCluster(spec, workload, fast_decode=fast_decode, images=images)
    cluster.run(horizon_s)
    wall = time.perf_counter() - t0
    if check and cluster.done >= len(cluster.records):
        cluster.check_conservation()
    ev = cluster.loop.processed
    sim = {"events": ev, "wall_s": wall, "events_per_s": ev / wall if wall > 0 else None,
           "virtual_end_s": cluster.loop.clock.now(), "num_gpus": spec.num_gpus,
           "sim_s_per_wall_s": cluster.loop.clock.now() / wall if wall > 0 else None,
           "steps": sum(i.steps for i in cluster.instances.values()),
           "preemptions": sum(i.scheduler.preempted_total for i in cluster.instances.values()),
           "kv_transfers": cluster.transfers_done, "kv_transfer_bytes": cluster.transfer_bytes,
           "output_tokens": cluster.tokens_out, "moves": cluster.moves,
           "tie_break": "time, then scheduling order (FIFO)",
           "decode_path": "fast" if cluster.fast_decode else ("runs" if cluster.coalesce else "stepwise"),
           # instances that draft (speculative decoding) step one event per step whatever the path
           "drafting_instances": sum(i.drafter is not None for i in cluster.instances.values()),
           "group_steps": sum(getattr(i.scheduler, "group_steps", 0) for i in cluster.instances.values()),
           "group_dissolved": sum(getattr(i.scheduler, "dissolved", 0) for i in cluster.instances.values()),
           "prefix_query_tokens": sum(getattr(i.kv, "query_tokens", 0) for i in cluster.instances.values()),
           "prefix_hit_tokens": sum(getattr(i.kv, "hit_tokens", 0) for i in cluster.instances.values())}
    if cluster.images is not None:
        encoders = [i.images for i in cluster.instances.values()]
        sim["images"] = {"per_request": cluster.images.per_request, "distinct": cluster.images.distinct,
                         "vision": spec.vision, "encoded": sum(e.encoder.encoded for e in encoders),
                         "encoder_cache_hits": sum(e.cache.hits for e in encoders if e.cache is not None)}
    m = {"source": "sim", "workload": workload.name, "workload_params": workload.params,
         "qps": workload.params.get("qps"), "seed": seed if seed is not None else workload.params.get("seed"),
         "policy": spec.policy, "spec": spec.model_dump(), "sim": sim, **(meta or {})}
    res = build_results(list(cluster.records.values()), m, warmup_s=warmup_s, warmup_requests=warmup_requests)
    res["_cluster"] = cluster if check else None
    if not check:
        res.pop("_cluster")
    return res
