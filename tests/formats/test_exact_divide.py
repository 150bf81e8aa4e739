"""exact_divide and cast_rounded (jaxlp.formats.base) against NumPy float64 division rounded to FP32."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from jaxlp.formats.base import cast_rounded, exact_divide


def ref_divide(a, b):
    with np.errstate(over="ignore"):  # overflow to inf is part of the test
        return (a.astype(np.float64) / b.astype(np.float64)).astype(np.float32)  # with gradual underflow


def test_random_quotients_are_correctly_rounded():
    rng = np.random.default_rng(601)
    n = 200_000
    a = (rng.standard_normal(n) * np.exp2(rng.integers(-70, 70, n))).astype(np.float32)
    b = (rng.standard_normal(n) * np.exp2(rng.integers(-70, 70, n))).astype(np.float32)
    a[:100] = 0.0
    a[100:200] = -0.0
    a[200:300] = b[200:300] * np.float32(2.5)  # many exact quotients
    a[300:2000] = (rng.standard_normal(1700) * 2.0**-60).astype(np.float32)  # subnormal and underflowing quotients
    b[300:2000] = np.exp2(rng.uniform(60, 100, 1700)).astype(np.float32)
    out = np.asarray(jax.jit(exact_divide)(a, b))
    ref = ref_divide(a, b)
    assert np.sum((ref != 0) & (np.abs(ref) < 2.0**-126)) > 500, "test should reach subnormal quotients"
    np.testing.assert_array_equal(out.view(np.uint32), ref.view(np.uint32))


def test_broadcast_scalar_and_constant_divisors():
    # XLA rewrites x / c into x * (1 / c): about a quarter of these quotients would be 1 ulp off.
    x = np.random.default_rng(602).uniform(0.01, 100, 4096).astype(np.float32)
    ref = ref_divide(x, np.float32(2688.0))
    np.testing.assert_array_equal(np.asarray(jax.jit(lambda v: exact_divide(v, 2688.0))(x)), ref)
    rows = jnp.asarray(x.reshape(64, 64))
    d = jnp.asarray(np.random.default_rng(603).uniform(0.1, 3, 64).astype(np.float32))
    out = jax.jit(lambda v, s: exact_divide(v, s[:, None]))(rows, d)
    np.testing.assert_array_equal(np.asarray(out), ref_divide(np.asarray(rows), np.asarray(d)[:, None]))
    assert np.all(np.asarray(jax.jit(exact_divide)(x, x)) == 1.0)


def test_special_values():
    a = np.array([1.0, 0.0, 3e38, -3e38, 1e-30, 5.0, np.inf], np.float32)
    b = np.array([0.0, 0.0, 1e-3, 1e-3, 1e20, np.inf, 2.0], np.float32)
    out = np.asarray(exact_divide(a, b))
    assert out[0] == np.inf and np.isnan(out[1])
    assert out[2] == np.inf and out[3] == -np.inf  # overflow
    assert out[4] == 0.0 and not np.signbit(out[4])  # below the subnormal range
    assert out[5] == 0.0 and out[6] == np.inf


def test_cast_rounded_keeps_the_rounding_under_jit():
    x = np.random.default_rng(604).uniform(0.001, 400, 4096).astype(np.float32)
    out = np.asarray(jax.jit(lambda v: cast_rounded(v, jnp.float8_e4m3fn).astype(jnp.float32))(x))
    np.testing.assert_array_equal(out, x.astype(ml_dtypes.float8_e4m3fn).astype(np.float32))
