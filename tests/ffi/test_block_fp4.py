"""The MXFP4 / DialectFP4 GEMV's building blocks on the CPU: the magnitude tables, the table decode
(``decode_word_lut``) and the block scales (``mxfp4_scale2``, ``dialect_scale2``) of
``nvfp4_common.cuh`` emulated bit for bit in NumPy against float64 values computed from the formats'
definitions; the custom call's argument checks and lowering. The kernel itself: test_block_fp4_gpu.py."""

import re
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jaxlp.ffi import block_fp4
from jaxlp.formats import dialect_fp4, mxfp4

COMMON = Path(block_fp4.__file__).with_name("nvfp4_common.cuh").read_text()
E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6], np.float64)


def prmt(a, b, sel):
    """PTX ``prmt.b32`` (default mode) on uint32 arrays: output byte i is byte ``sel_i & 7`` of
    {b, a} (a = bytes 0..3), or that byte's sign replicated when ``sel_i & 8``."""
    a, b, sel = (np.asarray(v, np.uint64) for v in (a, b, sel))
    src = a | (b << np.uint64(32))
    out = np.zeros(np.broadcast(a, b, sel).shape, np.uint64)
    for i in range(4):
        s = (sel >> np.uint64(4 * i)) & np.uint64(0xF)
        byte = (src >> ((s & np.uint64(7)) * np.uint64(8))) & np.uint64(0xFF)
        byte = np.where(s & np.uint64(8), np.where(byte & np.uint64(0x80), np.uint64(0xFF), np.uint64(0)), byte)
        out |= byte << np.uint64(8 * i)
    return out.astype(np.uint32)


def bf16_value(bits):
    return np.asarray(bits, np.uint16).view(ml_dtypes.bfloat16).astype(np.float64)


def hmul2_bf16(a, b):
    """BF16x2 multiply; every product here is exact, which this checks."""
    out = []
    for shift in (0, 16):
        x = bf16_value((a >> shift) & 0xFFFF) * bf16_value((b >> shift) & 0xFFFF)
        r = x.astype(ml_dtypes.bfloat16)
        assert np.array_equal(r.astype(np.float64), x), "a product is not exact in BF16"
        out.append(r.view(np.uint16).astype(np.uint32) << shift)
    return out[0] | out[1]


def decode_word_lut(w, tab, scale2):
    """nvfp4_common.cuh's decode_word_lut, line for line (uint32 arrays; ``tab`` [4] words)."""
    w = np.asarray(w, np.uint32)
    sel_a, sel_b = w & 0x7777, (w >> 16) & 0x7777
    lo_a, lo_b = prmt(tab[0], tab[1], sel_a), prmt(tab[0], tab[1], sel_b)
    hi_a, hi_b = prmt(tab[2], tab[3], sel_a), prmt(tab[2], tab[3], sel_b)
    ya, yb = prmt(w, 0, 0x1100), prmt(w, 0, 0x3322)
    hi_a = hi_a | (((ya << 4) & 0x00800080) | (ya & 0x80008000))
    hi_b = hi_b | (((yb << 4) & 0x00800080) | (yb & 0x80008000))
    pairs = [prmt(lo_a, hi_a, 0x5140), prmt(lo_a, hi_a, 0x7362), prmt(lo_b, hi_b, 0x5140), prmt(lo_b, hi_b, 0x7362)]
    return [hmul2_bf16(p, scale2) for p in pairs]


def pairs_to_values(pairs):
    """Four BF16x2 pairs (natural order) -> the 8 values, [..., 8] float64."""
    cols = []
    for p in pairs:
        cols += [bf16_value(p & 0xFFFF), bf16_value(p >> 16)]
    return np.stack(cols, axis=-1)


def mxfp4_scale2(b):
    b = np.asarray(b, np.uint32)
    s = np.where(b >= 2, (b - 1) << 7, 0x40 >> np.clip(1 - b.astype(np.int64), 0, 1)).astype(np.uint32)
    return s | (s << 16)


def dialect_scale2(c):
    s = (np.asarray(c, np.uint32) + 108) << 7
    return s | (s << 16)


