"""Rendering of docs/results.md: one function per section from the stored summaries
(docs/figures/data.json entries keyed by job key), tables in Markdown, figures with matplotlib,
and the verdicts (claim reproduced or not) computed from the data.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from raycluster.sim.results_setup import (DOCS, JUSTITIA_APPS_DURATION_S, JUSTITIA_MICE_QPS,
                                          JUSTITIA_POLS, KAIROS_DECODE_DURATION_S, KAIROS_DECODE_SEED,
                                          KAIROS_DURATION_S, KAIROS_LONG_TOKENS, KAIROS_PREFILL_CFGS,
                                          MEDHA_CFGS, MEDHA_EDF_DURATION_S, MEDHA_LABEL)
from raycluster.sim.results_prefix import render_prefix

# ---------------------------------------------------------------------------------------------
# rendering


def _f(v, nd=2, unit=""):
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return "-"
    return f"{v:.{nd}f}{unit}"


def _plot(path: Path, title: str, xlabel: str, ylabel: str, series: dict, logy: bool = False,
          distinct: bool = False, bands: dict | None = None) -> None:
    """distinct: a different marker and dash per series, so curves that coincide stay visible.
    bands: series label -> (xs, lows, highs), shaded around that series (e.g. min-max over seeds)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 3.6))
    markers, dashes = ["o", "s", "^", "D", "v", "x"], ["-", "--", "-.", ":"]
    for i, (label, (xs, ys)) in enumerate(series.items()):
        pts = [(x, y) for x, y in zip(xs, ys) if y is not None]
        style = ({"marker": markers[i % len(markers)], "linestyle": dashes[i % len(dashes)], "markersize": 8 - i,
                  "alpha": 0.85} if distinct else {"marker": "o"})
        if pts:
            line, = ax.plot([p[0] for p in pts], [p[1] for p in pts], label=label, **style)
            if bands and label in bands:
                bx, lo, hi = bands[label]
                b = [(x, a, c) for x, a, c in zip(bx, lo, hi) if a is not None and c is not None]
                if b:
                    ax.fill_between([p[0] for p in b], [p[1] for p in b], [p[2] for p in b],
                                    color=line.get_color(), alpha=0.15, linewidth=0)
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    if logy:
        ax.set_yscale("log")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _ratio(a, b):
    return a / b if a is not None and b not in (None, 0) else None


def render_medha(d: dict) -> str:
    qps = sorted({k[2] for k in d})
    lines = ["## Medha: short-request TTFT with 5% 128K-1M prompts",
             "",
             "Setup: Llama-3-8B, 16 A100s as one TP8 x SPP2 replica (roofline predictor, MFU 0.5, MBU 0.8), "
             "`long-mix` workload (ShareGPT-like chat + 5% long prompts uniform in 128K-1M tokens), Poisson, "
             "400 s of arrivals per point, seed 1, TTFT SLO 2 s (long: 1 ms/token), TPOT SLO 100 ms. Rows "
             "differ only in policy and packer: FCFS non-preemptive (token packer, whole prompts), FCFS / "
             "EDF / LARS with fixed 2048-token chunks (token budget 2048), and LARS with the Medha "
             "time-budget packer (adaptive chunks, multi-prefill batching, space sharing). The library has "
             "no switch for 'Medha packer without multi-prefill', so the LARS row uses fixed chunks. "
             "Spec: `sims/medha-16xa100.yaml`.", "",
             "Short-request TTFT P50 / P90 / P99 (s):", "",
             "| QPS | " + " | ".join(MEDHA_LABEL[c] for c in MEDHA_CFGS) + " |",
             "|---|" + "---|" * len(MEDHA_CFGS)]
    for q in qps:
        cells = []
        for c in MEDHA_CFGS:
            s = d.get(("medha", c, q), {}).get("by_class", {}).get("short", {})
            cells.append(f"{_f(s.get('ttft_p50_s'))} / {_f(s.get('ttft_p90_s'))} / {_f(s.get('ttft_p99_s'))}")
        lines.append(f"| {q} | " + " | ".join(cells) + " |")
    lines += ["", "Ratio non-preemptive FCFS / LARS+multi-prefill of short TTFT (seed: 30x median, 174x P99):", "",
              "| QPS | P50 ratio | P99 ratio | EDF P99 / chunked FCFS P99 | long requests finished | virtual end (s) |",
              "|---|---|---|---|---|---|"]
    best50, best99 = [], []
    for q in qps:
        np_ = d.get(("medha", "np-fcfs", q), {}).get("by_class", {}).get("short", {})
        mp = d.get(("medha", "lars+mp", q), {}).get("by_class", {}).get("short", {})
        edf = d.get(("medha", "edf", q), {}).get("by_class", {}).get("short", {})
        cf = d.get(("medha", "chunked-fcfs", q), {}).get("by_class", {}).get("short", {})
        r50, r99 = _ratio(np_.get("ttft_p50_s"), mp.get("ttft_p50_s")), _ratio(np_.get("ttft_p99_s"), mp.get("ttft_p99_s"))
        best50.append(r50 or 0)
        best99.append(r99 or 0)
        lg = d.get(("medha", "lars+mp", q), {}).get("by_class", {}).get("long", {})
        lines.append(f"| {q} | {_f(r50, 1, 'x')} | {_f(r99, 1, 'x')} | "
                     f"{_f(_ratio(edf.get('ttft_p99_s'), cf.get('ttft_p99_s')), 4)} | {lg.get('completed', '-')} | "
                     f"{_f(d.get(('medha', 'lars+mp', q), {}).get('sim', {}).get('virtual_end_s'), 0)} |")
    m50, m99 = max(best50, default=0), max(best99, default=0)
    lines += ["", f"Largest ratios over the sweep: P50 {m50:.1f}x (claim 30x; one third = 10x: "
              f"{'met' if m50 >= 10 else 'NOT met'}), P99 {m99:.1f}x (claim 174x; one third = 58x: "
              f"{'met' if m99 >= 58 else 'NOT met'}). See `figures/medha_ttft_p99.png`.", ""]
    series = {MEDHA_LABEL[c]: (qps, [d.get(("medha", c, q), {}).get("by_class", {}).get("short", {}).get("ttft_p99_s")
                                     for q in qps]) for c in MEDHA_CFGS}
    _plot(DOCS / "figures" / "medha_ttft_p99.png", "Medha: short-request TTFT P99", "QPS", "TTFT P99 (s)", series, logy=True)
    series = {MEDHA_LABEL[c]: (qps, [d.get(("medha", c, q), {}).get("by_class", {}).get("short", {}).get("ttft_p50_s")
                                     for q in qps]) for c in MEDHA_CFGS}
    _plot(DOCS / "figures" / "medha_ttft_p50.png", "Medha: short-request TTFT P50", "QPS", "TTFT P50 (s)", series, logy=True)
    return "\n".join(lines)


