"""The NestedFP CUDA kernels for 1..8 tokens, and 9..64 in FP16 mode (``jaxlp.ffi.nestedfp``; the layers' implementation
``"nestedfp_cuda"`` through ``jaxlp.quantization.nestedfp_dispatch``): what it takes and refuses,
its split choice, the 32-bit merge it runs (exhaustively against the format's own merge), its
lowering (CPU), and on a GPU both modes against float64 NumPy products of the FP16 / E4M3 values
(``ml_dtypes`` casts) on fresh random weights with the format's edge values."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jaxlp.ffi import nestedfp as cuda
from jaxlp.formats import fp8, nestedfp
from jaxlp.quantization import activations, nestedfp_dispatch
from jaxlp.quantization.linear import QuantizedLinear

ON_GPU = jax.default_backend() == "gpu"
E4M3 = ml_dtypes.float8_e4m3fn
TOL = 1e-3  # relative to float64 (FP32 accumulation of exact products; summation order only)


def rel(y, ref) -> float:
    y, ref = np.asarray(y, np.float64), np.asarray(ref, np.float64)
    return float(np.linalg.norm(y - ref) / max(np.linalg.norm(ref), 1e-30))


def weights(rng, n, k, limit=nestedfp.DEFAULT_THRESHOLD):
    w = np.clip(rng.standard_normal((n, k)).astype(np.float32) * 0.3, -limit, limit)
    w[1] = 0.0  # an all-zero output channel
    w[2, :4] = [limit, -limit, 3e-6, -6e-8]  # the threshold, FP16 subnormals
    return w


def layer(w, mode="fp16", implementation="nestedfp_cuda"):
    return QuantizedLinear(nestedfp.quantize(jnp.asarray(w, jnp.float16)), mode=mode, implementation=implementation)


def test_merge_words_rebuild_every_eligible_fp16_word():
    """The kernel's merge: 4 upper and 4 lower bytes -> 4 FP16 words by one 32-bit expression and
    two byte permutes (``merge4`` in nestedfp_gemv.cu, emulated here), on every FP16 word with
    |w| < 1.9375, against the format's merge and the original words."""
    a = np.arange(1 << 16, dtype=np.uint32)
    w = a.astype(np.uint16).view(np.float16)
    words = a[np.isfinite(w) & (np.abs(w.astype(np.float32)) < 1.9375)].astype(np.uint16)
    words = np.concatenate([words, np.zeros((-len(words)) % 4, np.uint16)])
    upper, lower = (np.asarray(b) for b in nestedfp.split(jnp.asarray(words.view(np.float16))))
    u = upper.view(np.uint32).astype(np.uint64)  # 4 bytes per word, little-endian
    lo = lower.view(np.uint32).astype(np.uint64)
    t = ((((u - ((lo & 0x80808080) >> 7)) & 0xFFFFFFFF) >> 1) & 0x3F3F3F3F) | (u & 0x80808080)

    def prmt(a, b, sel):  # __byte_perm(a, b, sel): byte i of the result is byte sel_i of (b:a)
        pool = np.stack([(a >> (8 * i)) & 0xFF for i in range(4)] + [(b >> (8 * i)) & 0xFF for i in range(4)])
        return sum(pool[(sel >> (4 * i)) & 0x7] << (8 * i) for i in range(4))

    w01, w23 = prmt(lo, t, 0x5140), prmt(lo, t, 0x7362)
    rebuilt = np.stack([w01 & 0xFFFF, w01 >> 16, w23 & 0xFFFF, w23 >> 16], axis=1).reshape(-1).astype(np.uint16)
    np.testing.assert_array_equal(rebuilt, words)
    merged = np.asarray(nestedfp.merge(jnp.asarray(upper), jnp.asarray(lower))).view(np.uint16)
    np.testing.assert_array_equal(rebuilt, merged)