def cuda_e2m1_table():
    body = COMMON[COMMON.index("void e2m1_table"):]
    return np.array([int(v, 16) for v in re.findall(r"tab\[\d\] = 0x([0-9A-F]+)u;", body)[:4]], np.uint32)


def table_words(table_bytes):
    return np.asarray(table_bytes, np.uint8).view("<u4")


def test_magnitude_tables_hold_each_dialect_in_bf16():
    tables = block_fp4.magnitude_tables(dialect_fp4.FORMATBOOK)
    assert tables.shape == (16, 16) and tables.dtype == np.uint8
    bits = tables[:, 0:8].astype(np.uint16) | (tables[:, 8:16].astype(np.uint16) << 8)
    np.testing.assert_array_equal(bf16_value(bits), dialect_fp4.FORMATBOOK.astype(np.float64))
    custom = np.array([np.sort(np.random.default_rng(i).choice(16, 8, replace=False)) for i in range(16)])
    bits = block_fp4.magnitude_tables(custom)
    got = bits[:, 0:8].astype(np.uint16) | (bits[:, 8:16].astype(np.uint16) << 8)
    np.testing.assert_array_equal(bf16_value(got), custom.astype(np.float64))


def test_cuda_e2m1_table_is_e2m1_in_half_units():
    tab = cuda_e2m1_table()
    assert tab.shape == (4,)
    np.testing.assert_array_equal(tab, table_words(block_fp4.magnitude_tables(dialect_fp4.FORMATBOOK)[7]))
    np.testing.assert_array_equal(dialect_fp4.FORMATBOOK[7] / 2, E2M1)  # the row MXFP4's table is taken from


@pytest.mark.parametrize("seed", [0, 1])
def test_table_decode_of_dialect_words(seed):
    rng = np.random.default_rng(seed)
    tables = block_fp4.magnitude_tables(dialect_fp4.FORMATBOOK)
    n = 4096
    words = rng.integers(0, 2**32, n, dtype=np.uint64).astype(np.uint32)
    words[:16] = [0, 0xFFFFFFFF, 0x88888888, 0x77777777] * 4  # zeros, -0, largest magnitudes
    ids = rng.integers(0, 16, n)
    codes = rng.integers(0, 32, n)
    codes[:32] = np.arange(32)
    got = np.empty((n, 8))
    for d in range(16):
        sel = ids == d
        got[sel] = pairs_to_values(decode_word_lut(words[sel], table_words(tables[d]), dialect_scale2(codes[sel])))
    nib = (words[:, None] >> (4 * np.arange(8, dtype=np.uint32))) & 0xF
    mag = dialect_fp4.FORMATBOOK.astype(np.float64)[ids[:, None], nib & 7] * 0.5
    want = np.where(nib >= 8, -1.0, 1.0) * mag * np.exp2(codes[:, None] - 18.0)
    np.testing.assert_array_equal(got, want)


def test_table_decode_of_mxfp4_words_at_every_scale():
    rng = np.random.default_rng(2)
    # every E8M0 byte the quantizer writes: shared exponents -127..125 (FP32 inputs); 6 * 2^126 overflows
    scales = np.repeat(np.arange(253), 8)
    words = rng.integers(0, 2**32, scales.size, dtype=np.uint64).astype(np.uint32)
    got = pairs_to_values(decode_word_lut(words, cuda_e2m1_table(), mxfp4_scale2(scales)))
    nib = (words[:, None] >> (4 * np.arange(8, dtype=np.uint32))) & 0xF
    want = np.where(nib >= 8, -1.0, 1.0) * E2M1[nib & 7] * np.exp2(scales[:, None] - 127.0)
    np.testing.assert_array_equal(got, want)


def test_scales_in_bf16():
    np.testing.assert_array_equal(bf16_value(mxfp4_scale2(np.arange(255)) & 0xFFFF), np.exp2(np.arange(255) - 128.0))
    np.testing.assert_array_equal(bf16_value(dialect_scale2(np.arange(32)) >> 16), np.exp2(np.arange(32) - 19.0))


