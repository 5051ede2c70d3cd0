"""Reading results files and printing them side by side.

Owns `load_results` (a results JSON from `loadgen run` or the simulator, or a sweep file from
`loadgen sweep`: {"meta": {"kind": "sweep", ...}, "runs": [results, ...]}) and `render_table`.
Data enters as file paths; it leaves as a list of (label, results) columns and a text table,
one row per metric, one column per run (a sweep contributes one column per QPS).
The table prints the numbers stored in the files (computed by metrics.build_results); it does
not recompute them.
"""

from __future__ import annotations

import json
from pathlib import Path

ROWS = [
    ("completed", "d"), ("failed", "d"), ("throughput_rps", ".3f"), ("goodput_rps", ".3f"),
    ("output_tok_s", ".1f"), ("slo_attainment", ".3f"), ("ttft_slo_attainment", ".3f"),
    ("tpot_slo_attainment", ".3f"), ("ttft_p50_s", ".3f"), ("ttft_p90_s", ".3f"),
    ("ttft_p99_s", ".3f"), ("tpot_p50_s", ".4f"), ("tpot_p99_s", ".4f"), ("tbt_p50_s", ".4f"),
    ("tbt_p99_s", ".4f"), ("e2e_p50_s", ".3f"), ("e2e_p99_s", ".3f"),
]
CLASS_ROWS = ["completed", "slo_attainment", "ttft_p50_s", "ttft_p99_s", "tpot_p99_s"]
APP_ROWS = [("count", "d"), ("completed", "d"), ("completion_avg_s", ".3f"), ("completion_p90_s", ".3f")]


def load_results(path: str | Path) -> list[tuple[str, dict]]:
    """[(label, results)] for one file; a sweep file gives one entry per run."""
    with open(path) as f:
        data = json.load(f)
    name = Path(path).stem
    if data.get("meta", {}).get("kind") == "sweep":
        return [(f"{name}@{run['meta'].get('qps')}", run) for run in data["runs"]]
    return [(name, data)]


def is_sweep(path: str | Path) -> bool:
    with open(path) as f:
        return json.load(f).get("meta", {}).get("kind") == "sweep"


def _fmt(v, spec: str) -> str:
    if v is None:
        return "-"
    return format(v, spec) if spec != "d" else str(int(v))


def render_table(columns: list[tuple[str, dict]]) -> str:
    """Metrics as rows, runs as columns."""
    header = ["metric"] + [label for label, _ in columns]
    rows: list[list[str]] = []
    meta_keys = ["workload", "qps", "concurrency", "model", "source"]
    for k in meta_keys:
        vals = [res.get("meta", {}).get(k) for _, res in columns]
        if any(v is not None for v in vals):
            rows.append([k] + ["-" if v is None else str(v) for v in vals])
    for key, spec in ROWS:
        rows.append([key] + [_fmt(res["summary"].get(key), spec) for _, res in columns])
    classes = [c for c in ("short", "long")
               if any(res.get("by_class", {}).get(c, {}).get("num_requests") for _, res in columns)]
    spec_of = dict(ROWS)
    for c in classes:
        for key in CLASS_ROWS:
            rows.append([f"{c}.{key}"] + [_fmt(res.get("by_class", {}).get(c, {}).get(key), spec_of[key])
                                          for _, res in columns])
    if any(res.get("apps") for _, res in columns):
        for key, spec in APP_ROWS:
            rows.append([f"apps.{key}"] + [_fmt((res.get("apps") or {}).get(key), spec) for _, res in columns])
    if any(len(res.get("by_tenant", {})) > 1 for _, res in columns):
        rows.append(["tenant_fairness_jain"] + [_fmt(res.get("fairness", {}).get("jain_index"), ".3f")
                                                for _, res in columns])
    widths = [max(len(r[i]) for r in [header] + rows) for i in range(len(header))]
    line = lambda r: "  ".join(c.ljust(w) if i == 0 else c.rjust(w)  # noqa: E731
                               for i, (c, w) in enumerate(zip(r, widths)))
    sep = "  ".join("-" * w for w in widths)
    return "\n".join([line(header), sep] + [line(r) for r in rows])
