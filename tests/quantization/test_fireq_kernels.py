"""FireQ W4A8 layer products on the kernels (``jaxlp.quantization.fireq_kernels``): the CUDA GEMV
(``"fireq_cuda"``), the Pallas GEMMs (``"fireq_pallas"``, both designs) and the CUTLASS GEMM
(``"fireq_cutlass"``) with its table builder: what they take and
refuse, the GEMM design and dispatch rules, the lowering (CPU), and on a GPU the products against
float64 NumPy of the exactly decoded E4M3 weights and the quantized activations (``ml_dtypes``), with
the format's edge values, PTS's ``1/p``, XLA's FP8 dot beside them, and ``"auto"``'s choice."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fireq_operands import rel, weights
from jaxlp.ffi import cutlass_gemm
from jaxlp.ffi import fireq as cuda
from jaxlp.formats import int4_fp8, nestedfp
from jaxlp.quantization import fireq_kernels
from jaxlp.quantization.linear import KERNELS, QuantizedLinear

ON_GPU = jax.default_backend() == "gpu"
# relative to float64 (FP32 sums of exact products, summation order only, then the one rounding to
# the output: FP16 within 1e-3, BF16 within half its epsilon)
TOL = {jnp.dtype(jnp.float16): 1e-3, jnp.dtype(jnp.bfloat16): float(jnp.finfo(jnp.bfloat16).eps) / 2}


def layer(w, implementation="fireq_cuda", out_scale=1.0):
    return QuantizedLinear(int4_fp8.quantize(jnp.asarray(w)), activation="fireq_fp8", out_scale=out_scale,
                           implementation=implementation)


def test_why_not_names_what_does_not_fit():
    rng = np.random.default_rng(0)
    lay = layer(weights(rng, 48, 256))
    x = jnp.ones((2, 256), jnp.bfloat16)
    if not ON_GPU:
        assert "not available" in fireq_kernels.why_not_gemv(lay, x)
        assert "needs a GPU" in fireq_kernels.why_not_gemm(lay, x)
    assert "tokens" in fireq_kernels.why_not_gemv(lay, jnp.ones((33, 256), jnp.bfloat16))
    assert "tokens" in fireq_kernels.why_not_gemv(lay, jnp.ones((3, 11, 256), jnp.bfloat16))
    wide = layer(weights(rng, 132 * 128, 128))  # its GEMM tiles fill the SMs: the GEMV stops at 16
    assert "tokens" in fireq_kernels.why_not_gemv(wide, jnp.ones((17, 128), jnp.bfloat16))
    assert fireq_kernels.gemv_tokens(4096) == 32 and fireq_kernels.gemv_tokens(28672) == 16
    assert "multiple of 16" in fireq_kernels.why_not_gemv(layer(weights(rng, 40, 256)), x)
    assert "bfloat16 or float16" in fireq_kernels.why_not_gemm(lay, x.astype(jnp.float32))
    assert "no tokens" in fireq_kernels.why_not_gemm(lay, jnp.ones((0, 256), jnp.bfloat16))
    w4a16 = QuantizedLinear(int4_fp8.quantize(jnp.ones((48, 256))), implementation="auto")
    assert "fireq_fp8" in fireq_kernels.why_not_gemv(w4a16, x)
    nested = QuantizedLinear(nestedfp.quantize(jnp.ones((48, 256), jnp.float16)), implementation="auto")
    assert "format" in fireq_kernels.why_not_gemm(nested, x)
    groups64 = QuantizedLinear(int4_fp8.quantize(jnp.ones((48, 256)), group_size=64), activation="fireq_fp8")
    assert "groups of 128" in fireq_kernels.why_not_gemm(groups64, x)


def test_gemm_design_is_checked():
    lay = layer(weights(np.random.default_rng(0), 64, 256), "fireq_pallas")
    with pytest.raises(ValueError, match="unknown FireQ GEMM design"):
        fireq_kernels.matmul_gemm(lay, jnp.ones((4, 256), jnp.bfloat16), design="xla")
    assert fireq_kernels.default_design(4, 28672) == "in_kernel"
    available = cuda.available()
    assert fireq_kernels.default_design(4096, 28672) == ("decoded" if available else "in_kernel")
    assert fireq_kernels.default_design(64, 4096) == ("decoded" if available else "in_kernel")


def test_layer_product_lowers_to_the_gemv_for_cuda():
    lay = layer(weights(np.random.default_rng(2), 64, 256), out_scale=0.25)
    x = jnp.ones((2, 3, 256), jnp.bfloat16)
    f = jax.jit(lambda x: fireq_kernels.matmul_gemv(lay, x))
    assert f.eval_shape(x).shape == (2, 3, 64) and f.eval_shape(x).dtype == jnp.bfloat16
    text = f.trace(x).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("stablehlo.custom_call") == 1 and cuda.TARGET in text


def test_cutlass_gemm_is_checked_and_lowers_to_one_custom_call():
    """"fireq_cutlass": refused off its shapes and without the library (here: no GPU); its product
    one custom call (the tables built by XLA here, where the CUDA table builder is not available)."""
    lay = layer(weights(np.random.default_rng(3), 64, 256), "fireq_cutlass", out_scale=0.25)
    x = jnp.ones((2, 3, 256), jnp.bfloat16)
    if not ON_GPU:
        assert "CUTLASS library is not available" in fireq_kernels.why_not_cutlass(lay, x)
    assert "groups of 128" in fireq_kernels.why_not_cutlass(
        QuantizedLinear(int4_fp8.quantize(jnp.ones((48, 256)), group_size=64), activation="fireq_fp8"), x)
    f = jax.jit(lambda x: fireq_kernels.matmul_cutlass(lay, x, config="co128x64"))
    assert f.eval_shape(x).shape == (2, 3, 64) and f.eval_shape(x).dtype == jnp.bfloat16
    text = f.trace(x).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count(f"stablehlo.custom_call @{cutlass_gemm.FIREQ_TARGET}") == 1


def test_cutlass_decoded_design_is_checked_and_lowers_to_the_decode_and_the_fp8_gemm():
    """"fireq_cutlass", design "decoded": the CUDA decode's custom call, then CUTLASS's FP8 GEMM's;
    an unknown design or lookup tables beside it refused; the default design by tokens."""
    lay = layer(weights(np.random.default_rng(4), 64, 256), "fireq_cutlass", out_scale=0.25)
    x = jnp.ones((2, 3, 256), jnp.bfloat16)
    with pytest.raises(ValueError, match="unknown FireQ CUTLASS design"):
        fireq_kernels.matmul_cutlass(lay, x, design="fp8")
    with pytest.raises(ValueError, match="no lookup tables"):
        fireq_kernels.matmul_cutlass(lay, x, design="decoded", tables=jnp.zeros((2, 64, 8), jnp.uint8))
    f = jax.jit(lambda x: fireq_kernels.matmul_cutlass(lay, x, design="decoded"))
    assert f.eval_shape(x).shape == (2, 3, 64) and f.eval_shape(x).dtype == jnp.bfloat16
    text = f.trace(x).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count(f"stablehlo.custom_call @{cuda.DECODE_TARGET}") == 1
    assert text.count(f"stablehlo.custom_call @{cutlass_gemm.TARGET}(") == 1
    assert cutlass_gemm.FIREQ_TARGET not in text
    cut = fireq_kernels.CUTLASS_DECODED_FROM_TOKENS
    assert fireq_kernels.default_cutlass_design(cut - 1) == "mixed"
    assert fireq_kernels.default_cutlass_design(cut) == "decoded"


def test_auto_takes_cutlass_past_the_gemv(monkeypatch):
    """"auto" tries CUTLASS first, which passes the GEMV's 1..16 tokens and needs the CUDA table
    builder and decode."""
    names = list(KERNELS)
    assert names.index("fireq_cutlass") < names.index("fireq_cuda") < names.index("fireq_pallas")
    assert names.index("fireq_pallas") < names.index("xla_native")
    lay = layer(weights(np.random.default_rng(3), 64, 256), "auto")
    decline = KERNELS["fireq_cutlass"].auto_declines
    assert "the GEMV's" in decline(lay, jnp.ones((2, 8, 256), jnp.bfloat16))
    monkeypatch.setattr(fireq_kernels.gemv_kernel, "available", lambda: False)
    assert "table builder" in decline(lay, jnp.ones((17, 256), jnp.bfloat16))
    monkeypatch.setattr(fireq_kernels.gemv_kernel, "available", lambda: True)
    assert decline(lay, jnp.ones((17, 256), jnp.bfloat16)) is None
    assert decline(lay, jnp.ones((4, 256, 256), jnp.bfloat16)) is None  # 1024 tokens
    assert decline(lay, jnp.ones((5000, 256), jnp.bfloat16)) is None


def test_table_builder_is_checked_and_lowers():
    w = int4_fp8.quantize(jnp.asarray(weights(np.random.default_rng(5), 64, 256)))
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        cuda.tables(w.scales.astype(jnp.float32))
    f = jax.jit(cuda.tables)
    assert f.eval_shape(w.scales).shape == (2, 64, 8) and f.eval_shape(w.scales).dtype == jnp.uint8
    text = f.trace(w.scales).lower(lowering_platforms=("cuda",)).as_text()
    assert f"stablehlo.custom_call @{cuda.TABLES_TARGET}" in text


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize("n, k", [(16, 128), (1000, 1024), (4096, 14336)])
def test_gpu_table_builder_matches_the_reference_bit_for_bit(n, k):
    """The CUDA tables against XLA's (cutlass_gemm.fireq_tables), with zero, saturating and subnormal
    scale groups."""
    rng = np.random.default_rng(n)
    w = rng.standard_normal((n, k)).astype(np.float32)
    w[0, :128] = 0.0  # the scale floor
    w[1, :128] *= 1e4  # the scale at E4M3's 448: products past 448 saturate
    w[2, :128] *= 1e-4  # subnormal products
    q = int4_fp8.quantize(jnp.asarray(w))
    np.testing.assert_array_equal(np.asarray(cuda.tables(q.scales)), np.asarray(cutlass_gemm.fireq_tables(q)))


def numpy_reference(w, x, out_scale=1.0):
    """float64 product of the values the kernels multiply: ``e4m3(q * s)`` and the quantized
    activations, times the BF16 activation scale and ``out_scale``."""
    wq = int4_fp8.quantize(jnp.asarray(w))
    w8 = np.asarray(wq.fp8_values()).astype(np.float64)
    x8, scale = int4_fp8.quantize_activation_fp8(jnp.asarray(x))
    x8 = np.asarray(x8).astype(np.float64)
    return (x8 @ w8.T) * np.asarray(scale.astype(jnp.float32), np.float64) * out_scale


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a GPU")
@pytest.mark.parametrize("implementation", ["fireq_cuda", "fireq_pallas", "fireq_cutlass"])
@pytest.mark.parametrize("m,n,k", [(1, 16, 128), (3, 48, 1024), (8, 4096, 4096), (9, 1024, 4224), (16, 14336, 512),
                                   (13, 4096, 14336), (17, 4096, 1024), (32, 1024, 14336)])
def test_gpu_matches_float64(implementation, m, n, k):
    rng = np.random.default_rng(m * 1000 + n + k)
    w = weights(rng, n, k)
    x = rng.standard_normal((m, k)).astype(np.float32) * np.exp(rng.uniform(-3, 3, (m, 1)))
    x[0] = 0.0 if m > 1 else x[0]  # an all-zero token
    lay = layer(w, implementation, out_scale=0.5)
    xin = jnp.asarray(x, jnp.float16 if m % 2 else jnp.bfloat16)  # odd M: an FP16 model
    why_not = {"fireq_cuda": fireq_kernels.why_not_gemv, "fireq_pallas": fireq_kernels.why_not_gemm,
               "fireq_cutlass": fireq_kernels.why_not_cutlass}[implementation]
    assert why_not(lay, xin) is None
    y = jax.jit(lambda x: lay(x))(xin)
    ref = numpy_reference(w, xin.astype(jnp.float32), 0.5)
    assert y.dtype == xin.dtype and y.shape == (m, n)
    assert rel(np.asarray(y, np.float32), ref) <= TOL[y.dtype]
    if m > 1:
        assert not np.asarray(y[0], np.float32).any()
    # the same as XLA's FP8 dot of the materialized FP8 weight (summation order and rounding)
    native = jax.jit(lambda x: layer(w, "xla_native", 0.5)(x))(xin)
    assert rel(np.asarray(y, np.float32), np.asarray(native, np.float32)) <= 2 * TOL[y.dtype]


GEMMS = {**{design: ("fireq_pallas", dict(design=design)) for design in fireq_kernels.GEMM_DESIGNS},
         **{f"cutlass-{c}": ("fireq_cutlass", dict(design="mixed", config=c)) for c in cutlass_gemm.FIREQ_CONFIGS},
         "cutlass-decoded": ("fireq_cutlass", dict(design="decoded"))}


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a GPU")
@pytest.mark.parametrize("gemm", list(GEMMS))
@pytest.mark.parametrize("m", [40, 700])
def test_gpu_gemms_match_float64(gemm, m):
    """Each GEMM (both Pallas designs, every CUTLASS config) through its layer product."""
    implementation, options = GEMMS[gemm]
    rng = np.random.default_rng(m)
    w = weights(rng, 640, 1024)
    lay = layer(w, implementation, out_scale=0.25)
    matmul = fireq_kernels.matmul_gemm if implementation == "fireq_pallas" else fireq_kernels.matmul_cutlass
    xin = jnp.asarray(rng.standard_normal((m, 1024)), jnp.float16)
    y = jax.jit(lambda x: matmul(lay, x, **options))(xin)
    assert y.dtype == jnp.float16 and y.shape == (m, 640)
    assert rel(np.asarray(y, np.float32), numpy_reference(w, xin.astype(jnp.float32), 0.25)) <= TOL[y.dtype]


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a GPU")
def test_gpu_auto_takes_the_gemv_then_cutlass_mixed_then_decoded():
    """1..16 tokens the GEMV, 17..1023 CUTLASS's mixed-input GEMM (its tables built by CUDA), from
    1024 on the CUDA decode and CUTLASS's FP8 GEMM; never the Pallas GEMM."""
    rng = np.random.default_rng(1)
    w = weights(rng, 256, 512)
    lay = layer(w, "auto")
    cut = fireq_kernels.CUTLASS_DECODED_FROM_TOKENS
    for m in (1, 16, 17, 32, 33, 300, cut - 1, cut, cut + 1):
        xin = jnp.asarray(rng.standard_normal((m, 512)), jnp.float16)
        text = jax.jit(lambda x: lay(x)).lower(xin).as_text()
        gemv, mixed, decoded = m <= 16, 16 < m < cut, m >= cut
        assert (cuda.TARGET in text) == gemv and (cutlass_gemm.FIREQ_TARGET in text) == mixed
        assert (cuda.TABLES_TARGET in text) == mixed and "mosaic_gpu" not in text
        assert (cuda.DECODE_TARGET in text) == decoded and (f"@{cutlass_gemm.TARGET}(" in text) == decoded
        y = jax.jit(lambda x: lay(x))(xin)
        assert rel(np.asarray(y, np.float32), numpy_reference(w, xin.astype(jnp.float32))) <= TOL[y.dtype]