def test_decode_matches_the_stored_formats():
    """Whole quantized rows through the emulated decode equal the formats' own dequantize."""
    rng = np.random.default_rng(3)
    x = rng.standard_normal((4, 256)).astype(np.float32) * np.float32(0.05)
    x[1, 32:64] = 0.0
    for q in (mxfp4.quantize(jnp.asarray(x)), dialect_fp4.quantize(jnp.asarray(x))):
        if q.format == "mxfp4":
            codes, exps = np.asarray(q.data), np.asarray(q.scale).view(np.uint8)
        else:
            codes, exps = np.asarray(q.codes), np.asarray(q.exponents)
        words = codes.reshape(4, 32, 4).copy().view("<u4")[..., 0]  # [4, 32] words of 8 codes
        blocks = np.repeat(np.arange(8), 4)  # word -> block of 32
        got = np.empty((4, 32, 8))
        for r in range(4):
            for j in range(32):
                b = blocks[j]
                if q.format == "mxfp4":
                    tab, s = cuda_e2m1_table(), mxfp4_scale2(exps[r, b])
                else:
                    tab = table_words(block_fp4.magnitude_tables(q.formatbook)[int(np.asarray(q.dialects)[r, b])])
                    s = dialect_scale2(exps[r, b])
                got[r, j] = pairs_to_values(decode_word_lut(words[r, j : j + 1], tab, s))[0]
        np.testing.assert_array_equal(got.reshape(4, 256), np.asarray(q.dequantize(jnp.float32), np.float64))


def test_checks_name_the_problem():
    w = mxfp4.quantize(jnp.ones((64, 256)))
    x = jnp.ones((2, 256), jnp.bfloat16)
    assert block_fp4.why_not(w, 2, jnp.bfloat16) is None
    assert "blocks of 32" in block_fp4.why_not(mxfp4.quantize(jnp.ones((64, 256)), block_size=16), 2, jnp.bfloat16)
    assert "multiple of 128" in block_fp4.why_not(mxfp4.quantize(jnp.ones((64, 192))), 2, jnp.bfloat16)
    assert "multiple of 128" in block_fp4.why_not(dialect_fp4.quantize(jnp.ones((64, 320))), 2, jnp.bfloat16)
    assert block_fp4.why_not(dialect_fp4.quantize(jnp.ones((64, 384))), 2, jnp.bfloat16) is None
    assert "1..32" in block_fp4.why_not(w, 33, jnp.bfloat16)
    assert block_fp4.why_not(w, 3000, jnp.bfloat16, block_fp4.Config(kernel="gemm")) is None
    assert "64 x split" in block_fp4.why_not(mxfp4.quantize(jnp.ones((64, 128))), 64, jnp.bfloat16,
                                             block_fp4.Config(kernel="gemm", split=4))
    assert "bfloat16" in block_fp4.why_not(w, 2, jnp.float32)
    assert "'nvfp4'" in block_fp4.why_not(type("W", (), {"format": "nvfp4"})(), 2, jnp.bfloat16)
    with pytest.raises(ValueError, match="K = 128"):
        block_fp4.matmul(jnp.ones((2, 128), jnp.bfloat16), w)
    with pytest.raises(ValueError, match="1..32"):
        block_fp4.matmul(jnp.ones((40, 256), jnp.bfloat16), w)
    with pytest.raises(ValueError, match="out_dtype"):
        block_fp4.matmul(x, w, out_dtype=jnp.float16)
    with pytest.raises(ValueError, match="activation"):
        block_fp4.matmul(x, w, activation="nvfp4")
    with pytest.raises(ValueError, match="split"):
        block_fp4.Config(split=3)
    with pytest.raises(ValueError, match="kernel"):
        block_fp4.Config(kernel="regs")
    for name in ("P1C1", "P2C4", "G64x64", "G128x128S2", "G64x128S4"):
        assert block_fp4.Config.from_name(name).name == name
    with pytest.raises(ValueError, match="not a block_fp4 launch"):
        block_fp4.Config.from_name("R1KS8")


