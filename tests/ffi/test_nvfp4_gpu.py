"""The NVFP4 CUDA kernels (regs, pipe and pipe16 GEMVs, the GEMM, the quantizer) on a GPU against
float64 references (skipped without a CUDA GPU)."""

import functools

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


def _gemv16(x, q, g_x, cfg, probe=False):
    return jax.jit(lambda x, q, g: ffi_nvfp4.gemv_call(
        x, q.data, jax.lax.bitcast_convert_type(q.block_scale, jnp.uint8), q.tensor_scale, g, config=cfg,
        probe=probe))(x, q, g_x)


def check_fp16_gemv_w4a16(x, q, wref, cfg):
    """W4A16 through an FP16-product GEMV configuration: the staged activations bit-exact, the
    output within 1e-3 of float64 (after its BF16 rounding for BF16 activations)."""
    y, x_eff, xs = _gemv16(x, q, None, cfg)
    assert y.dtype == x.dtype and y.shape == (x.shape[0], wref.shape[0])
    xf = np.asarray(x.astype(jnp.float32))
    e_eff, e_xs = stage_a16(xf)
    np.testing.assert_array_equal(np.asarray(x_eff), e_eff)
    np.testing.assert_array_equal(np.asarray(xs), e_xs)
    ref = xf.astype(np.float64) @ wref.T
    y = np.asarray(y.astype(jnp.float32))
    assert np.isfinite(y).all()
    if x.dtype == jnp.float32:
        assert rel(y, ref) < 1e-3, cfg.name  # FP32 inputs enter the products rounded to FP16
    else:
        assert rel(y, ref.astype(ml_dtypes.bfloat16).astype(np.float64)) < 1e-3, cfg.name
        assert rel(y, ref) < 4e-3, cfg.name


def check_amax_operand(x, q, amax, cfg):
    """W4A4 with the amax as the kernel operand (g_x computed on the GPU) is bit-identical to W4A4
    with g_x computed by XLA."""
    g_x = dispatch.act_tensor_scale(amax)
    a = jax.jit(lambda x: ffi_nvfp4.nvfp4_gemv(x, q, act_tensor_scale=g_x, config=cfg))(x)
    b = jax.jit(lambda x: ffi_nvfp4.nvfp4_gemv(x, q, act_amax=jnp.float32(amax), config=cfg))(x)
    np.testing.assert_array_equal(np.asarray(a.astype(jnp.float32)), np.asarray(b.astype(jnp.float32)))


def check_fp16_gemv_w4a4_saturated(x, q, wref, cfg):
    """W4A4 with a tensor scale from half the true amax (so activations saturate): staging
    bit-exact, the output as the fake-quantized product (exact products, FP32 sums)."""
    amax = float(np.abs(np.asarray(x, np.float32)).max()) * 0.5
    g_x = dispatch.act_tensor_scale(amax)
    y, x_eff, _ = _gemv16(x, q, g_x, cfg)
    np.testing.assert_array_equal(np.asarray(x_eff), stage_a4(np.asarray(x, np.float32), float(g_x)))
    ref = np.asarray(fake_quantize(x, "nvfp4", jnp.float32(amax)), np.float64) @ wref.T
    y = np.asarray(y.astype(jnp.float32))
    if x.dtype == jnp.float32:
        assert rel(y, ref) < 1e-5, cfg.name
    else:
        assert rel(y, ref.astype(ml_dtypes.bfloat16).astype(np.float64)) < 1e-3, cfg.name


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

PIPE16_CONFIGS = [
    ffi_nvfp4.GemvConfig(1, kernel="pipe16"),
    ffi_nvfp4.GemvConfig(2, kernel="pipe16", split=2),
    ffi_nvfp4.GemvConfig(1, kernel="pipe16", split=4, pdl=False),
    ffi_nvfp4.GemvConfig(2, kernel="pipe16", split=1),
]
PIPE16_SHAPES = [  # M = 1..8 and across the 8-token groups; N not a multiple of 16 / 32; K % 64 == 0, not always % 256
    (1, 1000, 4096),
    (2, 37, 64),
    (3, 520, 1088),
    (4, 333, 320),
    (5, 4096, 1088),
    (6, 130, 2048),
    (7, 96, 576),
    (8, 520, 2048),
    (9, 333, 320),
    (17, 2048, 512),
    (32, 130, 1024),
]


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("configs,m,n,k", [pytest.param(CONFIGS, *s, id=f"regs-{s}") for s in SHAPES]
                         + [pytest.param(PIPE16_CONFIGS, *s, id=f"pipe16-{s}") for s in PIPE16_SHAPES])
