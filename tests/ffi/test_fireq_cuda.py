"""The FireQ CUDA kernels (``jaxlp.ffi.fireq``): the W4A8 GEMV for 1..32 tokens and the INT4 -> E4M3
decode: what they take and refuse, the GEMV's split choice and lowering (CPU), and on a GPU the
decode against the format's own E4M3 values bit for bit and the GEMV's unrolls against float64
NumPy products (``ml_dtypes``) of fresh random operands with the format's edge values. The layer
products through them: ``tests/quantization/test_fireq_kernels.py``."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from fireq_operands import rel, weights
from jaxlp.ffi import fireq as cuda
from jaxlp.formats import int4_fp8

ON_GPU = jax.default_backend() == "gpu"
E4M3 = ml_dtypes.float8_e4m3fn


def test_default_splits_fill_the_gpu_and_leave_each_warp_work():
    assert cuda.default_splits(4096, 4096) == 1  # 256 blocks >= 132 SMs
    assert cuda.default_splits(4096, 14336) == 1
    assert cuda.default_splits(1024, 14336) == 3  # 64 blocks: 3 for 132 CTAs, 112 windows allow 7
    assert cuda.default_splits(1024, 256) == 1  # 2 windows: none to split
    assert cuda.default_splits(28672, 4096) == 1
    assert cuda.default_splits(1024, 14336, num_sms=64) == 1  # 64 blocks fill a 64-SM GPU
    for n in (16, 1024, 4096, 14336):
        for k in (128, 1024, 4096, 14336):
            s = cuda.default_splits(n, k)
            assert s >= 1 and (s == 1 or (k // cuda.WINDOW) // s >= 2 * cuda.WARPS)


def test_gemv_refuses_bad_operands():
    w = int4_fp8.quantize(jnp.ones((48, 256)))
    x8 = jnp.ones((2, 256), jnp.float8_e4m3fn)
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        cuda.gemv(x8.astype(jnp.bfloat16), w.codes, w.scales)
    with pytest.raises(ValueError, match="tokens"):
        cuda.gemv(jnp.ones((33, 256), jnp.float8_e4m3fn), w.codes, w.scales)
    with pytest.raises(ValueError, match="N a multiple"):
        cuda.gemv(x8, w.codes[:40], w.scales[:40])
    with pytest.raises(ValueError, match="codes must be"):
        cuda.gemv(x8, w.codes[:, :64], w.scales)
    with pytest.raises(ValueError, match="2-D"):
        cuda.gemv(x8[0], w.codes, w.scales)
    with pytest.raises(ValueError, match="out_dtype"):
        cuda.gemv(x8, w.codes, w.scales, out_dtype=jnp.int32)
    with pytest.raises(ValueError, match="one value per token"):
        cuda.gemv(x8, w.codes, w.scales, token_scale=jnp.ones((3,), jnp.float32))
    with pytest.raises(ValueError, match="splits"):
        cuda.gemv(x8, w.codes, w.scales, splits=9)


def test_decode_refuses_bad_operands_and_lowers_to_one_custom_call():
    w = int4_fp8.quantize(jnp.ones((64, 256)))
    with pytest.raises(ValueError, match="uint8"):
        cuda.decode(w.codes.astype(jnp.int8), w.scales)
    with pytest.raises(ValueError, match="scales"):
        cuda.decode(w.codes, w.scales[:, :1])
    with pytest.raises(ValueError, match="unroll"):
        cuda.gemv(jnp.ones((1, 256), jnp.float8_e4m3fn), w.codes, w.scales, unroll=3)
    text = jax.jit(cuda.decode).trace(w.codes, w.scales).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("stablehlo.custom_call") == 1 and cuda.DECODE_TARGET in text


def test_gemv_lowers_to_one_custom_call_for_cuda():
    """The wrapper's operands lower for CUDA on any machine (no kernel runs)."""
    w = int4_fp8.quantize(jnp.ones((64, 256)))
    x8 = jnp.ones((11, 256), jnp.float8_e4m3fn)
    f = jax.jit(lambda x8, c, s, t: cuda.gemv(x8, c, s, splits=2, token_scale=t, multiplier=0.25,
                                              out_dtype=jnp.bfloat16))
    text = f.trace(x8, w.codes, w.scales, jnp.ones((11, 1))).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("stablehlo.custom_call") == 1 and cuda.TARGET in text
    assert "-> tensor<11x64xbf16>" in text  # the splits added and the product scaled inside the kernel
    assert "splits = 2 : i32" in text and "multiplier = 2.500000e-01 : f32" in text
    assert "stablehlo.reduce" not in text and "stablehlo.multiply" not in text


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a GPU")
def test_gpu_decode_is_the_formats_fp8_values_bit_for_bit():
    rng = np.random.default_rng(5)
    for n, k in ((16, 128), (4096, 14336), (48, 4224)):
        w = int4_fp8.quantize(jnp.asarray(weights(rng, n, k)))
        got = np.asarray(jax.jit(cuda.decode)(w.codes, w.scales)).view(np.uint8)
        np.testing.assert_array_equal(got, np.asarray(w.fp8_values()).view(np.uint8))


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a GPU")
@pytest.mark.parametrize("unroll", [1, 2, 4])
@pytest.mark.parametrize("m", [5, 16, 29])
def test_gpu_gemv_unrolls_agree_with_float64(unroll, m):
    rng = np.random.default_rng(unroll + m)
    w = int4_fp8.quantize(jnp.asarray(weights(rng, 1024, 2048)))
    x8 = jnp.asarray((rng.standard_normal((m, 2048)) * 50).clip(-448, 448).astype(E4M3))
    y = jax.jit(lambda x8: cuda.gemv(x8, w.codes, w.scales, unroll=unroll, splits=3))(x8)
    want = np.asarray(x8).astype(np.float64) @ np.asarray(w.fp8_values()).astype(np.float64).T
    assert rel(y, want) <= 1e-5  # FP32 sums of exact products


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a GPU")
@pytest.mark.parametrize("out_dtype", [jnp.float32, jnp.float16, jnp.bfloat16])
@pytest.mark.parametrize("splits", [1, 4])
def test_gpu_gemv_writes_the_scaled_product(out_dtype, splits):
    """``(x8 @ W8.T) * token_scale * multiplier`` rounded once to the output dtype, with one split
    and with a cluster of four."""
    rng = np.random.default_rng(splits)
    m, n, k = 12, 160, 4096
    w = int4_fp8.quantize(jnp.asarray(weights(rng, n, k)))
    x8 = jnp.asarray((rng.standard_normal((m, k)) * 50).clip(-448, 448).astype(E4M3))
    wv = np.asarray(w.fp8_values()).astype(np.float64)
    raw = np.asarray(x8).astype(np.float64) @ wv.T
    ts = jnp.asarray(rng.uniform(0.5, 2.0, (m,)) / np.abs(raw).max(), jnp.float32)  # outputs within FP16's range
    y = jax.jit(lambda x8: cuda.gemv(x8, w.codes, w.scales, splits=splits, token_scale=ts, multiplier=0.75,
                                     out_dtype=out_dtype))(x8)
    assert y.dtype == out_dtype and y.shape == (m, n)
    want = raw * np.asarray(ts, np.float64)[:, None] * 0.75
    magnitude = (np.abs(np.asarray(x8).astype(np.float64)) @ np.abs(wv).T) * np.asarray(ts, np.float64)[:, None] * 0.75
    assert np.all(np.abs(np.asarray(y, np.float64) - want) <= float(jnp.finfo(out_dtype).eps) / 2 * np.abs(want)
                  + 2.0**-16 * magnitude)


