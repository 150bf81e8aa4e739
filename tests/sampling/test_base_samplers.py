"""base.py: filter_logits (top-k / top-p / min-p) vs NumPy float64, Greedy, Categorical."""

from __future__ import annotations

import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxlp.sampling.base import Categorical, Greedy, filter_logits, sample_with_temperature


def ref_filter(logits, top_k=None, top_p=None, min_p=None):
    """bool keep-mask per row, float64, in base.py's order: top-k, then min-p, then top-p.
    Also returns per row the smallest |mass_before - top_p| (closeness to a float tie)."""
    x = np.asarray(logits, np.float64).copy()
    margin = np.full(x.shape[0], np.inf)
    for r in range(x.shape[0]):
        row = x[r]
        if top_k is not None:
            kth = np.sort(row)[::-1][top_k - 1]
            row[row < kth] = -np.inf
        if min_p is not None:
            p = np.exp(row - row.max())
            row[p < min_p] = -np.inf  # p / p_max < min_p
        if top_p is not None:
            order = np.argsort(-row, kind="stable")
            p = np.exp(row[order] - row.max())
            p /= p.sum()
            before = np.cumsum(p) - p
            keep_sorted = before < top_p
            keep_sorted[0] = True
            margin[r] = np.min(np.abs(before[1:] - top_p), initial=np.inf)
            cut = row[order][keep_sorted].min()
            row[row < cut] = -np.inf
    return np.isfinite(x), margin


@pytest.mark.parametrize(
    "kw",
    [
        dict(top_k=1), dict(top_k=5), dict(top_k=64),
        dict(top_p=0.5), dict(top_p=0.9), dict(top_p=0.95), dict(top_p=1e-4),
        dict(min_p=0.05), dict(min_p=0.3), dict(min_p=1.0),
        dict(top_k=10, top_p=0.8), dict(top_p=0.95, min_p=0.1), dict(top_k=20, top_p=0.7, min_p=0.02),
    ],
)
def test_filter_logits_matches_numpy(kw):
    rng = np.random.default_rng(zlib.crc32(repr(sorted(kw.items())).encode()))
    logits = (rng.normal(size=(40, 64)) * rng.uniform(0.3, 4, size=(40, 1))).astype(np.float32)
    got = np.isfinite(np.asarray(filter_logits(jnp.asarray(logits), **kw)))
    keep, margin = ref_filter(logits, **kw)
    clear = margin > 1e-5  # rows not within float32 rounding of a top-p tie
    assert clear.sum() >= 36
    np.testing.assert_array_equal(got[clear], keep[clear])
    assert np.all(got[np.arange(40), logits.argmax(-1)])  # the most likely token always survives
    kept = np.asarray(filter_logits(jnp.asarray(logits), **kw))
    np.testing.assert_array_equal(kept[got], logits[got])  # survivors unchanged


def test_filter_logits_ties_and_masked_input():
    logits = np.array([[3.0, 3.0, 1.0, 1.0, 1.0, -np.inf], [0.0, 0.0, 0.0, 0.0, 0.0, 0.0]], np.float32)
    # top-k keeps every token tied with the k-th
    np.testing.assert_array_equal(np.isfinite(filter_logits(jnp.asarray(logits), top_k=3)), [[1, 1, 1, 1, 1, 0], [1] * 6])
    # top-p: the token crossing p is kept, and ties with the smallest kept logit too
    np.testing.assert_array_equal(np.isfinite(filter_logits(jnp.asarray(logits), top_p=0.5)), [[1, 1, 0, 0, 0, 0], [1] * 6])
    got = np.isfinite(np.asarray(filter_logits(jnp.asarray(logits), top_p=0.95)))
    np.testing.assert_array_equal(got, [[1, 1, 1, 1, 1, 0], [1] * 6])


def test_greedy_sampler():
    rng = np.random.default_rng(1)
    logits = rng.normal(size=(7, 33)).astype(np.float32)
    out = Greedy().sample((), jnp.asarray(logits), jax.random.key(0))
    np.testing.assert_array_equal(np.asarray(out.tokens), logits.argmax(-1))
    assert out.tokens.dtype == jnp.int32
    np.testing.assert_array_equal(np.asarray(out.temperature), np.zeros(7))
    assert Greedy().init(3) == ()