def test_w4a16(configs, m, n, k, dtype):
    rng = np.random.default_rng(1000 + m * 7 + k)
    q, wref = weight(rng, n, k)
    for cfg in configs:
        # fresh inputs per call: a stale output buffer would show
        check_fp16_gemv_w4a16(acts(rng, m, k, dtype), q, wref, cfg)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("configs,m,n,k", [pytest.param(CONFIGS[:2], *s, id=f"regs-{s}") for s in SHAPES]
                         + [pytest.param(PIPE16_CONFIGS[:2], *s, id=f"pipe16-{s}") for s in PIPE16_SHAPES])
def test_w4a4(configs, m, n, k, dtype):
    rng = np.random.default_rng(2000 + m * 7 + k)
    q, wref = weight(rng, n, k)
    for cfg in configs:
        check_fp16_gemv_w4a4_saturated(acts(rng, m, k, dtype), q, wref, cfg)


@pytest.mark.parametrize("lanes", [1, 2, 4])
@pytest.mark.parametrize("m,k", [(1, 25600), (8, 4096), (3, 48), (32, 1040)])
def test_quantize_activations_bit_exact(m, k, lanes):
    rng = np.random.default_rng(3000 + m + k)
    x = rng.standard_normal((m, k)).astype(np.float32) * 4.0
    x[0, :32] = 0.0
    x[-1, 16:32] = 1e-30  # tiny values: smallest block scale
    for dtype in (jnp.float32, jnp.bfloat16):
        xd = jnp.asarray(x, dtype)
        g = dispatch.act_tensor_scale(float(np.abs(x).max()) * 0.7)
        got = jax.jit(functools.partial(ffi_nvfp4.quantize_activations, lanes=lanes))(xd, g)
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


@pytest.mark.parametrize("activation", [None, "nvfp4"])
@pytest.mark.parametrize("m", [1, 3, 6, 8])
@pytest.mark.parametrize("n,k", [(512, 256), (1536, 256), (256, 768)])
def test_dispatch_of_small_layers_matches_exact(activation, m, n, k):
    """Layers far from the table's shapes (a tiny model's fused qkv / gate_up, K = 256 is one chunk)."""
    rng = np.random.default_rng(5000 + m + n + k)
    q, _ = weight(rng, n, k)
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
    amax = jnp.float32(np.abs(np.asarray(x, np.float32)).max() * 0.8) if activation else None
    layer = QuantizedLinear(q, activation=activation, act_amax=amax, implementation="auto")
    y = np.asarray(jax.jit(lambda x: layer(x))(x).astype(jnp.float32))
    xq = np.asarray(fake_quantize(x, "nvfp4", amax) if activation else x.astype(jnp.float32), np.float64)
    exact = xq @ np.asarray(q.dequantize(jnp.float32), np.float64).T
    assert rel(y, exact.astype(ml_dtypes.bfloat16).astype(np.float64)) < 1e-3, dispatch.plan(m, n, k, "w4a4" if activation else "w4a16")


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


# --- the BF16 tensor-core kernels: "pipe" (small M) and "gemm" (any M) -----------------------

PIPE_CONFIGS = [
    ffi_nvfp4.GemvConfig(1, kernel="pipe"),
    ffi_nvfp4.GemvConfig(2, kernel="pipe", split=2),
    ffi_nvfp4.GemvConfig(1, kernel="pipe", split=4, pdl=False),
]
GEMM_CONFIGS = [
    ffi_nvfp4.GemvConfig(kernel="gemm", block_n=64, block_m=64),
    ffi_nvfp4.GemvConfig(kernel="gemm", block_n=128, block_m=64, split=2),
    ffi_nvfp4.GemvConfig(kernel="gemm", block_n=64, block_m=128, split=4),
    ffi_nvfp4.GemvConfig(kernel="gemm", block_n=128, block_m=128, pdl=False),
]

PIPE_SHAPES = [  # K a multiple of 64 but not always of the 256-k chunk; N not a multiple of 16 / 32
    (1, 1000, 4096),
    (2, 37, 64),
    (5, 4096, 1088),
    (8, 520, 2048),
    (9, 333, 320),
    (16, 96, 256),
    (17, 2048, 512),
    (32, 130, 1024),
]
GEMM_SHAPES = [(1, 64, 256), (16, 300, 1024), (33, 130, 4096), (64, 1000, 1088), (130, 257, 512), (300, 4096, 320)]


