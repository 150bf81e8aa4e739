"""Confidence intervals of an accuracy measured over seeds x problems (pure NumPy).

``correct [S, n]``: whether sample ``s`` of problem ``i`` is right. The accuracy is the mean
of the S per-seed accuracies; its Student-t interval (S - 1 degrees of freedom) is the spread
due to sampling on this fixed problem set. The percentile bootstrap over problems (each with
its S samples) also counts the choice of problems.
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple, Sequence

import numpy as np

CONFIDENCE = 0.95


def t_two_sided_cdf(t: float, df: int) -> float:
    """P(|T| <= t) for Student's t with integer ``df`` >= 1 (Abramowitz & Stegun 26.7.3-4)."""
    if df < 1 or int(df) != df:
        raise ValueError(f"df must be an integer >= 1, got {df!r}")
    if t <= 0:
        return 0.0
    if math.isinf(t):
        return 1.0
    theta = math.atan(t / math.sqrt(df))
    s, c = math.sin(theta), math.cos(theta)
    if df % 2 == 1:
        series, term = 0.0, c
        for k in range(1, (df - 1) // 2 + 1):  # c, (2/3) c^3, (2*4)/(3*5) c^5, ... up to c^(df-2)
            if k > 1:
                term *= (2 * k - 2) / (2 * k - 1) * c * c
            series += term
        return (2.0 / math.pi) * (theta + s * series)
    series, term = 1.0, 1.0
    for k in range(1, (df - 2) // 2 + 1):  # 1, (1/2) c^2, (1*3)/(2*4) c^4, ... up to c^(df-2)
        term *= (2 * k - 1) / (2 * k) * c * c
        series += term
    return s * series


def t_critical(df: int, confidence: float = CONFIDENCE) -> float:
    """The two-sided critical value: ``t`` with ``P(|T_df| <= t) = confidence``."""
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence must be in (0, 1), got {confidence!r}")
    lo, hi = 0.0, 1.0
    while t_two_sided_cdf(hi, df) < confidence:
        hi *= 2.0
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if t_two_sided_cdf(mid, df) < confidence:
            lo = mid
        else:
            hi = mid
        if hi - lo <= 1e-12 * hi:
            break
    return 0.5 * (lo + hi)


def t_interval(values: Sequence[float], confidence: float = CONFIDENCE) -> tuple[float, float]:
    """``(mean, half_width)`` of the Student-t interval of the mean of ``values`` (NaN width if n < 2)."""
    x = np.asarray(values, np.float64).reshape(-1)
    if x.size == 0:
        raise ValueError("t_interval needs at least one value")
    if x.size < 2:
        return float(x.mean()), float("nan")
    return float(x.mean()), t_critical(x.size - 1, confidence) * float(x.std(ddof=1)) / math.sqrt(x.size)


def bootstrap_problems(correct: np.ndarray, *, resamples: int = 2000, seed: int = 0,
                       confidence: float = CONFIDENCE) -> tuple[float, float]:
    """Percentile-bootstrap interval of the accuracy, resampling problems (columns of
    ``correct [S, n]``) with replacement, each with all its S samples."""
    c = np.asarray(correct, np.float64)
    if c.ndim != 2 or c.size == 0:
        raise ValueError(f"correct must be a non-empty [seeds, problems] array, got shape {c.shape}")
    per_problem = c.mean(axis=0)
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, per_problem.size, size=(resamples, per_problem.size))
    means = per_problem[idx].mean(axis=1)
    alpha = (1.0 - confidence) / 2.0
    lo, hi = np.quantile(means, [alpha, 1.0 - alpha])
    return float(lo), float(hi)


@dataclasses.dataclass(frozen=True)
class AccuracySummary:
    """Mean accuracy of ``correct [S, n]`` with its t-interval over the S per-seed accuracies
    (``ci = accuracy -+ half_width``) and the percentile bootstrap over problems."""

    accuracy: float
    half_width: float
    ci: list[float]
    ci_bootstrap_problems: list[float]
    per_seed: list[float]
    samples: int

    def as_dict(self) -> dict:
        """The fields, in order, as the evaluation's JSON records them."""
        return dataclasses.asdict(self)


def accuracy_summary(correct: np.ndarray, confidence: float = CONFIDENCE, resamples: int = 2000) -> AccuracySummary:
    """The :class:`AccuracySummary` of ``correct [S, n]``."""
    c = np.asarray(correct, bool)
    if c.ndim != 2 or c.size == 0:
        raise ValueError(f"correct must be a non-empty [seeds, problems] array, got shape {c.shape}")
    per_seed = c.mean(axis=1)
    mean, half = t_interval(per_seed, confidence)
    return AccuracySummary(mean, half, [mean - half, mean + half],
                           list(bootstrap_problems(c, resamples=resamples, confidence=confidence)),
                           [float(a) for a in per_seed], int(c.size))


class PairedDelta(NamedTuple):
    """Mean per-seed accuracy difference to a reference and the half-width of its t-interval."""

    delta: float
    half_width: float


def paired_delta(correct: np.ndarray, reference: np.ndarray, confidence: float = CONFIDENCE) -> PairedDelta:
    """Accuracy difference to ``reference`` (same problems and seeds), t-interval over the
    per-seed differences."""
    a, b = np.asarray(correct, bool), np.asarray(reference, bool)
    if a.shape != b.shape:
        raise ValueError(f"paired_delta needs equal shapes, got {a.shape} and {b.shape}")
    return PairedDelta(*t_interval(a.mean(axis=1) - b.mean(axis=1), confidence))