def test_default_splits_fill_the_gpu_and_leave_each_warp_work():
    assert cuda.default_splits(4096, 4096) == 1  # 256 row blocks >= 132
    assert cuda.default_splits(1024, 4096) == 4  # 64 blocks: 5 for two CTAs per SM, 4 leave each warp 2 windows
    assert cuda.default_splits(128, 1 << 16) == cuda.MAX_SPLITS
    assert cuda.default_splits(1024, 4096, num_sms=64) == 1  # a smaller GPU: 64 blocks fill it
    assert cuda.default_splits(1024, 512) == 1  # 8 windows: 1 per warp
    assert cuda.default_splits(28672, 4096) == 1
    assert cuda.default_splits(4096, 64) == 1
    for n in (16, 1024, 4096, 14336):
        for k in (64, 1024, 4096, 14336 // 64 * 64):
            s = cuda.default_splits(n, k)
            assert 1 <= s <= cuda.MAX_SPLITS and (s == 1 or (k // cuda.WINDOW) // s >= 2 * cuda.WARPS)


def test_default_unroll_by_waves():
    """Fewer windows in flight (registers) while the grid fits one wave at 3 CTAs per SM."""
    assert cuda.default_unroll("fp16", 6144, 1) == 1 and cuda.default_unroll("fp16", 14336, 1) == 2
    assert cuda.default_unroll("fp8", 4096, 1) == 2 and cuda.default_unroll("fp8", 28672, 1) == 4
    assert cuda.default_unroll("fp16", 1024, 4) == 1  # 256 CTAs
    assert cuda.default_unroll("fp16", 6144, 1, num_sms=114) == 2  # 384 CTAs: more than a wave on 114 SMs


def test_skinny_defaults():
    """Past 8 tokens: the GEMV to 16 tokens, then the skinny GEMM with about 64 CTAs over its 128-row
    tiles (at most 8 splits, each CTA at least 8 windows); "auto" takes the kernels to 16 tokens,
    the skinny GEMM to 32 on layers of at most 1024 rows."""
    assert cuda.default_design(16) == "gemv" and cuda.default_design(17) == "skinny"
    assert cuda.default_skinny_splits(4096, 4096) == 2  # 32 tiles: 64 CTAs
    assert cuda.default_skinny_splits(6144, 4096) == 2  # 48 tiles
    assert cuda.default_skinny_splits(24576, 4096) == 1  # 192 tiles
    assert cuda.default_skinny_splits(1024, 4096) == 8  # 8 tiles
    assert cuda.default_skinny_splits(1024, 512) == 1  # 8 windows
    for n in (16, 1024, 4096, 14336):
        for k in (64, 1024, 4160, 12288):
            s = cuda.default_skinny_splits(n, k)
            assert 1 <= s <= cuda.MAX_SPLITS and (s == 1 or k // 64 // s >= 8)
            assert s == 1 or -(-n // 128) * s < 128
    assert cuda.max_tokens("fp16") == 64 and cuda.max_tokens("fp16", "gemv") == 16 and cuda.max_tokens("fp8") == 8
    rng = np.random.default_rng(0)
    wide, narrow = layer(weights(rng, 1040, 128)), layer(weights(rng, 1024, 128))
    assert nestedfp_dispatch.auto_declines(wide, jnp.ones((2, 8, 128), jnp.float16)) is None
    assert "CUTLASS" in nestedfp_dispatch.auto_declines(wide, jnp.ones((17, 128), jnp.float16))
    assert nestedfp_dispatch.auto_declines(narrow, jnp.ones((32, 128), jnp.float16)) is None
    assert "CUTLASS" in nestedfp_dispatch.auto_declines(narrow, jnp.ones((33, 128), jnp.float16))


@pytest.mark.parametrize("mode", ["fp16", "fp8"])
def test_why_not_names_what_does_not_fit(mode):
    rng = np.random.default_rng(0)
    lay = layer(weights(rng, 48, 128), mode)
    x = jnp.ones((2, 128), jnp.float16)
    if not ON_GPU:
        assert "not available" in nestedfp_dispatch.why_not(lay, x)
    for shape in ((9, 128), (3, 3, 128)):  # FP8 mode takes 1..8 tokens, FP16 mode 1..64
        assert ("tokens" in (nestedfp_dispatch.why_not(lay, jnp.ones(shape, jnp.float16)) or "")) == (mode == "fp8")
    assert "tokens" in nestedfp_dispatch.why_not(lay, jnp.ones((65, 128), jnp.float16))
    assert "multiple" in nestedfp_dispatch.why_not(layer(weights(rng, 40, 128), mode), jnp.ones((1, 128), jnp.float16))
    assert "multiple" in nestedfp_dispatch.why_not(layer(weights(rng, 48, 96), mode), jnp.ones((1, 96), jnp.float16))
    bf16 = nestedfp_dispatch.why_not(lay, jnp.ones((1, 128), jnp.bfloat16))
    assert ("float16 activations" in bf16) == (mode == "fp16")
    w8 = QuantizedLinear(fp8.quantize(jnp.ones((48, 128)), granularity="channel"), implementation="auto")
    assert "format" in nestedfp_dispatch.why_not(w8, x)


def test_gemv_refuses_bad_operands():
    x = jnp.ones((2, 128), jnp.float16)
    u = jnp.zeros((48, 128), jnp.uint8)
    with pytest.raises(ValueError, match="float16"):
        cuda.gemv(x.astype(jnp.bfloat16), u, u)
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        cuda.gemv(x, u, None)
    with pytest.raises(ValueError, match="uint8"):
        cuda.gemv(x, u[:, :64], u)
    with pytest.raises(ValueError, match="tokens"):
        cuda.gemv(jnp.ones((65, 128), jnp.float16), u, u)
    with pytest.raises(ValueError, match="1..8 tokens in FP8 mode"):
        cuda.gemv(jnp.ones((9, 128), jnp.float8_e4m3fn), u, None)
    with pytest.raises(ValueError, match="one window per stage"):
        cuda.gemv(jnp.ones((9, 128), jnp.float16), u, u, unroll=2, design="skinny")
    with pytest.raises(ValueError, match="design must be"):
        cuda.gemv(x, u, u, design="wgmma")
    with pytest.raises(ValueError, match="skinny GEMM computes the FP16 mode"):
        cuda.gemv(x.astype(jnp.float8_e4m3fn), u, None, design="skinny")
    with pytest.raises(ValueError, match="gemv design takes 1..16 tokens"):
        cuda.gemv(jnp.ones((17, 128), jnp.float16), u, u, design="gemv")
    with pytest.raises(ValueError, match="two token groups take unroll 1 or 2"):
        cuda.gemv(jnp.ones((12, 128), jnp.float16), u, u, design="gemv", unroll=4)
    with pytest.raises(ValueError, match="N a multiple"):
        cuda.gemv(x, u[:40], u[:40])
    with pytest.raises(ValueError, match="unroll"):
        cuda.gemv(x, u, u, unroll=3)
    with pytest.raises(ValueError, match="out_dtype"):
        cuda.gemv(x, u, u, out_dtype=jnp.int8)
    with pytest.raises(ValueError, match="one value per token"):
        cuda.gemv(x, u, u, divisor=jnp.ones((3,), jnp.float32))
    with pytest.raises(ValueError, match="splits"):
        cuda.gemv(x, u, u, splits=9)


@pytest.mark.parametrize("mode", ["fp16", "fp8"])
def test_lowers_to_one_custom_call_for_cuda(mode):
    """The wrapper's operands lower for CUDA on any machine (no kernel runs)."""
    x = jnp.ones((3, 256), jnp.float16 if mode == "fp16" else jnp.float8_e4m3fn)
    u = jnp.zeros((64, 256), jnp.uint8)
    f = jax.jit(lambda x, u: cuda.gemv(x, u, None if mode == "fp8" else u, splits=2, unroll=1))
    text = f.trace(x, u).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("stablehlo.custom_call") == 1 and cuda.TARGETS[mode] in text
    assert "-> tensor<3x64xf32>" in text  # the splits added inside the kernel
    assert "splits = 2 : i32" in text and "unroll = 1 : i32" in text


def test_skinny_lowers_to_the_same_custom_call():
    """FP16 mode past 8 tokens: the same target, the design an attribute (the skinny GEMM by
    default, the GEMV's two token groups up to 16 tokens on request), default splits and unroll."""
    x = jnp.ones((40, 4096), jnp.float16)
    u = jnp.zeros((1024, 4096), jnp.uint8)
    text = jax.jit(lambda x, u: cuda.gemv(x, u, u)).trace(x, u).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("stablehlo.custom_call") == 1 and cuda.TARGETS["fp16"] in text
    assert "-> tensor<40x1024xf32>" in text
    assert f"splits = {cuda.default_skinny_splits(1024, 4096)} : i32" in text and "unroll = 1 : i32" in text
    assert "skinny = 1 : i32" in text
    gemv_text = jax.jit(lambda x, u: cuda.gemv(x, u, u, design="gemv")).trace(x[:12], u).lower(
        lowering_platforms=("cuda",)).as_text()
    assert "skinny = 0 : i32" in gemv_text and "-> tensor<12x1024xf32>" in gemv_text


@pytest.mark.parametrize("splits", [1, 3])
def test_the_kernel_writes_the_scaled_product_itself(splits):
    """One custom call whose result is the [M, N] product in the output dtype (no sum, no scale
    pass, no convert); the divisor per token and the multiplier are its operand and attribute."""
    x = jnp.ones((3, 256), jnp.float8_e4m3fn)
    u = jnp.zeros((64, 256), jnp.uint8)
    f = jax.jit(lambda x, u, d: cuda.gemv(x, u, None, splits=splits, divisor=d, multiplier=0.5,
                                          out_dtype=jnp.bfloat16))
    lowered = f.trace(x, u, jnp.ones((3, 1), jnp.float32)).lower(lowering_platforms=("cuda",))
    text = lowered.as_text()
    assert text.count("stablehlo.custom_call") == 1 and "-> tensor<3x64xbf16>" in text
    assert "multiplier = 5.000000e-01 : f32" in text
    assert "stablehlo.reduce" not in text and "stablehlo.divide" not in text


@pytest.mark.parametrize("mode", ["fp16", "fp8"])
def test_layer_product_lowers_to_the_kernel_for_cuda(mode):
    """A NestedFP layer's product through the dispatch (activation scales of FP8 mode included)."""
    lay = layer(weights(np.random.default_rng(2), 64, 256), mode)
    x = jnp.ones((2, 3, 256), jnp.float16)  # 6 tokens
    f = jax.jit(lambda x: nestedfp_dispatch.matmul(lay, x))
    assert f.eval_shape(x).shape == (2, 3, 64) and f.eval_shape(x).dtype == jnp.float16
    text = f.trace(x).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("stablehlo.custom_call") == 1 and cuda.TARGETS[mode] in text


def numpy_reference(w, x, mode):
    """float64 product of the values the kernel multiplies (FP16 weights; or E4M3 upper bytes and
    the quantized activations, with their scales)."""
    w16 = np.asarray(w, np.float16).astype(np.float64)
    x = np.asarray(x, np.float32)
    if mode == "fp16":
        return np.asarray(x, np.float16).astype(np.float64) @ w16.T
    upper, _ = nestedfp.split(jnp.asarray(w, jnp.float16))
    w8 = np.asarray(upper).view(E4M3).astype(np.float64)
    x8, scale = activations.nestedfp_fp8(jnp.asarray(x))
    x8 = np.asarray(x8).astype(np.float64)
    return (x8 @ w8.T) / np.asarray(scale, np.float64) * nestedfp.FP8_SCALE


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a GPU")
@pytest.mark.parametrize("mode", ["fp16", "fp8"])
@pytest.mark.parametrize("m,n,k", [(1, 16, 64), (3, 48, 1024), (8, 4096, 4096), (5, 1024, 4160), (8, 14336, 512)])
def test_gpu_matches_float64(mode, m, n, k):
    rng = np.random.default_rng(m * 1000 + n + k)
    w = weights(rng, n, k)
    x = rng.standard_normal((m, k)).astype(np.float32) * np.exp(rng.uniform(-3, 3, (m, 1)))
    x[0] = 0.0 if m > 1 else x[0]  # an all-zero token
    lay = layer(w, mode)
    xin = jnp.asarray(x, jnp.float16)
    assert nestedfp_dispatch.why_not(lay, xin) is None
    y = jax.jit(lambda x: lay(x))(xin)
    ref = numpy_reference(w, xin.astype(jnp.float32), mode)
    assert y.dtype == jnp.float16 and y.shape == (m, n)
    assert rel(np.asarray(y, np.float32), ref) <= TOL
    if m > 1:
        assert not np.asarray(y[0]).any()
    # the same as XLA's native dot of the same math (summation order and FP16 output rounding)
    native = jax.jit(lambda x: layer(w, mode, "xla_native")(x))(xin)
    assert rel(np.asarray(y, np.float32), np.asarray(native, np.float32)) <= TOL


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a GPU")
@pytest.mark.parametrize("m,n,k", [(9, 16, 64), (16, 48, 1024), (17, 1040, 4160), (32, 4096, 4096), (33, 256, 512),
                                   (40, 1024, 12288), (64, 6144, 4096), (64, 272, 128)])
def test_gpu_skinny_matches_float64(m, n, k):
    """FP16 mode past 8 tokens (the skinny GEMM, default splits and unroll): token counts at and
    between the 8-token groups, N off the 128-row tiles, K of an odd window count, an all-zero
    token, the format's edge values."""
    rng = np.random.default_rng(m * 1000 + n + k)
    w = weights(rng, n, k)
    x = rng.standard_normal((m, k)).astype(np.float32) * np.exp(rng.uniform(-3, 3, (m, 1)))
    x[3] = 0.0
    lay = layer(w, "fp16")
    xin = jnp.asarray(x, jnp.float16)
    assert nestedfp_dispatch.why_not(lay, xin) is None
    y = jax.jit(lambda x: nestedfp_dispatch.matmul(lay, x, design="skinny"))(xin)
    assert y.dtype == jnp.float16 and y.shape == (m, n)
    assert rel(np.asarray(y, np.float32), numpy_reference(w, xin.astype(jnp.float32), "fp16")) <= TOL
    assert not np.asarray(y[3]).any()
    auto = jax.jit(lambda x: lay(x))(xin)  # the default design
    assert rel(np.asarray(auto, np.float32), numpy_reference(w, xin.astype(jnp.float32), "fp16")) <= TOL


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a GPU")
@pytest.mark.parametrize("m", [12, 24, 57])
@pytest.mark.parametrize("splits", [1, 3, 8])
@pytest.mark.parametrize("out_dtype", [jnp.float32, jnp.bfloat16])
def test_gpu_skinny_every_group_split_and_output(m, splits, out_dtype):
    """The skinny GEMM's token groups (2, 4, 8 MMAs per fragment), splits (a cluster whose ranks
    each add some row blocks' sums) and output dtypes, with a divisor per token and a multiplier:
    the float64 value rounded once."""
    n, k = 400, 3072  # 3.125 tiles of 128 rows: the last tile's warps past N write nothing
    rng = np.random.default_rng(m * 10 + splits)
    w = weights(rng, n, k)
    upper, lower = nestedfp.split(jnp.asarray(w, jnp.float16))
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.float16)
    divisor = jnp.asarray(rng.uniform(0.5, 4.0, (m,)), jnp.float32)
    wv = np.asarray(w, np.float16).astype(np.float64)
    ref = (np.asarray(x, np.float64) @ wv.T) / np.asarray(divisor, np.float64)[:, None] * 0.375
    magnitude = (np.abs(np.asarray(x, np.float64)) @ np.abs(wv).T) / np.asarray(divisor, np.float64)[:, None] * 0.375
    y = jax.jit(lambda x: cuda.gemv(x, upper, lower, splits=splits, design="skinny", divisor=divisor,
                                    multiplier=0.375, out_dtype=out_dtype))(x)
    assert y.dtype == out_dtype and y.shape == (m, n)
    assert np.all(np.abs(np.asarray(y, np.float64) - ref) <= float(jnp.finfo(out_dtype).eps) / 2 * np.abs(ref)
                  + 2.0**-16 * magnitude)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a GPU")
@pytest.mark.parametrize("m", [9, 13, 16])
@pytest.mark.parametrize("unroll", [1, 2])
@pytest.mark.parametrize("splits", [1, 3, 8])
def test_gpu_gemv_two_token_groups(m, unroll, splits):
    """FP16 mode's GEMV past 8 tokens (each merged fragment feeds the MMAs of tokens g and g + 8):
    K = 4160 (65 windows: a step past K), 1 / 3 / 8 CTAs per row block, an all-zero token, the
    second group partly past M."""
    n, k = 96, 4160
    rng = np.random.default_rng(m * 100 + unroll * 10 + splits)
    w = weights(rng, n, k)
    x = rng.standard_normal((m, k)).astype(np.float32)
    x[8] = 0.0
    lay = layer(w, "fp16")
    x16 = jnp.asarray(x, jnp.float16)
    y = jax.jit(lambda x: nestedfp_dispatch.matmul(lay, x, splits=splits, unroll=unroll, design="gemv"))(x16)
    assert rel(np.asarray(y, np.float32), numpy_reference(w, x16.astype(jnp.float32), "fp16")) <= TOL
    assert not np.asarray(y[8]).any()


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a GPU")
def test_gpu_auto_takes_the_kernels_then_cutlass():
    rng = np.random.default_rng(1)
    w = weights(rng, 256, 512)
    lay = layer(w, "fp16", "auto")
    for m in (1, 8, 9, 16, 17, 33):
        xin = jnp.asarray(rng.standard_normal((m, 512)), jnp.float16)
        text = jax.jit(lambda x: lay(x)).lower(xin).as_text()
        # 256 rows: a narrow layer, the skinny GEMM to 32 tokens
        assert (cuda.TARGETS["fp16"] in text) == (m <= nestedfp_dispatch.SKINNY_AUTO_MAX_TOKENS)
        y = jax.jit(lambda x: lay(x))(xin)
        assert rel(np.asarray(y, np.float32), numpy_reference(w, xin.astype(jnp.float32), "fp16")) <= TOL


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a GPU")
@pytest.mark.parametrize("mode", ["fp16", "fp8"])
@pytest.mark.parametrize("unroll", cuda.UNROLLS)
@pytest.mark.parametrize("splits", [1, 3, 8])
def test_gpu_every_unroll_and_split_count(mode, unroll, splits):
    """K = 4160 (65 windows): each unroll's last step past K, with 1, 3 and 8 CTAs (a cluster) per
    row block."""
    m, n, k = 7, 96, 4160
    rng = np.random.default_rng(unroll * 10 + splits)
    w = weights(rng, n, k)
    x = rng.standard_normal((m, k)).astype(np.float32)
    lay = layer(w, mode)
    f = jax.jit(lambda x: nestedfp_dispatch.matmul(lay, x, splits=splits, unroll=unroll))
    x16 = jnp.asarray(x, jnp.float16)
    assert rel(np.asarray(f(x16), np.float32), numpy_reference(w, x16.astype(jnp.float32), mode)) <= TOL


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a GPU")
@pytest.mark.parametrize("mode", ["fp16", "fp8"])
@pytest.mark.parametrize("out_dtype", [jnp.float32, jnp.float16, jnp.bfloat16])
def test_gpu_scaled_product_one_split_and_several(mode, out_dtype):
    """``(x @ W.T / divisor) * multiplier`` written by the kernel, with one split and with three
    (a cluster adding its CTAs' sums): the float64 value rounded once to the output dtype."""
    m, n, k = 6, 160, 2048
    rng = np.random.default_rng(5)
    w = weights(rng, n, k)
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.float16)
    upper, lower = nestedfp.split(jnp.asarray(w, jnp.float16))
    if mode == "fp8":
        x, lower = x.astype(jnp.float8_e4m3fn), None
        wv = np.asarray(upper).view(E4M3).astype(np.float64)
    else:
        wv = np.asarray(w, np.float16).astype(np.float64)
    divisor = jnp.asarray(rng.uniform(0.5, 4.0, (m, 1)), jnp.float32)
    ref = (np.asarray(x, np.float64) @ wv.T) / np.asarray(divisor, np.float64) * 0.375
    magnitude = (np.abs(np.asarray(x, np.float64)) @ np.abs(wv).T) / np.asarray(divisor, np.float64) * 0.375
    for splits in (1, 3):
        y = jax.jit(lambda x: cuda.gemv(x, upper, lower, splits=splits, divisor=divisor, multiplier=0.375,
                                        out_dtype=out_dtype))(x)
        assert y.dtype == out_dtype and y.shape == (m, n)
        # one rounding to the output dtype, plus float32 summation (bounded by the sum of |terms|)
        assert np.all(np.abs(np.asarray(y, np.float64) - ref) <= float(jnp.finfo(out_dtype).eps) / 2 * np.abs(ref)
                      + 2.0**-16 * magnitude)
