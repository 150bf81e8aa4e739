"""A NumPy model of the CUDA GEMV's arithmetic (nvfp4_gemv.cu), checked against float64 references.

The model follows the kernel step by step: the FP16 bit-trick decode of nibbles (i, i+4) of a
32-bit word (built per byte, placed by PRMT), the E4M3 scale times 2^7 in FP16, the x_eff workspace layout (x0 x4 x1 x5 x2 x6 x3 x7
per group of 8; W4A16 chunks scaled by 2^(15 - e)), the thread/chunk mapping (thread t of a row
owns k in [256c + 64t, +64)), and the final scale g_w * 2^7 (* g_x). If the kernel's index math
or constants were wrong here, these tests fail on the CPU before any GPU run.
"""

import ml_dtypes
import numpy as np
import pytest

import jax.numpy as jnp

from jaxlp.formats import e2m1, nvfp4

MAGS = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
CHUNK = 256


def e2m1_values(codes):
    codes = np.asarray(codes)
    return np.where(codes & 8, -1.0, 1.0) * MAGS[codes & 7]


# --- the kernel's building blocks, written as the CUDA code computes them -----------------------


def prmt(a: np.ndarray, b, sel: int) -> np.ndarray:
    """PTX prmt.b32 (default mode): byte k of the result is byte sel[4k:4k+4] of (b:a)."""
    src = (np.asarray(b, np.uint64) << 32) | a.astype(np.uint64)
    out = np.zeros(a.shape, np.uint64)
    for k in range(4):
        idx = (sel >> (4 * k)) & 0x7
        out |= ((src >> np.uint64(8 * idx)) & np.uint64(0xFF)) << np.uint64(8 * k)
    return out.astype(np.uint32)


def decode_word(w: np.ndarray) -> list[np.ndarray]:
    """decode_word: uint32 words -> 4 uint32 holding FP16 {e2m1(n_i), e2m1(n_{i+4})} * 2^-14."""
    w = w.astype(np.uint32)
    even = ((w << 4) & 0x80808080) | ((w << 1) & 0x0E0E0E0E)
    odd = (w & 0x80808080) | ((w >> 3) & 0x0E0E0E0E)
    return [prmt(even, 0, 0x2404), prmt(odd, 0, 0x2404), prmt(even, 0, 0x3414), prmt(odd, 0, 0x3414)]


def decode_pair(w: np.ndarray, i: int) -> np.ndarray:
    return decode_word(w)[i]


