"""base.py: filter_logits (top-k / top-p / min-p) vs NumPy float64, Greedy, Categorical."""

from __future__ import annotations

import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxlp.sampling.base as base
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


# ----------------------------------------------------------------------------------------------
# The sort-free top-p path (nucleus_cut): every stage, the fallback, the edge cases


@pytest.fixture
def nucleus_config(monkeypatch):
    """Set NUCLEUS_CAPACITY / NUCLEUS_EXACT_FALLBACK / PREFIX_BLOCK for one test."""

    def set_config(**kw):
        for name, value in kw.items():
            monkeypatch.setattr(base, name, value)

    return set_config


def crossing_margin(logits, top_p, min_p=None):
    """Per row, how far (float64) the mass before the last kept and the first dropped token
    lies from p: rows closer than float32 rounding are ties the two sides may break apart."""
    out = np.full(len(logits), np.inf)
    for r, row in enumerate(np.asarray(logits, np.float64)):
        if min_p is not None:
            row = np.where(np.exp(row - row.max()) < min_p, -np.inf, row)
        q = np.exp(np.sort(row)[::-1] - row.max())
        q /= q.sum()
        before = np.cumsum(q) - q
        k = max(int(np.sum(before < top_p)) - 1, 0)  # last kept position
        out[r] = np.min(np.abs(before[k:k + 2] - top_p))
    return out


def check_top_p(logits, top_p, min_p=None, min_clear=None):
    """filter_logits vs the float64 NumPy reference, on rows not within rounding of a tie."""
    logits = np.asarray(logits, np.float32)
    got = np.isfinite(np.asarray(filter_logits(jnp.asarray(logits), top_p=top_p, min_p=min_p)))
    keep, _ = ref_filter(logits, top_p=top_p, min_p=min_p)
    clear = crossing_margin(logits, top_p, min_p) > 1e-6
    assert clear.sum() >= (len(logits) - 1 if min_clear is None else min_clear)
    np.testing.assert_array_equal(got[clear], keep[clear])
    assert np.all(got[np.arange(len(logits)), logits.argmax(-1)])
    return got


# The final stage as configured by default (with a smaller prefix block) and in a shape whose last
# bracket is left unresolved often (no refinement: splits 1; 8 slots) so that many rows take the
# full-sort fallback.
SEARCH_SHAPES = [
    dict(NUCLEUS_CAPACITY=128, PREFIX_BLOCK=64),
    dict(NUCLEUS_CAPACITY=8, NUCLEUS_SPLITS=1),
]
SHAPE_IDS = ["compact", "compact-fallback"]


@pytest.mark.parametrize("shape", SEARCH_SHAPES, ids=SHAPE_IDS)
@pytest.mark.parametrize("vocab", [1000, 3001])
@pytest.mark.parametrize("scale", [0.3, 2.0, 30.0])
def test_nucleus_matches_numpy_across_shapes(vocab, scale, shape, nucleus_config):
    """Flat to peaked rows, vocab not a multiple of the prefix block."""
    nucleus_config(**shape)
    rng = np.random.default_rng(vocab * 7 + int(scale * 10))
    logits = (rng.standard_normal((6, vocab)) * scale * rng.uniform(0.5, 1.5, (6, 1))).astype(np.float32)
    for p in (0.5, 0.9, 0.95):
        check_top_p(logits, p)


def test_nucleus_candidate_path_without_fallback(nucleus_config):
    """With the fallback off (no lax.cond), rows that stage 3 resolves are still exact."""
    nucleus_config(NUCLEUS_CAPACITY=512, NUCLEUS_EXACT_FALLBACK=False)
    rng = np.random.default_rng(41)
    logits = (rng.standard_normal((8, 20000)) * rng.uniform(2, 6, (8, 1))).astype(np.float32)
    check_top_p(logits, 0.95)
    check_top_p(logits, 0.6)


def test_nucleus_overflow_without_fallback_keeps_a_superset(nucleus_config):
    nucleus_config(NUCLEUS_CAPACITY=16, NUCLEUS_SPLITS=1, NUCLEUS_EXACT_FALLBACK=False)
    rng = np.random.default_rng(42)
    logits = (rng.standard_normal((4, 5000)) * 0.2).astype(np.float32)  # thousands near the cut
    got = np.isfinite(np.asarray(filter_logits(jnp.asarray(logits), top_p=0.9)))
    keep, _ = ref_filter(logits, top_p=0.9)
    assert np.all(got >= keep) and np.any(got > keep)


