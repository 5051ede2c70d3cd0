"""PLA-Serve's compute/memory boundary L_m, fitted at runtime, and the short/long classifier.

Owns: the latency model of a (re-)prefill of L new tokens over H cached ones,
    T_comp(L, H) = alpha * L * (L + 2H) + beta * L           (causal attention + FFN)
    T_mem(L, H)  = gamma_w * L + gamma_r * H                 (KV writes + KV reads)
and the length where the two are equal:
    H = 0:  L_m = max(0, (gamma_w - beta) / alpha)
    H > 0:  L_m = max(0, (-(b) + sqrt(b^2 + 4 alpha gamma_r H)) / (2 alpha)),  b = 2 alpha H + beta - gamma_w
Below L_m a prefill is memory-bound ("short"), at or above it compute-bound ("long").

Data enters as samples through `BoundaryFitter.add(L, H, comp_s, mem_s)` (the split the seed
collects: e.g. GEMM/attention kernel time vs KV-copy time, or a roofline's two terms) or
`add_total(L, H, seconds)`. Total time alone cannot separate beta from gamma_w (both multiply L),
so totals need `beta_prior` (per-token FFN compute time, e.g. 2 * params / (peak * MFU) from
`raycluster.sched.roofline`); the fit then sets gamma_w = (fitted L coefficient) - beta_prior.
It leaves as a `Boundary` (coefficients, `l_m(H)`, `classify(length, history)`).
All fits are non-negative least squares (`raycluster.sched.profile.nnls`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from raycluster.sched.profile import nnls


@dataclass(frozen=True)
class Boundary:
    alpha: float
    beta: float
    gamma_w: float
    gamma_r: float

    def l_m(self, history: int = 0) -> float:
        """Token count where compute equals memory time; inf if compute never catches up."""
        a, b0, gw, gr = self.alpha, self.beta, self.gamma_w, self.gamma_r
        h = max(0, history)
        if a <= 0.0:
            # Linear compute: beta * L = gamma_w * L + gamma_r * H.
            return gr * h / (b0 - gw) if b0 > gw else math.inf
        if h == 0:
            return max(0.0, (gw - b0) / a)
        b = 2 * a * h + b0 - gw
        return max(0.0, (-b + math.sqrt(b * b + 4 * a * gr * h)) / (2 * a))

    def classify(self, length: int, history: int = 0) -> str:
        return "short" if length < self.l_m(history) else "long"


@dataclass
class BoundaryFitter:
    beta_prior: float | None = None
    comp: list[tuple[int, int, float]] = field(default_factory=list)
    mem: list[tuple[int, int, float]] = field(default_factory=list)
    total: list[tuple[int, int, float]] = field(default_factory=list)

    def add(self, length: int, history: int, comp_s: float, mem_s: float) -> None:
        self.comp.append((length, history, comp_s))
        self.mem.append((length, history, mem_s))

    def add_total(self, length: int, history: int, seconds: float) -> None:
        self.total.append((length, history, seconds))

    def fit(self) -> Boundary:
        if self.comp:
            a_comp = np.array([[l * (l + 2 * h), l] for l, h, _ in self.comp], dtype=float)
            alpha, beta = nnls(a_comp, np.array([t for _, _, t in self.comp]), scale=True)
            a_mem = np.array([[l, h] for l, h, _ in self.mem], dtype=float)
            gamma_w, gamma_r = nnls(a_mem, np.array([t for _, _, t in self.mem]), scale=True)
            return Boundary(float(alpha), float(beta), float(gamma_w), float(gamma_r))
        if not self.total:
            raise ValueError("BoundaryFitter.fit: no samples")
        if self.beta_prior is None:
            raise ValueError("BoundaryFitter.fit: total-time samples cannot separate beta from "
                             "gamma_w; pass beta_prior or add (comp_s, mem_s) samples")
        # T = alpha * L(L + 2H) + (beta + gamma_w) * L + gamma_r * H
        a = np.array([[l * (l + 2 * h), l, h] for l, h, _ in self.total], dtype=float)
        alpha, lin, gamma_r = nnls(a, np.array([t for _, _, t in self.total]), scale=True)
        gamma_w = max(0.0, float(lin) - self.beta_prior)
        return Boundary(float(alpha), float(self.beta_prior), gamma_w, float(gamma_r))


class LengthClassifier:
    """Runtime short/long split: refits every `refit_every` samples, static boundary until then."""

    def __init__(self, initial_l_m: int = 256, refit_every: int = 64, min_samples: int = 8,
                 beta_prior: float | None = None) -> None:
        self.fitter = BoundaryFitter(beta_prior=beta_prior)
        self.initial_l_m = initial_l_m
        self.refit_every = refit_every
        self.min_samples = min_samples
        self.boundary: Boundary | None = None
        self._since_fit = 0

    def add(self, length: int, history: int, comp_s: float, mem_s: float) -> None:
        self.fitter.add(length, history, comp_s, mem_s)
        self._tick()

    def add_total(self, length: int, history: int, seconds: float) -> None:
        self.fitter.add_total(length, history, seconds)
        self._tick()

    def _tick(self) -> None:
        self._since_fit += 1
        n = len(self.fitter.comp) + len(self.fitter.total)
        if n >= self.min_samples and (self.boundary is None or self._since_fit >= self.refit_every):
            try:
                self.boundary = self.fitter.fit()
            except ValueError:
                return      # totals without a beta prior: keep the static boundary
            self._since_fit = 0

    def l_m(self, history: int = 0) -> float:
        return self.boundary.l_m(history) if self.boundary else float(self.initial_l_m)

    def classify(self, length: int, history: int = 0) -> str:
        return "short" if length < self.l_m(history) else "long"