def render_medha_edf(d: dict) -> str:
    qps = sorted({k[2] for k in d})
    st = lambda c, q, cl, k: (d.get(("medha-edf", c, q), {}).get("by_class", {}).get(cl, {})  # noqa: E731
                              if cl else d.get(("medha-edf", c, q), {}).get("summary", {})).get(k)
    lines = ["## Medha: EDF over a 30-minute window", "",
             "Seed claim (Medha Fig. 13, Llama-3-8B, TP8 x SPP2 A100s, 5% long requests): EDF is effective at "
             "low load but degrades toward FCFS at high load (1.75 QPS): it defers long requests until "
             "their deadlines pass, then they take the highest priority and convoy the short ones.", "",
             f"Setup: as the Medha table above (same replica, workload, seed, chunked FCFS / EDF / LARS with "
             f"2048-token chunks), but {MEDHA_EDF_DURATION_S // 60} minutes of arrivals instead of 400 s: long "
             "prompts get TTFT deadlines of 1 ms/token (128-1000 s), so only a window longer than those "
             "deadlines lets a starved long request pass its deadline while short requests keep arriving.", "",
             "Short-request TTFT P50 / P99 (s), and all requests' TTFT P50 / P99:", "",
             "| QPS | FCFS chunked (short) | EDF (short) | LARS chunked (short) | FCFS (all) | EDF (all) | "
             "LARS (all) | EDF / FCFS short P50 |", "|---|---|---|---|---|---|---|---|"]
    for q in qps:
        cell = lambda c, cl: f"{_f(st(c, q, cl, 'ttft_p50_s'))} / {_f(st(c, q, cl, 'ttft_p99_s'))}"  # noqa: E731
        lines.append(f"| {q} | {cell('chunked-fcfs', 'short')} | {cell('edf', 'short')} | {cell('lars', 'short')} | "
                     f"{cell('chunked-fcfs', None)} | {cell('edf', None)} | {cell('lars', None)} | "
                     f"{_f(_ratio(st('edf', q, 'short', 'ttft_p50_s'), st('chunked-fcfs', q, 'short', 'ttft_p50_s')), 3)} |")
    lo, hi = (qps[0], qps[-1]) if qps else (None, None)
    r_lo = _ratio(st("edf", lo, "short", "ttft_p50_s"), st("chunked-fcfs", lo, "short", "ttft_p50_s"))
    r_hi = _ratio(st("edf", hi, "short", "ttft_p50_s"), st("chunked-fcfs", hi, "short", "ttft_p50_s"))
    slo_lo, slo_hi = st("edf", lo, "short", "ttft_p50_s"), st("edf", hi, "short", "ttft_p50_s")
    degrades = None not in (r_lo, r_hi, slo_lo, slo_hi) and r_hi > 10 * r_lo and slo_hi > 2.0 >= slo_lo
    lines += ["", f"Verdict: EDF's short-request median TTFT is {_f(slo_lo)} s at QPS {lo} ({_f(r_lo, 4)} of "
              f"chunked FCFS's) and {_f(slo_hi)} s at QPS {hi} ({_f(r_hi, 3)} of FCFS's): meets the 2 s SLO at "
              f"low load and degrades toward FCFS at high load: {'yes' if degrades else 'NO'}.", ""]
    return "\n".join(lines)


def highest_full_qps(qps: list, att: list, level: float = 1.0) -> float | None:
    """Highest QPS of the sweep up to which attainment stays >= level at every point."""
    best = None
    for q, a in zip(qps, att):
        if a is None or a < level - 1e-12:
            break
        best = q
    return best


def kairos_runs(d: dict, cfg: str, q, part: str = "prefill") -> list[dict]:
    """One configuration's runs at one QPS point, one entry per seed (seed order); `part`:
    "prefill" (the TTFT sweep over seeds) or "decode" (the one-seed TPOT comparison)."""
    return [d[k] for k in sorted((k for k in d if len(k) == 5 and k[1] == cfg and k[2] == q and k[4] == part),
                                 key=lambda k: k[3])]


def _kairos_qps(d: dict, part: str) -> list:
    return sorted({k[2] for k in d if len(k) == 5 and k[4] == part})


def _mean(xs: list) -> float | None:
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else None


def kairos_misses(runs: list[dict], klass: str) -> int:
    """TTFT misses of one request class, summed over the runs (seeds)."""
    return sum(r.get("ttft_misses", {}).get(klass, {}).get("misses", 0) for r in runs)


def _miss_range(runs: list[dict], klass: str, lo: str, hi: str):
    ms = [r.get("ttft_misses", {}).get(klass, {}) for r in runs]
    los, his = [m[lo] for m in ms if m.get(lo) is not None], [m[hi] for m in ms if m.get(hi) is not None]
    return (min(los), max(his)) if los and his else (None, None)


