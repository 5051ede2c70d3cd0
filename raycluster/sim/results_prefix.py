"""docs/results.md's prefix-caching section (ours: no seed paper claims it): a multi-turn chat
workload on 4 mixed A100 instances of Llama-3-8B at rising load, without the cache, with it and
placement by load alone, and with it and the router's prefix affinity.

`prefix_jobs(quick)` lists the simulator runs (results_setup.run_one executes them);
`render_prefix(d)` turns their summaries into the table, the figure and a verdict computed from
the data. Registered in results_setup.jobs_for / EXPERIMENTS and results_render.RENDER.
"""

from __future__ import annotations

from raycluster.sim.results_fmt import fmt, last_holding
from raycluster.sim.results_fmt import plot as _plot
from raycluster.sim.results_setup import DOCS

PREFIX_CFGS = {"nocache": {}, "cache-load": {"engine": {"enable_prefix_caching": True},
                                             "router": {"prefix_affinity": False}},
               "cache": {"engine": {"enable_prefix_caching": True}}}
PREFIX_LABEL = {"nocache": "no cache", "cache-load": "cache, placement by load", "cache": "cache + prefix affinity"}
PREFIX_QPS = [4, 8, 9, 10, 11, 12, 14, 16]
PREFIX_DURATION_S = 180
PREFIX_TTFT_P90_S = 1.0          # the "holds" criterion of the verdict


def prefix_spec(cfg: str) -> dict:
    return {"gpu": "a100", "model": "llama-3-8b", "policy": "lars",
            "pools": [{"role": "mixed", "instances": 4}], **PREFIX_CFGS[cfg]}


def prefix_jobs(quick: bool) -> list[dict]:
    qps = [4, 12] if quick else PREFIX_QPS
    return [{"key": ["prefix", cfg, q], "spec": prefix_spec(cfg),
             "wl": dict(name="multiturn", seed=0, qps=q, duration=30 if quick else PREFIX_DURATION_S)}
            for q in qps for cfg in PREFIX_CFGS]


def hit_rate(r: dict) -> float | None:
    q = r["sim"].get("prefix_query_tokens") or 0
    return r["sim"].get("prefix_hit_tokens", 0) / q if q else None


def holds_up_to(d: dict, cfg: str) -> float | None:
    """The highest QPS up to which every point keeps TTFT P90 under PREFIX_TTFT_P90_S."""
    def ok(q) -> bool:
        p90 = d[("prefix", cfg, q)]["summary"].get("ttft_p90_s")
        return p90 is not None and p90 < PREFIX_TTFT_P90_S
    return last_holding({k[2] for k in d if k[1] == cfg}, ok)


def render_prefix(d: dict) -> str:
    qps = sorted({k[2] for k in d})
    lines = ["## Prefix caching (ours: no seed claim)", "",
             "Setup: Llama-3-8B on 4 mixed instances (one A100 each, roofline predictor, LARS, Medha packer), "
             f"the `multiturn` workload (conversations started Poisson at the given rate for {PREFIX_DURATION_S} s, "
             "4 turns on average, 1 s think time; each turn re-sends the conversation so far, with a stand-in of "
             "the previous reply's length, so a turn can reuse at most the previous turn's prompt), seed 0. "
             "Configurations: no prefix cache; `enable_prefix_caching` with the router placing by load alone "
             "(`prefix_affinity: false`); and with the router's prefix index (a turn goes where its conversation "
             "probably is cached unless that instance is busier by more than the cached part). The simulator runs "
             "the engine's prefix-caching KV manager on the workload's real token ids (per-token decode steps: the "
             "decode fast path is off with caching). Hit rate: cached tokens over looked-up tokens.", "",
             "| QPS (conversations/s) | requests | TTFT P50 / P90 no cache (s) | TTFT P50 / P90 cache by load (s) | "
             "TTFT P50 / P90 cache + affinity (s) | hit rate by load / affinity | TPOT P50 no cache / affinity (ms) |",
             "|---|---|---|---|---|---|---|"]
    for q in qps:
        r = {c: d.get(("prefix", c, q)) for c in PREFIX_CFGS}
        if any(v is None for v in r.values()):
            continue
        s = {c: v["summary"] for c, v in r.items()}
        lines.append(f"| {q:g} | {r['nocache']['num_requests']} | "
                     + " | ".join(f"{fmt(s[c].get('ttft_p50_s'), 3)} / {fmt(s[c].get('ttft_p90_s'), 3)}" for c in PREFIX_CFGS)
                     + f" | {fmt(hit_rate(r['cache-load']), 2)} / {fmt(hit_rate(r['cache']), 2)} | "
                     f"{fmt(1e3 * s['nocache']['tpot_p50_s'], 1)} / {fmt(1e3 * s['cache']['tpot_p50_s'], 1)} |")
    series = {f"TTFT P90 {PREFIX_LABEL[c]}": (qps, [d.get(("prefix", c, q), {}).get("summary", {}).get("ttft_p90_s")
                                                  for q in qps]) for c in PREFIX_CFGS}
    _plot(DOCS / "figures" / "prefix_ttft.png", "Prefix caching: TTFT P90 vs load (4 x A100, multiturn)",
          "conversations/s", "TTFT P90 (s)", series, logy=True)
    held = {c: holds_up_to(d, c) for c in PREFIX_CFGS}
    lines += ["", f"Verdict: TTFT P90 stays under {PREFIX_TTFT_P90_S:g} s up to "
              + " / ".join("none" if held[c] is None else f"{held[c]:g}" for c in PREFIX_CFGS)
              + " conversations/s (" + " / ".join(PREFIX_LABEL[c] for c in PREFIX_CFGS) + "). Hit rates fall as load rises: cached blocks are free blocks, "
              "and with more requests running the KV they sit in is handed out before the conversation's next "
              "turn arrives.", "", "Figure: `figures/prefix_ttft.png`.", ""]
    return "\n".join(lines)
