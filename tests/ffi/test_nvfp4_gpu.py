"""The NVFP4 CUDA kernels on a GPU against float64 references (skipped without a CUDA GPU)."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jaxlp.ffi import nvfp4 as ffi_nvfp4
from jaxlp.formats import nvfp4
from jaxlp.quantization import QuantizedLinear
from jaxlp.quantization import nvfp4_dispatch as dispatch
from jaxlp.quantization.activations import fake_quantize

from test_nvfp4_kernel_model import permute8, stage_a4, stage_a16, weight_f64

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(jax.devices()[0].platform != "gpu", reason="needs a CUDA GPU"),
]

CONFIGS = [ffi_nvfp4.GemvConfig(1, 8), ffi_nvfp4.GemvConfig(2, 4), ffi_nvfp4.GemvConfig(1, 2, pdl=False)]


def rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def weight(rng, n, k, zero_blocks=4):
    w = rng.standard_normal((n, k)).astype(np.float32) * rng.uniform(0.01, 3.0, (n, 1)).astype(np.float32)
    for r, c in zip(rng.integers(0, n, zero_blocks), rng.integers(0, k // 16, zero_blocks)):
        w[r, 16 * c : 16 * c + 16] = 0.0
    q = nvfp4.quantize(jnp.asarray(w))
    ref = weight_f64(np.asarray(q.data), np.asarray(q.block_scale).view(np.uint8), float(q.tensor_scale))
    return q, ref


def acts(rng, m, k, dtype):
    x = rng.standard_normal((m, k)) * np.exp(rng.uniform(-2, 2, (m, 1)))
    x[rng.integers(0, m), : min(k, 48)] = 0.0  # all-zero blocks
    return jnp.asarray(x, dtype)


SHAPES = [  # (M, N, K): N not a multiple of 16 / 32, K a multiple of 16 but not of 32 or 128
    (1, 1000, 4112),
    (2, 37, 48),
    (5, 4096, 1040),
    (6, 300, 1056),  # K % 32 == 0 but K % 64 != 0: 128-bit loads, byte-wise scale loads
    (8, 520, 2048),
    (9, 333, 4096),
    (16, 96, 272),
    (17, 2048, 512),
    (32, 130, 1024),
]


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("m,n,k", SHAPES)
def test_w4a16(m, n, k, dtype):
    rng = np.random.default_rng(1000 + m * 7 + k)
    q, wref = weight(rng, n, k)
    for cfg in CONFIGS:
        x = acts(rng, m, k, dtype)  # fresh inputs per call: a stale output buffer would show
        y, x_eff, xs = jax.jit(lambda x, q: ffi_nvfp4.gemv_call(
            x, q.data, jax.lax.bitcast_convert_type(q.block_scale, jnp.uint8), q.tensor_scale, config=cfg))(x, q)
        assert y.dtype == dtype and y.shape == (m, n)
        xf = np.asarray(x.astype(jnp.float32))
        ref = xf.astype(np.float64) @ wref.T
        e_eff, e_xs = stage_a16(xf)
        np.testing.assert_array_equal(np.asarray(x_eff), e_eff)
        np.testing.assert_array_equal(np.asarray(xs), e_xs)
        y = np.asarray(y.astype(jnp.float32))
        assert np.isfinite(y).all()
        if dtype == jnp.float32:
            assert rel(y, ref) < 1e-3  # FP32 inputs enter the products rounded to FP16
        else:
            assert rel(y, ref.astype(ml_dtypes.bfloat16).astype(np.float64)) < 1e-3
            assert rel(y, ref) < 4e-3  # BF16 output rounding


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("m,n,k", SHAPES)
def test_w4a4(m, n, k, dtype):
    rng = np.random.default_rng(2000 + m * 7 + k)
    q, wref = weight(rng, n, k)
    for cfg in CONFIGS[:2]:
        x = acts(rng, m, k, dtype)
        amax = float(np.abs(np.asarray(x, np.float32)).max()) * 0.5  # half the true max: saturation
        g_x = dispatch.act_tensor_scale(amax)
        y, x_eff, _ = jax.jit(lambda x, q, g: ffi_nvfp4.gemv_call(
            x, q.data, jax.lax.bitcast_convert_type(q.block_scale, jnp.uint8), q.tensor_scale, g, config=cfg))(x, q, g_x)
        xq = np.asarray(fake_quantize(x, "nvfp4", jnp.float32(amax)), np.float64)
        ref = xq @ wref.T
        np.testing.assert_array_equal(np.asarray(x_eff), stage_a4(np.asarray(x, np.float32), float(g_x)))
        y = np.asarray(y.astype(jnp.float32))
        if dtype == jnp.float32:
            assert rel(y, ref) < 1e-5
        else:
            assert rel(y, ref.astype(ml_dtypes.bfloat16).astype(np.float64)) < 1e-3


@pytest.mark.parametrize("m,k", [(1, 25600), (8, 4096), (3, 48), (32, 1040)])
def test_quantize_activations_bit_exact(m, k):
    rng = np.random.default_rng(3000 + m + k)
    x = rng.standard_normal((m, k)).astype(np.float32) * 4.0
    x[0, :32] = 0.0
    x[-1, 16:32] = 1e-30  # tiny values: smallest block scale
    for dtype in (jnp.float32, jnp.bfloat16):
        xd = jnp.asarray(x, dtype)
        g = dispatch.act_tensor_scale(float(np.abs(x).max()) * 0.7)
        got = jax.jit(ffi_nvfp4.quantize_activations)(xd, g)
        want = nvfp4.quantize(xd.astype(jnp.float32), tensor_scale=g)
        np.testing.assert_array_equal(np.asarray(got.data), np.asarray(want.data))
        np.testing.assert_array_equal(np.asarray(got.block_scale).view(np.uint8), np.asarray(want.block_scale).view(np.uint8))


@pytest.mark.parametrize("activation", [None, "nvfp4"])
@pytest.mark.parametrize("m", [1, 4, 8, 16, 33, 96])
def test_quantized_linear_dispatch_matches_reference(activation, m):
    """Across the dispatch boundary (GEMV for small M, XLA dequantize-then-dot above)."""
    rng = np.random.default_rng(4000 + m)
    n, k = 768, 1024
    q, _ = weight(rng, n, k)
    x = jnp.asarray(rng.standard_normal((m, 1, k)), jnp.bfloat16)  # leading axes are flattened
    amax = jnp.float32(np.abs(np.asarray(x, np.float32)).max() * 0.8) if activation else None
    layer = QuantizedLinear(q, activation=activation, act_amax=amax, implementation="nvfp4_cuda")
    assert dispatch.supports(layer, x)
    y = np.asarray(jax.jit(lambda x: layer(x))(x).astype(jnp.float32))
    ref_layer = QuantizedLinear(q, activation=activation, act_amax=amax, implementation="xla")
    # An exact float64 product of the same quantized operands.
    xq = np.asarray(fake_quantize(x, "nvfp4", amax) if activation else x.astype(jnp.float32), np.float64)
    exact = xq @ np.asarray(q.dequantize(jnp.float32), np.float64).T
    assert rel(y, exact.astype(ml_dtypes.bfloat16).astype(np.float64)) < 1e-3
    # The pure-JAX reference rounds W4A16 weights to BF16 first, so it is ~1e-3 away itself.
    assert rel(y, np.asarray(ref_layer(x).astype(jnp.float32))) < 1e-2
    auto = QuantizedLinear(q, activation=activation, act_amax=amax, implementation="auto")
    np.testing.assert_array_equal(np.asarray(jax.jit(lambda x: auto(x))(x).astype(jnp.float32)), y)


@pytest.mark.parametrize("m,k", [(300, 4096), (2048, 1040)])
def test_large_m_cuda_activation_quantizer_matches_xla(m, k):
    """The XLA large-M W4A4 path with the CUDA activation quantizer: bit-exact codes, same product."""
    rng = np.random.default_rng(5000 + m)
    x = jnp.asarray(rng.standard_normal((m, k)) * 2, jnp.bfloat16)
    g = dispatch.act_tensor_scale(float(np.abs(np.asarray(x, np.float32)).max()) * 0.6)
    got = jax.jit(ffi_nvfp4.quantize_activations)(x, g)
    want = nvfp4.quantize(x.astype(jnp.float32), tensor_scale=g)
    np.testing.assert_array_equal(np.asarray(got.data), np.asarray(want.data))
    np.testing.assert_array_equal(np.asarray(got.block_scale).view(np.uint8), np.asarray(want.block_scale).view(np.uint8))
    q, _ = weight(rng, 256, k)
    y_cuda = jax.jit(lambda x: dispatch.dequantize_dot(x, q, g, act_quantizer="cuda"))(x)
    y_xla = jax.jit(lambda x: dispatch.dequantize_dot(x, q, g, act_quantizer="xla"))(x)
    np.testing.assert_array_equal(np.asarray(y_cuda.astype(jnp.float32)), np.asarray(y_xla.astype(jnp.float32)))