@pytest.mark.parametrize("temperature", [0.0, 1e-7, 1e-6])
def test_categorical_tiny_temperature_is_argmax(temperature):
    rng = np.random.default_rng(2)
    logits = rng.normal(size=(9, 40)).astype(np.float32)
    out = jax.jit(Categorical(temperature=temperature, top_p=0.9).sample)((), jnp.asarray(logits), jax.random.key(5))
    np.testing.assert_array_equal(np.asarray(out.tokens), logits.argmax(-1))
    np.testing.assert_array_equal(np.asarray(out.temperature), np.zeros(9))


def test_categorical_reports_temperature_above_greedy_cutoff():
    out = Categorical(temperature=1e-5).sample((), jnp.zeros((2, 4)), jax.random.key(0))
    np.testing.assert_array_equal(np.asarray(out.temperature), np.full(2, np.float32(1e-5)))


@pytest.mark.parametrize("temperature,kw", [(0.6, dict(top_p=0.95)), (1.3, dict(min_p=0.05)), (1.0, dict(top_k=3))])
def test_categorical_distribution(temperature, kw):
    logits_row = np.array([1.0, 0.7, 0.2, 0.0, -0.4, -1.0, -2.0, -4.0], np.float32)
    n = 20000
    out = jax.jit(Categorical(temperature=temperature, **kw).sample)(
        (), jnp.broadcast_to(jnp.asarray(logits_row), (n, 8)), jax.random.key(11)
    )
    scaled = logits_row / np.float32(temperature)
    keep, _ = ref_filter(scaled[None], **kw)
    x = scaled.astype(np.float64)
    q = np.where(keep[0], np.exp(x - x.max()), 0.0)
    q /= q.sum()
    freq = np.bincount(np.asarray(out.tokens), minlength=8) / n
    assert np.all(freq[q == 0] == 0)
    np.testing.assert_array_less(np.abs(freq - q), 5 * np.sqrt(q * (1 - q) / n) + 1e-9)


def test_seeds_are_deterministic_and_rows_independent():
    rng = np.random.default_rng(3)
    logits = rng.normal(size=(16, 100)).astype(np.float32)
    sampler = Categorical(temperature=1.0, top_p=0.95)
    f = jax.jit(sampler.sample)
    a = np.asarray(f((), jnp.asarray(logits), jax.random.key(1)).tokens)
    b = np.asarray(f((), jnp.asarray(logits), jax.random.key(1)).tokens)
    c = np.asarray(f((), jnp.asarray(logits), jax.random.key(2)).tokens)
    np.testing.assert_array_equal(a, b)
    assert np.any(a != c)
    other = logits.copy()
    other[1:] = rng.normal(size=(15, 100))
    d = np.asarray(f((), jnp.asarray(other), jax.random.key(1)).tokens)
    assert d[0] == a[0]


def test_sample_with_temperature_per_row():
    logits = jnp.asarray(np.random.default_rng(4).normal(size=(3, 50)).astype(np.float32))
    temps = jnp.asarray([0.0, 1.0, 1e-6])
    tokens = np.asarray(sample_with_temperature(logits, temps, jax.random.key(0)))
    assert tokens[0] == int(jnp.argmax(logits[0])) and tokens[2] == int(jnp.argmax(logits[2]))


def test_categorical_hyperparameters_are_leaves():
    calls = []

    @jax.jit
    def f(sampler, logits, key):
        calls.append(1)
        return sampler.sample((), logits, key).tokens

    logits = jnp.zeros((2, 8))
    f(Categorical(temperature=0.6, top_p=0.9), logits, jax.random.key(0))
    f(Categorical(temperature=1.1, top_p=0.5), logits, jax.random.key(0))
    assert len(calls) == 1


def test_top_p_fast_path_equals_full_sort():
    """The top-k candidate path and the full-sort path keep the same tokens."""
    import jaxlp.sampling.base as base

    rng = np.random.default_rng(123)
    for scale in (0.5, 3.0, 8.0):  # flat (sort path) to peaked (candidate path) rows
        logits = jnp.asarray(rng.standard_normal((4, 3000)) * scale, jnp.float32)
        fast = base.filter_logits(logits, top_p=0.9)
        old = base.TOP_P_CANDIDATES
        try:
            base.TOP_P_CANDIDATES = 3000  # forces the exact full sort
            full = base.filter_logits(logits, top_p=0.9)
        finally:
            base.TOP_P_CANDIDATES = old
        np.testing.assert_array_equal(np.isfinite(np.asarray(fast)), np.isfinite(np.asarray(full)))
