"""Capacity search over cluster configurations (Vidur-Search's question, on this simulator):
for each candidate cluster, the highest offered load (QPS) at which a workload still meets the
given SLO constraints, and which candidate serves the most QPS per GPU.

A search file (YAML, validated by `SearchSpec`; errors name the field):

    base: kairos-4p4d.yaml              # a cluster spec (path relative to this file), or
    # spec: {gpu: a100, ...}            # the spec inline
    candidates:                          # overrides merged onto the base (mappings merge, lists replace)
      - {name: pd-4p4d}
      - {name: mixed-8, pools: [{role: mixed, instances: 8}]}
    grid: {policy: [fcfs, lars]}         # optional: every candidate x every combination ("engine.chunk_size": dotted)
    slo:                                 # all must hold (summary keys of the results JSON)
      - {metric: ttft_p99_s, max: 8.0}
      - {metric: slo_attainment, min: 0.99}
      - {metric: ttft_p90_s, max: 1.0, class: short}    # a class's keys (by_class)
    qps: {min: 0.5, max: 64, rel_tol: 0.05}

Data flow: `expand` turns the file into named `SimSpec`s; `capacity` runs the simulator
(`raycluster.sim.run.simulate`) on the workload rebuilt at each probed QPS (same seed, so only the
arrival rate changes) and bisects geometrically between a QPS that meets every constraint and one
that does not, until they are within `rel_tol`; `search` does that per candidate and returns a
JSON-able dict (probes, capacity, QPS per GPU, the best candidate). Every request must also
complete (a run cut by `horizon_s` fails the probe). Bisection assumes that meeting the SLOs is
monotone in the load; each probe is kept in the output so a non-monotone case shows.
"""

from __future__ import annotations

import copy
import itertools
import math
from concurrent.futures import ProcessPoolExecutor
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import yaml
from pydantic import BaseModel, ConfigDict, Field, model_validator

from loadgen.images import ImageLoad
from loadgen.metrics import summarize
from loadgen.workloads import Workload
from raycluster.sim.spec import SimSpec

SUMMARY_KEYS = tuple(summarize([], 1.0))
# What each probe and the capacity row keep of a run's summary.
REPORTED = ("num_requests", "completed", "slo_attainment", "ttft_p50_s", "ttft_p99_s", "tpot_p50_s",
            "tpot_p90_s", "e2e_p50_s", "throughput_rps")


class Constraint(BaseModel):
    """One SLO: a summary metric of the run (or of one request class) at most `max` / at least `min`."""
    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    metric: str
    max: float | None = None
    min: float | None = None
    klass: str | None = Field(None, alias="class", description="short | long: the class's metric (by_class)")

    @model_validator(mode="after")
    def _check(self) -> "Constraint":
        if self.metric not in SUMMARY_KEYS:
            raise ValueError(f"metric: {self.metric!r} is not a results summary key; one of {', '.join(SUMMARY_KEYS)}")
        if (self.max is None) == (self.min is None):
            raise ValueError(f"{self.metric}: give exactly one of max or min")
        if self.klass not in (None, "short", "long"):
            raise ValueError(f"class: {self.klass!r}; short or long")
        return self

    def label(self) -> str:
        where = f"{self.klass}." if self.klass else ""
        return f"{where}{self.metric} {'<=' if self.max is not None else '>='} {self.max if self.max is not None else self.min}"

    def value(self, results: dict) -> float | None:
        return (results["by_class"][self.klass] if self.klass else results["summary"]).get(self.metric)

    def holds(self, results: dict) -> bool:
        v = self.value(results)
        if v is None:                       # no request measured it: nothing shows the SLO is met
            return False
        return v <= self.max if self.max is not None else v >= self.min


class QPSRange(BaseModel):
    model_config = ConfigDict(extra="forbid")
    min: float = Field(0.25, gt=0)
    max: float = Field(64.0, gt=0)
    rel_tol: float = Field(0.05, gt=0, le=1, description="stop once the bracket's ends are within this ratio")
    max_probes: int = Field(16, ge=2, description="simulations per candidate at most")

    @model_validator(mode="after")
    def _check(self) -> "QPSRange":
        if self.max <= self.min:
            raise ValueError(f"qps.max ({self.max}) must exceed qps.min ({self.min})")
        return self


class Candidate(BaseModel):
    model_config = ConfigDict(extra="allow")
    name: str = Field(..., min_length=1)

    def overrides(self) -> dict:
        return dict(self.model_extra or {})


class SearchSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")
    base: str | None = Field(None, description="cluster spec YAML, relative to the search file")
    spec: dict | None = Field(None, description="the cluster spec inline (instead of base)")
    candidates: list[Candidate] = Field(default_factory=lambda: [Candidate(name="base")], min_length=1)
    grid: dict[str, list] = Field(default_factory=dict)
    slo: list[Constraint] = Field(..., min_length=1)
    qps: QPSRange = Field(default_factory=QPSRange)

    @model_validator(mode="after")
    def _check(self) -> "SearchSpec":
        if (self.base is None) == (self.spec is None):
            raise ValueError("base: give a cluster spec file (base) or an inline spec, not both or neither")
        names = [c.name for c in self.candidates]
        if len(set(names)) != len(names):
            raise ValueError(f"candidates: names must be unique, got {names}")
        for key, values in self.grid.items():
            if not values:
                raise ValueError(f"grid.{key}: give at least one value")
        return self


def load_search(path: str | Path) -> tuple[SearchSpec, dict]:
    """The search file and its base cluster spec (as a mapping)."""
    path = Path(path)
    data = yaml.safe_load(path.read_text()) or {}
    if not isinstance(data, dict):
        raise ValueError(f"{path}: a search file is a YAML mapping")
    search = SearchSpec(**data)
    if search.spec is not None:
        return search, copy.deepcopy(search.spec)
    base = yaml.safe_load((path.parent / search.base).read_text()) or {}
    if not isinstance(base, dict):
        raise ValueError(f"base: {search.base} is not a YAML mapping")
    return search, base


