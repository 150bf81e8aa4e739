"""E2M1 codec against an independent float64 nearest-value reference and ml_dtypes."""

import hypothesis.extra.numpy as hnp
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxlp.formats import e2m1

MAGS = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def ref_encode(x):
    """Nearest of the 8 magnitudes by distance, ties to the even index; sign bit iff x < 0."""
    x = np.asarray(x, np.float64)
    a = np.minimum(np.abs(x), 6.0)
    dist = np.abs(a[..., None] - MAGS)
    best = dist.min(-1, keepdims=True)
    cand = dist == best
    # Among the (at most two) nearest, prefer the even index.
    idx = np.where(cand[..., ::2].any(-1), np.argmax(cand & (np.arange(8) % 2 == 0), -1), np.argmax(cand, -1))
    return (idx | np.where(x < 0, 8, 0)).astype(np.uint8)


def ref_decode(codes):
    codes = np.asarray(codes)
    return np.where(codes & 8, -1.0, 1.0) * MAGS[codes & 7]


def test_tie_points_round_to_even():
    ties = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], np.float32)
    expected_mag = np.array([0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0])
    codes = np.asarray(e2m1.encode(jnp.asarray(ties)))
    np.testing.assert_array_equal(ref_decode(codes), expected_mag)
    np.testing.assert_array_equal(codes, [0, 2, 2, 4, 4, 6, 6])
    neg = np.asarray(e2m1.encode(jnp.asarray(-ties)))
    np.testing.assert_array_equal(neg, [8, 10, 10, 12, 12, 14, 14])
    # Just off each tie goes to the nearer side.
    up = np.nextafter(ties, np.float32(np.inf))
    down = np.nextafter(ties, np.float32(-np.inf))
    np.testing.assert_array_equal(np.asarray(e2m1.encode(jnp.asarray(up))), [1, 2, 3, 4, 5, 6, 7])
    np.testing.assert_array_equal(np.asarray(e2m1.encode(jnp.asarray(down))), [0, 1, 2, 3, 4, 5, 6])


def test_exact_values_and_clipping():
    x = np.array([0.0, 0.5, 1, 1.5, 2, 3, 4, 6, 6.5, 7.0, 1e30, -1e30, -6, -0.5, -0.0, -0.1, 0.1], np.float32)
    codes = np.asarray(e2m1.encode(jnp.asarray(x)))
    np.testing.assert_array_equal(codes, [0, 1, 2, 3, 4, 5, 6, 7, 7, 7, 7, 15, 15, 9, 0, 8, 0])


def test_negative_subnormals_keep_their_sign():
    # XLA flushes FP32 subnormals in arithmetic; the sign test must stay bitwise (ModelOpt: x < 0).
    x = np.array([-1e-39, 1e-39, -1e-45, -0.0, 0.0, -1.0], np.float32)
    np.testing.assert_array_equal(np.asarray(e2m1.encode(jnp.asarray(x))), [8, 0, 8, 0, 0, 10])
    clipped = jax.jit(lambda v: e2m1.encode(jnp.clip(v, -6, 6), sign_of=v))(jnp.asarray(x))
    np.testing.assert_array_equal(np.asarray(clipped), [8, 0, 8, 0, 0, 10])


def test_random_matches_references():
    rng = np.random.default_rng(101)
    x = np.concatenate(
        [
            rng.standard_normal(20000) * 3,
            rng.uniform(-8, 8, 20000),
            np.round(rng.uniform(-28, 28, 5000)) / 4,  # quarter grid: hits every tie point
        ]
    ).astype(np.float32)
    x = x + np.float32(0.0)  # -0.0 -> +0.0 (ml_dtypes keeps the sign of -0.0; ModelOpt's x < 0 does not)
    codes = np.asarray(e2m1.encode(jnp.asarray(x)))
    np.testing.assert_array_equal(codes, ref_encode(x))
    # ml_dtypes' RNE cast agrees.
    ml = np.clip(x, -6, 6).astype(ml_dtypes.float4_e2m1fn).view(np.uint8)
    np.testing.assert_array_equal(codes, ml)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32])
