"""Step-time and dispatch-latency variability in the simulator: the per-instance multiplier
process (spec `step_noise`), the inverse-CDF draw both noise blocks share, and their fits from
sim_to_real's calibration trace (sim/s2r_noise.py runs the fit).

Why: the simulator's step times are the predictor's (plus fitted overheads), deterministic; the
real instance's are not (a shared 2-core host, Python GC, thread hand-offs), and a slow stretch
lasts: consecutive requests' measured / simulated TPOT on the calibration trace correlate (lag-1
0.63-0.76 at 0.4-0.5 s apart on 2026-11-26). So the multiplier is a process in time, not a fresh
draw per step: m(t) = Q(Phi(z(t))) with z a stationary Ornstein-Uhlenbeck process (a Gaussian
copula), Q the empirical inverse CDF of the measured ratios. With corr_time_s = 0 every step
draws anew.

`StepNoise` (one per simulated instance, its own seeded `random.Random`): `factor(now)` moves z
from the last step's start to `now` and returns the multiplier; one normal draw per step, so a
run is a pure function of spec, workload and seed.

Fits (calibration data only): `trace_ratios` pairs each calibration-trace request's real TPOT
with the noise-free simulator's; `fit_from_samples` turns (time, ratio) samples into the
`step_noise` block (quantiles of ratio / median ratio: the level is fitted separately; the
correlation time -mean gap / ln(rho) from the lag-1 correlation rho of consecutive samples'
normal scores); `fit_dispatch` the `dispatch_noise` block from the requests the simulator served
alone.
"""

from __future__ import annotations

import math
import random
import statistics
from dataclasses import dataclass

N_QUANTILES = 11            # the multiplier at probabilities 0, 0.1, ..., 1
MAX_CORR_TIME_S = 60.0      # rho ~ 1 over the calibration's gaps: cap (longer than any test trace's regime)
_SQRT2 = math.sqrt(2.0)


def inverse_cdf(quantiles: tuple[float, ...] | list[float], u: float) -> float:
    """Q(u) for quantiles at evenly spaced probabilities 0 .. 1, linear in between."""
    x = u * (len(quantiles) - 1)
    i = min(int(x), len(quantiles) - 2)
    a = quantiles[i]
    return a + (quantiles[i + 1] - a) * (x - i)


def normal_cdf(z: float) -> float:
    return 0.5 * (1.0 + math.erf(z / _SQRT2))


@dataclass(slots=True)
class StepNoise:
    """One instance's multiplier process (see the module docstring)."""
    quantiles: tuple[float, ...]
    corr_time_s: float
    rng: random.Random
    z: float | None = None          # the process's state at `t` (None: before the first step)
    t: float = 0.0

    @classmethod
    def for_instance(cls, spec, instance_id: str) -> "StepNoise":
        """`spec`: a SimStepNoise. A str seed hashes with SHA-512 (not Python's salted hash): stable
        across processes."""
        return cls(tuple(spec.quantiles), spec.corr_time_s, random.Random(f"{spec.seed}/{instance_id}"))

    def factor(self, now: float) -> float:
        e = self.rng.normalvariate(0.0, 1.0)
        z = self.z
        if z is None or self.corr_time_s <= 0.0:
            z = e                   # stationary start, or independent steps
        else:
            a = math.exp(-max(0.0, now - self.t) / self.corr_time_s)
            z = a * z + math.sqrt(1.0 - a * a) * e
        self.z, self.t = z, now
        return inverse_cdf(self.quantiles, normal_cdf(z))


# ---- fit ---------------------------------------------------------------------------------------------
def normal_scores(xs: list[float]) -> list[float]:
    """Phi^-1(rank / (n + 1)), ties by order: the copula's z for each sample."""
    nd = statistics.NormalDist()
    order = sorted(range(len(xs)), key=lambda i: xs[i])
    z = [0.0] * len(xs)
    for rank, i in enumerate(order, 1):
        z[i] = nd.inv_cdf(rank / (len(xs) + 1))
    return z


