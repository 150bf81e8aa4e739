"""NestedFP: exhaustive bit-level checks over all FP16 words against a NumPy reference."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jaxlp.formats import base
from jaxlp.formats import nestedfp
from jaxlp.formats.nestedfp import NestedFPArray, is_eligible, merge, split

ALL_BITS = np.arange(1 << 16, dtype=np.uint16)
ALL_WORDS = ALL_BITS.view(np.float16)
ABS = np.abs(ALL_WORDS.astype(np.float64))
BIT14_CLEAR = (ALL_BITS & 0x4000) == 0


def reference_split(bits: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The notes' split, written with integer arithmetic on int64 (independent of the bit-op code)."""
    b = bits.astype(np.int64)
    lower = b % 256
    sign = b // 32768
    exponent = (b // 1024) % 32
    mantissa = b % 1024
    c = sign * 128 + (exponent % 16) * 8 + mantissa // 128
    dropped = mantissa % 128
    round_up = (dropped > 64) | ((dropped == 64) & (c % 2 == 1))
    round_up &= ~((exponent % 16 == 15) & (mantissa // 128 == 6))
    c = (c + round_up) % 256
    return c.astype(np.uint8), lower.astype(np.uint8)


@pytest.fixture(scope="module")
def split_all():
    upper, lower = split(jnp.asarray(ALL_WORDS))
    return np.asarray(upper), np.asarray(lower)


def test_split_matches_reference_on_all_words(split_all):
    upper, lower = split_all
    ref_upper, ref_lower = reference_split(ALL_BITS)
    np.testing.assert_array_equal(upper, ref_upper)
    np.testing.assert_array_equal(lower, ref_lower)


def test_merge_is_exact_except_top_range(split_all):
    upper, lower = split_all
    merged = np.asarray(merge(jnp.asarray(upper), jnp.asarray(lower))).view(np.uint16)
    broken = (ABS >= 1.9375) & (ABS < 2)
    exact_domain = BIT14_CLEAR & ~broken
    assert exact_domain.sum() == 32768 - 2 * 64  # 64 magnitudes in [1.9375, 2) per sign
    np.testing.assert_array_equal(merged[exact_domain], ALL_BITS[exact_domain])
    # The documented failure region really fails (the carry runs into the sign bit).
    assert np.all(merged[BIT14_CLEAR & broken] != ALL_BITS[BIT14_CLEAR & broken])


def test_upper_is_rne_fp8_of_scaled_weight(split_all):
    upper, _ = split_all
    domain = BIT14_CLEAR & (ABS < 1.875)
    scaled = np.clip(ALL_WORDS[domain].astype(np.float32) * 256.0, -448.0, 448.0)
    expected = scaled.astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
    np.testing.assert_array_equal(upper[domain], expected)
    # (1.75, 1.875) saturates to +-448; [1.875, 1.9375) gives the NaN byte.
    sat = BIT14_CLEAR & (ABS > 1.75) & (ABS < 1.875)
    assert np.all(upper[sat] & 0x7F == 0x7E)
    nan_range = BIT14_CLEAR & (ABS >= 1.875) & (ABS < 1.9375)
    assert nan_range.sum() == 2 * 64
    assert np.all(upper[nan_range] & 0x7F == 0x7F)


@pytest.mark.parametrize(
    "word, upper, lower",
    [(0x3C00, 0x78, 0x00), (0x3F00, 0x7E, 0x00), (0x3F40, 0x7E, 0x40), (0x2E66, 0x5D, 0x66), (0xB555, 0xEB, 0x55)],
)
def test_notes_vectors(word, upper, lower):
    w = np.array([word], np.uint16).view(np.float16)
    u, low = split(jnp.asarray(w))
    assert (int(u[0]), int(low[0])) == (upper, lower)
    assert int(np.asarray(merge(u, low)).view(np.uint16)[0]) == word


def test_signed_zero_and_subnormals(split_all):
    upper, lower = split_all
    assert (upper[0x0000], lower[0x0000]) == (0x00, 0x00)
    assert (upper[0x8000], lower[0x8000]) == (0x80, 0x00)
    sub = (ALL_BITS & 0x7C00) == 0  # exponent field 0: zeros and subnormals
    merged = np.asarray(merge(jnp.asarray(upper[sub]), jnp.asarray(lower[sub]))).view(np.uint16)
    np.testing.assert_array_equal(merged, ALL_BITS[sub])
    # Subnormals with mantissa <= 64 (|w| <= 2**-18) give FP8 (+-)0; larger ones give FP8 subnormals.
    mant = ALL_BITS[sub] & 0x3FF
    assert np.all(upper[sub][mant <= 64] & 0x7F == 0)
    assert np.all((upper[sub][mant > 64] & 0x7F >= 1) & (upper[sub][mant > 64] & 0x7F <= 8))


def test_quantize_round_trip_and_fp8_mode():
    rng = np.random.default_rng(101)
    x = (rng.standard_normal((48, 96)) * 0.3).astype(np.float32)
    x[0, :4] = [1.75, -1.75, 0.0, -0.0]
    q = nestedfp.quantize(jnp.asarray(x))
    assert isinstance(q, NestedFPArray) and q.shape == (48, 96) and q.threshold == 1.75
    x16 = x.astype(np.float16)
    np.testing.assert_array_equal(np.asarray(q.dequantize(jnp.float16)).view(np.uint16), x16.view(np.uint16))
    assert q.dequantize().dtype == jnp.float32
    fp8 = (x16.astype(np.float32) * 256).astype(ml_dtypes.float8_e4m3fn)
    np.testing.assert_array_equal(np.asarray(q.upper_as_fp8()).view(np.uint8), fp8.view(np.uint8))
    np.testing.assert_array_equal(np.asarray(q.dequantize_fp8()), fp8.astype(np.float32) / 256)
    assert q.nbytes == 2 * x.size and q.bits_per_element == 16.0
    # The registry and pytree plumbing.
    q2 = base.quantize(jnp.asarray(x), "nestedfp")
    np.testing.assert_array_equal(np.asarray(q2.upper), np.asarray(q.upper))
    leaves, tree = jax.tree.flatten(q)
    assert len(leaves) == 2
    assert jax.tree.unflatten(tree, leaves).static_fields() == {"shape": (48, 96), "threshold": 1.75}


def test_quantize_casts_bfloat16_input():
    rng = np.random.default_rng(102)
    x = jnp.asarray(rng.standard_normal((8, 32)) * 0.2, dtype=jnp.bfloat16)
    q = nestedfp.quantize(x)
    np.testing.assert_array_equal(np.asarray(q.dequantize(jnp.float16)), np.asarray(x.astype(jnp.float16)))


def test_jit_matches_eager():
    rng = np.random.default_rng(103)
    x = jnp.asarray(rng.uniform(-1.7, 1.7, (16, 64)), jnp.float32)
    eager = nestedfp.quantize(x)
    jitted = jax.jit(lambda a: nestedfp.quantize(a, threshold=1.8))(x)
    np.testing.assert_array_equal(np.asarray(jitted.upper), np.asarray(eager.upper))
    np.testing.assert_array_equal(np.asarray(jitted.lower), np.asarray(eager.lower))
    np.testing.assert_array_equal(np.asarray(jax.jit(lambda q: q.dequantize())(eager)), np.asarray(eager.dequantize()))


def test_eligibility_and_errors():
    w = jnp.array([0.5, -1.75], jnp.float32)
    assert is_eligible(w) and is_eligible(w, 1.75)
    assert not is_eligible(jnp.array([0.5, -1.76]), 1.75)
    assert is_eligible(jnp.array([0.5, -1.8]), 1.8192)
    assert not is_eligible(jnp.array([0.1, np.nan]))
    with pytest.raises(ValueError, match="exceeds the eligibility threshold"):
        nestedfp.quantize(jnp.array([0.1, 1.76]))
    with pytest.raises(ValueError, match="NaN or Inf"):
        nestedfp.quantize(jnp.array([0.1, np.inf]))
    with pytest.raises(ValueError, match="NaN or Inf"):
        nestedfp.quantize(jnp.array([0.1, 1e6]))  # overflows float16
    for bad in (1.875, 2.0, 0.0, -1.0):
        with pytest.raises(ValueError, match="threshold must be in"):
            nestedfp.quantize(jnp.array([0.1]), threshold=bad)
    with pytest.raises(ValueError, match="floating-point"):
        nestedfp.quantize(jnp.array([1, 2], jnp.int32))
    with pytest.raises(ValueError, match="uint8"):
        merge(jnp.zeros(3, jnp.int32), jnp.zeros(3, jnp.uint8))
    with pytest.raises(ValueError, match="shape"):
        merge(jnp.zeros(3, jnp.uint8), jnp.zeros(4, jnp.uint8))


def test_check_and_checkpoint_round_trip(tmp_path):
    from jaxlp import checkpoint

    x = jnp.asarray(np.random.default_rng(104).uniform(-1.5, 1.5, (4, 32)), jnp.float32)
    q = nestedfp.quantize(x, threshold=1.8192)
    q.check()
    checkpoint.save(tmp_path / "ckpt", {"w": q})
    back = checkpoint.load(tmp_path / "ckpt")["w"]
    assert isinstance(back, NestedFPArray) and back.static_fields() == q.static_fields()
    np.testing.assert_array_equal(np.asarray(back.dequantize()), np.asarray(q.dequantize()))
    with pytest.raises(ValueError, match="lower"):
        NestedFPArray(upper=q.upper, lower=q.lower[:, :16], shape=q.shape).check()
    with pytest.raises(ValueError, match="threshold"):
        NestedFPArray(upper=q.upper, lower=q.lower, shape=q.shape, threshold=1.9).check()