def test_nucleus_fallback_rows_do_not_change_other_rows(nucleus_config):
    """A row that overflows (full sort) beside rows that do not: the others keep their cut."""
    nucleus_config(NUCLEUS_CAPACITY=64, NUCLEUS_SPLITS=1)
    rng = np.random.default_rng(43)
    peaked = (rng.standard_normal((3, 4000)) * 8).astype(np.float32)
    flat = (rng.standard_normal((1, 4000)) * 0.1).astype(np.float32)
    alone = np.isfinite(np.asarray(filter_logits(jnp.asarray(peaked), top_p=0.9)))
    mixed = np.isfinite(np.asarray(filter_logits(jnp.asarray(np.concatenate([peaked, flat])), top_p=0.9)))
    np.testing.assert_array_equal(mixed[:3], alone)
    check_top_p(np.concatenate([peaked, flat]), 0.9)


@pytest.mark.parametrize("shape", SEARCH_SHAPES, ids=SHAPE_IDS)
def test_nucleus_ties_at_the_threshold(shape, nucleus_config):
    """Logits on a coarse grid (as from a bf16 lm_head): every token tied with the cut is kept."""
    nucleus_config(**shape)
    rng = np.random.default_rng(44)
    logits = np.round(rng.standard_normal((8, 3000)) * 3 * 4) / 4  # steps of 0.25: many ties
    logits = logits.astype(np.float32)
    for p in (0.3, 0.8, 0.95):
        got = check_top_p(logits, p, min_clear=6)
        for r in range(len(logits)):  # kept set is closed under ties
            cut = logits[r][got[r]].min()
            assert np.all(got[r][logits[r] >= cut])


def test_nucleus_all_equal_and_masked_rows():
    logits = np.zeros((3, 2500), np.float32)
    logits[1, :2000] = -np.inf  # 500 equal finite tokens
    logits[2, ::2] = -np.inf
    logits[2, 1::2] = 1.5
    for p in (0.05, 0.5, 0.95, 1.0):
        got = np.isfinite(np.asarray(filter_logits(jnp.asarray(logits), top_p=p)))
        np.testing.assert_array_equal(got, np.isfinite(logits))  # all ties: all kept


@pytest.mark.parametrize("shape", SEARCH_SHAPES, ids=SHAPE_IDS)
def test_nucleus_neg_inf_entries(shape, nucleus_config):
    nucleus_config(**shape)
    rng = np.random.default_rng(45)
    logits = (rng.standard_normal((6, 2000)) * rng.uniform(0.5, 5, (6, 1))).astype(np.float32)
    logits[rng.random(logits.shape) < 0.4] = -np.inf
    got = check_top_p(logits, 0.9)
    assert not np.any(got[~np.isfinite(logits)])


def test_nucleus_p_one_keeps_everything_finite():
    rng = np.random.default_rng(46)
    logits = (rng.standard_normal((4, 3000)) * 10).astype(np.float32)
    logits[0, :10] = -np.inf
    got = np.isfinite(np.asarray(filter_logits(jnp.asarray(logits), top_p=1.0)))
    np.testing.assert_array_equal(got, np.isfinite(logits))
    tiny = np.isfinite(np.asarray(filter_logits(jnp.asarray(logits), top_p=1e-6)))
    np.testing.assert_array_equal(tiny.sum(-1), np.ones(4))  # only the max


@pytest.mark.parametrize("shape", SEARCH_SHAPES, ids=SHAPE_IDS)
@pytest.mark.parametrize("min_p", [0.001, 0.5])
def test_nucleus_with_min_p(min_p, shape, nucleus_config):
    nucleus_config(**shape)
    rng = np.random.default_rng(int(min_p * 1000) + 47)
    logits = (rng.standard_normal((6, 3000)) * rng.uniform(0.5, 6, (6, 1))).astype(np.float32)
    check_top_p(logits, 0.9, min_p=min_p, min_clear=5)


def test_nucleus_per_row_p_and_large_vocab():
    """Default configuration at a real vocab size: one row per regime, a per-row p."""
    rng = np.random.default_rng(48)
    scale = np.array([0.05, 1.0, 4.0, 12.0], np.float32)[:, None]
    logits = (rng.standard_normal((4, 151936)) * scale).astype(np.float32)
    p = np.array([0.95, 0.9, 0.95, 0.5], np.float32)
    got = np.isfinite(np.asarray(filter_logits(jnp.asarray(logits), top_p=jnp.asarray(p))))
    for r in range(4):
        keep, margin = ref_filter(logits[r:r + 1], top_p=float(p[r]))
        if margin[0] > 1e-5:
            np.testing.assert_array_equal(got[r], keep[0])