def test_gemv_bf16_token_scale_is_an_attribute():
    w = int4_fp8.quantize(jnp.ones((64, 256)))
    x8 = jnp.ones((3, 256), jnp.float8_e4m3fn)
    f = jax.jit(lambda x8, t: cuda.gemv(x8, w.codes, w.scales, token_scale=t, bf16_token_scale=True))
    text = f.trace(x8, jnp.ones((3,), jnp.float32)).lower(lowering_platforms=("cuda",)).as_text()
    assert "bf16_token_scale = 1 : i32" in text and text.count("stablehlo.custom_call") == 1


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a GPU")
def test_gpu_bf16_token_scale_rounds_like_the_format():
    """The kernel's BF16 rounding of the token scale is the format's: the same bits as passing the
    BF16-rounded scale; and the layer product through the CUDA quantizer's float32 scale is the
    XLA-quantized path's."""
    rng = np.random.default_rng(11)
    m, n, k = 5, 256, 1024
    w = int4_fp8.quantize(jnp.asarray(weights(rng, n, k)))
    x8 = jnp.asarray((rng.standard_normal((m, k)) * 50).clip(-448, 448).astype(E4M3))
    ts = jnp.asarray(rng.uniform(1e-4, 1e-3, (m,)), jnp.float32)
    rounded = ts.astype(jnp.bfloat16).astype(jnp.float32)
    a = jax.jit(lambda x8: cuda.gemv(x8, w.codes, w.scales, token_scale=ts, bf16_token_scale=True))(x8)
    b = jax.jit(lambda x8: cuda.gemv(x8, w.codes, w.scales, token_scale=rounded))(x8)
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