def kairos_verdict(d: dict) -> dict:
    """Thresholds from the prefill sweep: the highest QPS up to which the mean TTFT attainment
    over seeds stays at 100% ("full") and >= 99% ("99"), and the same per seed; TPOT comparison
    from the decode runs."""
    qps = _kairos_qps(d, "prefill")
    out: dict = {"qps": qps}
    seeds = sorted({k[3] for k in d if len(k) == 5 and k[4] == "prefill"})
    for c in KAIROS_PREFILL_CFGS:
        att = [[r.get("summary", {}).get("ttft_slo_attainment") for r in kairos_runs(d, c, q)] for q in qps]
        mean = [_mean(a) if a and None not in a else None for a in att]
        by_seed = {s: [next((r.get("summary", {}).get("ttft_slo_attainment") for r in kairos_runs(d, c, q)
                             if r.get("key", [None] * 4)[3] == s), None) for q in qps] for s in seeds}
        out[c] = {"mean": mean, "min": [min(a) if a and None not in a else None for a in att],
                  "max": [max(a) if a and None not in a else None for a in att],
                  "full": highest_full_qps(qps, mean), "99": highest_full_qps(qps, mean, 0.99),
                  "seed_full": {s: highest_full_qps(qps, a) for s, a in by_seed.items()},
                  "seed_99": {s: highest_full_qps(qps, a, 0.99) for s, a in by_seed.items()}}
    lvl = lambda v: -math.inf if v is None else v  # noqa: E731
    fc = [c for c in KAIROS_PREFILL_CFGS if c != "kairos/all"]
    for t in ("full", "99"):
        out[f"claim_{t}"] = lvl(out["kairos/all"][t]) > max(lvl(out[c][t]) for c in fc)
        out[f"seeds_higher_{t}"] = [s for s in seeds if lvl(out["kairos/all"][f"seed_{t}"][s])
                                    > max(lvl(out[c][f"seed_{t}"][s]) for c in fc)]
        out[f"seeds_lower_{t}"] = [s for s in seeds if lvl(out["kairos/all"][f"seed_{t}"][s])
                                   < max(lvl(out[c][f"seed_{t}"][s]) for c in fc)]
    out["seeds"] = seeds
    # Past the >= 99% threshold of every order: where urgency's mean is the highest, by how much,
    # and how far apart the traces are there.
    top99 = min((lvl(out[c]["99"]) for c in KAIROS_PREFILL_CFGS), default=-math.inf)
    idx = [i for i, q in enumerate(qps) if q > top99 and None not in (out[c]["mean"][i] for c in KAIROS_PREFILL_CFGS)]
    gain = {qps[i]: out["kairos/all"]["mean"][i] - max(out[c]["mean"][i] for c in fc) for i in idx}
    out["above_99"] = {"qps": [qps[i] for i in idx], "higher": [q for q, g in gain.items() if g > 1e-12],
                       "max_gain": max(gain.values(), default=None),
                       "spread": max((out["kairos/all"]["max"][i] - out["kairos/all"]["min"][i] for i in idx), default=None)}
    dq = _kairos_qps(d, "decode")
    tp = lambda c: [_mean([r.get("summary", {}).get("tpot_slo_attainment") or 0.0 for r in kairos_runs(d, c, q, "decode")]) or 0.0  # noqa: E731
                    for q in dq]
    out["tpot_better"] = [q for q, a, b in zip(dq, tp("kairos/kairos"), tp("kairos/all")) if a > b + 1e-9]
    out["tpot_worse"] = [q for q, a, b in zip(dq, tp("kairos/kairos"), tp("kairos/all")) if a < b - 1e-9]
    return out


