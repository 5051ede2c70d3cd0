"""Per-request records -> the results JSON (the schema loadgen and the simulator both write).

Owns `RequestRecord` (plain times in seconds on any clock -- wall offsets from the load
generator, virtual times from the simulator) and `build_results(records, meta)`, which returns

    {"meta": {...}, "summary": S, "by_class": {"short": S, "long": S},
     "by_tenant": {tenant: S, ...}, "fairness": {...}, "apps": {...}, "requests": [...]}

where every S has the keys of `summarize`. Definitions (all percentiles: numpy.percentile,
linear interpolation; empty sets give null):
- ttft = first_token_s - send_s (send_s defaults to arrival_s; a retry keeps the first send)
- tpot = (last_token - first_token) / (n_output - 1), requests with >= 2 output tokens
- tbt  = gaps between consecutive token times, pooled over requests (needs token_times_s)
- e2e  = finish_s - send_s
- a request meets its TTFT (TPOT) SLO if it completed and ttft <= ttft_slo (tpot <= tpot_slo; a
  missing SLO or a 1-token output counts as met); slo_attainment needs both, over all measured
  requests (failed ones miss); goodput_rps = requests meeting both / window.
- the window is first arrival to last finish of the measured (non-warm-up) requests.
- fairness: Jain's index J = (sum x)^2 / (n sum x^2) over tenants' mean normalized latency
  x = e2e / output tokens (1.0 = every tenant waits equally per token; 1/n = one tenant gets it all).
- apps: completion = last finish - first arrival of an application's calls; an application with a
  failed call counts as failed. Jain's index over applications' normalized completion
  (completion / total output tokens) is reported too.
Warm-up (by time from the first arrival, or by count in arrival order) is excluded from every
aggregate but its requests stay in "requests" with "warmup": true.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import numpy as np

OK = "ok"
PCTS = (50, 90, 99)


@dataclass
class RequestRecord:
    request_id: str
    arrival_s: float                     # when the request was ready to send (deps done)
    send_s: float | None = None          # first attempt put on the wire (None: = arrival_s)
    first_token_s: float | None = None
    finish_s: float | None = None        # stream end (or failure)
    num_output_tokens: int = 0
    token_times_s: list[float] | None = None   # every token's arrival, if known
    status: str = OK                     # ok | http_error | error | timeout | not_sent | dep_failed
    error: str | None = None
    http_status: int | None = None
    klass: str = "short"
    tenant: str = "default"
    app_id: str | None = None
    app_type: str | None = None
    prompt_tokens: int = 0               # as generated (the workload's target)
    server_prompt_tokens: int | None = None   # as the server counted them (usage), if reported
    expected_output_tokens: int | None = None
    ttft_slo_ms: float | None = None
    tpot_slo_ms: float | None = None
    retries: int = 0
    model: str | None = None             # the model (or LoRA adapter) it named

    # ---- derived ----
    @property
    def ok(self) -> bool:
        return self.status == OK

    @property
    def start(self) -> float:
        return self.arrival_s if self.send_s is None else self.send_s

    @property
    def ttft_s(self) -> float | None:
        return None if not self.ok or self.first_token_s is None else self.first_token_s - self.start

    @property
    def e2e_s(self) -> float | None:
        return None if not self.ok or self.finish_s is None else self.finish_s - self.start

    @property
    def tpot_s(self) -> float | None:
        if not self.ok or self.first_token_s is None or self.num_output_tokens < 2:
            return None
        last = self.token_times_s[-1] if self.token_times_s else self.finish_s
        return (last - self.first_token_s) / (self.num_output_tokens - 1)

    @property
    def tbt_s(self) -> list[float]:
        if not self.ok or not self.token_times_s:
            return []
        return np.diff(self.token_times_s).tolist()

    @property
    def ttft_ok(self) -> bool:
        t = self.ttft_s
        return bool(t is not None and (self.ttft_slo_ms is None or t * 1000.0 <= self.ttft_slo_ms))

    @property
    def tpot_ok(self) -> bool:
        if not self.ok:
            return False
        t = self.tpot_s
        return bool(t is None or self.tpot_slo_ms is None or t * 1000.0 <= self.tpot_slo_ms)


def _pct(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if len(values) else None


def _mean(values: list[float]) -> float | None:
    return float(np.mean(values)) if len(values) else None


def jain(xs: list[float]) -> float | None:
    """Jain's fairness index (sum x)^2 / (n * sum x^2); None for an empty list."""
    x = np.asarray(xs, dtype=float)
    if len(x) == 0 or not np.any(x):
        return None
    return float(x.sum() ** 2 / (len(x) * (x * x).sum()))