def test_prefix_count_and_compact():
    rng = np.random.default_rng(49)
    for v in (1, 7, 256, 1000, 5003):
        mask = rng.random((3, v)) < rng.uniform(0.01, 0.9, (3, 1))
        np.testing.assert_array_equal(np.asarray(base.prefix_count(jnp.asarray(mask))), np.cumsum(mask, -1))
        values = rng.standard_normal((3, v)).astype(np.float32)
        out = np.asarray(base.compact(jnp.asarray(values), jnp.asarray(mask), 40, -np.inf))
        for r in range(3):
            want = values[r][mask[r]][:40]
            np.testing.assert_array_equal(out[r, : len(want)], want)
            assert np.all(out[r, len(want):] == -np.inf)


def test_entropy_and_max_chunked():
    rng = np.random.default_rng(50)
    v = 2 * base.ENTROPY_CHUNK + 37  # not a multiple of the chunk
    logits = (rng.standard_normal((4, v)) * np.array([0.1, 1, 5, 40])[:, None]).astype(np.float32)
    logits[1, : v // 2] = -np.inf
    h, m = base.entropy_and_max(jnp.asarray(logits))
    x = logits.astype(np.float64) - logits.max(-1, keepdims=True)
    q = np.exp(x)
    q /= q.sum(-1, keepdims=True)
    ref = -np.sum(np.where(q > 0, q * np.log(np.where(q > 0, q, 1)), 0), -1)
    np.testing.assert_allclose(np.asarray(h), ref, rtol=2e-5, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(m), logits.max(-1))


@pytest.mark.parametrize("temperature", [2e-6, 1e-4])
def test_near_zero_temperature_is_argmax(temperature):
    """Just above the greedy cutoff the nucleus is the max (rows with a clear max)."""
    rng = np.random.default_rng(51)
    logits = (rng.standard_normal((16, 5000)) * 3).astype(np.float32)
    out = jax.jit(Categorical(temperature=temperature, top_p=0.95).sample)((), jnp.asarray(logits), jax.random.key(2))
    np.testing.assert_array_equal(np.asarray(out.tokens), logits.argmax(-1))


@pytest.mark.parametrize("shape", SEARCH_SHAPES, ids=SHAPE_IDS)
def test_nucleus_distribution_chi_square(shape, nucleus_config):
    """Empirical frequencies vs the exact nucleus distribution, every path."""
    nucleus_config(**shape)
    logits_row = np.array([2.0, 1.6, 1.6, 1.1, 0.9, 0.3, 0.0, -0.2, -1.0, -3.0, -np.inf, -5.0], np.float32)
    temperature, p, n = 0.8, 0.85, 40000
    f = jax.jit(Categorical(temperature=temperature, top_p=p).sample)
    out = f((), jnp.broadcast_to(jnp.asarray(logits_row), (n, 12)), jax.random.key(len(shape)))
    scaled = logits_row * (np.float32(1) / np.float32(temperature))
    keep, margin = ref_filter(scaled[None], top_p=p)
    assert margin[0] > 1e-3
    x = np.where(keep[0], scaled.astype(np.float64), -np.inf)
    q = np.exp(x - x.max())
    q /= q.sum()
    counts = np.bincount(np.asarray(out.tokens), minlength=12)
    assert np.all(counts[q == 0] == 0)
    expected = n * q[q > 0]
    chi2 = np.sum((counts[q > 0] - expected) ** 2 / expected)
    dof = int((q > 0).sum()) - 1
    assert chi2 < dof + 6 * np.sqrt(2 * dof), (chi2, dof)  # ~4 sigma for chi-square(dof)


def test_cut_statistics_and_split():
    """The per-cut statistics of each pass vs NumPy, and the cut points of a split."""
    rng = np.random.default_rng(52)
    y = rng.standard_normal((3, 500)).astype(np.float32)
    keep = rng.random((3, 500)) < 0.8
    cuts = np.sort(rng.standard_normal((3, 9)).astype(np.float32), axis=1)[:, ::-1]
    e = np.exp(y - y.max(1, keepdims=True)).astype(np.float32) * keep
    mass, count = base._mass_above(jnp.asarray(y), jnp.asarray(e), jnp.asarray(keep), jnp.asarray(cuts))
    for r in range(3):
        for j, c in enumerate(cuts[r]):
            above = keep[r] & (y[r] >= c)
            np.testing.assert_allclose(float(mass[r, j]), e[r][above].astype(np.float64).sum(), rtol=1e-5)
            assert int(count[r, j]) == above.sum()
    lo = jnp.asarray([0.0, -3.0, 1.0], jnp.float32)
    hi = jnp.asarray([1.0, -2.9999, 1.0000001], jnp.float32)
    sub = np.asarray(base._split(lo, hi, 64))
    assert sub.shape == (3, 65)
    np.testing.assert_array_equal(sub[:, 0], np.asarray(hi))
    np.testing.assert_array_equal(sub[:, -1], np.asarray(lo))
    assert np.all(np.diff(sub, axis=1) <= 0)