def test_input_dtypes(dtype):
    rng = np.random.default_rng(102)
    x = jnp.asarray(rng.uniform(-7, 7, 4096), dtype)
    codes = np.asarray(e2m1.encode(x))
    np.testing.assert_array_equal(codes, ref_encode(np.asarray(x.astype(jnp.float32))))


def test_decode_all_codes():
    codes = jnp.arange(16, dtype=jnp.uint8)
    dec = np.asarray(e2m1.decode(codes, jnp.float32))
    np.testing.assert_array_equal(dec, ref_decode(np.arange(16)))
    np.testing.assert_array_equal(dec, np.arange(16, dtype=np.uint8).view(ml_dtypes.float4_e2m1fn).astype(np.float32))
    assert np.signbit(dec[8])  # code 8 is -0.0
    assert e2m1.decode(codes, jnp.bfloat16).dtype == jnp.bfloat16


def test_pack_layout_and_roundtrip():
    packed = np.asarray(e2m1.pack(jnp.asarray([1, 2, 15, 0], jnp.uint8)))
    np.testing.assert_array_equal(packed, [0x21, 0x0F])
    rng = np.random.default_rng(103)
    codes = rng.integers(0, 16, (3, 5, 32), dtype=np.uint8)
    packed = np.asarray(e2m1.pack(jnp.asarray(codes)))
    assert packed.shape == (3, 5, 16) and packed.dtype == np.uint8
    np.testing.assert_array_equal(packed, codes[..., 0::2] + 16 * codes[..., 1::2])
    np.testing.assert_array_equal(np.asarray(e2m1.unpack(jnp.asarray(packed))), codes)


def test_errors():
    with pytest.raises(ValueError, match="even"):
        e2m1.pack(jnp.zeros((4, 3), jnp.uint8))
    with pytest.raises(ValueError, match="floating"):
        e2m1.encode(jnp.zeros(4, jnp.int32))
    with pytest.raises(ValueError, match="integer"):
        e2m1.decode(jnp.zeros(4, jnp.float32))
    with pytest.raises(ValueError, match="uint8"):
        e2m1.unpack(jnp.zeros(4, jnp.int32))


def test_fp16_bit_trick_is_exact():
    n = np.arange(16)
    bits = ((n & 8) << 12) | ((n & 7) << 9)
    as_fp16 = bits.astype(np.uint16).view(np.float16).astype(np.float64)
    np.testing.assert_array_equal(as_fp16 * 2.0**14, ref_decode(n))
    np.testing.assert_array_equal(np.asarray(e2m1.fp16_bits(jnp.asarray(n, jnp.uint8))), bits)
    dec = np.asarray(e2m1.decode_fp16_scaled(jnp.asarray(n, jnp.uint8)))
    assert dec.dtype == np.float16
    np.testing.assert_array_equal(dec.astype(np.float64) * 2.0**e2m1.FP16_BITS_EXPONENT, ref_decode(n))


def test_jit_matches_eager():
    rng = np.random.default_rng(104)
    x = jnp.asarray(rng.standard_normal((8, 64)) * 2, jnp.float32)
    np.testing.assert_array_equal(np.asarray(jax.jit(e2m1.encode)(x)), np.asarray(e2m1.encode(x)))
    c = e2m1.encode(x)
    np.testing.assert_array_equal(np.asarray(jax.jit(e2m1.pack)(c)), np.asarray(e2m1.pack(c)))


@settings(max_examples=60, deadline=None)
@given(hnp.arrays(np.float32, st.sampled_from([1, 7, 64]), elements=st.floats(-1e6, 1e6, width=32, allow_subnormal=False)))
def test_fuzz_nearest(x):
    codes = np.asarray(e2m1.encode(jnp.asarray(x)))
    dec = ref_decode(codes)
    clipped = np.clip(x.astype(np.float64), -6, 6)
    err = np.abs(dec - clipped)
    # No representable value (of the right sign) is closer.
    best = np.min(np.abs(np.abs(clipped)[:, None] - MAGS), axis=-1)
    np.testing.assert_array_equal(err, best)
