"""A NumPy model of the INT4 decode-attention kernel's arithmetic and index maps
(int4_decode_attention.cu), checked against float64 on the CPU.

The model follows the kernel's formulas lane by lane: the INT4 -> FP16 conversion of a 32-bit word
(LOP3 with the 0x6408 / 0x6480 magic, HSUB2 / HFMA2), the query fragments (channels tig * D/8 + 4 w
+ {0, 2} | +1, and + D/2), the key words of n-tile j (token 8 j + gid, bytes tig * D/8 on), the
value words of k-step i (tokens 16 i + {2 tig, 2 tig + 1, 2 tig + 8, 2 tig + 9}, bytes gid * D/16 on)
interleaved by PRMT, the m16n8k16 fragment layouts, and the output column map (column n of n-tile nt
is channel n * D/16 + nt / 2 + (nt & 1) * D/2). If one of them were wrong, S = Q K^T or O = P V of a
chunk would not be the float64 product and these tests would fail before any GPU run.
"""

import numpy as np
import pytest

from jaxlp.kvcache.quant import pack_int4


def prmt(a, b, sel):
    """PTX prmt.b32 (default mode): byte k of the result is byte sel[4k:4k+4] of (b:a)."""
    src = (np.uint64(b) << np.uint64(32)) | np.uint64(a)
    return np.uint32(sum(((int(src) >> (8 * ((sel >> (4 * k)) & 7))) & 0xFF) << (8 * k) for k in range(4)))


def half2(r):
    """The two FP16 halves of a 32-bit register, low first, as float64."""
    return np.array([r & 0xFFFF, r >> 16], np.uint16).view(np.float16).astype(np.float64)


def int4_to_half2(w):
    """The kernel's int4_to_half2: four FP16 pairs, (low nibbles of bytes 0, 2), (their high
    nibbles), (low nibbles of bytes 1, 3), (their high nibbles); FP16 arithmetic as the HSUB2 /
    HFMA2 round it."""
    w = int(w)
    w8 = w >> 8
    r = [(w & 0x000F000F) ^ 0x64086408, (w & 0x00F000F0) ^ 0x64806480,
         (w8 & 0x000F000F) ^ 0x64086408, (w8 & 0x00F000F0) ^ 0x64806480]
    out = []
    for i, x in enumerate(r):
        h = half2(x).astype(np.float16)
        h = (h * np.float16(0.0625) + np.float16(-72.0)) if i & 1 else (h - np.float16(1032.0))
        out.append(h.astype(np.float64))
    return out


def nibble(byte, high):
    v = (byte >> 4) & 15 if high else byte & 15
    return v - 16 if v >= 8 else v


def test_int4_to_half2_is_exact_for_every_byte():
    rng = np.random.default_rng(0)
    for value in range(256):
        for pos in range(4):
            b = rng.integers(0, 256, 4)
            b[pos] = value
            w = int(b[0]) | int(b[1]) << 8 | int(b[2]) << 16 | int(b[3]) << 24
            c = int4_to_half2(w)
            assert list(c[0]) == [nibble(b[0], 0), nibble(b[2], 0)]
            assert list(c[1]) == [nibble(b[0], 1), nibble(b[2], 1)]
            assert list(c[2]) == [nibble(b[1], 0), nibble(b[3], 0)]
            assert list(c[3]) == [nibble(b[1], 1), nibble(b[3], 1)]


def mma(a_frags, b_frags):
    """m16n8k16 from the 32 lanes' fragments: a[lane] = 4 FP16 pairs, b[lane] = 2 pairs; the C
    fragments c[lane] = [C[gid][2 tig], C[gid][2 tig + 1], C[gid + 8][2 tig], C[gid + 8][2 tig + 1]]."""
    A, B = np.zeros((16, 16)), np.zeros((16, 8))
    for lane in range(32):
        gid, tig = lane >> 2, lane & 3
        for reg, (row, col) in enumerate([(gid, 2 * tig), (gid + 8, 2 * tig), (gid, 2 * tig + 8), (gid + 8, 2 * tig + 8)]):
            A[row, col:col + 2] = a_frags[lane][reg]
        for reg, k in enumerate([2 * tig, 2 * tig + 8]):
            B[k:k + 2, gid] = b_frags[lane][reg]
    C = A @ B
    return [[C[l >> 2, 2 * (l & 3)], C[l >> 2, 2 * (l & 3) + 1], C[(l >> 2) + 8, 2 * (l & 3)],
             C[(l >> 2) + 8, 2 * (l & 3) + 1]] for l in range(32)]


def words(row_bytes, start, n):
    """n little-endian 32-bit words of a token's code bytes from byte ``start``."""
    b = row_bytes[start:start + 4 * n].astype(np.uint32)
    return [int(b[4 * i]) | int(b[4 * i + 1]) << 8 | int(b[4 * i + 2]) << 16 | int(b[4 * i + 3]) << 24 for i in range(n)]


