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
    x = jnp.ones((2, 192), jnp.bfloat16)
    y = layer(x)  # "auto" falls back to the reference
    np.testing.assert_allclose(np.asarray(y, np.float32), np.asarray(layer.reference(x), np.float32))
    layer = QuantizedLinear(mxfp4.quantize(jnp.ones((64, 256))), implementation="block_fp4_cuda")
    with pytest.raises(ValueError, match="bfloat16"):
        layer(jnp.ones((2, 256), jnp.float32))


def staged_inputs(rng, m, k):
    """Activations across magnitudes, a zero block, a block of equal values, ties of the roundings."""
    x = rng.standard_normal((m, k)) * 2.0 ** rng.integers(-6, 6, (m, k // 32)).repeat(32, axis=1)
    x[0, :32] = 0.0
    x[-1, 32:64] = 1.5
    x[0, 64:96] = np.linspace(-6, 6, 32)
    return jnp.asarray(x, jnp.bfloat16)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("act", FORMATS)
@pytest.mark.parametrize("m", [1, 7, 32, 64])
def test_w4a4_staging_equals_the_reference_quantizer(fmt, act, m):
    """The staged activations are fake_quantize's bit for bit: W4A4 through the kernel equals the same
    kernel's W4A16 on the reference's quantized activations, bit for bit."""
    from jaxlp.quantization.activations import fake_quantize

    rng = np.random.default_rng(m)
    q, x = weight(fmt, rng, 384, 1024), staged_inputs(rng, m, 1024)
    xq = fake_quantize(x, act).astype(jnp.bfloat16)
    configs = [GEMMS[1]] + ([block_fp4.Config()] if m <= block_fp4.MAX_M else [])
    for config in configs:
        got = block_fp4.matmul(x, q, config=config, activation=act, out_dtype=jnp.float32)
        want = block_fp4.matmul(xq, q, config=config, out_dtype=jnp.float32)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


@pytest.mark.parametrize("recipe", ["w4a16-mxfp4", "w4a16-dialect", "w4a4-mxfp4"])
def test_reasoner_greedy_tokens_through_the_kernels(recipe):
    """The shipped reasoner (K = 384, 896): the same greedy tokens through "auto" as through "xla"."""
    from importlib.resources import files

    import jaxlp
    from jaxlp.quantization import quantize_model, set_implementation

    model = jaxlp.from_pretrained(files("jaxlp") / "assets" / "reasoner", dtype=jnp.bfloat16)
    qmodel = quantize_model(model, recipe)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 60, 40).tolist(), rng.integers(3, 60, 25).tolist()]
    runs = []
    for impl in ("xla", "auto"):
        set_implementation(qmodel, impl)
        runs.append(jaxlp.generate(qmodel, prompts, max_new_tokens=12, stop_tokens=[]).tokens)
    np.testing.assert_array_equal(np.asarray(runs[0]), np.asarray(runs[1]))


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("n,k", [(3, 96), (300, 1024), (4096, 4096)])
def test_decode_equals_dequantize(fmt, n, k):
    q = weight(fmt, np.random.default_rng(n + k), n, k)
    got = block_fp4.decode(q)
    assert got.dtype == jnp.bfloat16 and got.shape == (n, k)
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(q.dequantize(jnp.bfloat16), np.float32))


def test_decode_of_every_dialect_exponent_and_scale():
    rng = np.random.default_rng(17)
    n, k = 512, 320
    ids = rng.integers(0, 16, (n, k // 32), dtype=np.uint8)
    exps = rng.integers(0, 32, (n, k // 32), dtype=np.uint8)
    codes = rng.integers(0, 256, (n, k // 2), dtype=np.uint8)
    q = DialectFP4Array(codes=jnp.asarray(codes), dialect_pairs=pack_dialects(jnp.asarray(ids)),
                        exponents=jnp.asarray(exps), shape=(n, k))
    nib = np.stack([codes & 0xF, codes >> 4], -1).reshape(n, k // 32, 32)
    mag = dialect_fp4.FORMATBOOK.astype(np.float64)[ids[..., None], nib & 7] * np.exp2(exps[..., None] - 19.0)
    want = np.where(nib >= 8, -mag, mag).reshape(n, k)
    np.testing.assert_array_equal(np.asarray(block_fp4.decode(q), np.float64), want)
    scales = np.repeat(np.arange(253, dtype=np.uint8)[None], 2, 0)  # every scale the quantizer writes
    codes = rng.integers(0, 256, (2, 253 * 16), dtype=np.uint8)
    q = MXFP4Array(data=jnp.asarray(codes), scale=jax.lax.bitcast_convert_type(jnp.asarray(scales),
                                                                               jnp.float8_e8m0fnu), shape=(2, 8096))
    e2m1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6])
    nib = np.stack([codes & 0xF, codes >> 4], -1).reshape(2, 253, 32)
    mag = e2m1[nib & 7] * np.exp2(scales[..., None].astype(np.float64) - 127)
    want = np.where(nib >= 8, -mag, mag).reshape(2, 8096)
    np.testing.assert_array_equal(np.asarray(block_fp4.decode(q), np.float64), want)
