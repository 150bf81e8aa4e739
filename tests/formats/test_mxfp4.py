"""MXFP4 against a float64 NumPy reference of the OCP MX v1.0 rule (scales checked via ml_dtypes E8M0)."""

import hypothesis.extra.numpy as hnp
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import jaxlp.formats as F
from jaxlp.formats import MXFP4Array, mxfp4

MAGS = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def ref_e2m1(q):
    a = np.abs(q)
    dist = np.abs(a[..., None] - MAGS)
    best = dist == dist.min(-1, keepdims=True)
    even = best & (np.arange(8) % 2 == 0)
    idx = np.where(even.any(-1), np.argmax(even, -1), np.argmax(best, -1))
    return (idx | np.where(q < 0, 8, 0)).astype(np.uint8)


def ref_mxfp4(x, block_size=32):
    """Returns (codes [..., K], shared exponents [..., K/bs], dequantized float32)."""
    x = np.asarray(x, np.float32).astype(np.float64)
    blocks = x.reshape(*x.shape[:-1], x.shape[-1] // block_size, block_size)
    bamax = np.max(np.abs(blocks), axis=-1)
    _, e = np.frexp(bamax)  # bamax = m * 2**e, m in [0.5, 1): floor(log2) = e - 1
    floor_log2 = np.where(bamax > 0, e - 1, -1000)
    shared = np.clip(floor_log2 - 2, -127, 127)
    q = np.clip(blocks / np.exp2(shared)[..., None], -6.0, 6.0)
    codes = ref_e2m1(q)
    vals = np.where(codes & 8, -1.0, 1.0) * MAGS[codes & 7]
    deq = (vals * np.exp2(shared)[..., None]).astype(np.float32)
    return codes.reshape(x.shape), shared, deq.reshape(x.shape)


def unpack_ref(packed):
    packed = np.asarray(packed)
    return np.stack([packed & 0xF, packed >> 4], -1).reshape(*packed.shape[:-1], -1)


def assert_matches(q, ref):
    codes, shared, deq = ref
    assert isinstance(q, MXFP4Array)
    np.testing.assert_array_equal(unpack_ref(q.data), codes)
    scale = np.asarray(q.scale)
    assert scale.dtype == ml_dtypes.float8_e8m0fnu
    np.testing.assert_array_equal(scale.view(np.uint8), (shared + 127).astype(np.uint8))
    np.testing.assert_array_equal(scale.astype(np.float64), np.exp2(shared))  # ml_dtypes decodes E8M0
    np.testing.assert_array_equal(scale.view(np.uint8), np.exp2(shared).astype(ml_dtypes.float8_e8m0fnu).view(np.uint8))
    np.testing.assert_array_equal(np.asarray(q.shared_exponent()), shared)
    np.testing.assert_array_equal(np.asarray(q.dequantize()), deq)


@pytest.mark.parametrize(
    ("shape", "block_size", "seed"),
    [((8, 256), 32, 301), ((3, 5, 32), 32, 302), ((1, 16), 16, 303), ((4, 128), 64, 304), ((6, 64), 16, 305)],
)
def test_normal_inputs(shape, block_size, seed):
    x = np.random.default_rng(seed).standard_normal(shape).astype(np.float32)
    assert_matches(mxfp4.quantize(jnp.asarray(x), block_size=block_size), ref_mxfp4(x, block_size))


def test_heavy_tailed_and_wide_range():
    rng = np.random.default_rng(306)
    x = rng.standard_t(2, (16, 128))
    x *= 10.0 ** rng.uniform(-30, 30, (16, 4, 1)).repeat(32, -1).reshape(16, 128)  # per-block magnitude
    x = x.astype(np.float32)
    assert_matches(mxfp4.quantize(jnp.asarray(x)), ref_mxfp4(x))


def test_zeros_and_all_zero_blocks():
    rng = np.random.default_rng(307)
    x = rng.standard_normal((4, 128)).astype(np.float32)
    x[rng.random(x.shape) < 0.3] = 0.0
    x[1, 32:64] = 0.0
    x[3] = 0.0
    q = mxfp4.quantize(jnp.asarray(x))
    assert_matches(q, ref_mxfp4(x))
    shared = np.asarray(q.shared_exponent())
    assert shared[1, 1] == -127 and np.all(shared[3] == -127)  # the microxcaling convention
    assert np.all(np.asarray(q.dequantize())[3] == 0)


def test_all_zero_tensor():
    x = np.zeros((2, 64), np.float32)
    q = mxfp4.quantize(jnp.asarray(x))
    assert np.all(np.asarray(q.data) == 0)
    np.testing.assert_array_equal(np.asarray(q.dequantize()), x)
    assert_matches(q, ref_mxfp4(x))


def test_exponent_choice_saturation_and_ties():
    # Block max 7.9: floor(log2) = 2 -> scale 1, and 7.9 saturates to 6 (the OCP rule clips).
    # Block max exactly 8: scale 2. Block max just below 8: scale 1.
    base = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -0.75, -1.25, -1.75, -2.5, -3.5, -5.0])
    rows = []
    for top in (7.9, 8.0, np.nextafter(np.float32(8.0), np.float32(0))):
        rows.append(np.concatenate([[top], base, np.zeros(17)]).astype(np.float32))
    x = np.stack(rows)
    q = mxfp4.quantize(jnp.asarray(x))
    np.testing.assert_array_equal(np.asarray(q.shared_exponent())[:, 0], [0, 1, 0])
    codes = unpack_ref(q.data)
    assert codes[0, 0] == 7 and codes[2, 0] == 7  # saturated to 6
    np.testing.assert_array_equal(codes[0, 1:15], [0, 2, 2, 4, 4, 6, 6, 8, 10, 10, 12, 12, 14, 14])
    assert_matches(q, ref_mxfp4(x))