def _matmul(x, q, g_x, cfg):
    return jax.jit(lambda x, q, g: ffi_nvfp4.matmul_call(
        x, q.data, jax.lax.bitcast_convert_type(q.block_scale, jnp.uint8), q.tensor_scale, g, config=cfg))(x, q, g_x)


def _check_a16(y, x, wref):
    ref = np.asarray(x.astype(jnp.float32), np.float64) @ wref.T
    y = np.asarray(y.astype(jnp.float32))
    assert np.isfinite(y).all()
    assert rel(y, ref.astype(ml_dtypes.bfloat16).astype(np.float64)) < 1e-3
    assert rel(y, ref) < 4e-3


def _check_a4(y, xeff, x, g_x, amax, wref):
    xq = nvfp4.quantize(x.astype(jnp.float32), tensor_scale=g_x)
    codes_scales = weight_f64(np.asarray(xq.data), np.asarray(xq.block_scale).view(np.uint8), 1.0)
    np.testing.assert_array_equal(np.asarray(xeff.astype(jnp.float32), np.float64), codes_scales)  # exact staging
    ref = np.asarray(fake_quantize(x, "nvfp4", jnp.float32(amax)), np.float64) @ wref.T
    y = np.asarray(y.astype(jnp.float32))
    if x.dtype == jnp.float32:
        assert rel(y, ref) < 1e-5
    else:
        assert rel(y, ref.astype(ml_dtypes.bfloat16).astype(np.float64)) < 1e-3


@pytest.mark.parametrize("m,n,k", PIPE_SHAPES)
def test_pipe_w4a16(m, n, k):
    rng = np.random.default_rng(6000 + m * 7 + k)
    q, wref = weight(rng, n, k)
    for cfg in PIPE_CONFIGS:
        x = acts(rng, m, k, jnp.bfloat16)
        y, _ = _matmul(x, q, None, cfg)
        assert y.dtype == jnp.bfloat16 and y.shape == (m, n)
        _check_a16(y, x, wref)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("m,n,k", PIPE_SHAPES[::2] + PIPE_SHAPES[1::4])
def test_pipe_w4a4(m, n, k, dtype):
    rng = np.random.default_rng(7000 + m * 7 + k)
    q, wref = weight(rng, n, k)
    for cfg in PIPE_CONFIGS[:2]:
        x = acts(rng, m, k, dtype)
        amax = float(np.abs(np.asarray(x, np.float32)).max()) * 0.5  # saturation
        g_x = dispatch.act_tensor_scale(amax)
        y, xeff = _matmul(x, q, g_x, cfg)
        assert y.dtype == dtype and xeff.shape == (m, k)
        _check_a4(y, xeff, x, g_x, amax, wref)


@pytest.mark.parametrize("m,n,k", GEMM_SHAPES)
def test_gemm_w4a16_and_w4a4(m, n, k):
    rng = np.random.default_rng(8000 + m * 7 + k)
    q, wref = weight(rng, n, k)
    for cfg in GEMM_CONFIGS:
        if cfg.unsupported(m, k, jnp.bfloat16, False):
            continue
        x = acts(rng, m, k, jnp.bfloat16)
        y, _ = _matmul(x, q, None, cfg)
        assert y.shape == (m, n)
        _check_a16(y, x, wref)
        for dtype in (jnp.float32, jnp.bfloat16):
            x = acts(rng, m, k, dtype)
            amax = float(np.abs(np.asarray(x, np.float32)).max()) * 0.7
            g_x = dispatch.act_tensor_scale(amax)
            y, xeff = _matmul(x, q, g_x, cfg)
            _check_a4(y, xeff, x, g_x, amax, wref)