def corr_time(samples: list[tuple[float, float]]) -> tuple[float, float]:
    """(lag-1 correlation of consecutive samples' normal scores, correlation time in s)."""
    if len(samples) < 3:
        return 0.0, 0.0
    z = normal_scores([v for _, v in samples])
    rho = statistics.correlation(z[:-1], z[1:])
    gap = statistics.fmean(b[0] - a[0] for a, b in zip(samples, samples[1:]))
    if rho <= 0.0 or gap <= 0.0:
        return rho, 0.0
    if rho >= 1.0:
        return rho, MAX_CORR_TIME_S
    return rho, min(MAX_CORR_TIME_S, -gap / math.log(rho))


def trace_ratios(real: list[dict], sim: list[dict]) -> list[tuple[float, float]]:
    """(real first-token time, real TPOT / simulated TPOT) per request of the calibration trace
    completed in both, in time order; `sim`: the noise-free simulator's records of the same trace,
    so each ratio is the request's measured / predicted decode step, queueing and batching as the
    simulator saw them."""
    by_id = {r["request_id"]: r for r in sim}
    out = []
    for r in real:
        s = by_id.get(r["request_id"])
        if (r.get("status") != "ok" or r.get("warmup") or s is None or not r.get("tpot_s")
                or not s.get("tpot_s") or r.get("first_token_s") is None):
            continue
        out.append((float(r["first_token_s"]), r["tpot_s"] / s["tpot_s"]))
    return sorted(out)


def fit_from_samples(samples: list[tuple[float, float]], n: int = N_QUANTILES, seed: int = 0) -> dict:
    """The `step_noise` spec block (plus `fit`: what it came from) from (time, ratio) samples in time
    order: quantiles of ratio / median ratio, correlation time from consecutive samples."""
    if len(samples) < 2:
        raise ValueError("step noise: fewer than 2 samples")
    ratios = [v for _, v in samples]
    med = statistics.median(ratios)
    qs = [min(ratios), *statistics.quantiles(ratios, n=n - 1, method="inclusive"), max(ratios)]
    rho, tau = corr_time(samples)
    return {"quantiles": [round(q / med, 6) for q in qs], "corr_time_s": round(tau, 6), "seed": seed,
            "fit": {"samples": len(samples), "median_ratio": med, "lag1_corr": rho,
                    "mean_gap_s": statistics.fmean(b[0] - a[0] for a, b in zip(samples, samples[1:]))}}


def fit_dispatch(real: list[dict], sim: list[dict], predictor, n: int = N_QUANTILES, seed: int = 0) -> dict:
    """The `dispatch_noise` block (plus `fit`: its sample count) from the calibration trace: quantiles of real TTFT - simulated TTFT
    at dispatch latency 0 over the requests the simulator served alone (its TTFT is exactly its
    own one-step prefill, `predictor` with the overheads: nothing queued ahead, nothing batched
    with it), clamped at 0. Elsewhere the real excess holds queueing behind slow steps too, which
    the step noise makes already; counted here it would be counted twice."""
    by_id = {r["request_id"]: r for r in sim}
    xs = []
    for r in real:
        s = by_id.get(r["request_id"])
        if (r.get("status") != "ok" or r.get("warmup") or r.get("ttft_s") is None or s is None
                or s.get("ttft_s") is None):
            continue
        alone = predictor.batch_time([(int(r["prompt_tokens"]), 0)], [])
        if s["ttft_s"] <= alone * (1 + 1e-9):
            xs.append(max(0.0, r["ttft_s"] - s["ttft_s"]))
    if len(xs) < 2:
        raise ValueError("dispatch noise: fewer than 2 requests the simulator served alone")
    xs.sort()
    qs = [xs[0], *statistics.quantiles(xs, n=n - 1, method="inclusive"), xs[-1]]
    return {"quantiles": [round(q, 6) for q in qs], "seed": seed, "fit": {"samples": len(xs)}}
