"""Arrival processes match their declared rates and burstiness (fixed seeds)."""

import math

import numpy as np
import pytest
from scipy import stats

from loadgen.arrivals import arrival_times, retime


@pytest.mark.parametrize("rate", [0.5, 4.0, 50.0])
def test_poisson_interarrivals_are_exponential_with_mean_one_over_rate(rate):
    t = arrival_times("poisson", np.random.default_rng(1), rate, n=20001)
    g = np.diff(t)
    assert abs(g.mean() - 1 / rate) < 0.03 / rate          # 20k samples: sd of mean ~0.7%
    assert stats.kstest(g, stats.expon(scale=1 / rate).cdf).pvalue > 0.01


@pytest.mark.parametrize("cv", [0.5, 2.0, 4.0])
def test_gamma_has_the_requested_rate_and_cv(cv):
    t = arrival_times("gamma", np.random.default_rng(2), 10.0, n=50001, cv=cv)
    g = np.diff(t)
    assert abs(g.mean() - 0.1) < 0.1 * 0.05
    assert abs(g.std() / g.mean() - cv) < 0.08 * cv


def test_constant_is_evenly_spaced_and_duration_bounds():
    t = arrival_times("constant", np.random.default_rng(0), 4.0, duration=10.0)
    assert len(t) == 40 and np.allclose(np.diff(t), 0.25)
    t = arrival_times("poisson", np.random.default_rng(0), 20.0, duration=30.0)
    assert t.max() < 30.0 and abs(len(t) - 600) < 5 * math.sqrt(600)
    t = arrival_times("poisson", np.random.default_rng(0), 20.0, duration=30.0, n=7)
    assert len(t) == 7
    assert np.all(arrival_times("poisson", np.random.default_rng(0), math.inf, n=5) == 0)


def test_bad_arguments_are_named():
    rng = np.random.default_rng(0)
    with pytest.raises(ValueError, match="count or a duration"):
        arrival_times("poisson", rng, 1.0)
    with pytest.raises(ValueError, match="unknown arrival"):
        arrival_times("weibull", rng, 1.0, n=3)
    with pytest.raises(ValueError, match="rate"):
        arrival_times("poisson", rng, 0.0, n=3)


def test_retime_keeps_count_and_rate():
    t = retime(np.zeros(10001), "poisson", np.random.default_rng(3), 5.0)
    assert len(t) == 10001 and t[0] == 0 and abs(np.diff(t).mean() - 0.2) < 0.01