@pytest.mark.parametrize("d, g", [(128, 4), (128, 16), (64, 1), (64, 8)])
def test_one_chunk_of_32_tokens_is_the_float64_attention(d, g):
    """S = Q K^T and O = (P * value scale) V of one warp's 32 tokens, assembled from the lanes'
    fragments as the kernel builds them, against float64 over the decoded codes."""
    rng = np.random.default_rng(d + g)
    kc = rng.integers(-8, 8, (32, d))
    vc = rng.integers(-8, 8, (32, d))
    kb = np.asarray(pack_int4(kc))  # [32, D/2]: channel i low nibble of byte i, i + D/2 high
    vb = np.asarray(pack_int4(vc))
    q = np.zeros((16, d))
    q[:g] = rng.standard_normal((g, d)).astype(np.float16)
    vs = rng.uniform(0.5, 2.0, 32)

    # Query fragments: k-step s, channel c = tig * D/8 + 4 (s >> 1) + (s & 1) (+2, + D/2, + D/2 + 2).
    def qa(lane, s):
        gid, tig = lane >> 2, lane & 3
        c = tig * (d // 8) + 4 * (s >> 1) + (s & 1)
        return [q[gid, [c, c + 2]], q[gid + 8, [c, c + 2]], q[gid, [c + d // 2, c + d // 2 + 2]],
                q[gid + 8, [c + d // 2, c + d // 2 + 2]]]

    sc = np.zeros((32, 4, 4))  # [lane][n-tile j][e]
    for j in range(4):
        acc = np.zeros((32, 4))
        kw = [words(kb[8 * j + (lane >> 2)], (lane & 3) * (d // 8), d // 32) for lane in range(32)]
        for w in range(d // 32):
            conv = [int4_to_half2(kw[lane][w]) for lane in range(32)]
            for part in range(2):
                acc += mma([qa(lane, 2 * w + part) for lane in range(32)],
                           [conv[lane][2 * part:2 * part + 2] for lane in range(32)])
        sc[:, j] = acc
    want_s = q @ kc.T  # [16, 32]
    for lane in range(32):
        gid, tig = lane >> 2, lane & 3
        for j in range(4):
            for e in range(4):
                assert sc[lane, j, e] == pytest.approx(want_s[gid + 8 * (e >> 1), 8 * j + 2 * tig + (e & 1)], abs=1e-9)

    # O += P V: P (any values: here S itself) times the value scale, as the kernel's A operand.
    p = sc
    o = np.zeros((32, d // 8, 4))
    for i in range(2):
        a = [[p[lane, 2 * i, [0, 1]] * vs[8 * (2 * i) + 2 * (lane & 3) + np.arange(2)],
              p[lane, 2 * i, [2, 3]] * vs[8 * (2 * i) + 2 * (lane & 3) + np.arange(2)],
              p[lane, 2 * i + 1, [0, 1]] * vs[8 * (2 * i + 1) + 2 * (lane & 3) + np.arange(2)],
              p[lane, 2 * i + 1, [2, 3]] * vs[8 * (2 * i + 1) + 2 * (lane & 3) + np.arange(2)]] for lane in range(32)]
        for w in range(d // 64):
            frags = []
            for lane in range(32):
                gid, tig = lane >> 2, lane & 3
                tok = [16 * i + 2 * tig + (e & 1) + 8 * (e >> 1) for e in range(4)]
                vw = [words(vb[t], gid * (d // 16), d // 64)[w] for t in tok]
                frags.append([int4_to_half2(prmt(vw[0], vw[1], 0x5410)), int4_to_half2(prmt(vw[0], vw[1], 0x7632)),
                              int4_to_half2(prmt(vw[2], vw[3], 0x5410)), int4_to_half2(prmt(vw[2], vw[3], 0x7632))])
            for x in range(4):
                for half, nt in ((0, 8 * w + x), (1, 8 * w + 4 + x)):
                    o[:, nt] += mma(a, [[frags[lane][half][x], frags[lane][2 + half][x]] for lane in range(32)])
    pm = np.zeros((16, 32))  # P as a matrix (row, token), times the value scale
    for lane in range(32):
        gid, tig = lane >> 2, lane & 3
        for j in range(4):
            for e in range(4):
                pm[gid + 8 * (e >> 1), 8 * j + 2 * tig + (e & 1)] = p[lane, j, e]
    want_o = (pm * vs) @ vc  # [16, D]
    for lane in range(32):
        gid, tig = lane >> 2, lane & 3
        for nt in range(d // 8):
            for e in range(4):
                n = 2 * tig + (e & 1)
                channel = n * (d // 16) + (nt >> 1) + (nt & 1) * (d // 2)
                assert o[lane, nt, e] == pytest.approx(want_o[gid + 8 * (e >> 1), channel], rel=1e-12, abs=1e-9)