def render_kairos(d: dict) -> str:
    qps, dqps = _kairos_qps(d, "prefill"), _kairos_qps(d, "decode")
    lt = KAIROS_LONG_TOKENS
    v = kairos_verdict(d)
    seeds = v["seeds"]
    sd = ", ".join(str(s) for s in seeds)
    lines = ["## Kairos: urgency-ordered prefill and slack-guided decode batching", "",
             "Seed claim: TTFT-SLO attainment vs QPS, FCFS prefill (DistServe) vs urgency scheduling, and TPOT "
             "attainment, continuous batching vs slack-guided decode batching (TTFT SLO 8 s, TPOT 50 ms, "
             "a long-tailed trace, 4 prefill + 4 decode): urgency keeps 100% TTFT attainment to a higher "
             "QPS (3.0 vs 2.8 there).", "",
             f"Setup: Llama-3-8B, 4 prefill + 4 decode instances (one A100 each, roofline predictor), "
             f"`long-mix` (ShareGPT-like chat) with 10% prompts uniform in {lt[0] // 1024}K-{lt[1] // 1024}K "
             f"tokens (0.85-6.5 s of isolated prefill: every request can meet the SLO alone, one or two "
             f"long prompts ahead can break it), Poisson arrivals, TTFT SLO "
             "8 s for every request, TPOT SLO 50 ms, KV handoff over the inter-node link (25 GB/s per "
             "A100). Requests go on arrival to the prefill instance with the fewest prompt tokens still to "
             "prefill, and each instance orders its own queue "
             "(the seed's per-instance scheduler). Prefill: FCFS over whole prompts (DistServe, the "
             "seed's baseline), FCFS with the same 8192-token chunk budget as urgency (isolates the "
             "ordering), and Kairos urgency (`kairos`, Alg. 1-2, chunk budget C = 8192). Decode (behind "
             "urgency prefill): continuous batching (`all`) vs slack-guided (`KairosDecodeSelector`). "
             "Spec: `sims/kairos-4p4d.yaml`.", "",
             f"Prefill (TTFT): every QPS point runs {len(seeds)} traces (random seeds {sd}) of {KAIROS_DURATION_S} s "
             "of arrivals each, decode by continuous batching; `requests` is the total over the traces. "
             "Attainment: mean over the traces [min, max]; misses: requests over the 8 s TTFT SLO, short "
             "(< 8K tokens) / long prompts, summed over the traces; TTFT P99: mean over the traces of each "
             "run's P99 per class.", "",
             "| QPS | requests | TTFT att. FCFS whole-prompt | TTFT att. FCFS chunked | TTFT att. urgency | "
             "misses short / long FCFS whole | misses short / long FCFS chunked | misses short / long urgency | "
             "short TTFT P99 FCFS chunked / urgency (s) | long TTFT P99 FCFS chunked / urgency (s) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    p99 = lambda c, q, cl: _mean([r.get("by_class", {}).get(cl, {}).get("ttft_p99_s") for r in kairos_runs(d, c, q)])  # noqa: E731
    for i, q in enumerate(qps):
        att = lambda c: f"{_f(v[c]['mean'][i], 4)} [{_f(v[c]['min'][i], 4)}, {_f(v[c]['max'][i], 4)}]"  # noqa: E731
        mis = lambda c: f"{kairos_misses(kairos_runs(d, c, q), 'short')} / {kairos_misses(kairos_runs(d, c, q), 'long')}"  # noqa: E731
        n = sum(r.get("num_requests", 0) for r in kairos_runs(d, "fcfs/all", q))
        lines.append(f"| {q:g} | {n} | {att('fcfs-whole/all')} | {att('fcfs/all')} | {att('kairos/all')} | "
                     f"{mis('fcfs-whole/all')} | {mis('fcfs/all')} | {mis('kairos/all')} | "
                     f"{_f(p99('fcfs/all', q, 'short'))} / {_f(p99('kairos/all', q, 'short'))} | "
                     f"{_f(p99('fcfs/all', q, 'long'))} / {_f(p99('kairos/all', q, 'long'))} |")
    full = lambda c: v[c]["full"] if v[c]["full"] is not None else "none"  # noqa: E731
    n99 = lambda c: v[c]["99"] if v[c]["99"] is not None else "none"  # noqa: E731
    ps = lambda t, c: " / ".join(str(x if x is not None else "none") for x in (v[c][f"seed_{t}"][s] for s in seeds))  # noqa: E731
    per = lambda t: (f"{ps(t, 'fcfs-whole/all')} (FCFS whole-prompt), {ps(t, 'fcfs/all')} (FCFS chunked), "  # noqa: E731
                     f"{ps(t, 'kairos/all')} (urgency)")
    yes = lambda b: "yes" if b else "NO"  # noqa: E731
    sds = " / ".join(str(s) for s in seeds)
    hi = v["above_99"]
    above = (f"Above that, urgency's mean attainment is the highest of the three at QPS "
             f"{', '.join(f'{q:g}' for q in hi['higher']) or 'none'} (by at most {_f(hi['max_gain'], 4)}), "
             f"{'well inside' if (hi['max_gain'] or 0) < (hi['spread'] or 0) else 'beyond'} the spread between "
             f"traces (urgency's max - min: up to {_f(hi['spread'], 4)})." if hi["qps"] else "")
    lines += ["", f"Verdict (mean over the {len(seeds)} traces): 100% TTFT attainment holds up to QPS "
              f"{full('fcfs-whole/all')} (FCFS whole-prompt), {full('fcfs/all')} (FCFS chunked), "
              f"{full('kairos/all')} (urgency); >= 99% up to {n99('fcfs-whole/all')} / {n99('fcfs/all')} / "
              f"{n99('kairos/all')}. Urgency keeps 100% to a higher QPS than both FCFS baselines: "
              f"{yes(v['claim_full'])}; >= 99% to a higher QPS: {yes(v['claim_99'])}. Per trace (seed {sds}): "
              f"100% up to QPS {per('full')}; >= 99% up to {per('99')}. Urgency's threshold is above both "
              f"baselines' in {len(v['seeds_higher_full'])} of {len(seeds)} traces at 100% (below in "
              f"{len(v['seeds_lower_full'])}) and in {len(v['seeds_higher_99'])} at >= 99% (below in "
              f"{len(v['seeds_lower_99'])}). {above}".rstrip(), ""]
    lines += _kairos_mechanism(d, v)
    # Decode: one seed, shorter window (see results_setup).
    dk = lambda c, q, k: _mean([r.get("summary", {}).get(k) for r in kairos_runs(d, c, q, "decode")])  # noqa: E731
    ms = lambda x: None if x is None else x * 1000  # noqa: E731
    lines += [f"Decode (TPOT), behind urgency prefill: one trace (random seed {KAIROS_DECODE_SEED}), {KAIROS_DECODE_DURATION_S} s "
              "of arrivals per point (the slack-guided selector costs 10-20x the wall time of continuous "
              "batching in the simulator):", "",
              "| QPS | TPOT att. continuous | TPOT att. slack-guided | TPOT P99 continuous / slack-guided (ms) |",
              "|---|---|---|---|"]
    for q in dqps:
        lines.append(f"| {q:g} | {_f(dk('kairos/all', q, 'tpot_slo_attainment'), 3)} | "
                     f"{_f(dk('kairos/kairos', q, 'tpot_slo_attainment'), 3)} | "
                     f"{_f(ms(dk('kairos/all', q, 'tpot_p99_s')), 1)} / {_f(ms(dk('kairos/kairos', q, 'tpot_p99_s')), 1)} |")
    lines += ["", f"Slack-guided decode batching has higher TPOT attainment than continuous batching at QPS "
              f"{v['tpot_better'] or 'none'}, lower at {v['tpot_worse'] or 'none'} (the paper: higher; one "
              "trace, so differences of a few requests are not a finding).", ""]
    att = lambda c, k: [d.get(("kairos", c, q, KAIROS_DECODE_SEED, "decode"), {}).get("summary", {}).get(k)  # noqa: E731
                        for q in dqps]
    series = {"TTFT FCFS whole-prompt": (qps, v["fcfs-whole/all"]["mean"]),
              "TTFT FCFS chunked": (qps, v["fcfs/all"]["mean"]),
              "TTFT urgency": (qps, v["kairos/all"]["mean"]),
              "TPOT continuous (1 trace)": (dqps, att("kairos/all", "tpot_slo_attainment")),
              "TPOT slack-guided (1 trace)": (dqps, att("kairos/kairos", "tpot_slo_attainment"))}
    bands = {f"TTFT {lab}": (qps, v[c]["min"], v[c]["max"]) for lab, c in
             (("FCFS whole-prompt", "fcfs-whole/all"), ("FCFS chunked", "fcfs/all"), ("urgency", "kairos/all"))}
    _plot(DOCS / "figures" / "kairos_attainment.png", "Kairos: SLO attainment vs QPS (TTFT: mean, min-max of traces)",
          "QPS", "attainment", series, distinct=True, bands=bands)
    lines += ["Figure: `figures/kairos_attainment.png`.", ""]
    return "\n".join(lines)


def _kairos_mechanism(d: dict, v: dict) -> list[str]:
    """Who misses, and why (Alg. 1), with the figures of the sweep: at the highest QPS where
    every order keeps >= 99% on average (no seed in overload), and at the top of the sweep."""
    qps = v["qps"]
    ok = [q for i, q in enumerate(qps) if all((v[c]["mean"][i] or 0) >= 0.99 for c in KAIROS_PREFILL_CFGS)]
    if not ok or not qps:
        return []
    q, top = ok[-1], qps[-1]
    fc, ur = kairos_runs(d, "fcfs/all", q), kairos_runs(d, "kairos/all", q)
    s_f, l_f, s_u, l_u = (kairos_misses(fc, "short"), kairos_misses(fc, "long"),
                          kairos_misses(ur, "short"), kairos_misses(ur, "long"))
    pu, tu = _miss_range(ur, "long", "prompt_min", "prompt_max"), _miss_range(ur, "long", "ttft_min_s", "ttft_max_s")
    pf, tf = _miss_range(fc, "long", "prompt_min", "prompt_max"), _miss_range(fc, "long", "ttft_min_s", "ttft_max_s")
    k = lambda x: "-" if x is None else f"{x / 1000:.0f}K"  # noqa: E731
    p99 = lambda runs, cl: _mean([r.get("by_class", {}).get(cl, {}).get("ttft_p99_s") for r in runs])  # noqa: E731
    cmp = lambda a, b: "more" if a > b else ("fewer" if a < b else "as many")  # noqa: E731
    starve = ("under sustained load the long prompts are the ones it starves." if l_u > l_f and s_u <= s_f else
              "here that does not cost the long prompts more misses than chunked FCFS.")
    out = [f"Who misses, and why. At QPS {q:g} (the highest point where every order keeps >= 99% on "
           f"average), urgency misses {s_u} short and {l_u} long requests over the {len(ur)} traces, chunked "
           f"FCFS {s_f} short and {l_f} long: urgency misses {cmp(l_u, l_f)} long prompts. Its long misses "
           f"are prompts of {k(pu[0])}-{k(pu[1])} tokens with TTFT {_f(tu[0], 1)}-{_f(tu[1], 1)} s (chunked "
           f"FCFS: {k(pf[0])}-{k(pf[1])} tokens, {_f(tf[0], 1)}-{_f(tf[1], 1)} s), while urgency "
           f"{'lowers' if (p99(ur, 'short') or 0) < (p99(fc, 'short') or 0) else 'raises'} the short TTFT P99 "
           f"from {_f(p99(fc, 'short'))} s to {_f(p99(ur, 'short'))} s. This is the seed's "
           "Alg. 1 as written (line 8; Eq. 1 of Sec. 3.1): u_r = (t_slack / SLO_TTFT) / input_len, with "
           "t_slack the SLO minus the FCFS-predicted time to finish, served in descending u. Dividing by "
           "the prompt length ranks a long prompt below every short prompt that still has positive "
           "slack, and once its own predicted slack turns negative its score is negative and it ranks "
           "below all of them: while short requests keep arriving it waits, up to "
           f"{_f(None if tu[1] is None else tu[1] - 8.0, 1)} s past its SLO here. Sec. 3.1 says the long request "
           "'retains a reasonable urgency score' and that the mechanism balances attainment 'without "
           f"risking starvation'; {starve} "
           "The 100% criterion itself turns on a handful of long prompts among thousands of requests "
           "(the misses columns), so it moves with the trace and the window length; the >= 99% "
           "threshold is the steadier comparison."]
    if top != q:
        fc, ur = kairos_runs(d, "fcfs/all", top), kairos_runs(d, "kairos/all", top)
        s_f, l_f, s_u, l_u = (kairos_misses(fc, "short"), kairos_misses(fc, "long"),
                              kairos_misses(ur, "short"), kairos_misses(ur, "long"))
        ts_f, ts_u = _miss_range(fc, "short", "ttft_min_s", "ttft_max_s"), _miss_range(ur, "short", "ttft_min_s", "ttft_max_s")
        out[0] += (f" Past the knee the order inverts: at QPS {top:g} many requests' predicted slack is "
                   "negative, and a negative slack divided by a long prompt's length is closer to zero, so "
                   "among late requests long prompts rank first. Urgency misses "
                   f"{l_u} long prompts vs {l_f} for chunked FCFS and "
                   f"{s_u} vs {s_f} short ones, but its short misses wait up to {_f(ts_u[1], 0)} s (chunked "
                   f"FCFS: {_f(ts_f[1], 0)} s); short TTFT P99 {_f(p99(ur, 'short'))} s vs "
                   f"{_f(p99(fc, 'short'))} s.")
    return out + [""]


def bounded_tail(xs: list) -> bool:
    """The last point is within 10% of the point two steps earlier (a 4x longer mice stream
    with a 2x step sweep) and every point is finite."""
    return len(xs) >= 3 and all(x is not None and math.isfinite(x) for x in xs) and xs[-1] <= 1.1 * xs[-3]


def render_justitia(d: dict) -> str:
    ms = sorted({k[2] for k in d})
    pols = [p for p in JUSTITIA_POLS if any(k[1] == p for k in d)]
    label = {"srjf": "SRJF", "justitia": "Justitia (M measured)", "justitia-kv": "Justitia (M = KV cache / iteration)",
             "vtc": "VTC", "fcfs": "FCFS"}
    e = lambda p, m: d.get(("justitia", p, m), {}).get("elephant_completion_s")  # noqa: E731
    a = lambda p, m: d.get(("justitia", p, m), {}).get("apps", {}).get("completion_avg_s")  # noqa: E731
    lines = ["## Justitia: one elephant application, then a growing stream of mice", "",
             "Seed claim: an elephant application followed by a growing number of mice: the elephant's "
             "completion time grows without bound under SRJF and stays bounded under Justitia; and "
             "Justitia's average application completion time is below VTC's on a mixed workload.", "",
             "Setup: Llama-3-8B on one A100 (mixed instance, 16 sequences per batch, roofline predictor). "
             "At t=0 an elephant application: a chain of 4 calls (6000-token prompts, 1500 output tokens "
             "each, each sent when the previous finished); from t=0.5 s single-call mouse applications "
             f"(100-400 prompt, 50-200 output tokens) arrive Poisson at {JUSTITIA_MICE_QPS:g}/s (about what "
             "the instance serves with 16 sequences per batch, so the waiting line never drains) for the "
             "given time. Seed 3. Elephant completion = last call finish - arrival; average app completion "
             "over all applications. Justitia's GPS service rate M (KV token-time per second): measured "
             "online by the policy (its default: KV token-time served per second while requests wait, "
             "EMA), or the seed's definition, the whole KV cache served once per iteration (set by this "
             "generator on the router's and the instance's policy: the spec has no policy options).", "",
             "Elephant completion (s):", "",
             "| mice for (s) | " + " | ".join(label[p] for p in pols) + " |", "|---|" + "---|" * len(pols)]
    for m in ms:
        lines.append(f"| {m} | " + " | ".join(_f(e(p, m), 1) for p in pols) + " |")
    lines += ["", "Average application completion (s):", "",
              "| mice for (s) | " + " | ".join(label[p] for p in pols) + " |", "|---|" + "---|" * len(pols)]
    for m in ms:
        lines.append(f"| {m} | " + " | ".join(_f(a(p, m), 1) for p in pols) + " |")
    series = {label[p]: (ms, [e(p, m) for m in ms]) for p in pols}
    _plot(DOCS / "figures" / "justitia_elephant.png", "Justitia: elephant completion vs mice stream",
          "mice arrive for (s)", "elephant completion (s)", series, distinct=True)
    el = lambda p: [e(p, m) if e(p, m) is not None else math.inf for m in ms]  # noqa: E731
    grows = lambda xs: all(b > a_ * 1.2 for a_, b in zip(xs, xs[1:]))  # noqa: E731
    below = lambda p: all((a(p, m) or math.inf) < (a("vtc", m) or 0) for m in ms)  # noqa: E731
    parts = [f"elephant completion grows with the mice stream under SRJF: {grows(el('srjf'))}"]
    for p in ("justitia", "justitia-kv"):
        if p in pols:
            parts.append(f"{label[p]}: grows {grows(el(p))}, bounded (last point within 10% of the one two "
                         f"steps earlier) {bounded_tail(el(p))}, average app completion below VTC at every "
                         f"point {below(p)}")
    lines += ["", "Verdict: " + "; ".join(parts) + ".", "", "Figure: `figures/justitia_elephant.png`.", ""]
    return "\n".join(lines)


def render_justitia_apps(d: dict) -> str:
    qps = sorted({k[2] for k in d})
    pols = [p for p in JUSTITIA_POLS if any(k[1] == p for k in d)]
    label = {"srjf": "SRJF", "justitia": "Justitia (M measured)", "justitia-kv": "Justitia (M = KV cache / iteration)",
             "vtc": "VTC", "fcfs": "FCFS"}
    ap = lambda p, q, k: d.get(("justitia-apps", p, q), {}).get("apps", {}).get(k)  # noqa: E731
    lines = ["## Justitia: average application completion on a mixed application workload", "",
             f"Setup: the instance of the elephant experiment (one A100, 16 sequences per batch); loadgen "
             f"`apps` (DAGs of calls sharing an app_id: fact verification, self-consistency, map-reduce "
             f"in Justitia's 72% / 26% / 2% small / medium / large mix), Poisson application arrivals for "
             f"{JUSTITIA_APPS_DURATION_S} s, seed 3, one tenant per application (VTC fair-shares between "
             "applications). Application completion = last call finish - first arrival.", "",
             "Average / P99 application completion (s):", "",
             "| apps/s | " + " | ".join(label[p] for p in pols) + " |", "|---|" + "---|" * len(pols)]
    for q in qps:
        lines.append(f"| {q} | " + " | ".join(f"{_f(ap(p, q, 'completion_avg_s'))} / {_f(ap(p, q, 'completion_p99_s'))}"
                                              for p in pols) + " |")
    below = {p: all((ap(p, q, "completion_avg_s") or math.inf) < (ap("vtc", q, "completion_avg_s") or 0) for q in qps)
             for p in ("justitia", "justitia-kv") if p in pols}
    lines += ["", "Verdict: average application completion below VTC's at every load: "
              + "; ".join(f"{label[p]}: {v}" for p, v in below.items()) + ".", ""]
    return "\n".join(lines)


def render_pla(d: dict) -> str:
    lines = ["## PLA-Serve: split prefill pools and the pressure controller", "",
             "Setup: Llama-3-8B, one A100 per instance, P/D with a decode pool; `long-mix` with prompts "
             "4K-32K as the long class, FCFS in each pool, TTFT SLO 2 s (long: 0.5 ms/token), TPOT 100 ms, "
             "120 s of Poisson arrivals. The simulator is open-loop, so offered QPS stands in for the "
             "seed's concurrency axis. (a) 4 prefill instances as one pool vs 2 short + 2 long "
             "(20% long, + 4 decode). (b) 8 prefill instances, static 4/4 split vs the same start with "
             "the PLA pressure controller (`raycluster.sched.pressure.decide`, period 2 s, cooldown 10 s; "
             "5% long, + 6 decode). AWD short-prefill batching is not wired into the engine scheduler, "
             "so it is not part of these runs.", "",
             "| setup | QPS | SLO violation | TTFT P99 short (s) | TTFT P99 long (s) | moves |", "|---|---|---|---|---|---|"]
    for kind in ("single", "split", "static8", "ctrl8"):
        for q in sorted({k[2] for k in d if k[1] == kind}):
            r = d[("pla", kind, q)]
            att = r["summary"].get("slo_attainment")
            lines.append(f"| {kind} | {q} | {_f(None if att is None else 1 - att, 3)} | "
                         f"{_f(r['by_class'].get('short', {}).get('ttft_p99_s'))} | "
                         f"{_f(r['by_class'].get('long', {}).get('ttft_p99_s'))} | {len(r['sim'].get('moves', []))} |")
    series = {}
    for kind in ("single", "split", "static8", "ctrl8"):
        qs = sorted({k[2] for k in d if k[1] == kind})
        series[kind] = (qs, [None if d[("pla", kind, q)]["summary"].get("slo_attainment") is None
                             else 1 - d[("pla", kind, q)]["summary"]["slo_attainment"] for q in qs])
    _plot(DOCS / "figures" / "pla_violation.png", "PLA-Serve: SLO violation vs QPS", "QPS", "violation rate", series)
    lines += ["", "Figure: `figures/pla_violation.png`.", ""]
    return "\n".join(lines)


def render_speed(d: dict) -> str:
    lines = ["## Speed", ""]
    for k, r in d.items():
        if k[1] == "window":
            by = {x["path"]: x for x in r["runs"]}
            f, e = by["fast"], by["exact"]
            hour = f["wall_s_per_sim_hour"]
            lines.append(
                f"Steady state (`python -m raycluster.sim.speed --qps {k[2]:.0f} --warm {f['window_s'][0]:g} "
                f"--until {f['window_s'][1]:g}`, same spec, `chat` at {k[2]:.0f} requests/s, about saturation; "
                f"only the window is timed, so start-up and drain are excluded): with the decode fast path "
                f"{f['wall_s']:.1f} s wall for {f['window_s'][1] - f['window_s'][0]:g} simulated s, "
                f"{f['events_per_s']:.0f} events/s, {hour / 60:.1f} minutes per simulated hour; the exact "
                f"stepwise path {e['wall_s']:.1f} s ({e['wall_s_per_sim_hour'] / 60:.1f} minutes per hour), "
                f"fast/exact speed-up {e['wall_s'] / max(f['wall_s'], 1e-9):.1f}x in the same process. Target "
                f"(one hour in under a minute): {'met' if hour < 60 else 'NOT met'}.")
            lines.append("")
            continue
        s = r["sim"]
        ratio = s["virtual_end_s"] / max(s["wall_s"], 1e-9)
        hour = 3600.0 / ratio if ratio > 0 else float("inf")
        lines.append(f"Setup: 128 H100s as 16 Llama-3-70B instances at TP8 (mixed pools, LARS, Medha packer, "
                     f"spec `sims/speed-128xh100.yaml`), `chat` at {k[2]:.0f} requests/s "
                     f"({r['num_requests']} requests, {r['summary']['completed']} completed; TTFT P50 "
                     f"{_f(r['summary']['ttft_p50_s'], 3)} s, TPOT P50 {_f(r['summary']['tpot_p50_s'], 4)} s). "
                     f"Simulated {s['virtual_end_s']:.1f} s of virtual time in {s['wall_s']:.1f} s wall "
                     f"({ratio:.2f}x real time): {s['events']} events, {s['events_per_s']:.0f} events/s, "
                     f"{s['steps']} engine steps, {s['output_tokens']} output tokens (this run's virtual "
                     f"time includes the drain after arrivals stop, so {hour / 60:.0f} minutes per simulated "
                     f"hour from it is optimistic; the steady-state figure is the one to quote). Measured "
                     f"on this 2-core machine.")
        lines.append("")
    return "\n".join(lines) + "\n"


def load_sim_to_real(out_dirs: str) -> dict | None:
    """The stored entry of the sim-to-real section: each of sim_to_real's DIR/summary.json
    (comma-separated DIRs, one batch of seeds each; nothing is rerun)."""
    batches = []
    for d in (x for x in out_dirs.split(",") if x):
        path = Path(d) / "summary.json"
        if path.is_file():
            summ = json.loads(path.read_text())
            batches.append({"meta": summ["meta"], "runs": summ["runs"], "source": str(path)})
    return {"key": ["sim-to-real", "summary"], "batches": batches} if batches else None


def render_sim_to_real(d: dict) -> str:
    from raycluster.sim.sim_to_real import render as s2r_table

    batches = next(iter(d.values()))["batches"]
    m = batches[-1]["meta"]
    ct = m["calibration_trace"]
    lines = ["## Sim-to-real", "",
             "Claim (issue 6): the same trace on the real local cluster (tiny model, CPU-profiled predictor) "
             f"and in the simulator gives P50 and P90 TTFT and TPOT per class within {m['target']:.0%} of each other.",
             "",
             f"Setup: `python -m raycluster.sim.sim_to_real --out-dir DIR --qps {m['qps']:g} --duration "
             f"{m['duration_s']:g} --seed {','.join(str(s) for s in m['seeds'])}`, run {len(batches)} time(s) "
             "(below, oldest first; each run's seeds use fresh clusters one after the other). Per seed one "
             f"`long-mix` trace ({m['long_fraction']:.0%} long prompts of {m['long_tokens'][0]}-{m['long_tokens'][1]} "
             f"tokens, the rest ShareGPT-shaped chat turns; outputs clipped to {m['max_output_tokens']} tokens, "
             "ignore_eos) replayed by `loadgen run --prompt-format ids` on a fresh local Ray cluster with "
             "deployments/local.yaml's topology (one mixed instance, lars, Medha packer, "
             "threads_per_instance=1, HTTP/SSE through the gateway) on this shared 2-core machine, and the "
             f"simulator on the same trace with `{m['spec']}` (`gpu: cpu`: the predictor profile the real "
             "instance loads). `sim` is that spec as is; `sim_cal` adds three serving-path overheads measured on "
             "the same real cluster from calibration requests sent before the trace, never from the test trace "
             f"(lone requests of {'/'.join(str(x) for x in ct['prompts'])} prompt tokens "
             f"{ct['gap_s']:g} s apart, and bursts of {'/'.join(str(x) for x in ct.get('bursts', ()))} requests "
             f"of {ct.get('burst_prompt', '-')} tokens sent together; {ct['output_tokens']} output tokens each): "
             "per burst size k, TPOT minus the predicted decode step; a line through k gives "
             "`step_overhead_s` (per step) and `step_overhead_per_seq_s` (per sequence); over lone requests, "
             "TTFT minus the predicted prefill step minus one step's overhead gives `dispatch_latency_s`. "
             "Statistic: the lower quartile over requests (other engineers' processes share the 2 cores and only "
             "ever add time, in bursts); the medians are in the saved JSON. Runs made with `--calib-trace` also "
             "replay a calibration trace (the same workload, seed + 1000) just before the test trace and fit on it "
             "alone (`sim_tcal`): the measured step overheads scaled by one factor so the simulated TPOT P50 matches "
             "that trace's, then `dispatch_latency_s` = the median per-request TTFT gap; the test trace only "
             "validates. rel. = (sim - real) / real.", ""]
    tot = {n: [0, 0] for n in ("sim", "sim_cal", "sim_tcal")}
    for b in batches:
        for run in b["runs"].values():
            for n in tot:
                w = run["compare"]["within"].get(n, {"ok": 0, "cells": 0})
                tot[n][0] += w["ok"]
                tot[n][1] += w["cells"]
    nseeds = sum(len(b["runs"]) for b in batches)
    met = all(run["compare"]["within"]["sim_cal"]["ok"] == run["compare"]["within"]["sim_cal"]["cells"]
              for b in batches for run in b["runs"].values())
    tc = (f", {tot['sim_tcal'][0]} of {tot['sim_tcal'][1]} with the overheads fitted on a calibration trace "
          "(`sim_tcal`)") if tot["sim_tcal"][1] else ""
    lines += [f"Verdict: over {nseeds} real replays, {tot['sim_cal'][0]} of {tot['sim_cal'][1]} cells within "
              f"{m['target']:.0%} with the measured overheads (`sim_cal`), {tot['sim'][0]} of {tot['sim'][1]} "
              f"without (`sim`){tc}: the target is {'met' if met else 'NOT met'} on this shared host. The measured "
              "overheads move the simulated medians toward the real ones but not within 15% on most cells, the "
              "P90s stay far apart, and runs taken while other benchmarks loaded the 2 cores are not comparable "
              "at all (the notes below say why).", ""]
    for bi, b in enumerate(batches):
        if "bursts" not in b["meta"]["calibration_trace"]:
            lines += [f"Run {bi + 1}'s calibration had lone requests only (no bursts): "
                      "step_overhead_per_seq_s was not measured (0) in its `sim_cal`.", ""]
        for seed, run in sorted(b["runs"].items()):
            cal, cmp = run["calibration"], run["compare"]
            rs, load = run["real_summary"], run.get("host_load") or {}
            ld = ", ".join(f"{k} {v[0]:.1f}" for k, v in load.items())
            lines += [f"### Run {bi + 1} ({b['meta']['date']}), seed {seed}", "",
                      f"Real: {rs['completed']}/{rs['num_requests']} completed"
                      + (f"; host 1-min load average {ld}" if ld else "") + ". "
                      f"Calibration ({cal['n']} requests, {cal.get('n_lone', cal['n'])} lone): step_overhead_s "
                      f"{cal['step_overhead_s'] * 1000:.2f} ms, step_overhead_per_seq_s "
                      f"{cal.get('step_overhead_per_seq_s', 0.0) * 1000:.3f} ms, dispatch_latency_s "
                      f"{cal['dispatch_latency_s'] * 1000:.1f} ms (medians instead: "
                      f"{cal.get('median_step_overhead_s', 0) * 1000:.2f} ms, "
                      f"{cal.get('median_step_overhead_per_seq_s', 0) * 1000:.3f} ms, "
                      f"{cal.get('median_dispatch_latency_s', 0) * 1000:.1f} ms).", "",
                      *([f"Trace calibration: step overheads x {tf['scale']:.2f} (-> {tf['step_overhead_s'] * 1000:.2f} ms + "
                         f"{tf['step_overhead_per_seq_s'] * 1000:.3f} ms/seq), dispatch_latency_s "
                         f"{tf['dispatch_latency_s'] * 1000:.1f} ms.", ""] if (tf := cal.get("trace_fit")) else []),
                      s2r_table(cmp, [n for n in ("sim", "sim_cal", "sim_tcal") if n in cmp["within"]]), ""]
    return "\n".join(lines) + "\n"


RENDER = {"sim-to-real": render_sim_to_real, "medha": render_medha, "medha-edf": render_medha_edf, "kairos": render_kairos, "justitia": render_justitia,
          "justitia-apps": render_justitia_apps, "pla": render_pla, "prefix": render_prefix,
          "speed": render_speed}