def test_bf16_input():
    x = jnp.asarray(np.random.default_rng(308).standard_normal((4, 64)) * 100, jnp.bfloat16)
    q = mxfp4.quantize(x)
    assert_matches(q, ref_mxfp4(np.asarray(x.astype(jnp.float32))))
    assert q.dequantize(jnp.bfloat16).dtype == jnp.bfloat16


def test_registry():
    x = jnp.asarray(np.random.default_rng(309).standard_normal((2, 64)), jnp.float32)
    q = F.quantize(x, "mxfp4", block_size=16)
    assert isinstance(q, MXFP4Array) and q.block_size == 16
    np.testing.assert_array_equal(np.asarray(F.dequantize(q)), np.asarray(q.dequantize()))
    assert F.array_class("mxfp4") is MXFP4Array


def test_errors():
    good = jnp.ones((2, 64), jnp.float32)
    with pytest.raises(ValueError, match="multiple of the block size 32"):
        mxfp4.quantize(jnp.ones((2, 48), jnp.float32))
    with pytest.raises(ValueError, match="block_size"):
        mxfp4.quantize(good, block_size=8)
    for bad in (np.nan, np.inf):
        with pytest.raises(ValueError, match="NaN or Inf"):
            mxfp4.quantize(good.at[0, 0].set(bad))
    with pytest.raises(ValueError, match="floating"):
        mxfp4.quantize(jnp.ones((2, 64), jnp.int8))


def test_jit_identical():
    x = jnp.asarray(np.random.default_rng(310).standard_t(3, (6, 96)), jnp.float32)
    eager = mxfp4.quantize(x)
    jitted = jax.jit(mxfp4.quantize, static_argnames="block_size")(x, block_size=32)
    assert jax.tree.structure(jitted) == jax.tree.structure(eager)
    np.testing.assert_array_equal(np.asarray(jitted.data), np.asarray(eager.data))
    np.testing.assert_array_equal(np.asarray(jitted.scale).view(np.uint8), np.asarray(eager.scale).view(np.uint8))
    np.testing.assert_array_equal(np.asarray(jax.jit(lambda q: q.dequantize())(eager)), np.asarray(eager.dequantize()))


@pytest.mark.parametrize(("block_size", "bits"), [(16, 4.5), (32, 4.25), (64, 4.125)])
def test_nbytes_and_bits(block_size, bits):
    q = mxfp4.quantize(jnp.ones((64, 256), jnp.float32), block_size=block_size)
    assert q.nbytes == 64 * 128 + 64 * 256 // block_size
    assert q.bits_per_element == bits
    q.check()
    with pytest.raises(ValueError, match="scale"):
        MXFP4Array(q.data, q.scale[:, :-1], q.shape, block_size).check()


@settings(max_examples=40, deadline=None)
@given(
    hnp.arrays(
        np.float32,
        st.sampled_from([(1, 32), (2, 64), (3, 32)]),
        elements=st.one_of(
            st.just(0.0),
            st.floats(2.0**-100, 2.0**120, width=32) | st.floats(-(2.0**120), -(2.0**-100), width=32),
        ),
    )
)
def test_fuzz_error_within_half_step(x):
    q = mxfp4.quantize(jnp.asarray(x))
    out = np.asarray(q.dequantize()).astype(np.float64)
    assert np.all(np.isfinite(out))
    codes, shared, _ = ref_mxfp4(x)
    np.testing.assert_array_equal(unpack_ref(q.data), codes)
    scale = np.exp2(shared).repeat(32, -1)
    xd = x.astype(np.float64)
    t = np.abs(xd) / scale
    spacing = np.where(t < 2, 0.5, np.where(t < 4, 1.0, 2.0))
    bound = np.maximum(0.5 * spacing * scale, np.abs(xd) - 6 * scale)
    assert np.all(np.abs(out - xd) <= bound)
