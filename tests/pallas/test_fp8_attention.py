"""The FP8 causal prefill attention (``jaxlp.pallas.fp8_attention``): its reference against a float64
NumPy model of the same quantized math and against BF16 attention, the per-head quantizer, the
checks and the CUDA lowering on the CPU; on a GPU the kernel against its reference (skipped without
a CUDA GPU) against a float64 NumPy model of its own blocked online softmax."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from fireq_operands import rel
from jaxlp.attention.reference import causal_attention
from jaxlp.pallas import fp8_attention as fa

ON_GPU = jax.devices()[0].platform == "gpu"
E4M3 = ml_dtypes.float8_e4m3fn


def qkv(rng, b, s, h, kvh, d=128):
    q = rng.standard_normal((b, s, h, d)).astype(np.float32)
    k = rng.standard_normal((b, s, kvh, d)).astype(np.float32) * np.exp(rng.uniform(-1, 1, (1, 1, kvh, 1)))
    v = rng.standard_normal((b, s, kvh, d)).astype(np.float32)
    return (jnp.asarray(x, jnp.bfloat16) for x in (q, k, v))


def numpy_model(q, k, v, scale):
    """float64 NumPy of the module doc's math (row maximum, E4M3 by ml_dtypes)."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    b, s, h, d = q.shape
    g = h // k.shape[2]

    def quant(x):  # per (row, head): amax / 448
        amax = np.abs(x).max(axis=(1, 3), keepdims=True)
        sc = np.where(amax > 0, amax / 448.0, 1.0).astype(np.float32).astype(np.float64)
        return np.clip(x / sc, -448, 448).astype(E4M3).astype(np.float64), sc

    (q8, sq), (k8, sk), (v8, sv) = quant(q), quant(k), quant(v)
    out = np.zeros((b, s, h, d))
    mask = np.tril(np.ones((s, s), bool))
    for bi in range(b):
        for hi in range(h):
            kv = hi // g
            sc = (q8[bi, :, hi] @ k8[bi, :, kv].T) * sq[bi, 0, hi, 0] * sk[bi, 0, kv, 0] * scale
            sc = np.where(mask, sc, -np.inf)
            p = np.exp(sc - sc.max(axis=1, keepdims=True))
            p8 = (p * fa.P_SCALE).astype(E4M3).astype(np.float64)
            out[bi, :, hi] = (p8 @ v8[bi, :, kv]) / p.sum(axis=1, keepdims=True) * sv[bi, 0, kv, 0] / fa.P_SCALE
    return out


