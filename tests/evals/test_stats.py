"""jaxlp.evals.stats: the t distribution against an integrated density, printed tables and SciPy;
the intervals and the problem bootstrap against NumPy references."""

import math

import numpy as np
import pytest

from jaxlp.evals.stats import (
    accuracy_summary,
    bootstrap_problems,
    paired_delta,
    t_critical,
    t_interval,
    t_two_sided_cdf,
)


def t_density_integral(t: float, df: int) -> float:
    """P(|T| <= t) by Simpson integration of the t density (float64), an independent reference."""
    x = np.linspace(0.0, t, 40001)
    log_c = math.lgamma((df + 1) / 2) - math.lgamma(df / 2) - 0.5 * math.log(df * math.pi)
    f = np.exp(log_c - (df + 1) / 2 * np.log1p(x * x / df))
    h = x[1] - x[0]
    simpson = h / 3 * (f[0] + f[-1] + 4 * f[1:-1:2].sum() + 2 * f[2:-1:2].sum())
    return 2 * simpson


@pytest.mark.parametrize("df", [1, 2, 3, 4, 7, 8, 15, 30])
def test_t_cdf_matches_integrated_density(df):
    rng = np.random.default_rng(100 + df)
    for t in np.concatenate([[0.5, 1.0, 2.0], rng.uniform(0.01, 6.0, 3)]):
        assert t_two_sided_cdf(float(t), df) == pytest.approx(t_density_integral(float(t), df), abs=1e-9)
    assert t_two_sided_cdf(0.0, df) == 0.0
    assert t_two_sided_cdf(math.inf, df) == 1.0


def test_t_critical_matches_printed_tables():
    table_975 = {1: 12.7062, 2: 4.3027, 3: 3.1824, 5: 2.5706, 7: 2.3646, 10: 2.2281, 30: 2.0423}
    for df, t in table_975.items():
        assert t_critical(df) == pytest.approx(t, abs=1e-4)
    assert t_critical(7, 0.99) == pytest.approx(3.4995, abs=1e-4)
    assert t_critical(4, 0.90) == pytest.approx(2.1318, abs=1e-4)
    for bad in (0, 2.5):
        with pytest.raises(ValueError):
            t_two_sided_cdf(1.0, bad)
    with pytest.raises(ValueError):
        t_critical(3, 1.0)


def test_t_critical_matches_scipy():
    stats = pytest.importorskip("scipy.stats")
    for df in range(1, 41):
        assert t_critical(df) == pytest.approx(stats.t.ppf(0.975, df), rel=1e-9)


def test_t_interval():
    rng = np.random.default_rng(7)
    x = rng.uniform(0.6, 1.0, 8)
    mean, half = t_interval(x)
    ref = 2.3646242515927849 * np.sqrt(np.sum((x - x.mean()) ** 2) / 7) / np.sqrt(8)  # t_{0.975, 7}
    assert mean == pytest.approx(x.mean(), rel=1e-12) and half == pytest.approx(ref, rel=1e-8)
    assert t_interval([0.75] * 8) == (0.75, 0.0)
    m1, h1 = t_interval([0.5])
    assert m1 == 0.5 and math.isnan(h1)
    with pytest.raises(ValueError):
        t_interval([])


def test_bootstrap_problems():
    assert bootstrap_problems(np.ones((8, 50), bool)) == (1.0, 1.0)
    assert bootstrap_problems(np.zeros((8, 50), bool)) == (0.0, 0.0)
    rng = np.random.default_rng(11)
    p = rng.uniform(0.3, 1.0, 2000)  # per-problem success probability: problems differ
    correct = rng.random((8, 2000)) < p
    lo, hi = bootstrap_problems(correct, resamples=4000, seed=3)
    per_problem = correct.mean(axis=0)
    half = 1.959964 * per_problem.std(ddof=1) / np.sqrt(per_problem.size)  # normal approximation
    assert lo < correct.mean() < hi
    assert (hi - lo) / 2 == pytest.approx(half, rel=0.1)
    assert (lo + hi) / 2 == pytest.approx(correct.mean(), abs=0.2 * half)
    for bad in (np.zeros(5), np.zeros((0, 3))):
        with pytest.raises(ValueError):
            bootstrap_problems(bad)


def test_accuracy_summary_and_paired_delta():
    a = np.array([[1, 1, 1, 0], [1, 0, 1, 0]], bool)  # per seed 0.75, 0.5
    b = np.array([[1, 0, 1, 0], [0, 1, 1, 0]], bool)  # per seed 0.5, 0.5
    s = accuracy_summary(a, resamples=500)
    assert s.accuracy == pytest.approx(0.625) and s.per_seed == [0.75, 0.5] and s.samples == 8
    half = 12.706204736174707 * np.std([0.75, 0.5], ddof=1) / np.sqrt(2)
    assert s.half_width == pytest.approx(half) and s.ci == pytest.approx([0.625 - half, 0.625 + half])
    assert list(s.as_dict()) == ["accuracy", "half_width", "ci", "ci_bootstrap_problems", "per_seed", "samples"]
    lo, hi = s.ci_bootstrap_problems
    assert 0.0 <= lo <= 0.625 <= hi <= 1.0
    d = paired_delta(a, b)
    assert d.delta == pytest.approx(0.125)
    assert d.half_width == pytest.approx(12.706204736174707 * np.std([0.25, 0.0], ddof=1) / np.sqrt(2))
    with pytest.raises(ValueError):
        paired_delta(a, b[:, :3])