def half2(bits: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(low, high) FP16 halves of uint32 words."""
    bits = bits.astype(np.uint32)
    return (bits & 0xFFFF).astype(np.uint16).view(np.float16), (bits >> 16).astype(np.uint16).view(np.float16)


def scale_times_128(scale_bits: np.ndarray) -> np.ndarray:
    """cvt.rn.f16x2.e4m3x2 then mul.rn.f16x2 by 128: E4M3 * 2^7 in FP16 (exact)."""
    s16 = scale_bits.view(ml_dtypes.float8_e4m3fn).astype(np.float16)
    return (s16 * np.float16(128.0)).astype(np.float16)


def stage_a16(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """stage_a16_kernel: x [M, K] (float32 values) -> x_eff FP16 [M, Kp] (permuted), xs [M, Kp/128]."""
    m, k = x.shape
    kp = -(-k // CHUNK) * CHUNK
    xp = np.zeros((m, kp), np.float32)
    xp[:, :k] = x
    chunks = xp.reshape(m, kp // CHUNK, CHUNK)
    amax = np.abs(chunks).max(-1)
    _, ex = np.frexp(amax)
    shift = np.where(amax > 0, np.clip(15 - ex, -100, 100), 0)
    scaled = (chunks * np.exp2(shift)[..., None].astype(np.float32)).astype(np.float16).reshape(m, kp)
    return permute8(scaled), np.exp2(-shift).astype(np.float32)


def stage_a4(x: np.ndarray, g: float) -> np.ndarray:
    """stage_a4_kernel's x_eff: e2m1(q) * e4m3(s) in FP16, FP32 ops in the kernel's order."""
    m, k = x.shape
    kp = -(-k // CHUNK) * CHUNK
    f = np.float32
    g = f(g)
    blocks = x.astype(f).reshape(m, k // 16, 16)
    amax = np.abs(blocks).max(-1)
    s = (amax / (f(6.0) * g)).astype(f)
    s = np.where(s == 0, f(1.0), s)
    s = np.clip(s, f(2.0**-9), f(448.0))
    sf = s.astype(ml_dtypes.float8_e4m3fn).astype(f)
    denom = (sf * g).astype(f)
    q = (blocks / denom[..., None]).astype(f)
    a = np.minimum(np.abs(q), f(6.0))
    ties = [(0.25, False), (0.75, True), (1.25, False), (1.75, True), (2.5, False), (3.5, True), (5.0, False)]
    mag = sum(((a >= t) if inclusive else (a > t)).astype(np.uint8) for t, inclusive in ties)
    codes = mag | ((q < 0).astype(np.uint8) << 3)
    xe = np.zeros((m, kp), np.float16)
    xe[:, :k] = (e2m1_values(codes) * sf[..., None]).astype(np.float16).reshape(m, k)
    return permute8(xe)


def permute8(v: np.ndarray) -> np.ndarray:
    """Each group of 8 along the last axis stored as x0 x4 x1 x5 x2 x6 x3 x7."""
    g = v.reshape(*v.shape[:-1], -1, 2, 4)  # [..., group, half (0: x0..3, 1: x4..7), i]
    return np.swapaxes(g, -1, -2).reshape(v.shape)  # [..., group, i, half]


def gemv(data, scale_bits, g_w, x_eff, xs=None, g_x=None) -> np.ndarray:
    """gemv_kernel in float64 (every product and the FP32 sums are exact or nearly so)."""
    n, k2 = data.shape
    k = 2 * k2
    m, kp = x_eff.shape
    chunks = kp // CHUNK
    # Weights padded with zero bytes past K (the kernel predicates those loads to zero).
    d = np.zeros((n, kp // 2), np.uint8)
    d[:, :k2] = data
    s = np.zeros((n, kp // 16), np.uint8)
    s[:, : k // 16] = scale_bits
    words = d.view("<u4").reshape(n, chunks, 4, 8)  # [row, chunk, thread t, word j]
    sc = scale_times_128(s).astype(np.float64).reshape(n, chunks, 4, 4)  # [.., t, block]
    w_pairs = np.empty((n, chunks, 4, 8, 4, 2))  # [row, c, t, j, i, lo/hi]
    pairs = decode_word(words)
    for i in range(4):
        lo, hi = half2(pairs[i])
        blk = sc[:, :, :, [0, 0, 1, 1, 2, 2, 3, 3]]  # word j uses block j // 2
        w_pairs[..., i, 0] = (lo.astype(np.float16) * blk.astype(np.float16)).astype(np.float64)
        w_pairs[..., i, 1] = (hi.astype(np.float16) * blk.astype(np.float16)).astype(np.float64)
    # x_eff pair q = 4j + i of thread t at halves 2q, 2q+1 of its 64: the same [c, t, j, i, h] index.
    xv = x_eff.astype(np.float64).reshape(m, chunks, 4, 8, 4, 2)
    part = np.einsum("nctjih,mctjih->mnc", w_pairs, xv)  # per-chunk partial sums
    if xs is not None:
        part = part * xs.astype(np.float64)[:, None, :]
    y = part.sum(-1) * float(g_w) * 128.0
    if g_x is not None:
        y = y * float(g_x)
    return y


# --- references -----------------------------------------------------------------------------


def quantized_weight(rng, n, k, *, zero_blocks=0):
    w = rng.standard_normal((n, k)).astype(np.float32) * rng.uniform(0.02, 2.0, (n, 1)).astype(np.float32)
    if zero_blocks:
        rows = rng.integers(0, n, zero_blocks)
        cols = rng.integers(0, k // 16, zero_blocks)
        for r, c in zip(rows, cols):
            w[r, 16 * c : 16 * c + 16] = 0.0
    q = nvfp4.quantize(jnp.asarray(w))
    return q, np.asarray(q.data), np.asarray(q.block_scale).view(np.uint8), float(q.tensor_scale)


def weight_f64(data, scale_bits, g):
    codes = np.stack([data & 0xF, data >> 4], -1).reshape(data.shape[0], -1)
    s = scale_bits.view(ml_dtypes.float8_e4m3fn).astype(np.float64)
    return e2m1_values(codes) * np.repeat(s, 16, axis=1) * g


def rel(a, b):
    return np.linalg.norm(a - b) / np.linalg.norm(b)


def all_nibble_pairs() -> tuple[np.ndarray, np.ndarray]:
    """The 256 pairs (a, b) of 4-bit codes, as two uint32 arrays."""
    a, b = np.meshgrid(np.arange(16, dtype=np.uint32), np.arange(16, dtype=np.uint32), indexing="ij")
    return a.ravel(), b.ravel()


def nibble_words(rng, a: np.ndarray, b: np.ndarray, i: int) -> np.ndarray:
    """uint32 words with nibble ``i`` = a and nibble ``i + 4`` = b; the other nibbles random."""
    noise = rng.integers(0, 2**32, a.shape, dtype=np.uint64).astype(np.uint32)
    keep = ~np.uint32((0xF << (4 * i)) | (0xF << (4 * i + 16)))
    return (noise & keep) | (a << (4 * i)) | (b << (4 * i + 16))


# --- tests ----------------------------------------------------------------------------------


def test_decode_pair_exhaustive():
    """Every nibble pair at every position i decodes to e2m1 * 2^-14 exactly (both halves)."""
    a, b = all_nibble_pairs()
    rng = np.random.default_rng(11)
    for i in range(4):
        words = nibble_words(rng, a, b, i)
        lo, hi = half2(decode_pair(words, i))
        np.testing.assert_array_equal(lo.astype(np.float64) * 2.0**14, e2m1_values(a))
        np.testing.assert_array_equal(hi.astype(np.float64) * 2.0**14, e2m1_values(b))
        # The library's description of the trick agrees.
        np.testing.assert_array_equal(np.asarray(e2m1.fp16_bits(jnp.asarray(a))), (lo.view(np.uint16)))


def test_scaled_weights_are_exact_in_fp16():
    """e2m1 * 2^-14 (FP16, subnormals included) times e4m3 * 2^7 is exact for every code and scale."""
    codes = np.arange(16)
    scales = np.arange(256, dtype=np.uint8)
    scales = scales[np.isfinite(scales.view(ml_dtypes.float8_e4m3fn).astype(np.float32))]
    lo, _ = half2(decode_pair(codes.astype(np.uint32), 0))
    prod = lo[:, None].astype(np.float16) * scale_times_128(scales)[None, :]
    exact = e2m1_values(codes)[:, None] * scales.view(ml_dtypes.float8_e4m3fn).astype(np.float64)[None, :] * 2.0**-7
    np.testing.assert_array_equal(prod.astype(np.float64), exact)


def test_permutation_matches_decode_pairs():
    """x_eff pair q = 4j + i holds (x[8j+i], x[8j+i+4]): the k's of the weight pair it meets."""
    x = np.arange(64, dtype=np.float32)[None]
    p = permute8(x).reshape(-1, 4, 2)  # [group j, i, half]
    for j in range(8):
        for i in range(4):
            assert tuple(p[j, i]) == (8 * j + i, 8 * j + i + 4)


@pytest.mark.parametrize(
    "m,n,k,seed",
    [(1, 48, 256, 1), (3, 37, 400, 2), (8, 64, 128, 3), (13, 20, 48, 4), (32, 16, 272, 5)],
)
def test_w4a16_model_matches_reference(m, n, k, seed):
    """N not a multiple of 16, K a multiple of 16 but not of 32 or 128, M across the n-tiles."""
    rng = np.random.default_rng(seed)
    q, data, sbits, g = quantized_weight(rng, n, k, zero_blocks=3)
    x = (rng.standard_normal((m, k)) * 3.0).astype(ml_dtypes.bfloat16).astype(np.float32)
    x[0, :16] = 0.0  # an all-zero chunk share
    x_eff, xs = stage_a16(x)
    got = gemv(data, sbits, g, x_eff, xs=xs)
    ref = x.astype(np.float64) @ weight_f64(data, sbits, g).T
    assert rel(got, ref) < 1e-6
    # The library's own dequantization agrees with the float64 weight reference.
    np.testing.assert_allclose(np.asarray(q.dequantize(jnp.float32)), weight_f64(data, sbits, g), rtol=1e-6)


def test_w4a16_model_wide_dynamic_range():
    """Per-chunk power-of-two scaling keeps BF16 values from 1e-8 to 1e8 exact in FP16."""
    rng = np.random.default_rng(21)
    m, n, k = 2, 32, 512
    _, data, sbits, g = quantized_weight(rng, n, k)
    x = (rng.standard_normal((m, k)) * np.exp(rng.uniform(-18, 18, (m, k)))).astype(ml_dtypes.bfloat16)
    x = x.astype(np.float32)
    x_eff, xs = stage_a16(x)
    got = gemv(data, sbits, g, x_eff, xs=xs)
    ref = x.astype(np.float64) @ weight_f64(data, sbits, g).T
    assert rel(got, ref) < 1e-6


@pytest.mark.parametrize("m,n,k,seed", [(1, 40, 208, 6), (8, 33, 384, 7), (17, 16, 64, 8)])
def test_w4a4_model_matches_fake_quantize(m, n, k, seed):
    rng = np.random.default_rng(seed)
    _, data, sbits, g = quantized_weight(rng, n, k, zero_blocks=2)
    x = rng.standard_normal((m, k)).astype(np.float32) * 2.0
    amax = float(np.abs(x).max()) * 0.6  # below the true max: some blocks saturate
    x[-1, :16] = 0.0  # an all-zero block
    g_x = float(nvfp4.tensor_scale_from_amax(amax))
    x_eff = stage_a4(x, g_x)
    # The model's staging equals the library's NVFP4 quantization without the tensor scale.
    xq = nvfp4.quantize(jnp.asarray(x), tensor_scale=g_x)
    xdq = np.asarray(xq.dequantize(jnp.float32)).astype(np.float64)
    kp = x_eff.shape[1]
    lib_eff = np.zeros((m, kp))
    lib_eff[:, :k] = xdq / g_x
    np.testing.assert_allclose(permute8(lib_eff), x_eff.astype(np.float64), rtol=2e-7, atol=0)
    got = gemv(data, sbits, g, x_eff, g_x=g_x)
    ref = xdq @ weight_f64(data, sbits, g).T
    assert rel(got, ref) < 1e-6


# --- the BF16 kernels (pipe_kernel, gemm_kernel) ---------------------------------------------


def decode_word_bf16(w: np.ndarray) -> list[np.ndarray]:
    """decode_word_bf16: uint32 words -> 4 uint32 holding BF16 {e2m1(n_i), e2m1(n_{i+4})} * 2^-126."""
    w = w.astype(np.uint32)
    m1, m2 = np.uint32(0x80008000), np.uint32(0x01C001C0)
    return [
        ((w << 12) & m1) | ((w << 6) & m2),
        ((w << 8) & m1) | ((w << 2) & m2),
        ((w << 4) & m1) | ((w >> 2) & m2),
        (w & m1) | ((w >> 6) & m2),
    ]


def bf16_halves(bits: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    bits = bits.astype(np.uint32)
    lo = (bits & 0xFFFF).astype(np.uint16).view(ml_dtypes.bfloat16)
    hi = (bits >> 16).astype(np.uint16).view(ml_dtypes.bfloat16)
    return lo, hi


def scale_bf16_2_119(scale_bits: np.ndarray) -> np.ndarray:
    """e4m3x2_to_bf16x2_scaled: E4M3 -> FP16 -> FP32 times 2^119 -> BF16 (round to nearest)."""
    s = scale_bits.view(ml_dtypes.float8_e4m3fn).astype(np.float16).astype(np.float32) * np.float32(2.0**119)
    return s.astype(ml_dtypes.bfloat16)


def act_pairs(words: np.ndarray) -> list[np.ndarray]:
    """act_pairs: 4 uint32 of natural-order BF16 (x0x1, x2x3, x4x5, x6x7) -> (x0,x4) (x1,x5) (x2,x6) (x3,x7)."""
    x, y, z, w = (words[..., i] for i in range(4))
    return [prmt(x, z, 0x5410), prmt(x, z, 0x7632), prmt(y, w, 0x5410), prmt(y, w, 0x7632)]


def test_decode_bf16_exhaustive():
    """Every nibble pair at every position decodes to e2m1 * 2^-126 exactly (BF16, code 1 subnormal)."""
    a, b = all_nibble_pairs()
    rng = np.random.default_rng(12)
    for i in range(4):
        words = nibble_words(rng, a, b, i)
        lo, hi = bf16_halves(decode_word_bf16(words)[i])
        np.testing.assert_array_equal(lo.astype(np.float64) * 2.0**126, e2m1_values(a))
        np.testing.assert_array_equal(hi.astype(np.float64) * 2.0**126, e2m1_values(b))
        assert lo.view(np.uint16)[a == 1][0] == 0x0040  # 0.5 * 2^-126: the subnormal 2^-127


def test_scaled_weights_are_exact_in_bf16():
    """e2m1 * 2^-126 (BF16) times e4m3 * 2^119 (BF16, no overflow) is e2m1 * e4m3 * 2^-7, exact and normal."""
    codes = np.arange(16, dtype=np.uint32)
    scales = np.arange(256, dtype=np.uint8)
    scales = scales[np.isfinite(scales.view(ml_dtypes.float8_e4m3fn).astype(np.float32))]
    s = scale_bf16_2_119(scales)
    assert np.isfinite(s.astype(np.float32)).all()
    np.testing.assert_array_equal(s.astype(np.float64), scales.view(ml_dtypes.float8_e4m3fn).astype(np.float64) * 2.0**119)
    lo, _ = bf16_halves(decode_word_bf16(codes)[0])
    prod = (lo.astype(np.float32)[:, None] * s.astype(np.float32)[None, :]).astype(ml_dtypes.bfloat16)
    exact = e2m1_values(codes)[:, None] * scales.view(ml_dtypes.float8_e4m3fn).astype(np.float64)[None, :] * 2.0**-7
    np.testing.assert_array_equal(prod.astype(np.float64), exact)
    nonzero = np.abs(exact) > 0
    assert np.abs(exact[nonzero]).min() >= 2.0**-17  # far above BF16's smallest normal


def test_act_pairs_meet_decode_pairs():
    """Natural-order activations permuted by PRMT pair (x[i], x[i+4]) like the weight nibbles."""
    x = np.arange(1, 9, dtype=np.float32).astype(ml_dtypes.bfloat16)
    words = x.view(np.uint16).astype(np.uint32)
    words = (words[0::2] | (words[1::2] << 16))[None]  # [1, 4]
    for i, p in enumerate(act_pairs(words)):
        lo, hi = bf16_halves(p)
        assert (float(lo[0]), float(hi[0])) == (float(x[i]), float(x[i + 4]))


def _swizzle_reads(rows, units_per_row, write, read):
    """Shared-memory layout check: every (row, unit) written to a distinct 16-byte slot, and each
    reader finds the unit it wants."""
    slots = {}
    for row in range(rows):
        for cu in range(units_per_row):
            a = write(row, cu)
            assert a not in slots
            slots[a] = (row, cu)
    return slots


def test_pipe_ring_layout_and_banks():
    """pipe_kernel: cp.async writes unit cu of row r at r*128 + ((cu ^ (r & 7)) << 4); thread (g, t)
    of half h reads unit 2t + h of rows g (+8) without bank conflicts (8 lanes per 16-byte phase)."""
    for r_tiles in (1, 2):
        rows = 16 * r_tiles
        slots = _swizzle_reads(rows, 8, lambda r, cu: r * 128 + ((cu ^ (r & 7)) << 4), None)
        # the writer's lanes cover every unit once
        covered = {((lane + 32 * q) >> 3, (lane + 32 * q) & 7) for q in range(4 * r_tiles) for lane in range(32)}
        assert covered == {(r, c) for r in range(rows) for c in range(8)}
        for rt in range(r_tiles):
            for h in range(2):
                for half in range(2):
                    addrs = []
                    for lane in range(32):
                        g, t = lane >> 2, lane & 3
                        row = rt * 16 + g + 8 * h
                        a = row * 128 + ((((2 * t + half) ^ g)) << 4)
                        assert slots[a] == (row, 2 * t + half)
                        addrs.append(a)
                    for phase in range(4):  # 128-bit loads: 8 lanes per phase, 8 distinct 16-byte bank groups
                        banks = {(a % 128) // 16 for a in addrs[8 * phase : 8 * phase + 8]}
                        assert len(banks) == 8


def test_gemm_activation_tile_layout_and_banks():
    """gemm_kernel: token row r, unit cu at r*128 + ((cu ^ (r & 7)) << 4); thread (g, t), word w of
    token group nt reads unit 2t + w of token 8*nt + g, conflict-free."""
    bm = 128
    slots = _swizzle_reads(bm, 8, lambda r, cu: r * 128 + ((cu ^ (r & 7)) << 4), None)
    covered = {((tid + 256 * q) >> 3, (tid + 256 * q) & 7) for q in range(bm // 32) for tid in range(256)}
    assert covered == {(r, c) for r in range(bm) for c in range(8)}
    for wc in range(2):
        for nt in range(bm // 16):
            for w in range(2):
                addrs = []
                for lane in range(32):
                    g, t = lane >> 2, lane & 3
                    tok = wc * (bm // 2) + nt * 8 + g
                    a = tok * 128 + (((2 * t + w) ^ g) << 4)
                    assert slots[a] == (tok, 2 * t + w)
                    addrs.append(a)
                for phase in range(4):
                    assert len({(a % 128) // 16 for a in addrs[8 * phase : 8 * phase + 8]}) == 8


def gemm_bf16(data, scale_bits, g_w, x_bf16, *, stage_k=64) -> np.ndarray:
    """gemm_kernel in float64: thread t owns block t of each 64-k stage, word w = k [16t + 8w, +8),
    weight pairs (n_i, n_{i+4}) against act_pairs of the same 8 activations."""
    n, k2 = data.shape
    k = 2 * k2
    m = x_bf16.shape[0]
    stages = k // stage_k
    words = data.view("<u4").reshape(n, stages, 4, 2)  # [row, stage, t, w]
    sc = scale_bf16_2_119(scale_bits).astype(np.float64).reshape(n, stages, 4)  # one block per t
    wp = np.empty((n, stages, 4, 2, 4, 2))
    for i, p in enumerate(decode_word_bf16(words)):
        lo, hi = bf16_halves(p)
        wp[..., i, 0] = (lo.astype(np.float32) * sc[..., None].astype(np.float32)).astype(ml_dtypes.bfloat16)
        wp[..., i, 1] = (hi.astype(np.float32) * sc[..., None].astype(np.float32)).astype(ml_dtypes.bfloat16)
    xw = x_bf16.view(np.uint16).astype(np.uint32).reshape(m, stages, 4, 2, 4, 2)
    xw = xw[..., 0] | (xw[..., 1] << 16)  # [m, stage, t, w, word]
    xp = np.empty((m, stages, 4, 2, 4, 2))
    for i, p in enumerate(act_pairs(xw)):
        lo, hi = bf16_halves(p)
        xp[..., i, 0], xp[..., i, 1] = lo.astype(np.float64), hi.astype(np.float64)
    return np.einsum("nstwih,mstwih->mn", wp, xp) * float(g_w) * 128.0


@pytest.mark.parametrize("m,n,k,seed", [(1, 40, 64, 31), (5, 33, 320, 32), (19, 16, 1088, 33)])
def test_gemm_bf16_model_matches_reference(m, n, k, seed):
    rng = np.random.default_rng(seed)
    _, data, sbits, g = quantized_weight(rng, n, k, zero_blocks=3)
    x = (rng.standard_normal((m, k)) * 3.0).astype(ml_dtypes.bfloat16)
    got = gemm_bf16(data, sbits, g, x)
    ref = x.astype(np.float64) @ weight_f64(data, sbits, g).T
    assert rel(got, ref) < 1e-6


# --- pipe16: the pipe ring's stage layout read with the regs GEMV's FP16 arithmetic ------------


def pipe16_stage(data, scale_bits, tile, c, r_tiles):
    """issue() of pipe_kernel: one (tile, chunk) item as stored in shared memory (bytes): 16R rows x
    8 units of 16 nibble bytes at row*128 + ((cu ^ (row & 7)) << 4), then 16R rows x 16 scale bytes;
    rows past N read row N-1, units past K are zeros (cp.async with src_bytes = 0)."""
    n, k2 = data.shape
    rows = 16 * r_tiles
    stage = np.zeros(rows * 144, np.uint8)
    for row in range(rows):
        r = min(tile * rows + row, n - 1)
        for cu in range(8):
            if c * 256 + cu * 32 < 2 * k2:
                a = row * 128 + ((cu ^ (row & 7)) << 4)
                stage[a : a + 16] = data[r, c * 128 + cu * 16 : c * 128 + cu * 16 + 16]
        for cu in range(4):
            if c * 256 + cu * 64 < 2 * k2:
                a = rows * 128 + row * 16 + cu * 4
                stage[a : a + 4] = scale_bits[r, c * 16 + cu * 4 : c * 16 + cu * 4 + 4]
    return stage


def pipe16_item(stage, x_eff, c, r_tiles):
    """pipe_item_f16 for every thread (g, t) of one warp: the [M, 16R] partial of the item, float64
    (products exact, sums of FP16 products of at most 22 significant bits)."""
    m = x_eff.shape[0]
    rows = 16 * r_tiles
    part = np.zeros((m, rows))
    for g in range(8):
        for t in range(4):
            k0 = c * 256 + 64 * t
            for half in range(2):
                xv = x_eff[:, k0 + 32 * half : k0 + 32 * half + 32].astype(np.float64).reshape(m, 4, 4, 2)
                for rt in range(r_tiles):
                    for h in range(2):
                        row = rt * 16 + g + 8 * h
                        a = row * 128 + (((2 * t + half) ^ g) << 4)
                        words = stage[a : a + 16].view("<u4")
                        s4 = stage[rows * 128 + row * 16 + 4 * t : rows * 128 + row * 16 + 4 * t + 4]
                        sc = scale_times_128(s4[2 * half : 2 * half + 2].copy())  # blocks 2*half, +1
                        s = sc[[0, 0, 1, 1]][:, None]  # word w uses block w // 2 of the half
                        lohi = [half2(p) for p in decode_word(words)]  # [i](lo, hi), each over words w
                        wl = np.stack([lo for lo, _ in lohi], 1).astype(np.float16)  # [w, i]
                        wh = np.stack([hi for _, hi in lohi], 1).astype(np.float16)
                        wl = (wl * s).astype(np.float16).astype(np.float64)
                        wh = (wh * s).astype(np.float16).astype(np.float64)
                        part[:, row] += np.einsum("wi,mwi->m", wl, xv[..., 0]) + np.einsum("wi,mwi->m", wh, xv[..., 1])
    return part


@pytest.mark.parametrize("m,n,k,r_tiles,seed", [(1, 40, 320, 1, 41), (5, 37, 576, 2, 42), (8, 16, 64, 1, 43)])
def test_pipe16_model_matches_reference(m, n, k, r_tiles, seed):
    """pipe16 = the ring's stages (N not a multiple of the tile, K % 64 == 0 but not % 256) read by
    pipe_item_f16 on the regs staging (W4A16 chunk scales; W4A4 x_eff), summed per (tile, chunk)."""
    rng = np.random.default_rng(seed)
    _, data, sbits, g = quantized_weight(rng, n, k, zero_blocks=3)
    x = (rng.standard_normal((m, k)) * 3.0).astype(ml_dtypes.bfloat16).astype(np.float32)
    x[0, :16] = 0.0
    ref_w = weight_f64(data, sbits, g)
    rows, chunks = 16 * r_tiles, -(-k // 256)
    for mode in ("w4a16", "w4a4"):
        if mode == "w4a16":
            x_eff, xs = stage_a16(x)
            ref = x.astype(np.float64) @ ref_w.T
            g_x = 1.0
        else:
            amax = float(np.abs(x).max()) * 0.5  # saturating
            g_x = float(np.float32(amax) / np.float32(2688.0))
            x_eff, xs = stage_a4(x, g_x), np.ones((m, chunks), np.float32)
        y = np.zeros((m, -(-n // rows) * rows))
        for tile in range(-(-n // rows)):
            for c in range(chunks):
                part = pipe16_item(pipe16_stage(data, sbits, tile, c, r_tiles), x_eff, c, r_tiles)
                y[:, tile * rows : tile * rows + rows] += part * xs[:, c : c + 1].astype(np.float64)
        y = y[:, :n] * g * 128.0 * g_x
        if mode == "w4a16":
            assert rel(y, ref) < 1e-6
        else:  # against the regs GEMV model on the same staging: only the summation order differs
            assert rel(y, gemv(data, sbits, g, x_eff, g_x=g_x)) < 1e-9