def numpy_blocked_model(q, k, v, scale, block_kv=128):
    """float64 NumPy of what the kernel computes: the softmax over key blocks of ``block_kv`` with a
    running maximum ``m`` (each block's P rounded to E4M3 relative to the maximum so far, the
    accumulator rescaled when it grows), ``l`` the sum of the unrounded probabilities."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    b, s, h, d = q.shape
    g = h // k.shape[2]

    def quant(x):
        amax = np.abs(x).max(axis=(1, 3), keepdims=True)
        sc = np.where(amax > 0, amax / 448.0, 1.0).astype(np.float32).astype(np.float64)
        return np.clip(x / sc, -448, 448).astype(E4M3).astype(np.float64), sc

    (q8, sq), (k8, sk), (v8, sv) = quant(q), quant(k), quant(v)
    out = np.zeros((b, s, h, d))
    rows = np.arange(s)[:, None]
    for bi in range(b):
        for hi in range(h):
            kv = hi // g
            acc, m, l_sum = np.zeros((s, d)), np.full((s, 1), -np.inf), np.zeros((s, 1))
            for j0 in range(0, s, block_kv):  # block 0 holds key 0, which every row sees: m finite after it
                cols = np.arange(j0, min(j0 + block_kv, s))[None, :]
                sc = (q8[bi, :, hi] @ k8[bi, cols[0], kv].T) * sq[bi, 0, hi, 0] * sk[bi, 0, kv, 0] * scale
                sc = np.where(rows >= cols, sc, -np.inf)
                m_new = np.maximum(m, sc.max(axis=1, keepdims=True))
                alpha, p = np.exp(m - m_new), np.exp(sc - m_new)
                p8 = (p * fa.P_SCALE).astype(E4M3).astype(np.float64)
                acc = acc * alpha + p8 @ v8[bi, cols[0], kv]
                l_sum = l_sum * alpha + p.sum(axis=1, keepdims=True)
                m = m_new
            out[bi, :, hi] = acc / l_sum * sv[bi, 0, kv, 0] / fa.P_SCALE
    return out


def test_blocked_model_is_the_reference_up_to_p_rounding():
    """The blocked model's only difference from the reference's math is the maximum P is rounded
    against (one block: the same)."""
    rng = np.random.default_rng(3)
    q, k, v = qkv(rng, 1, 100, 2, 1)
    np.testing.assert_allclose(numpy_blocked_model(q, k, v, 0.1), numpy_model(q, k, v, 0.1), rtol=1e-12)
    q, k, v = qkv(rng, 1, 300, 2, 1)
    err = rel(numpy_blocked_model(q, k, v, 0.1), numpy_model(q, k, v, 0.1))
    assert 1e-4 < err < 2e-2


@pytest.mark.parametrize("b, s, h, kvh", [(1, 40, 2, 1), (2, 67, 4, 2), (1, 129, 3, 3)])
def test_reference_is_the_quantized_math_in_float64(b, s, h, kvh):
    rng = np.random.default_rng(b * 100 + s)
    q, k, v = qkv(rng, b, s, h, kvh)
    got = fa.reference(q, k, v, scale=128**-0.5)
    assert got.dtype == jnp.bfloat16 and got.shape == q.shape
    assert rel(np.asarray(got, np.float32), numpy_model(q, k, v, 128**-0.5)) <= 4e-3  # BF16 output rounding


def test_reference_is_near_bf16_attention():
    """FP8 Q, K, V and P against the BF16 reference attention on Gaussian inputs: 6.1% relative here
    (at 1000 tokens: Q alone 3.6%, K 3.8%, V 2.6%, all four 6.1%: E4M3's 3-bit mantissa; P adds
    little); the documented bound is 8e-2."""
    rng = np.random.default_rng(0)
    q, k, v = qkv(rng, 1, 200, 4, 2)
    pos = jnp.arange(200)[None]
    want = causal_attention(q, k, v, pos, pos, scale=128**-0.5)
    got = fa.reference(q, k, v, scale=128**-0.5)
    err = rel(np.asarray(got, np.float32), np.asarray(want, np.float32))
    assert 1e-2 < err <= 8e-2  # FP8 costs something, but not more than this


def test_quantize_heads_scales_and_zero_heads():
    x = jnp.asarray(np.random.default_rng(1).standard_normal((2, 10, 3, 128)), jnp.float32).at[1, :, 2].set(0.0)
    x8, s = fa.quantize_heads(x)
    assert x8.dtype == jnp.float8_e4m3fn and s.shape == (2, 3) and float(s[1, 2]) == 1.0
    np.testing.assert_allclose(np.abs(np.asarray(x8, np.float32)).max(axis=(1, 3))[0], 448.0)
    assert rel(np.asarray(x8, np.float32) * np.asarray(s)[:, None, :, None], x) < 0.05


def test_config_and_shapes_are_checked():
    with pytest.raises(ValueError, match="block_q"):
        fa.AttentionConfig(block_q=96)
    with pytest.raises(ValueError, match="block_kv"):
        fa.AttentionConfig(block_kv=64)
    q = jnp.zeros((1, 64, 4, 128), jnp.bfloat16)
    with pytest.raises(ValueError, match="head_dim"):
        fa.fp8_attention(q[..., :64], q[:, :, :2, :64], q[:, :, :2, :64], scale=1.0)
    with pytest.raises(ValueError, match="multiple of KV heads"):
        fa.fp8_attention(q, q[:, :, :3], q[:, :, :3], scale=1.0)


@pytest.mark.parametrize("promote_pv", [True, False])
def test_lowers_for_cuda_on_any_machine(promote_pv):
    q = jnp.zeros((2, 300, 8, 128), jnp.bfloat16)
    k = jnp.zeros((2, 300, 2, 128), jnp.bfloat16)
    cfg = fa.AttentionConfig(promote_pv=promote_pv)
    text = jax.jit(lambda q, k, v: fa.fp8_attention(q, k, v, scale=0.088, config=cfg)).trace(q, k, k).lower(
        lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize("b, s, h, kvh", [(1, 256, 2, 1), (2, 1000, 8, 2), (1, 2048, 16, 4)])
def test_gpu_matches_float64_of_its_math(b, s, h, kvh):
    """Against the float64 model of the kernel's blocked softmax on the same FP8-rounded inputs:
    measured 4.0-4.6e-3 on the H100 (docs/perf.md "session 21"; BF16 output rounding alone is ~1e-3,
    the rest not explained: not the PV accumulation, which promotion leaves unchanged, and the
    blocked model is 2x closer than the row-maximum one), bound 8e-3 (issue #18 asks 2e-3); against
    the reference, whose P is rounded relative to the row's maximum, <= 2e-2 (BF16 attention is
    ~6e-2 away)."""
    rng = np.random.default_rng(s)
    q, k, v = qkv(rng, b, s, h, kvh)
    got = np.asarray(fa.fp8_attention(q, k, v, scale=128**-0.5), np.float32)
    assert got.shape == q.shape
    assert rel(got, numpy_blocked_model(q, k, v, 128**-0.5)) <= 8e-3
    assert rel(got, np.asarray(fa.reference(q, k, v, scale=128**-0.5), np.float32)) <= 2e-2
