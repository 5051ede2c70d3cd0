"""Figures for `loadgen report --plot PNG` (matplotlib, Agg backend: no display needed).

Owns `plot(paths, out_png)`. Data enters as results / sweep file paths (read via report.py);
it leaves as one PNG: a TTFT CDF panel per request class (one line per run, log-scale time
axis so short and long requests both show), and, when a sweep file is among the inputs, a panel
of SLO attainment (both SLOs) against offered QPS, one line per sweep file and class.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from loadgen.report import is_sweep, load_results  # noqa: E402


def _ttfts(res: dict, klass: str) -> np.ndarray:
    v = [r["ttft_s"] for r in res.get("requests", [])
         if r.get("klass") == klass and r.get("ttft_s") is not None and not r.get("warmup")]
    return np.sort(np.asarray(v, dtype=float))


def plot(paths: list[str], out_png: str) -> str:
    columns = [c for p in paths for c in load_results(p)]
    classes = [k for k in ("short", "long") if any(len(_ttfts(res, k)) for _, res in columns)] or ["short"]
    sweeps = [p for p in paths if is_sweep(p)]
    n = len(classes) + (1 if sweeps else 0)
    fig, axes = plt.subplots(1, n, figsize=(6.0 * n, 4.5), squeeze=False)
    axes = axes[0]
    for ax, klass in zip(axes, classes):
        for label, res in columns:
            x = _ttfts(res, klass)
            if len(x):
                ax.step(x, np.arange(1, len(x) + 1) / len(x), where="post", label=f"{label} (n={len(x)})")
        ax.set_xscale("log")
        ax.set_xlabel("TTFT (s, log scale)")
        ax.set_ylabel("fraction of requests")
        ax.set_title(f"TTFT CDF, {klass} requests")
        ax.set_ylim(0, 1.02)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8, loc="lower right")
    if sweeps:
        ax = axes[-1]
        for p in sweeps:
            runs = load_results(p)
            qps = [res["meta"].get("qps") for _, res in runs]
            ax.plot(qps, [res["summary"].get("slo_attainment") for _, res in runs], "o-",
                    label=f"{Path(p).stem} all")
            for klass in ("short", "long"):
                att = [res.get("by_class", {}).get(klass, {}).get("slo_attainment") for _, res in runs]
                if any(a is not None for a in att) and any(
                        res.get("by_class", {}).get(klass, {}).get("num_requests") for _, res in runs):
                    ax.plot(qps, [np.nan if a is None else a for a in att], "s--",
                            label=f"{Path(p).stem} {klass}")
        ax.set_xlabel("offered load (QPS)")
        ax.set_ylabel("SLO attainment (TTFT and TPOT met)")
        ax.set_title("SLO attainment vs QPS")
        ax.set_ylim(-0.02, 1.02)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out_png, dpi=110)
    plt.close(fig)
    return out_png