def summarize(recs: list[RequestRecord], window_s: float) -> dict:
    """The summary keys (see module docstring) over `recs`; rates divide by `window_s`."""
    done = [r for r in recs if r.ok]
    ttft = [r.ttft_s for r in done if r.ttft_s is not None]
    tpot = [r.tpot_s for r in done if r.tpot_s is not None]
    e2e = [r.e2e_s for r in done if r.e2e_s is not None]
    tbt = [g for r in done for g in r.tbt_s]
    n = len(recs)
    good = sum(1 for r in recs if r.ttft_ok and r.tpot_ok)
    w = window_s if window_s > 0 else math.nan
    rate = lambda x: None if math.isnan(w) else x / w  # noqa: E731
    s = {
        "num_requests": n,
        "completed": len(done),
        "failed": n - len(done),
        "window_s": window_s,
        "throughput_rps": rate(len(done)),
        "goodput_rps": rate(good),
        "output_tok_s": rate(sum(r.num_output_tokens for r in done)),
        "input_tok_s": rate(sum(r.prompt_tokens for r in done)),
        "slo_attainment": good / n if n else None,
        "ttft_slo_attainment": sum(r.ttft_ok for r in recs) / n if n else None,
        "tpot_slo_attainment": sum(r.tpot_ok for r in recs) / n if n else None,
        "ttft_mean_s": _mean(ttft),
        "tpot_mean_s": _mean(tpot),
        "e2e_mean_s": _mean(e2e),
    }
    for name, vals in (("ttft", ttft), ("tpot", tpot), ("tbt", tbt), ("e2e", e2e)):
        for q in PCTS:
            s[f"{name}_p{q}_s"] = _pct(vals, q)
    return s


def _apps(recs: list[RequestRecord]) -> dict:
    groups: dict[str, list[RequestRecord]] = {}
    for r in recs:
        if r.app_id is not None:
            groups.setdefault(r.app_id, []).append(r)
    if not groups:
        return {}
    rows = []
    for app_id, rs in groups.items():
        ok = all(r.ok and r.finish_s is not None for r in rs)
        comp = max(r.finish_s for r in rs) - min(r.arrival_s for r in rs) if ok else None
        toks = sum(r.num_output_tokens for r in rs)
        rows.append((app_id, rs[0].app_type, ok, comp, toks))

    def stats(rows_) -> dict:
        c = [row[3] for row in rows_ if row[2]]
        return {"count": len(rows_), "completed": len(c), "failed": len(rows_) - len(c),
                "completion_avg_s": _mean(c), "completion_p50_s": _pct(c, 50),
                "completion_p90_s": _pct(c, 90), "completion_p99_s": _pct(c, 99)}

    out = stats(rows)
    out["jain_normalized_completion"] = jain([row[3] / max(row[4], 1) for row in rows if row[2]])
    types = sorted({row[1] or "none" for row in rows})
    out["by_type"] = {t: stats([row for row in rows if (row[1] or "none") == t]) for t in types}
    return out


def _fairness(recs: list[RequestRecord]) -> dict:
    per: dict[str, list[float]] = {}
    for r in recs:
        if r.ok and r.e2e_s is not None and r.num_output_tokens > 0:
            per.setdefault(r.tenant, []).append(r.e2e_s / r.num_output_tokens)
    means = {t: float(np.mean(v)) for t, v in sorted(per.items())}
    return {"metric": "jain_index_of_tenant_mean_normalized_latency_s_per_token",
            "jain_index": jain(list(means.values())), "per_tenant": means}


def _warmup_ids(recs: list[RequestRecord], warmup_s: float, warmup_requests: int) -> set[str]:
    if not recs:
        return set()
    order = sorted(recs, key=lambda r: r.arrival_s)
    t0 = order[0].arrival_s
    ids = {r.request_id for r in order[:warmup_requests]}
    ids |= {r.request_id for r in order if r.arrival_s < t0 + warmup_s}
    # An application is measured whole or not at all.
    apps = {r.app_id for r in recs if r.request_id in ids and r.app_id is not None}
    ids |= {r.request_id for r in recs if r.app_id in apps}
    return ids


def _clean(x):
    """JSON-safe: NaN/inf -> None, numpy scalars -> Python."""
    if isinstance(x, dict):
        return {k: _clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_clean(v) for v in x]
    if isinstance(x, (np.floating, float)):
        return None if not math.isfinite(float(x)) else float(x)
    if isinstance(x, np.integer):
        return int(x)
    if isinstance(x, np.bool_):
        return bool(x)
    return x


def build_results(records: list[RequestRecord], meta: dict | None = None, *, warmup_s: float = 0.0,
                  warmup_requests: int = 0, keep_token_times: bool = False) -> dict:
    """Aggregate per-request records into the results schema (see module docstring)."""
    warm = _warmup_ids(records, warmup_s, warmup_requests)
    measured = [r for r in records if r.request_id not in warm]
    if measured:
        t0 = min(r.arrival_s for r in measured)
        t1 = max(max(r.finish_s or r.arrival_s, r.arrival_s) for r in measured)
        window = t1 - t0
    else:
        window = 0.0
    classes = {"short": [], "long": []}
    tenants: dict[str, list[RequestRecord]] = {}
    for r in measured:
        classes.setdefault(r.klass, []).append(r)
        tenants.setdefault(r.tenant, []).append(r)
    requests = []
    for r in records:
        d = asdict(r)
        if not keep_token_times:
            d.pop("token_times_s")
        d.update(ttft_s=r.ttft_s, tpot_s=r.tpot_s, e2e_s=r.e2e_s, ttft_ok=r.ttft_ok,
                 tpot_ok=r.tpot_ok, warmup=r.request_id in warm)
        requests.append(d)
    meta = dict(meta or {})
    meta.update(warmup_s=warmup_s, warmup_requests=warmup_requests, num_warmup=len(warm))
    return _clean({
        "meta": meta,
        "summary": summarize(measured, window),
        "by_class": {k: summarize(v, window) for k, v in classes.items()},
        "by_tenant": {k: summarize(v, window) for k, v in sorted(tenants.items())},
        "fairness": _fairness(measured),
        "apps": _apps(measured),
        "requests": requests,
    })
