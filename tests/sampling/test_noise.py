"""jaxlp.sampling.noise against a NumPy uint64 implementation of the documented hash."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from jaxlp.sampling import noise

M32 = (1 << 32) - 1


def mix_np(x):
    x = x.astype(np.uint64)
    x ^= x >> 16
    x = (x * 0x7FEB352D) & M32
    x ^= x >> 15
    x = (x * 0x846CA68B) & M32
    return x ^ (x >> 16)


def gumbel_np(keys, v):
    i = np.arange(v, dtype=np.uint64)[None, :]
    k0 = keys[:, :1].astype(np.uint64)
    k1 = keys[:, 1:].astype(np.uint64)
    bits = mix_np(mix_np((i + k0) & M32) ^ k1)
    u = ((bits >> 9).astype(np.float64) + 0.5) * 2.0**-23
    return -np.log(-np.log(u))


def test_gumbel_matches_numpy_hash():
    rng = np.random.default_rng(0)
    keys = rng.integers(0, 1 << 32, (3, 2), dtype=np.uint64).astype(np.uint32)
    keys[0] = [0, 0]
    keys[1] = [M32, M32]  # i + k0 wraps around
    got = np.asarray(noise.gumbel(jnp.asarray(keys), 5000), np.float64)
    np.testing.assert_allclose(got, gumbel_np(keys, 5000), rtol=2e-6, atol=2e-6)


def test_mix32_is_lowbias32_and_a_bijection_on_a_sample():
    x = np.random.default_rng(1).integers(0, 1 << 32, 100_000, dtype=np.uint64)
    got = np.asarray(noise.mix32(jnp.asarray(x.astype(np.uint32)))).astype(np.uint64)
    np.testing.assert_array_equal(got, mix_np(x))
    assert len(np.unique(got)) == len(np.unique(x))


def test_bounds_are_the_extreme_uniforms():
    u_lo, u_hi = 0.5 * 2.0**-23, ((1 << 23) - 0.5) * 2.0**-23
    assert noise.GUMBEL_MIN == pytest.approx(-np.log(-np.log(u_lo)), abs=1e-12)
    assert noise.GUMBEL_MAX == pytest.approx(-np.log(-np.log(u_hi)), abs=1e-9)
    g = np.asarray(noise.gumbel(jnp.asarray([[7, 9]], jnp.uint32), 200_000))
    assert noise.GUMBEL_MIN - 1e-5 <= g.min() and g.max() <= noise.GUMBEL_MAX + 1e-4


def test_gumbel_distribution():
    keys = noise.row_keys(noise.key_words(jax.random.key(3)), 4)
    g = np.asarray(noise.gumbel(keys, 50_000), np.float64).reshape(-1)
    assert stats.kstest(g, stats.gumbel_r.cdf).pvalue > 1e-3
    assert abs(g.mean() - np.euler_gamma) < 0.01


def test_key_words():
    key = jax.random.key(7)
    np.testing.assert_array_equal(noise.key_words(key), jax.random.key_data(key))
    raw = jnp.asarray([3, 4], jnp.uint32)
    np.testing.assert_array_equal(noise.key_words(raw), raw)
    rbg = noise.key_words(jax.random.key(7, impl="rbg"))
    assert rbg.shape == (2,) and rbg.dtype == jnp.uint32
    assert not np.array_equal(rbg, noise.key_words(jax.random.key(8, impl="rbg")))


def test_row_keys_match_numpy_and_do_not_depend_on_batch_size():
    words = np.asarray([0xDEADBEEF, 0xFFFFFFFF], np.uint32)
    b = np.arange(5, dtype=np.uint64)
    k0 = mix_np(words[0] ^ mix_np((b * 0x9E3779B9 + 0x7F4A7C15) & M32))
    k1 = mix_np((words[1] + mix_np(b ^ 0x85EBCA6B)) & M32)
    got = np.asarray(noise.row_keys(jnp.asarray(words), 5)).astype(np.uint64)
    np.testing.assert_array_equal(got, np.stack([k0, k1], -1))
    np.testing.assert_array_equal(noise.row_keys(jnp.asarray(words), 2), got[:2].astype(np.uint32))
    assert len({tuple(r) for r in got}) == 5
    g = np.asarray(noise.gumbel(jnp.asarray(got.astype(np.uint32)), 1000))
    assert abs(np.corrcoef(g[0], g[1])[0, 1]) < 0.15
