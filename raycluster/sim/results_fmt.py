"""Formatting and plotting helpers shared by the results.md renderers (results_render,
results_kairos, results_prefix): numbers, with a dash where a value is missing, and one
matplotlib line plot per figure."""

from __future__ import annotations

import math
from pathlib import Path


def fmt(v, nd=2, unit=""):
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return "-"
    return f"{v:.{nd}f}{unit}"


def last_holding(xs, ok) -> float | None:
    """The largest x of the sorted `xs` up to which `ok(x)` holds at every point (None: not at
    the first)."""
    best = None
    for x in sorted(xs):
        if not ok(x):
            break
        best = x
    return best


def plot(path: Path, title: str, xlabel: str, ylabel: str, series: dict, logy: bool = False,
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
