"""Arrival processes: when each root request (or session / application) arrives.

Owns the inter-arrival laws -- Poisson (exponential gaps), gamma (burstiness set by the
coefficient of variation CV; CV=1 is Poisson, CV>1 burstier), constant (evenly spaced) -- and
`retime`, which re-stamps an existing sorted list of times (trace replay keeps its own times).
Data enters as (kind, rate in requests/s, a numpy Generator, a count and/or a duration bound) and
leaves as a sorted numpy array of arrival offsets in seconds from the start of the run.
Every generator is bounded: a count, a duration, or both (whichever ends first).
"""

from __future__ import annotations

import math

import numpy as np

KINDS = ("poisson", "gamma", "constant")


def gaps(kind: str, rng: np.random.Generator, rate: float, size: int, cv: float = 1.0) -> np.ndarray:
    """`size` inter-arrival gaps (seconds) with mean 1/rate. rate=inf gives zeros (all at once)."""
    if rate <= 0:
        raise ValueError(f"rate must be > 0, got {rate}")
    if math.isinf(rate):
        return np.zeros(size)
    mean = 1.0 / rate
    if kind == "poisson":
        return rng.exponential(mean, size)
    if kind == "gamma":
        if cv <= 0:
            raise ValueError(f"gamma CV must be > 0, got {cv}")
        shape = 1.0 / (cv * cv)            # CV of a gamma(k, theta) is 1/sqrt(k)
        return rng.gamma(shape, mean / shape, size)
    if kind == "constant":
        return np.full(size, mean)
    raise ValueError(f"unknown arrival process {kind!r}; choose one of {KINDS} (or a trace file)")


def arrival_times(kind: str, rng: np.random.Generator, rate: float, *, n: int | None = None,
                  duration: float | None = None, cv: float = 1.0, max_n: int = 10_000_000) -> np.ndarray:
    """Arrival offsets (s) of a process starting at 0: the first arrival is at 0, then gaps follow.

    Stops after `n` arrivals or at `duration` seconds, whichever comes first. One of them is
    required; `max_n` caps the count even for an infinite rate with a duration.
    """
    if n is None and duration is None:
        raise ValueError("need a request count or a duration")
    if n is not None and n < 0:
        raise ValueError(f"request count must be >= 0, got {n}")
    if math.isinf(rate) and n is None:
        raise ValueError("an infinite rate needs a request count")
    if n is not None:
        size = min(n, max_n)
    else:  # enough draws to pass `duration` with overwhelming probability; topped up below
        size = min(max_n, int(rate * duration + 10 * math.sqrt(rate * duration + 1) * max(cv, 1.0) + 10))
    if size == 0:
        return np.zeros(0)
    g = gaps(kind, rng, rate, size, cv)
    g[0] = 0.0
    t = np.cumsum(g)
    if duration is not None:
        while n is None and t[-1] < duration and len(t) < max_n:
            t = np.concatenate([t, t[-1] + np.cumsum(gaps(kind, rng, rate, len(t), cv))])[:max_n]
        t = t[t < duration]
    return t


def retime(times: np.ndarray, kind: str, rng: np.random.Generator, rate: float, cv: float = 1.0) -> np.ndarray:
    """New arrival offsets for len(times) arrivals under another process (order kept)."""
    if len(times) == 0:
        return np.zeros(0)
    g = gaps(kind, rng, rate, len(times), cv)
    g[0] = 0.0
    return np.cumsum(g)
