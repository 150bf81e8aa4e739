"""NVFP4 against a float64 NumPy reference of the ModelOpt numerics (FP32 rounding points explicit)."""

import hypothesis.extra.numpy as hnp
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import jaxlp.formats as F
from jaxlp.formats import NVFP4Array, nvfp4

MAGS = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def f32(v):
    """Round float64 to the nearest FP32 (an FP32 op on FP32 operands, computed exactly in float64)."""
    return np.asarray(v, np.float64).astype(np.float32).astype(np.float64)


def ref_e2m1(q):
    """Codes by nearest magnitude, ties to the even index; sign iff q < 0."""
    a = np.abs(q)
    dist = np.abs(a[..., None] - MAGS)
    best = dist == dist.min(-1, keepdims=True)
    even = best & (np.arange(8) % 2 == 0)
    idx = np.where(even.any(-1), np.argmax(even, -1), np.argmax(best, -1))
    return (idx | np.where(q < 0, 8, 0)).astype(np.uint8)


def ref_nvfp4(x, tensor_scale=None, amax=None, scale_min=2.0**-9):
    """Returns (codes [..., K], scale bytes [..., K/16], g, dequantized float32)."""
    x = np.asarray(x, np.float32).astype(np.float64)
    if tensor_scale is not None:
        g = f32(tensor_scale)
    elif amax is not None:
        g = f32(f32(amax) / 2688.0)
    else:
        a = np.max(np.abs(x))
        g = np.float64(1.0) if a == 0 else f32(a / 2688.0)
    g = max(float(g), 2.0**-117)
    blocks = x.reshape(*x.shape[:-1], x.shape[-1] // 16, 16)
    bamax = np.max(np.abs(blocks), axis=-1)
    s = f32(bamax / f32(6.0 * g))
    s = np.where(s == 0, 1.0, s)
    s = np.clip(s, scale_min, 448.0)
    s8 = s.astype(np.float32).astype(ml_dtypes.float8_e4m3fn)
    s8f = s8.astype(np.float64)
    denom = f32(s8f * g)
    q = np.clip(f32(blocks / denom[..., None]), -6.0, 6.0)
    codes = ref_e2m1(q)
    vals = np.where(codes & 8, -1.0, 1.0) * MAGS[codes & 7]
    deq = f32(vals * s8f[..., None] * g).astype(np.float32)  # vals * s8f is exact: one rounding
    return codes.reshape(x.shape), s8.view(np.uint8), np.float32(g), deq.reshape(x.shape)


def unpack_ref(packed):
    packed = np.asarray(packed)
    return np.stack([packed & 0xF, packed >> 4], -1).reshape(*packed.shape[:-1], -1)


def assert_matches(q, ref):
    codes, scale_bytes, g, deq = ref
    assert isinstance(q, NVFP4Array)
    np.testing.assert_array_equal(unpack_ref(q.data), codes)
    np.testing.assert_array_equal(np.asarray(q.block_scale).view(np.uint8), scale_bytes)
    assert np.asarray(q.tensor_scale).dtype == np.float32 and np.asarray(q.tensor_scale) == g
    out = np.asarray(q.dequantize())
    np.testing.assert_array_equal(out, deq)
    assert np.all(np.isfinite(out))


@pytest.mark.parametrize(
    ("shape", "seed"), [((8, 256), 201), ((3, 5, 32), 202), ((1, 16), 203), ((64,), 204)]
)
def test_normal_inputs(shape, seed):
    x = np.random.default_rng(seed).standard_normal(shape).astype(np.float32)
    assert_matches(nvfp4.quantize(jnp.asarray(x)), ref_nvfp4(x))


def test_heavy_tailed_inputs():
    x = np.random.default_rng(205).standard_t(2, (16, 128)).astype(np.float32) * 0.02
    assert_matches(nvfp4.quantize(jnp.asarray(x)), ref_nvfp4(x))


def test_tiny_blocks_make_subnormal_and_clamped_scales():
    rng = np.random.default_rng(206)
    x = rng.standard_normal((16, 256))
    x *= 10.0 ** rng.uniform(-7, 0, (16, 16, 1)).repeat(16, -1).reshape(16, 256)  # per-block magnitude
    x[0, 0] = 10.0  # one large element fixes the tensor amax
    x = x.astype(np.float32)
    ref = ref_nvfp4(x)
    scales = ref[1].view(ml_dtypes.float8_e4m3fn).astype(np.float64)
    assert np.any((scales < 2.0**-6) & (scales > 2.0**-9)), "test should reach subnormal E4M3 scales"
    assert np.any(scales == 2.0**-9), "test should reach the 2**-9 clamp"
    assert_matches(nvfp4.quantize(jnp.asarray(x)), ref)
    # torchao clamps at the smallest normal E4M3 instead.
    ref_ao = ref_nvfp4(x, scale_min=2.0**-6)
    q_ao = nvfp4.quantize(jnp.asarray(x), scale_clamp="torchao")
    assert_matches(q_ao, ref_ao)
    assert q_ao.scale_clamp == "torchao"
    assert np.min(np.asarray(q_ao.block_scale).astype(np.float32)) == 2.0**-6


def test_zeros_and_all_zero_blocks():
    rng = np.random.default_rng(207)
    x = rng.standard_normal((4, 64)).astype(np.float32)
    x[rng.random(x.shape) < 0.3] = 0.0
    x[1, 16:32] = 0.0
    x[3, :] = 0.0
    q = nvfp4.quantize(jnp.asarray(x))
    assert_matches(q, ref_nvfp4(x))
    scales = np.asarray(q.block_scale).astype(np.float32)
    assert scales[1, 1] == 1.0 and np.all(scales[3] == 1.0)
    assert np.all(np.asarray(q.dequantize())[3] == 0)


def test_all_zero_tensor():
    x = np.zeros((2, 32), np.float32)
    q = nvfp4.quantize(jnp.asarray(x))
    assert float(q.tensor_scale) == 1.0
    assert np.all(np.asarray(q.block_scale).astype(np.float32) == 1.0)
    assert np.all(np.asarray(q.data) == 0)
    np.testing.assert_array_equal(np.asarray(q.dequantize()), x)
    assert_matches(q, ref_nvfp4(x))


def test_tie_points_with_unit_scales():
    # tensor_scale 1 and a block max of 6 give s = 1 exactly, so x / (s * g) == x.
    ties = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]
    row = np.array([6.0] + ties + [-t for t in ties] + [0.0], np.float32)
    q = nvfp4.quantize(jnp.asarray(row[None]), tensor_scale=1.0)
    assert float(q.block_scale[0, 0].astype(jnp.float32)) == 1.0
    codes = unpack_ref(q.data)[0]
    np.testing.assert_array_equal(codes, [7, 0, 2, 2, 4, 4, 6, 6, 8, 10, 10, 12, 12, 14, 14, 0])