def test_every_code_and_scale_extremes():
    """Random bytes (every E2M1 code pair) under E4M3 scales from the smallest subnormal 2^-9 to
    448, through all three kernels: the BF16 decode's subnormal (code 1) and the scale range."""
    rng = np.random.default_rng(9000)
    n, k = 160, 1024
    finite = np.arange(0x7F, dtype=np.uint8)  # non-negative E4M3, 0x7F is NaN
    sbits = rng.choice(np.concatenate([finite, np.array([1, 2, 0x7E, 0x7E, 0x08], np.uint8)]), (n, k // 16))
    data = rng.integers(0, 256, (n, k // 2), dtype=np.uint8)
    g = 0.37
    q = nvfp4.NVFP4Array(
        data=jnp.asarray(data),
        block_scale=jax.lax.bitcast_convert_type(jnp.asarray(sbits), jnp.float8_e4m3fn),
        tensor_scale=jnp.float32(g),
        shape=(n, k),
    )
    wref = weight_f64(data, sbits, np.float32(g))
    for m, cfgs in ((3, [ffi_nvfp4.GemvConfig()] + PIPE_CONFIGS + PIPE16_CONFIGS), (70, GEMM_CONFIGS)):
        for cfg in cfgs:
            x = acts(rng, m, k, jnp.bfloat16)
            y = jax.jit(lambda x, q: ffi_nvfp4.nvfp4_gemv(x, q, config=cfg))(x, q)
            _check_a16(y, x, wref)


def test_dispatch_falls_back_for_unsupported_calls():
    """A table choice of pipe / gemm with K % 64 != 0 or FP32 W4A16 runs the regs GEMV or XLA, correctly."""
    rng = np.random.default_rng(9100)
    for m, k, dtype in ((4, 1040, jnp.bfloat16), (4, 1024, jnp.float32), (40, 1040, jnp.bfloat16)):
        q, wref = weight(rng, 96, k)
        layer = QuantizedLinear(q, implementation="nvfp4_cuda")
        x = acts(rng, m, k, dtype)
        for cfg in PIPE_CONFIGS[:1] + GEMM_CONFIGS[:1]:
            y = jax.jit(lambda x: dispatch.nvfp4_matmul(layer, x, config=cfg))(x)
            ref = np.asarray(x.astype(jnp.float32), np.float64) @ wref.T
            assert rel(np.asarray(y.astype(jnp.float32)), ref) < 4e-3


@pytest.mark.parametrize("amax", [3.7, 1e-15, 123456.0])
def test_amax_operand_matches_tensor_scale(amax):
    """W4A4 with the calibrated amax as the kernel operand (g_x computed on the GPU) is
    bit-identical to W4A4 with g_x computed by XLA, for all three kernels."""
    rng = np.random.default_rng(9200)
    q, _ = weight(rng, 200, 1024)
    for m, cfg in ((3, ffi_nvfp4.GemvConfig()), (5, PIPE_CONFIGS[1]), (6, PIPE16_CONFIGS[1]), (40, GEMM_CONFIGS[1])):
        check_amax_operand(acts(rng, m, 1024, jnp.bfloat16), q, amax, cfg)


# --- pipe16: the pipe kernel's ring with the regs GEMV's FP16 arithmetic (regs staging; its
# configurations and shapes are defined with the regs ones, test_w4a16 / test_w4a4 cover it) -----

def test_pipe16_probe_runs_and_rejects_bad_calls():
    """The loads-only probe launches (its output is meaningless); K % 64 != 0 is refused."""
    rng = np.random.default_rng(12000)
    q, _ = weight(rng, 300, 1024)
    for cfg in PIPE16_CONFIGS[:2]:
        y, _, _ = _gemv16(acts(rng, 1, 1024, jnp.bfloat16), q, None, cfg, probe=True)
        assert y.shape == (1, 300)
    q, _ = weight(rng, 64, 1040)
    with pytest.raises(ValueError, match="multiple of 64"):
        _gemv16(acts(rng, 2, 1040, jnp.bfloat16), q, None, PIPE16_CONFIGS[0])


def test_dispatch_runs_a_pipe16_choice():
    """A table choosing pipe16 runs it through QuantizedLinear (and falls back to regs for K % 64 != 0)."""
    rng = np.random.default_rng(12100)
    for k in (1024, 1040):
        q, wref = weight(rng, 200, k)
        layer = QuantizedLinear(q, implementation="nvfp4_cuda")
        x = acts(rng, 3, k, jnp.bfloat16)
        y = jax.jit(lambda x: dispatch.nvfp4_matmul(layer, x, config=PIPE16_CONFIGS[0]))(x)
        ref = np.asarray(x.astype(jnp.float32), np.float64) @ wref.T
        assert rel(np.asarray(y.astype(jnp.float32)), ref) < 4e-3


# --- the M <= 8 variants: regs with 3 CTAs per SM (B3), two MMA chains (A2), pipe16 with a 2-stage ring (S2) --

VARIANT_CONFIGS = [
    ffi_nvfp4.GemvConfig(1, 8, blocks_per_sm=3),
    ffi_nvfp4.GemvConfig(1, 4, blocks_per_sm=3, accumulators=2, pdl=False),
    ffi_nvfp4.GemvConfig(2, 8, accumulators=2),
    ffi_nvfp4.GemvConfig(1, kernel="pipe16", stages=2),
    ffi_nvfp4.GemvConfig(2, kernel="pipe16", split=2, stages=2, accumulators=2),
    ffi_nvfp4.GemvConfig(1, kernel="pipe16", split=4, accumulators=2),
]
VARIANT_SHAPES = [  # M = 1..8; N not a multiple of 16 / 32; K % 16 == 0 but not % 64 or % 256 where the kernel takes it
    (1, 1000, 4112),
    (2, 37, 64),
    (3, 520, 1088),
    (4, 333, 320),
    (5, 4096, 1040),
    (6, 300, 1056),
    (7, 96, 576),
    (8, 520, 2048),
]


@pytest.mark.parametrize("m,n,k", VARIANT_SHAPES)
def test_small_m_variants_w4a16_and_w4a4(m, n, k):
    rng = np.random.default_rng(13000 + m * 7 + k)
    q, wref = weight(rng, n, k, zero_blocks=8)
    ran = 0
    for cfg in VARIANT_CONFIGS:
        if cfg.unsupported(m, k, jnp.bfloat16, False):
            assert cfg.kernel == "pipe16" and k % 64, cfg.name  # only pipe16's K % 64 limit applies at M <= 8
            continue
        ran += 1
        for dtype in (jnp.bfloat16, jnp.float32):
            check_fp16_gemv_w4a16(acts(rng, m, k, dtype), q, wref, cfg)  # fresh inputs per call
            check_fp16_gemv_w4a4_saturated(acts(rng, m, k, dtype), q, wref, cfg)
    assert ran >= 3


def test_small_m_variants_every_code_and_amax_operand():
    """Every E2M1 code pair under extreme E4M3 scales through the variants, and W4A4 with the amax
    operand bit-identical to W4A4 with g_x."""
    rng = np.random.default_rng(13500)
    n, k = 160, 1024
    sbits = rng.choice(np.concatenate([np.arange(0x7F, dtype=np.uint8), np.array([1, 2, 0x7E, 0x08], np.uint8)]),
                       (n, k // 16))
    data = rng.integers(0, 256, (n, k // 2), dtype=np.uint8)
    q = nvfp4.NVFP4Array(data=jnp.asarray(data), block_scale=jax.lax.bitcast_convert_type(
        jnp.asarray(sbits), jnp.float8_e4m3fn), tensor_scale=jnp.float32(0.37), shape=(n, k))
    wref = weight_f64(data, sbits, np.float32(0.37))
    for cfg in VARIANT_CONFIGS:
        x = acts(rng, 3, k, jnp.bfloat16)
        _check_a16(jax.jit(lambda x: ffi_nvfp4.nvfp4_gemv(x, q, config=cfg))(x), x, wref)
        check_amax_operand(x, q, 5.5, cfg)


def test_small_m_variants_refuse_m_above_8_and_dispatch_falls_back():
    rng = np.random.default_rng(13600)
    q, wref = weight(rng, 200, 1024)
    with pytest.raises(ValueError, match="takes 1..8"):
        _gemv16(acts(rng, 9, 1024, jnp.bfloat16), q, None, VARIANT_CONFIGS[0])
    y, _, _ = _gemv16(acts(rng, 1, 1024, jnp.bfloat16), q, None, ffi_nvfp4.GemvConfig(1, kernel="pipe16", stages=2),
                      probe=True)  # the S2 ring's loads-only probe launches
    assert y.shape == (1, 200)
    layer = QuantizedLinear(q, implementation="nvfp4_cuda")
    for m in (4, 12):  # a table choosing a variant: it runs at M <= 8, the regs GEMV above
        x = acts(rng, m, 1024, jnp.bfloat16)
        y = jax.jit(lambda x: dispatch.nvfp4_matmul(layer, x, config=VARIANT_CONFIGS[0]))(x)
        _check_a16(y, x, wref)
