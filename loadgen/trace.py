"""JSONL traces: write a Workload to a file and load one back (identically).

Owns the trace file format: one JSON object per line, the fields of `WorkloadRequest`
(`to_dict`). Hand-written traces need only `arrival_s` (or `timestamp`), `output_tokens` and
either `prompt` (text or a list of token ids), `segments` or `prompt_tokens` (then synthetic text
of that length is generated); missing ids are numbered, missing SLOs stay None (no SLO).
Blank lines and lines starting with '#' are skipped. Data enters as a path and leaves as a
Workload (sorted by arrival, optionally re-timed by an arrival process and cut by count/duration).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from loadgen import arrivals
from loadgen.workloads import Workload, WorkloadRequest, _cut


def write_trace(workload: Workload | list[WorkloadRequest], path: str | Path) -> None:
    with open(path, "w") as f:
        for r in workload:
            f.write(json.dumps(r.to_dict()) + "\n")


def _normalise(d: dict, i: int, rng: np.random.Generator) -> dict:
    d = dict(d)
    if "timestamp" in d and "arrival_s" not in d:
        d["arrival_s"] = float(d.pop("timestamp"))
    d.setdefault("request_id", f"t{i:06d}")
    d.setdefault("arrival_s", 0.0)
    if "output_tokens" not in d:
        raise ValueError(f"trace line {i + 1}: missing output_tokens")
    if d.get("prompt") is None and not d.get("segments"):
        if "prompt_tokens" not in d:
            raise ValueError(f"trace line {i + 1}: needs prompt, segments or prompt_tokens")
        d["segments"] = [[int(rng.integers(0, 2**31 - 1)), int(d["prompt_tokens"])]]
    return d


def load_trace(path: str | Path, *, seed: int = 0, qps: float = 0.0, arrival: str = "trace",
               cv: float = 1.0, num_requests: int | None = None,
               duration: float | None = None) -> Workload:
    """Load a JSONL trace. arrival "trace" keeps its times; another kind re-times it at `qps`
    (applications move together: a group's calls keep sharing its arrival time)."""
    rng = np.random.default_rng(seed)
    reqs = []
    with open(path) as f:
        for i, line in enumerate(x for x in f if x.strip() and not x.lstrip().startswith("#")):
            reqs.append(WorkloadRequest.from_dict(_normalise(json.loads(line), i, rng)))
    reqs.sort(key=lambda r: r.arrival_s)
    if arrival != "trace" and qps > 0:
        groups: dict[str, list[WorkloadRequest]] = {}
        for r in reqs:
            groups.setdefault(r.app_id or r.request_id, []).append(r)
        new = arrivals.retime(np.zeros(len(groups)), arrival, rng, qps, cv)
        for t, members in zip(new, groups.values()):
            for r in members:
                r.arrival_s = float(t)
        reqs.sort(key=lambda r: r.arrival_s)
    if duration is not None:
        reqs = [r for r in reqs if r.arrival_s < duration]
    reqs = _cut(reqs, num_requests)
    params = dict(name=str(path), seed=seed, qps=qps, arrival=arrival, cv=cv,
                  num_requests=num_requests, duration=duration, trace=str(path))
    return Workload(str(path), params, reqs)