def merged(base: dict, overrides: dict) -> dict:
    """`base` with `overrides` on top: mappings merge key by key, anything else replaces."""
    out = copy.deepcopy(base)
    for k, v in overrides.items():
        out[k] = merged(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else copy.deepcopy(v)
    return out


def _dotted(key: str, value) -> dict:
    for part in reversed(key.split(".")):
        value = {part: value}
    return value


def expand(search: SearchSpec, base: dict) -> list[tuple[str, SimSpec]]:
    """Every candidate under every grid combination, as (name, validated spec)."""
    keys = list(search.grid)
    combos = list(itertools.product(*(search.grid[k] for k in keys))) or [()]
    out = []
    for cand in search.candidates:
        for combo in combos:
            doc = merged(base, cand.overrides())
            for k, v in zip(keys, combo):
                doc = merged(doc, _dotted(k, v))
            name = cand.name + ("" if not keys else "/" + ",".join(f"{k}={v}" for k, v in zip(keys, combo)))
            try:
                out.append((name, SimSpec(**doc)))
            except ValueError as e:
                raise ValueError(f"candidate {name!r}: {e}") from e
    return out


@dataclass
class Probe:
    qps: float
    ok: bool
    failed: list[str]               # the constraints the run missed ("completed" when requests did not finish)
    summary: dict


@dataclass
class Capacity:
    name: str
    num_gpus: int
    capacity_qps: float             # the highest probed QPS that met every constraint (0: none did)
    status: str                     # ok | below_min (min failed) | at_max (max met: capacity is at least this)
    bracket: tuple[float, float]    # (met, missed); (max, max) at_max, (0, min) below_min
    probes: list[Probe] = field(default_factory=list)

    @property
    def qps_per_gpu(self) -> float:
        return self.capacity_qps / self.num_gpus if self.num_gpus else 0.0

    def to_dict(self) -> dict:
        d = asdict(self)
        d["qps_per_gpu"] = self.qps_per_gpu
        met = [p for p in self.probes if p.ok and p.qps == self.capacity_qps]
        d["at_capacity"] = met[0].summary if met else None
        return d


def check(results: dict, constraints: list[Constraint]) -> list[str]:
    """The labels of the constraints `results` misses (empty: every one holds)."""
    s = results["summary"]
    missed = [] if s["completed"] == s["num_requests"] else [f"completed ({s['completed']}/{s['num_requests']})"]
    return missed + [c.label() for c in constraints if not c.holds(results)]


def capacity(name: str, spec: SimSpec, run: Callable[[SimSpec, float], dict], constraints: list[Constraint],
             qps: QPSRange) -> Capacity:
    """Bisect (geometrically) for the highest QPS in [qps.min, qps.max] meeting `constraints`;
    `run(spec, q)` simulates the workload offered at q and returns the results dict."""
    probes: list[Probe] = []

    def meets(q: float) -> bool:
        res = run(spec, q)
        missed = check(res, constraints)
        probes.append(Probe(q, not missed, missed, {k: res["summary"].get(k) for k in REPORTED}))
        return not missed

    if not meets(qps.min):
        return Capacity(name, spec.num_gpus, 0.0, "below_min", (0.0, qps.min), probes)
    if meets(qps.max):
        return Capacity(name, spec.num_gpus, qps.max, "at_max", (qps.max, qps.max), probes)
    lo, hi = qps.min, qps.max
    while hi / lo > 1 + qps.rel_tol and len(probes) < qps.max_probes:
        mid = math.sqrt(lo * hi)
        if meets(mid):
            lo = mid
        else:
            hi = mid
    return Capacity(name, spec.num_gpus, lo, "ok", (lo, hi), probes)


@dataclass
class _Simulate:
    """`run` for `capacity`: the workload at q QPS through the simulator (a picklable callable,
    so candidates can run in worker processes)."""
    workload_at: Callable[[float], Workload]
    horizon_s: float | None
    decode_path: str
    images: ImageLoad | None = None

    def __call__(self, spec: SimSpec, q: float) -> dict:
        from raycluster.sim.run import simulate, with_decode_path

        return simulate(with_decode_path(spec, self.decode_path), self.workload_at(q), horizon_s=self.horizon_s,
                        fast_decode=self.decode_path == "fast", images=self.images)


def search(search_spec: SearchSpec, base: dict, workload_at: Callable[[float], Workload], *,
           horizon_s: float | None = None, decode_path: str = "default", jobs: int = 1,
           progress: Callable[[str], None] | None = None, images: ImageLoad | None = None) -> dict:
    """Capacity of every candidate, and the best by QPS per GPU (ties: fewer GPUs, then name).
    `workload_at(q)`: the workload offered at q QPS (picklable when jobs > 1); `horizon_s`,
    `decode_path`: as `raycluster sim`; `jobs`: candidates searched at once, in worker processes
    (each search is sequential; the results do not depend on jobs); `images`: pictures in every
    request (every candidate's spec then needs a vision tower)."""
    run = _Simulate(workload_at, horizon_s, decode_path, images)
    names, specs = zip(*expand(search_spec, base))
    n = len(names)
    args = (names, specs, [run] * n, [search_spec.slo] * n, [search_spec.qps] * n)
    rows = []
    with ProcessPoolExecutor(max_workers=jobs) if jobs > 1 else nullcontext() as pool:
        for cap in (pool.map if pool else map)(capacity, *args):
            if progress:
                progress(f"{cap.name}: {cap.capacity_qps:.3g} QPS on {cap.num_gpus} GPU(s) ({cap.status}, "
                         f"{len(cap.probes)} runs)")
            rows.append(cap)
    served = [c for c in rows if c.capacity_qps > 0]
    best = min(served, key=lambda c: (-c.qps_per_gpu, c.num_gpus, c.name)).name if served else None
    return {"constraints": [c.label() for c in search_spec.slo], "qps_range": search_spec.qps.model_dump(),
            "candidates": [c.to_dict() for c in rows], "best": best}


def table(result: dict) -> str:
    """The candidates as a markdown table, best first."""
    rows = sorted(result["candidates"], key=lambda c: (-c["qps_per_gpu"], c["num_gpus"], c["name"]))
    fmt = lambda v, scale=1.0: "-" if v is None else f"{v * scale:.3g}"  # noqa: E731
    out = ["| candidate | GPUs | capacity QPS | QPS per GPU | TTFT P99 (s) | TPOT P90 (ms) | SLO attainment | runs |",
           "|---|---|---|---|---|---|---|---|"]
    for c in rows:
        at = c["at_capacity"] or {}
        cap = {"at_max": ">= ", "below_min": "< "}.get(c["status"], "")
        qps = c["bracket"][1] if c["status"] == "below_min" else c["capacity_qps"]
        out.append(f"| {c['name']} | {c['num_gpus']} | {cap}{qps:.3g} | {c['qps_per_gpu']:.3g} | "
                   f"{fmt(at.get('ttft_p99_s'))} | {fmt(at.get('tpot_p90_s'), 1000)} | {fmt(at.get('slo_attainment'))} "
                   f"| {len(c['probes'])} |")
    return "\n".join(out)
