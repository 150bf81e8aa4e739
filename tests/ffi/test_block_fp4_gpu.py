"""The MXFP4 / DialectFP4 GEMV (jaxlp.ffi.block_fp4) and its dispatch on a GPU, against float64 products of
the dequantized operands (skipped without a CUDA GPU)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxlp.ffi import block_fp4
from jaxlp.formats import dialect_fp4, mxfp4
from jaxlp.formats.dialect_fp4 import DialectFP4Array, pack_dialects
from jaxlp.formats.mxfp4 import MXFP4Array
from jaxlp.quantization import QuantizedLinear
from jaxlp.quantization import block_fp4_dispatch as dispatch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(jax.devices()[0].platform != "gpu", reason="needs a CUDA GPU"),
]

FORMATS = {"mxfp4": mxfp4.quantize, "dialect_fp4": dialect_fp4.quantize}
CONFIGS = [block_fp4.Config(r, s) for r in (1, 2) for s in (1, 2, 4)]


def rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-300))


def weight(fmt, rng, n, k, zero_blocks=4):
    w = rng.standard_normal((n, k)).astype(np.float32) * rng.uniform(0.005, 2.0, (n, 1)).astype(np.float32)
    for r, c in zip(rng.integers(0, n, zero_blocks), rng.integers(0, k // 32, zero_blocks)):
        w[r, 32 * c : 32 * c + 32] = 0.0
    return FORMATS[fmt](jnp.asarray(w))


def product_f64(x, q):
    return np.asarray(x, np.float64) @ np.asarray(q.dequantize(jnp.float32), np.float64).T


def activations(rng, m, k):
    x = rng.standard_normal((m, k)).astype(np.float32)
    x[m // 2] = 0.0  # an all-zero token
    return jnp.asarray(x, jnp.bfloat16)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("n,k", [(40, 128), (200, 384), (1024, 896), (4096, 4096)])
@pytest.mark.parametrize("m", [1, 5, 8, 9, 17, 32])
def test_matches_float64(fmt, n, k, m):
    rng = np.random.default_rng(n + k + m)
    q, x = weight(fmt, rng, n, k), activations(rng, m, k)
    ref = product_f64(x, q)
    y32 = block_fp4.matmul(x, q, out_dtype=jnp.float32)
    assert rel(y32, ref) < 1e-5
    y = block_fp4.matmul(x, q)
    assert y.dtype == jnp.bfloat16 and rel(y, ref) < 4e-3
    np.testing.assert_array_equal(np.asarray(y), np.asarray(y32.astype(jnp.bfloat16)))


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: c.name)
def test_every_launch(fmt, config):
    rng = np.random.default_rng(7)
    for n, k, m in [(300, 1152, 3), (2048, 640, 24)]:  # 1152 = 4.5 chunks; 640: odd rows' ids 2 bytes in
        q, x = weight(fmt, rng, n, k), activations(rng, m, k)
        assert rel(block_fp4.matmul(x, q, config=config, out_dtype=jnp.float32), product_f64(x, q)) < 1e-5


GEMMS = [block_fp4.Config(kernel="gemm", block_n=bn, block_m=bm, split=s)
         for bn, bm, s in [(64, 64, 1), (64, 64, 2), (128, 64, 2), (64, 128, 4), (128, 128, 1)]]


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("config", GEMMS, ids=lambda c: c.name)
def test_gemm_matches_float64(fmt, config):
    rng = np.random.default_rng(13)
    for n, k, m in [(200, 640, 17), (1024, 896, 200), (256, 4096, 64)]:
        q, x = weight(fmt, rng, n, k), activations(rng, m, k)
        y32 = block_fp4.matmul(x, q, config=config, out_dtype=jnp.float32)
        assert rel(y32, product_f64(x, q)) < 1e-5
        y = block_fp4.matmul(x, q, config=config)
        np.testing.assert_array_equal(np.asarray(y), np.asarray(y32.astype(jnp.bfloat16)))


def random_codes(rng, n, k):
    return jnp.asarray(rng.integers(0, 256, (n, k // 2), dtype=np.uint8))


@pytest.mark.parametrize("k", [384, 512])
def test_every_code_dialect_and_exponent(k):
    """Arrays built directly: every dialect id, every exponent code 0..31, every code."""
    rng = np.random.default_rng(k)
    n = 512
    ids = rng.integers(0, 16, (n, k // 32), dtype=np.uint8)
    exps = rng.integers(0, 32, (n, k // 32), dtype=np.uint8)
    exps[:32, 0] = np.arange(32)
    q = DialectFP4Array(codes=random_codes(rng, n, k), dialect_pairs=pack_dialects(jnp.asarray(ids)),
                        exponents=jnp.asarray(exps), shape=(n, k))
    x = jnp.asarray(rng.standard_normal((4, k)) * 2.0 ** rng.integers(-8, 8, (4, k)), jnp.bfloat16)
    for config in (block_fp4.Config(), GEMMS[1]):
        assert rel(block_fp4.matmul(x, q, config=config, out_dtype=jnp.float32), product_f64(x, q)) < 1e-5


def test_mxfp4_scales_across_the_range():
    """E8M0 scales from 2^-100 to 2^100 in one layer: every product exact, the sums FP32."""
    rng = np.random.default_rng(11)
    n, k = 256, 1024
    scales = rng.integers(27, 228, (n, k // 32)).astype(np.uint8)
    q = MXFP4Array(data=random_codes(rng, n, k), scale=jax.lax.bitcast_convert_type(jnp.asarray(scales),
                                                                                   jnp.float8_e8m0fnu),
                   shape=(n, k))
    x = jnp.asarray(rng.standard_normal((3, k)), jnp.bfloat16)
    ref = product_f64(x, q)
    got = np.asarray(block_fp4.matmul(x, q, out_dtype=jnp.float32), np.float64)
    # each output against its own largest product (rows mix magnitudes 2^200 apart)
    bound = np.abs(np.asarray(x, np.float64)) @ np.abs(np.asarray(q.dequantize(jnp.float32), np.float64)).T
    assert np.all(np.abs(got - ref) <= 1e-5 * bound)
    got = np.asarray(block_fp4.matmul(x, q, config=GEMMS[0], out_dtype=jnp.float32), np.float64)
    assert np.all(np.abs(got - ref) <= 1e-5 * bound)


def test_zero_weights_and_activations_give_zeros():
    q = mxfp4.quantize(jnp.zeros((64, 256)))
    assert not np.any(np.asarray(block_fp4.matmul(jnp.ones((2, 256), jnp.bfloat16), q)))
    q = dialect_fp4.quantize(jnp.ones((64, 256)))
    y = np.asarray(block_fp4.matmul(jnp.zeros((2, 256), jnp.bfloat16), q))
    assert np.all(y == 0) and not np.any(np.isnan(y))


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("act", [None, "same"])
@pytest.mark.parametrize("m", [1, 8, 16, 17, 33, 100, 300])
def test_linear_through_auto_matches_the_reference(fmt, act, m):
    rng = np.random.default_rng(m)
    q = weight(fmt, rng, 512, 768)
    layer = QuantizedLinear(q, activation=fmt if act else None, implementation="auto")
    x = jnp.asarray(rng.standard_normal((1, m, 768)), jnp.bfloat16)
    assert dispatch.why_not(layer, x) is None
    y = jax.jit(lambda x: layer(x))(x)
    ref = layer.reference(x)
    assert y.shape == ref.shape == (1, m, 512) and y.dtype == jnp.bfloat16
    assert rel(y, ref) < 4e-3


def test_dispatch_declines_what_it_cannot_run():
    w = mxfp4.quantize(jnp.ones((64, 192)))
    layer = QuantizedLinear(w, implementation="auto")
    assert "multiple of 128" in dispatch.why_not(layer, jnp.ones((2, 192), jnp.bfloat16))
    y = layer(jnp.ones((2, 192), jnp.bfloat16))  # "auto" falls back to the reference
    np.testing.assert_allclose(np.asarray(y, np.float32), np.asarray(layer.reference(jnp.ones((2, 192),
                                                                                             jnp.bfloat16)), np.float32))
    layer = QuantizedLinear(mxfp4.quantize(jnp.ones((64, 256))), implementation="block_fp4_cuda")
    with pytest.raises(ValueError, match="bfloat16"):
        layer(jnp.ones((2, 256), jnp.float32))
