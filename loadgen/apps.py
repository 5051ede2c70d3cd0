"""Justitia-style applications: DAGs of LLM calls that share an app_id.

Owns the application templates and the mix they are drawn from. Data enters as a `_Builder`
(seeded rng, ids, SLOs) from workloads.py, the arrival times of applications and a length
profile; it leaves as WorkloadRequests in topological order whose `depends_on` name the calls
whose outputs they consume. The client sends a call when all its dependencies finished; an
application completes when its last call does (metrics.py measures that time).

Templates (sizes scaled for a tiny CPU model; Justitia runs them on GPUs at larger sizes):
- `fact_verification` (small): extract claims from a document -> verify each claim in parallel
  against evidence -> one verdict call reading all verifications.
- `self_consistency` (medium): n parallel samples of the same question; the majority vote is
  client-side, so no aggregation call.
- `map_reduce` (large): summarise k document chunks in parallel -> one reduce call over the
  concatenated partial summaries.
`DEFAULT_MIX` uses Justitia's sampling probabilities of small / medium / large applications
(72% / 26% / 2%, Justitia Sec. "Evaluation", following prior work).
"""

from __future__ import annotations

import numpy as np

DEFAULT_MIX: dict[str, float] = {"fact_verification": 0.72, "self_consistency": 0.26, "map_reduce": 0.02}


def _fact_verification(b, t: float, app_id: str, prof) -> list:
    rng = b.rng
    kw = dict(app_id=app_id, app_type="fact_verification")
    doc, claims_out = int(rng.integers(300, 601)), 48
    extract = b.req(t, [b.seg(doc)], claims_out, **kw)
    claims_seg = b.seg(claims_out)  # stand-in for the extracted claims (same length)
    verifies = []
    for _ in range(int(rng.integers(2, 5))):
        verifies.append(b.req(t, [claims_seg, b.seg(int(rng.integers(200, 401)))], 32,
                              depends_on=(extract.request_id,), **kw))
    verdict_prompt = [b.seg(32) for _ in verifies] + [b.seg(32)]
    verdict = b.req(t, verdict_prompt, 16, depends_on=tuple(v.request_id for v in verifies), **kw)
    return [extract, *verifies, verdict]


def _self_consistency(b, t: float, app_id: str, prof) -> list:
    rng = b.rng
    question = b.seg(int(rng.integers(100, 301)))
    n = int(rng.integers(5, 9))
    outs = prof.output.sample(rng, n)
    return [b.req(t, [question], int(o), app_id=app_id, app_type="self_consistency") for o in outs]


def _map_reduce(b, t: float, app_id: str, prof) -> list:
    rng = b.rng
    kw = dict(app_id=app_id, app_type="map_reduce")
    maps = [b.req(t, [b.seg(1024)], 128, **kw) for _ in range(int(rng.integers(4, 9)))]
    reduce_prompt = [b.seg(128) for _ in maps] + [b.seg(64)]
    red = b.req(t, reduce_prompt, 256, depends_on=tuple(m.request_id for m in maps), **kw)
    return [*maps, red]


TEMPLATES = {"fact_verification": _fact_verification, "self_consistency": _self_consistency,
             "map_reduce": _map_reduce}


def make_apps(b, times: np.ndarray, prof, mix: dict[str, float]) -> list:
    """One application per arrival time, its type drawn from `mix` (weights, normalised)."""
    unknown = set(mix) - set(TEMPLATES)
    if unknown:
        raise ValueError(f"unknown application types {sorted(unknown)}; known: {sorted(TEMPLATES)}")
    names = list(mix)
    p = np.array([mix[k] for k in names], dtype=float)
    p /= p.sum()
    kinds = b.rng.choice(len(names), size=len(times), p=p)
    out = []
    for i, (t, k) in enumerate(zip(times, kinds)):
        out += TEMPLATES[names[k]](b, float(t), f"a{i:05d}", prof)
    return out