def test_static_scale_saturates():
    rng = np.random.default_rng(208)
    x = rng.standard_normal((8, 64)).astype(np.float32)
    x[2, 5] = 40.0
    x[6, 40] = -25.0
    calibrated_amax = 4.0
    q = nvfp4.quantize(jnp.asarray(x), amax=calibrated_amax)
    assert_matches(q, ref_nvfp4(x, amax=calibrated_amax))
    scales = np.asarray(q.block_scale).astype(np.float32)
    assert scales[2, 0] == 448.0 and scales[6, 2] == 448.0
    codes = unpack_ref(q.data)
    assert codes[2, 5] == 7 and codes[6, 40] == 15  # +6 and -6
    g = np.float32(calibrated_amax) / np.float32(2688.0)
    np.testing.assert_array_equal(np.asarray(q.dequantize())[2, 5], np.float32(6 * 448 * np.float64(g)))
    # tensor_scale= is the same as amax= with g = amax / 2688.
    q2 = nvfp4.quantize(jnp.asarray(x), tensor_scale=g)
    np.testing.assert_array_equal(np.asarray(q2.data), np.asarray(q.data))
    np.testing.assert_array_equal(np.asarray(q2.block_scale).view(np.uint8), np.asarray(q.block_scale).view(np.uint8))
    assert_matches(q2, ref_nvfp4(x, tensor_scale=g))


def test_bf16_input():
    x = jnp.asarray(np.random.default_rng(209).standard_normal((4, 48)), jnp.bfloat16)
    q = nvfp4.quantize(x)
    assert_matches(q, ref_nvfp4(np.asarray(x.astype(jnp.float32))))
    assert q.dequantize(jnp.bfloat16).dtype == jnp.bfloat16


def test_registry_and_dequantize():
    x = jnp.asarray(np.random.default_rng(210).standard_normal((4, 32)), jnp.float32)
    assert "nvfp4" in F.formats()
    q = F.quantize(x, "nvfp4")
    np.testing.assert_array_equal(np.asarray(F.dequantize(q)), np.asarray(nvfp4.quantize(x).dequantize()))
    assert F.array_class("nvfp4") is NVFP4Array
    with pytest.raises(ValueError, match="unknown quantization format"):
        F.quantize(x, "nvfp5")


