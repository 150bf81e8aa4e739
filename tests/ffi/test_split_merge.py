"""jaxlp/ffi/split_merge.cuh (the decode attention's split merge on the GPU), its two kernels'
arithmetic mirrored in NumPy: split_merge_kernel (each of 8 warps takes every 8th split and keeps a
running sum, the warps' maxima and sums meet in shared memory) and split_merge_queries_kernel (a
warp per (row, query), every split in order). Against the reference, jaxlp.attention.reference.merge_splits, on fresh
random partials with empty splits (m = -inf, l = 0, o = 0) and rows where every split is empty.
The CUDA kernels themselves run in the GPU tests of tests/ffi/test_quantized_decode_attention_cuda.py
and tests/ffi/test_int4_decode_attention_cuda.py (out, m and l against float64)."""

import numpy as np
import pytest

from jaxlp.attention.reference import merge_splits

WARPS = 8  # kMergeWarps


def split_merge_model(o, m, l):
    """split_merge_kernel over every (row, query): o [R, S, G, D], m, l [R, S, G] (float32) ->
    out [R, G, D], m_all, den [R, G], in the kernel's order of float32 operations."""
    r, s, g, d = o.shape
    f32 = np.float32
    out, m_all, den_all = np.zeros((r, g, d), f32), np.zeros((r, g), f32), np.zeros((r, g), f32)
    for ri in range(r):
        for gi in range(g):
            warp_max = [max([f32(-np.inf)] + [m[ri, x, gi] for x in range(w, s, WARPS)]) for w in range(WARPS)]
            mx = f32(max(warp_max))
            safe = f32(0) if mx == -np.inf else mx
            parts, dens = np.zeros((WARPS, d), f32), np.zeros(WARPS, f32)
            for w in range(WARPS):
                for x in range(w, s, WARPS):
                    wt = f32(0) if m[ri, x, gi] == -np.inf else np.exp(f32(m[ri, x, gi] - safe), dtype=f32)
                    dens[w] = f32(dens[w] + f32(l[ri, x, gi] * wt))
                    parts[w] = (parts[w] + (wt * o[ri, x, gi]).astype(f32)).astype(f32)
            den = f32(0)
            for w in range(WARPS):
                den = f32(den + dens[w])
            total = np.zeros(d, f32)
            for w in range(WARPS):
                total = (total + parts[w]).astype(f32)
            out[ri, gi] = total / den if den > 0 else 0
            m_all[ri, gi], den_all[ri, gi] = mx, den
    return out, m_all, den_all


def split_merge_queries_model(o, m, l):
    """split_merge_queries_kernel (splits <= 32): per (row, query) the splits' maximum, then the
    weighted sums over the splits in order; the kernel's FMAs (acc + w x, one rounding) in float64."""
    r, s, g, d = o.shape
    f32 = np.float32
    out, m_all, den_all = np.zeros((r, g, d), f32), np.zeros((r, g), f32), np.zeros((r, g), f32)
    for ri in range(r):
        for gi in range(g):
            mx = f32(m[ri, :, gi].max())
            safe = f32(0) if mx == -np.inf else mx
            acc, den = np.zeros(d, f32), f32(0)
            for x in range(s):
                wt = f32(0) if m[ri, x, gi] == -np.inf else np.exp(f32(m[ri, x, gi] - safe), dtype=f32)
                den = f32(np.float64(l[ri, x, gi]) * np.float64(wt) + np.float64(den))
                acc = (np.float64(wt) * o[ri, x, gi].astype(np.float64) + acc.astype(np.float64)).astype(f32)
            out[ri, gi] = acc / den if den > 0 else 0
            m_all[ri, gi], den_all[ri, gi] = mx, den
    return out, m_all, den_all


@pytest.mark.parametrize("model, splits", [(split_merge_model, s) for s in (1, 5, 8, 34, 67)]
                         + [(split_merge_queries_model, s) for s in (1, 2, 5, 32)])
def test_split_merge_matches_the_reference_with_empty_splits_and_rows(model, splits):
    rng = np.random.default_rng(splits)
    r, g, d = 3, 4, 64
    m = (rng.standard_normal((r, splits, g)) * 4).astype(np.float32)
    l = rng.uniform(0.5, 40.0, (r, splits, g)).astype(np.float32)
    o = (rng.standard_normal((r, splits, g, d)) * l[..., None]).astype(np.float32)
    empty = rng.random((r, splits, g)) < 0.3  # empty splits: no token seen
    empty[2] = True  # a row whose every split is empty (a row with nothing to attend)
    m[empty], l[empty], o[empty] = -np.inf, 0.0, 0.0
    got = model(o, m, l)
    want = [np.asarray(x)[:, 0] for x in merge_splits(o[:, None], m[:, None], l[:, None])]  # one KV head per row
    assert not any(np.isnan(x).any() for x in got)
    np.testing.assert_array_equal(got[1], want[1])  # the maxima: exact (-inf where all are empty)
    np.testing.assert_allclose(got[2], want[2], rtol=1e-5)
    np.testing.assert_allclose(got[0], want[0], rtol=1e-5, atol=1e-6)
    assert (got[0][2] == 0).all() and (got[2][2] == 0).all() and np.isneginf(got[1][2]).all()
