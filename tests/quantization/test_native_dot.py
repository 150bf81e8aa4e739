"""``implementation="xla_native"``: XLA's FP8 / FP16 dots on the stored bytes of FP8, NestedFP and
FireQ INT4 linears, against float64 NumPy products of the quantized values (``ml_dtypes`` casts),
on CPU."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jaxlp.formats import fp8, int4_fp8, nestedfp
from jaxlp.quantization.linear import QuantizedLinear

E4M3 = ml_dtypes.float8_e4m3fn


def rel(y, ref) -> float:
    y, ref = np.asarray(y, np.float64), np.asarray(ref, np.float64)
    return float(np.linalg.norm(y - ref) / max(np.linalg.norm(ref), 1e-30))


def activations(rng, shape, dtype):
    x = rng.standard_normal(shape).astype(np.float32) * np.exp(rng.uniform(-3, 3, shape[:-1] + (1,)))
    x.reshape(-1, shape[-1])[0] = 0.0  # an all-zero token
    return jnp.asarray(x, dtype)


def weights(rng, n, k, *, limit=None):
    w = rng.standard_normal((n, k)).astype(np.float32) * 0.3
    w[1] = 0.0  # an all-zero output channel
    if limit is not None:  # NestedFP edge values: the threshold, FP16 subnormals
        w = np.clip(w, -limit, limit)
        w[2, :4] = [limit, -limit, 3e-6, -6e-8]
    return w


def native(layer, x):
    return jax.jit(lambda x: layer(x))(x)


@pytest.mark.parametrize("dtype,tol", [(jnp.float16, 1e-3), (jnp.bfloat16, 4e-3)])
@pytest.mark.parametrize("lead", [(1,), (3,), (2, 5)])
def test_w8a16_fp8_matches_float64(dtype, tol, lead):
    rng = np.random.default_rng(hash((str(dtype), lead)) % 2**32)
    w = weights(rng, 40, 48)
    wq = fp8.quantize(jnp.asarray(w), granularity="channel")
    x = activations(rng, lead + (48,), dtype)
    w64 = np.asarray(wq.data).astype(np.float64) * np.asarray(wq.scale, np.float64)[:, None]
    ref = np.asarray(x, np.float64) @ w64.T
    y = native(QuantizedLinear(wq, implementation="xla_native"), x)
    assert y.dtype == dtype and y.shape == lead + (40,)
    assert rel(y, ref) <= tol


@pytest.mark.parametrize("granularity", ["channel", "tensor"])
def test_w8a8_fp8_matches_float64_of_quantized_tokens(granularity):
    rng = np.random.default_rng(7)
    w = weights(rng, 24, 80)
    wq = fp8.quantize(jnp.asarray(w), granularity=granularity)
    x = activations(rng, (2, 3, 80), jnp.float32)
    xf = np.asarray(x, np.float32)
    amax = np.abs(xf).max(-1, keepdims=True)
    s = np.where(amax == 0, np.float32(1), np.maximum(amax / np.float32(448), np.float32(2.0**-126)))
    x8 = (xf / s).astype(E4M3).astype(np.float64) * s
    w64 = np.asarray(wq.data).astype(np.float64) * np.asarray(wq.scale, np.float64)[..., None]
    ref = x8 @ w64.T
    layer = QuantizedLinear(wq, activation="fp8_token", implementation="xla_native")
    y = native(layer, x)
    assert rel(y, ref) <= 1e-5  # float32 output: only the summation order and scale rounding differ
    assert np.all(np.asarray(y)[0, 0] == 0)  # the all-zero token


@pytest.mark.parametrize("mode", ["fp16", "fp8"])
def test_nestedfp_matches_float64(mode):
    rng = np.random.default_rng(11)
    w = weights(rng, 64, 96, limit=nestedfp.DEFAULT_THRESHOLD)
    w16 = w.astype(np.float16)
    wq = nestedfp.quantize(jnp.asarray(w16))
    x = activations(rng, (5, 96), jnp.float16)
    layer = QuantizedLinear(wq, implementation="xla_native", mode=mode)
    y = native(layer, x)
    xf = np.asarray(x, np.float32)
    if mode == "fp16":  # the original FP16 weights, not the merge under test
        ref = xf.astype(np.float64) @ w16.astype(np.float64).T
    else:
        s = np.clip(np.float32(0.7 * 448.0) / np.maximum(np.abs(xf).max(-1, keepdims=True), np.float32(1e-5)),
                    np.float32(0.1), np.float32(50.0))
        x8 = np.clip(xf * s, -448, 448).astype(E4M3).astype(np.float64) / s
        upper = np.asarray(wq.upper).view(E4M3).astype(np.float64) * 2.0**-8
        np.testing.assert_array_equal(upper, (w16.astype(np.float32) * 256).astype(E4M3).astype(np.float64) / 256)
        ref = x8 @ upper.T
    assert y.dtype == jnp.float16
    assert rel(y, ref) <= 1e-3


def fireq_weight_fp8(wq) -> np.ndarray:
    """``e4m3(q * s)`` of a FireQ weight in float64, decoded here from its bytes (low nibble first,
    two's complement; E4M3 group scales; products beyond +-448 saturate)."""
    codes = np.asarray(wq.codes)
    nib = np.stack([codes & 0xF, codes >> 4], axis=-1).reshape(codes.shape[0], -1).astype(np.int64)
    q = np.where(nib >= 8, nib - 16, nib).astype(np.float64)
    s = np.asarray(wq.scales).astype(np.float64).repeat(wq.group_size, axis=-1)
    return np.clip(q * s, -448, 448).astype(E4M3).astype(np.float64)


@pytest.mark.parametrize("lead", [(1,), (2, 3)])
def test_fireq_w4a8_matches_float64_of_quantized_tokens(lead):
    """W4A8-FireQ: per-token FP8 codes (scale ``amax / 448``, applied in BF16) times the exact FP8
    weight; PTS's output scale; an all-zero token and output channel; weights spanning scales."""
    rng = np.random.default_rng(len(lead))
    w = weights(rng, 48, 256)
    w[3] *= 1e-4  # tiny groups: scales near the E4M3 subnormal floor
    w[4, :128] *= 300.0  # large group: q * s near the E4M3 range
    wq = int4_fp8.quantize(jnp.asarray(w))
    x = activations(rng, lead + (256,), jnp.float32)
    xf = np.asarray(x, np.float32)
    scale = np.abs(xf).max(-1, keepdims=True) / np.float32(448)
    x8 = np.clip(xf / np.where(scale > 0, scale, 1), -448, 448).astype(E4M3).astype(np.float64)
    xq = x8 * scale.astype(ml_dtypes.bfloat16).astype(np.float64)
    ref = xq @ fireq_weight_fp8(wq).T * 0.25
    layer = QuantizedLinear(wq, activation="fireq_fp8", out_scale=0.25, implementation="xla_native")
    y = native(layer, x)
    assert y.shape == lead + (48,) and rel(y, ref) <= 1e-5  # float32 out: summation order only
    assert np.all(np.asarray(y).reshape(-1, 48)[0] == 0) and np.all(np.asarray(y)[..., 1] == 0)
    np.testing.assert_allclose(np.asarray(y), np.asarray(QuantizedLinear(wq, activation="fireq_fp8", out_scale=0.25)(x)),
                               rtol=1e-5, atol=1e-6 * np.abs(ref).max())  # the reference path agrees


def test_fireq_w4a16_matches_float64():
    rng = np.random.default_rng(21)
    wq = int4_fp8.quantize(jnp.asarray(weights(rng, 40, 128)))
    x = activations(rng, (5, 128), jnp.bfloat16)
    ref = np.asarray(x, np.float64) @ fireq_weight_fp8(wq).T
    y = native(QuantizedLinear(wq, implementation="xla_native"), x)
    assert y.dtype == jnp.bfloat16 and rel(y, ref) <= 4e-3


def test_the_dots_run_on_the_stored_low_precision_operands():
    """Not float32 emulation: the HLO dot takes the E4M3 / FP16 operands."""
    rng = np.random.default_rng(3)
    cases = [
        (QuantizedLinear(fp8.quantize(jnp.asarray(weights(rng, 32, 64)), granularity="channel"),
                         activation="fp8_token", implementation="xla_native"), jnp.bfloat16, "f8E4M3FN"),
        (QuantizedLinear(nestedfp.quantize(jnp.asarray(weights(rng, 32, 64, limit=1.5))), implementation="xla_native",
                         mode="fp8"), jnp.float16, "f8E4M3FN"),
        (QuantizedLinear(nestedfp.quantize(jnp.asarray(weights(rng, 32, 64, limit=1.5))), implementation="xla_native"),
                         jnp.float16, "f16"),
        (QuantizedLinear(int4_fp8.quantize(jnp.asarray(weights(rng, 32, 64)), group_size=32), activation="fireq_fp8",
                         implementation="xla_native"), jnp.bfloat16, "f8E4M3FN"),
    ]
    for layer, dtype, operand in cases:
        hlo = jax.jit(lambda x, layer=layer: layer(x)).lower(jnp.ones((4, 64), dtype)).as_text()
        dots = [line for line in hlo.splitlines() if "dot_general" in line]
        assert len(dots) == 1 and f"tensor<4x64x{operand}>" in dots[0] and f"tensor<32x64x{operand}>" in dots[0], dots


def test_refusals_name_the_reason():
    rng = np.random.default_rng(5)
    nested = QuantizedLinear(nestedfp.quantize(jnp.asarray(weights(rng, 16, 32, limit=1.5))),
                             implementation="xla_native")
    with pytest.raises(ValueError, match="float16 activations"):
        nested(jnp.ones((2, 32), jnp.bfloat16))
    from jaxlp.formats import nvfp4

    w4 = QuantizedLinear(nvfp4.quantize(jnp.asarray(weights(rng, 16, 32))), implementation="xla_native")
    with pytest.raises(ValueError, match="weight format 'nvfp4'"):
        w4(jnp.ones((2, 32), jnp.bfloat16))
    w8 = QuantizedLinear(fp8.quantize(jnp.asarray(weights(rng, 16, 32)), granularity="channel"),
                         implementation="xla_native")
    with pytest.raises(ValueError, match="bfloat16 or float16"):
        w8(jnp.ones((2, 32), jnp.float32))
    w4 = QuantizedLinear(int4_fp8.quantize(jnp.asarray(weights(rng, 16, 32)), group_size=32),
                         activation="fp8_token", implementation="xla_native")
    with pytest.raises(ValueError, match="only none or 'fireq_fp8'"):
        w4(jnp.ones((2, 32), jnp.bfloat16))


def test_auto_keeps_the_reference_off_a_gpu():
    if jax.default_backend() == "gpu":
        pytest.skip("on a GPU, auto takes the native dots")
    rng = np.random.default_rng(9)
    wq = fp8.quantize(jnp.asarray(weights(rng, 16, 32)), granularity="channel")
    x = activations(rng, (3, 32), jnp.bfloat16)
    auto = QuantizedLinear(wq, activation="fp8_token", implementation="auto")(x)
    xla = QuantizedLinear(wq, activation="fp8_token", implementation="xla")(x)
    np.testing.assert_array_equal(np.asarray(auto, np.float32), np.asarray(xla, np.float32))


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a CUDA GPU")
@pytest.mark.parametrize("m", [1, 8, 33, 256])
def test_native_dots_on_a_gpu_match_float64(m):
    """cuBLASLt's FP8 / FP16 GEMMs (N not a multiple of 64, K not of 128 for NestedFP) against float64
    (``"auto"`` takes the Pallas GEMMs for NestedFP past 8 tokens: tests/quantization/test_fp8_gemm.py,
    test_nestedfp_gemm.py)."""
    rng = np.random.default_rng(m)
    w = weights(rng, 1000, 1040, limit=1.75)
    w16 = w.astype(np.float16)
    x = activations(rng, (m, 1040), jnp.float16)
    xf = np.asarray(x, np.float32)
    nested = nestedfp.quantize(jnp.asarray(w16))
    y16 = native(QuantizedLinear(nested, implementation="xla_native"), x)
    assert rel(y16, xf.astype(np.float64) @ w16.astype(np.float64).T) <= 1e-3
    s = np.clip(np.float32(0.7 * 448.0) / np.maximum(np.abs(xf).max(-1, keepdims=True), np.float32(1e-5)),
                np.float32(0.1), np.float32(50.0))
    x8 = np.clip(xf * s, -448, 448).astype(E4M3).astype(np.float64) / s
    upper = np.asarray(nested.upper).view(E4M3).astype(np.float64) * 2.0**-8
    y8 = native(QuantizedLinear(nested, implementation="xla_native", mode="fp8"), x)
    assert rel(y8, x8 @ upper.T) <= 1e-3
    hlo = jax.jit(lambda x: QuantizedLinear(nested, implementation="xla_native", mode="fp8")(x)).lower(x).as_text()
    assert "f8E4M3FN" in "".join(line for line in hlo.splitlines() if "dot_general" in line)
    # W4A8: FP8 x FP8 with the per-token BF16 scale; FireQ's groups need K a multiple of 128 (9 groups)
    fireq = int4_fp8.quantize(jnp.asarray(weights(rng, 1000, 1152, limit=1.75)))
    xb = activations(rng, (m, 1152), jnp.bfloat16)
    y4 = native(QuantizedLinear(fireq, activation="fireq_fp8", implementation="xla_native"), xb)
    want = native(QuantizedLinear(fireq, activation="fireq_fp8", implementation="xla"), xb)
    assert rel(y4, want) <= 8e-3  # BF16 outputs of two summation orders