def test_errors():
    good = jnp.ones((2, 32), jnp.float32)
    with pytest.raises(ValueError, match="multiple of the block size 16"):
        nvfp4.quantize(jnp.ones((2, 24), jnp.float32))
    with pytest.raises(ValueError, match="scalar"):
        nvfp4.quantize(jnp.float32(1.0))
    for bad in (np.nan, np.inf, -np.inf):
        with pytest.raises(ValueError, match="NaN or Inf"):
            nvfp4.quantize(good.at[1, 3].set(bad))
    with pytest.raises(ValueError, match="floating"):
        nvfp4.quantize(jnp.ones((2, 32), jnp.int32))
    with pytest.raises(ValueError, match="not both"):
        nvfp4.quantize(good, tensor_scale=1.0, amax=1.0)
    with pytest.raises(ValueError, match="positive"):
        nvfp4.quantize(good, tensor_scale=0.0)
    with pytest.raises(ValueError, match="positive"):
        nvfp4.quantize(good, amax=-1.0)
    with pytest.raises(ValueError, match="scalar"):
        nvfp4.quantize(good, tensor_scale=jnp.ones(2))
    with pytest.raises(ValueError, match="scale_clamp"):
        nvfp4.quantize(good, scale_clamp="trtllm")


def test_jit_identical():
    x = jnp.asarray(np.random.default_rng(211).standard_t(3, (6, 96)), jnp.float32)
    eager = nvfp4.quantize(x)
    jitted = jax.jit(nvfp4.quantize)(x)
    assert jax.tree.structure(jitted) == jax.tree.structure(eager)
    for a, b in zip(jax.tree.leaves(jitted), jax.tree.leaves(eager)):
        np.testing.assert_array_equal(np.atleast_1d(np.asarray(a)).view(np.uint8), np.atleast_1d(np.asarray(b)).view(np.uint8))
    # A traced static tensor scale works too.
    static = jax.jit(lambda v, g: nvfp4.quantize(v, tensor_scale=g))(x, jnp.float32(0.001))
    assert_matches(static, ref_nvfp4(np.asarray(x), tensor_scale=np.float32(0.001)))
    np.testing.assert_array_equal(np.asarray(jax.jit(lambda q: q.dequantize())(eager)), np.asarray(eager.dequantize()))


def test_tensor_scale_is_a_true_division_under_jit():
    # XLA rewrites x / const into x * (1 / const) unless prevented; ModelOpt divides.
    amax = np.random.default_rng(212).uniform(0.01, 100, 4096).astype(np.float32)
    g = np.asarray(jax.jit(nvfp4.tensor_scale_from_amax)(jnp.asarray(amax)))
    np.testing.assert_array_equal(g, f32(amax.astype(np.float64) / 2688.0).astype(np.float32))


def test_nbytes_and_bits():
    q = nvfp4.quantize(jnp.ones((128, 256), jnp.float32))
    assert q.data.shape == (128, 128) and q.block_scale.shape == (128, 16) and q.tensor_scale.shape == ()
    assert q.nbytes == 128 * 128 + 128 * 16 + 4
    assert q.bits_per_element == pytest.approx(4.5 + 32 / (128 * 256))
    q.check()
    bad = NVFP4Array(q.data[:, :-1], q.block_scale, q.tensor_scale, q.shape)
    with pytest.raises(ValueError, match="data"):
        bad.check()


@settings(max_examples=40, deadline=None)
@given(
    x=hnp.arrays(
        np.float32,
        st.sampled_from([(1, 16), (2, 32), (3, 48)]),
        elements=st.one_of(
            st.just(0.0),
            st.floats(2.0**-100, 2.0**100, width=32) | st.floats(-(2.0**100), -(2.0**-100), width=32),
        ),
    ),
    static=st.booleans(),
)
def test_fuzz_error_within_half_step(x, static):
    amax = float(np.max(np.abs(x))) / 2 if static and np.max(np.abs(x)) > 0 else None
    q = nvfp4.quantize(jnp.asarray(x), amax=amax)
    out = np.asarray(q.dequantize()).astype(np.float64)
    assert np.all(np.isfinite(out))
    codes, scale_bytes, g, deq = ref_nvfp4(x, amax=amax)
    np.testing.assert_array_equal(unpack_ref(q.data), codes)
    # Error bound: half the E2M1 spacing at |x| / denom, or the saturation loss beyond 6.
    denom = (np.asarray(q.block_scale).astype(np.float64) * float(q.tensor_scale)).repeat(16, -1)
    xd = x.astype(np.float64)
    t = np.abs(xd) / denom
    spacing = np.where(t < 2, 0.5, np.where(t < 4, 1.0, 2.0))
    bound = np.maximum(0.5 * spacing * denom, np.abs(xd) - 6 * denom) * (1 + 1e-6) + 1e-37
    assert np.all(np.abs(out - xd) <= bound)


def test_static_tensor_scale_captured_inside_jit():
    x = jnp.asarray(np.random.default_rng(0).standard_normal((2, 32)), jnp.float32)
    eager = nvfp4.quantize(x, tensor_scale=0.01)
    traced = jax.jit(lambda a: nvfp4.quantize(a, tensor_scale=0.01).data)(x)
    np.testing.assert_array_equal(np.asarray(traced), np.asarray(eager.data))