def test_selection_tables_layout():
    sel = block_fp4.selection_tables()
    assert sel.shape == (168,) and sel.dtype == np.float32
    np.testing.assert_array_equal(sel[:128].reshape(16, 8), dialect_fp4.FORMATBOOK)
    np.testing.assert_array_equal(sel[128:160].reshape(16, 2), dialect_fp4.beneficial_ranges())
    np.testing.assert_array_equal(sel[160:], [15, 14, 13, 12, 11, 10, 9, 8])  # the pairs' shared maxima


@pytest.mark.parametrize("fmt", ["mxfp4", "dialect_fp4"])
def test_gemm_metadata_packs_each_stage_in_one_word(fmt):
    """Per (row, 64-k stage): the two blocks' scale bytes, their dialect-id byte, zero."""
    rng = np.random.default_rng(5)
    x = rng.standard_normal((3, 384)).astype(np.float32)
    q = (mxfp4 if fmt == "mxfp4" else dialect_fp4).quantize(jnp.asarray(x))
    meta = np.asarray(block_fp4.gemm_metadata(q))
    assert meta.shape == (3, 384 // 16) and meta.dtype == np.uint8
    words = meta.reshape(3, 6, 4)
    scales = np.asarray(q.scale).view(np.uint8) if fmt == "mxfp4" else np.asarray(q.exponents)
    np.testing.assert_array_equal(words[..., 0], scales[:, 0::2])
    np.testing.assert_array_equal(words[..., 1], scales[:, 1::2])
    ids = np.asarray(q.dialects) if fmt == "dialect_fp4" else np.zeros((3, 12), np.uint8)
    np.testing.assert_array_equal(words[..., 2] & 0xF, ids[:, 0::2])
    np.testing.assert_array_equal(words[..., 2] >> 4, ids[:, 1::2])
    assert not words[..., 3].any()


def test_decode_checks_and_lowers():
    w = dialect_fp4.quantize(jnp.ones((64, 96)))
    text = jax.jit(block_fp4.decode).trace(w).lower(lowering_platforms=("cuda",)).as_text()
    assert f"stablehlo.custom_call @{block_fp4.DECODE_TARGET}" in text and "tensor<64x96xbf16>" in text
    with pytest.raises(ValueError, match="blocks of 32"):
        block_fp4.decode(mxfp4.quantize(jnp.ones((64, 96)), block_size=16))


@pytest.mark.parametrize("fmt", ["mxfp4", "dialect_fp4"])
def test_lowers_to_the_custom_call(fmt):
    w = (mxfp4 if fmt == "mxfp4" else dialect_fp4).quantize(jnp.ones((64, 512)))
    f = jax.jit(lambda x, w: block_fp4.matmul(x, w, config=block_fp4.Config(1, 4), out_dtype=jnp.float32))
    text = f.trace(jnp.zeros((3, 512), jnp.bfloat16), w).lower(lowering_platforms=("cuda",)).as_text()
    assert f"stablehlo.custom_call @{block_fp4.TARGET}" in text and "tensor<3x64xf32>" in text
    assert f"format = {block_fp4.FORMATS[fmt]} : i64" in text and "split = 4 : i64" in text
    gemm = block_fp4.Config(kernel="gemm", block_n=64, block_m=128)
    f = jax.jit(lambda x, w: block_fp4.matmul(x, w, config=gemm))
    text = f.trace(jnp.zeros((300, 512), jnp.bfloat16), w).lower(lowering_platforms=("cuda",)).as_text()
    assert "kernel = 2 : i64" in text and "block_m = 128 : i64" in text and "tensor<64x32xui8>" in text
    f = jax.jit(lambda x, w: block_fp4.matmul(x, w, activation="dialect_fp4"))
    text = f.trace(jnp.zeros((5, 512), jnp.bfloat16), w).lower(lowering_platforms=("cuda",)).as_text()
    assert "act = 2 : i64" in text and "tensor<168xf32>" in text and "tensor<5x512xbf16>)" in text
