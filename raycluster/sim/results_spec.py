"""docs/results.md's speculative-decoding section (ours: no seed paper claims it): chat on 4 mixed
A100 instances of Llama-3-8B at rising load, without drafts, with free drafts (n-gram lookup's
cost) and with a draft model's, each at an assumed acceptance rate (raycluster/sim/spec_decode.py).

`spec_jobs(quick)` lists the simulator runs (results_setup.run_one executes them);
`render_spec(d)` turns their summaries into the table, the figure and a verdict computed from the
data. Registered in results_setup.jobs_for / EXPERIMENTS and results_render.RENDER.
"""

from __future__ import annotations

from raycluster.sim.results_fmt import fmt, last_holding
from raycluster.sim.results_fmt import plot as _plot
from raycluster.sim.results_setup import DOCS

SPEC_CFGS = {
    "plain": {},
    "free-k3": {"engine": {"speculative_method": "ngram", "num_speculative_tokens": 3},
                "spec_decode": {"acceptance": 0.6}},
    "draft-k4": {"engine": {"speculative_method": "ngram", "num_speculative_tokens": 4},
                 "spec_decode": {"acceptance": 0.8, "draft_cost": 0.1}},
}
SPEC_LABEL = {"plain": "no drafts", "free-k3": "free drafts, k 3, acceptance 0.6",
              "draft-k4": "draft model, k 4, acceptance 0.8, cost 0.1 of the target's"}
SPEC_QPS = [4, 16, 32, 48, 64]
SPEC_DURATION_S = 120


def spec_spec(cfg: str) -> dict:
    return {"gpu": "a100", "model": "llama-3-8b", "policy": "lars", "pools": [{"role": "mixed", "instances": 4}],
            **SPEC_CFGS[cfg]}


def spec_jobs(quick: bool) -> list[dict]:
    qps = [4, 48] if quick else SPEC_QPS
    return [{"key": ["spec-decode", cfg, q], "spec": spec_spec(cfg),
             "wl": dict(name="chat", seed=1, qps=q, duration=30 if quick else SPEC_DURATION_S)}
            for q in qps for cfg in SPEC_CFGS]


def helps_up_to(d: dict, cfg: str) -> float | None:
    """The highest QPS up to which every point's TPOT P50 is below the no-draft run's."""
    def ok(q) -> bool:
        a, b = d.get(("spec-decode", cfg, q)), d.get(("spec-decode", "plain", q))
        return a is not None and b is not None and a["summary"]["tpot_p50_s"] < b["summary"]["tpot_p50_s"]
    return last_holding({k[2] for k in d}, ok)


def render_spec(d: dict) -> str:
    qps = sorted({k[2] for k in d})
    lines = ["## Speculative decoding at cluster scale (ours: no seed claim)", "",
             "Setup: Llama-3-8B on 4 mixed instances (one A100 each, roofline predictor, LARS, Medha packer), "
             f"`chat` Poisson arrivals for {SPEC_DURATION_S} s, seed 1. The simulator has no tokens to compare, so a "
             "drafting pool's `spec_decode` block assumes how drafts fare: each is accepted with the given "
             "probability until the first rejection; a verifying step is timed as the request's last token and its "
             "drafts in one chunk on its context, plus k draft passes over the drafting requests at `draft_cost` "
             "of a decode step each (0 for n-gram lookup) and, before a request's first drafts, the draft's "
             "prefill of its context at `draft_cost` of the target's. The engine's own Scheduler fits the drafts into the "
             "token budget the step's decodes leave, before prefills, as on the real engine. Configurations: "
             + "; ".join(f"`{c}`: {SPEC_LABEL[c]}" for c in SPEC_CFGS) + ".", "",
             "| QPS | requests | " + " | ".join(f"TPOT P50 / P99 {c} (ms)" for c in SPEC_CFGS) + " | "
             + " | ".join(f"TTFT P90 {c} (s)" for c in SPEC_CFGS) + " |",
             "|---|---|" + "---|" * (2 * len(SPEC_CFGS))]
    for q in qps:
        r = {c: d.get(("spec-decode", c, q)) for c in SPEC_CFGS}
        if any(v is None for v in r.values()):
            continue
        s = {c: v["summary"] for c, v in r.items()}
        lines.append(f"| {q:g} | {r['plain']['num_requests']} | "
                     + " | ".join(f"{fmt(1e3 * s[c]['tpot_p50_s'], 1)} / {fmt(1e3 * s[c]['tpot_p99_s'], 1)}"
                                  for c in SPEC_CFGS) + " | "
                     + " | ".join(fmt(s[c].get("ttft_p90_s"), 3) for c in SPEC_CFGS) + " |")
    series = {f"TPOT P50 {SPEC_LABEL[c]}": (qps, [d.get(("spec-decode", c, q), {}).get("summary", {}).get("tpot_p50_s")
                                                  for q in qps]) for c in SPEC_CFGS}
    _plot(DOCS / "figures" / "spec_decode_tpot.png", "Speculative decoding: TPOT P50 vs load (4 x A100, chat)",
          "requests/s", "TPOT P50 (s)", series, logy=False)
    low = min(qps) if qps else None
    gains = {c: d[("spec-decode", "plain", low)]["summary"]["tpot_p50_s"] / d[("spec-decode", c, low)]["summary"]["tpot_p50_s"]
             for c in SPEC_CFGS if c != "plain" and ("spec-decode", c, low) in d and ("spec-decode", "plain", low) in d}
    held = {c: helps_up_to(d, c) for c in SPEC_CFGS if c != "plain"}
    lines += ["", "Verdict: at " + (f"{low:g} requests/s" if low is not None else "the lowest load") + " drafts cut TPOT P50 "
              + " / ".join(f"{gains[c]:.2f}x" for c in gains) + " (" + " / ".join(f"`{c}`" for c in gains) + "), "
              "about the expected tokens per verifying step, since a decode step of a few sequences is bound by "
              "reading the weights and the extra rows ride along. Drafts keep TPOT P50 below the no-draft run up to "
              + " / ".join("none" if held[c] is None else f"{held[c]:g}" for c in held) + " requests/s ("
              + " / ".join(f"`{c}`" for c in held) + "); past that, verifying rows of many sequences is compute, "
              "the rejected drafts are wasted work, and the drafts, scheduled with the running decodes before any "
              "prefill (as vLLM's scheduler does), take token budget and step time the prefills would use, so TPOT "
              "and TTFT both grow: speculative decoding is a low-load latency tool, as vLLM's documentation also "
              "says.", "", "Figure: `figures/spec_decode_tpot.png`.", ""]
    return "\n".join(lines)
