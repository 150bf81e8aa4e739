"""Kitty pages against a NumPy implementation of the notes, attention error bounds, bytes."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxlp import kvcache
from jaxlp.kvcache import kitty
from jaxlp.models import ModelConfig

G = 128

# Jitted once per shape (eager dispatch of every small op is slow on CPU).
quantize_key_page = jax.jit(kitty.quantize_key_page, static_argnums=1)
dequantize_key_page = jax.jit(kitty.dequantize_key_page)
quantize_value_page = jax.jit(kitty.quantize_value_page)
dequantize_value_page = jax.jit(kitty.dequantize_value_page)


@functools.partial(jax.jit, static_argnames="scale")
def attend(layer, q, k, v, positions, scale):
    return layer.attend(q, k, v, positions, scale=scale, window=None, softcap=None)


def np_minmax(x, levels, axis):
    """The notes' rule in float32: FP16 scale (floored at 1e-6) and min; codes from those (divisions
    as products with the float32 reciprocal, as :mod:`jaxlp.kvcache.quant` writes them)."""
    lo = x.min(axis, keepdims=True)
    hi = x.max(axis, keepdims=True)
    scale = np.maximum((hi - lo) * (np.float32(1) / np.float32(levels)), np.float32(1e-6)).astype(np.float16)
    lo = lo.astype(np.float16)
    codes = np.floor((x - lo.astype(np.float32)) * (np.float32(1) / scale.astype(np.float32)) + np.float32(0.5))
    return np.clip(codes, 0, levels).astype(np.uint8), scale, lo


def np_pack2(codes):
    """[..., N] 2-bit codes -> [..., M = N/4] bytes, planar: element t*M + i in byte i at bits 2t."""
    m = codes.shape[-1] // 4
    c = codes.astype(np.uint32)
    return (c[..., :m] | c[..., m:2 * m] << 2 | c[..., 2 * m:3 * m] << 4 | c[..., 3 * m:] << 6).astype(np.uint8)


def np_key_page(k, n_boost):
    x = np.asarray(k, np.float32)  # [G, D]
    score = np.abs(x).mean(0)
    order = np.argsort(-score, kind="stable")
    rank = np.empty_like(order)
    rank[order] = np.arange(len(order))
    levels = np.where(rank < n_boost, 15, 3).astype(np.float32)
    codes, scale, lo = np_minmax(x, levels[None], 0)
    codes = codes.T  # [D, G]
    return dict(
        low=np_pack2(codes & 3),
        high=np_pack2((codes >> 2)[order[:n_boost]]),
        boost_idx=np.where(rank < n_boost, rank, n_boost).astype(np.uint8),
        scale=scale[0],
        min=lo[0],
        codes=codes,
    )


def np_value_page(v):
    codes, scale, lo = np_minmax(np.asarray(v, np.float32), 3, 1)
    return dict(codes=np_pack2(codes), scale=scale[:, 0], min=lo[:, 0], raw=codes)


def random_keys(rng, d):
    """Channels of very different magnitudes and offsets, in FP16 (what the Q-buffer holds)."""
    k = rng.normal(size=(G, d)) * np.exp(1.5 * rng.normal(size=d)) + rng.normal(size=d)
    return k.astype(np.float16).astype(np.float32)


@pytest.mark.parametrize("d, n_boost, seed", [(32, 4, 0), (64, 16, 1), (128, 32, 2), (32, 0, 3), (32, 32, 4), (24, 3, 5)])
def test_key_page_matches_numpy(d, n_boost, seed):
    k = random_keys(np.random.default_rng(seed), d)
    page = quantize_key_page(jnp.asarray(k), n_boost)
    want = np_key_page(k, n_boost)
    assert page.low.shape == (d, G // 4) and page.high.shape == (n_boost, G // 4) and page.boost_idx.shape == (d,)
    assert page.low.dtype == page.high.dtype == page.boost_idx.dtype == jnp.uint8
    assert page.scale.dtype == page.min.dtype == jnp.float16
    for field in ("low", "high", "boost_idx", "scale", "min"):
        np.testing.assert_array_equal(np.asarray(getattr(page, field)), want[field], err_msg=field)
    deq = np.asarray(dequantize_key_page(page))
    want_deq = (want["codes"] * want["scale"][:, None].astype(np.float64) + want["min"][:, None]).T
    np.testing.assert_allclose(deq, want_deq, rtol=1e-6, atol=1e-6)
    # Round trip: within half a step of the channel's grid (plus FP16 rounding of min and scale).
    step = want["scale"].astype(np.float64)
    slack = 2.0**-10 * (np.abs(k).max(0) + 15 * step)
    assert (np.abs(deq - k) <= 0.5 * step + slack + 1e-6).all()


def test_boost_selects_largest_mean_magnitude():
    rng = np.random.default_rng(10)
    k = rng.normal(size=(G, 32)).astype(np.float32)
    big = [3, 17, 30, 8]
    k[:, big] *= np.array([40.0, 30.0, 20.0, 10.0])  # ranks 0..3 in this order
    page = quantize_key_page(jnp.asarray(k), 4)
    idx = np.asarray(page.boost_idx)
    assert idx[big].tolist() == [0, 1, 2, 3]
    assert (np.delete(idx, big) == 4).all()
    err = np.abs(np.asarray(dequantize_key_page(page)) - k).max(0)
    assert (err[big] / np.ptp(k[:, big], 0)).max() < 0.5 / 15 + 1e-3  # INT4 grid on boosted channels


def test_key_page_bit_layout():
    """Planar packing, bytes by hand. Channel 0 (INT2) holds code ``t // 32`` at token t: plane p
    of every byte (bits 2p) is tokens [32p, 32p + 32), so every byte is 0b11100100. Channel 1
    (boosted, INT4) holds code ``t // 8``: token i + 32p of byte i has code i // 8 + 4p, so the
    low bits of byte i are i // 8 in every plane and the high bits p."""
    t = np.arange(G)
    k = np.zeros((G, 4), np.float32)
    k[:, 0] = t // 32
    k[:, 1] = 100 * (t // 8)  # largest mean magnitude -> rank 0; scale 100
    page = quantize_key_page(jnp.asarray(k), 1)
    assert np.asarray(page.boost_idx).tolist() == [1, 0, 1, 1]
    low = np.asarray(page.low)
    assert (low[0] == 0b11100100).all()
    assert low[1].tolist() == [0b00000000] * 8 + [0b01010101] * 8 + [0b10101010] * 8 + [0b11111111] * 8
    assert (np.asarray(page.high)[0] == 0b11100100).all()
    assert (low[2:] == 0).all()  # constant channels: code 0
    np.testing.assert_allclose(np.asarray(dequantize_key_page(page)), k, atol=1e-4)
    v = np.zeros((G, 8), np.float32)
    v[:, :2], v[:, 2:4], v[:, 4:6], v[:, 6:] = 0.0, 1.0, 2.0, 3.0  # channel plane u = channels [2u, 2u + 2)
    vpage = quantize_value_page(jnp.asarray(v))
    assert (np.asarray(vpage.codes) == 0b11100100).all()
    np.testing.assert_allclose(np.asarray(dequantize_value_page(vpage)), v, atol=1e-4)


def test_key_page_edge_cases():
    zeros = quantize_key_page(jnp.zeros((G, 8)), 2)
    assert np.asarray(zeros.scale).astype(np.float32) == pytest.approx(np.float16(1e-6).astype(np.float32))
    assert (np.asarray(dequantize_key_page(zeros)) == 0).all()
    const = quantize_key_page(jnp.full((G, 8), -3.5), 2)  # zero range: floor scale, exact min
    np.testing.assert_array_equal(np.asarray(dequantize_key_page(const)), -3.5)
    batched = jax.random.normal(jax.random.key(0), (2, 3, G, 16))
    pages = quantize_key_page(batched, 4)  # leading dims are batch
    one = quantize_key_page(batched[1, 2], 4)
    for a, b in zip(jax.tree.leaves(pages), jax.tree.leaves(one)):
        np.testing.assert_array_equal(np.asarray(a)[1, 2], np.asarray(b))
    nan = quantize_key_page(jnp.full((G, 8), jnp.nan), 2)
    assert np.isnan(np.asarray(dequantize_key_page(nan))).all()


def test_page_argument_checks():
    with pytest.raises(ValueError, match="n_boost"):
        kitty.quantize_key_page(jnp.zeros((G, 8)), 9)
    with pytest.raises(ValueError, match="multiple of 4"):
        kitty.quantize_key_page(jnp.zeros((G + 2, 8)), 2)
    with pytest.raises(ValueError, match="tokens, head_dim"):
        kitty.quantize_key_page(jnp.zeros((G,)), 2)
    with pytest.raises(ValueError, match="head_dim 6"):
        kitty.quantize_value_page(jnp.zeros((G, 6)))
    with pytest.raises(ValueError, match="divisible by 4"):
        kvcache.get("kitty").init(ModelConfig("llama", 8, 8, 8, 1, 2, 1, 6), 1, 64)


@pytest.mark.parametrize("d, seed", [(32, 20), (64, 21), (8, 22)])
def test_value_page_matches_numpy(d, seed):
    rng = np.random.default_rng(seed)
    v = (rng.normal(size=(G, d)) * np.exp(rng.normal(size=(G, 1)))).astype(np.float16).astype(np.float32)
    page = quantize_value_page(jnp.asarray(v))
    want = np_value_page(v)
    assert page.codes.shape == (G, d // 4) and page.scale.shape == (G,)
    for field in ("codes", "scale", "min"):
        np.testing.assert_array_equal(np.asarray(getattr(page, field)), want[field], err_msg=field)
    deq = np.asarray(dequantize_value_page(page))
    np.testing.assert_allclose(deq, want["raw"] * want["scale"][:, None].astype(np.float64) + want["min"][:, None],
                               rtol=1e-6, atol=1e-6)
    step = want["scale"].astype(np.float64)[:, None]
    assert (np.abs(deq - v) <= 0.5 * step + 2.0**-10 * (np.abs(v).max(1, keepdims=True) + 3 * step) + 1e-6).all()


@pytest.mark.parametrize("name, seed", [("kitty-pro", 31)])
def test_decode_attention_error_within_quantization_bound(name, seed):
    """One decode step over 32 + 3 * 128 + 100 cached tokens against float64 attention on the
    unquantized keys and values. Bound: keys are off by at most half their channel's INT2 step
    per page (INT4 channels less), so each score by at most ``eps = scale * sum_d |q_d| *
    step_d / 2``; softmax weights then move by a factor within ``exp(+-2 eps)``, so the output
    is off by at most ``(exp(2 eps) - 1) max|v| + max |v - v_hat|`` (per-token value step / 2),
    plus FP16 rounding."""
    rng = np.random.default_rng(seed)
    h, kvh, d, n = 4, 2, 32, 32 + 3 * 128 + 100
    cfg = ModelConfig("llama", 16, 16, 16, 1, h, kvh, d)
    k = (rng.normal(size=(1, n, kvh, d)) * np.exp(rng.normal(size=(1, 1, kvh, d)))).astype(np.float32)
    v = rng.normal(size=(1, n, kvh, d)).astype(np.float32)
    q = rng.normal(size=(1, n, h, d)).astype(np.float32)
    layer = kvcache.get(name).init(cfg, 1, n).layers[0]
    pos = jnp.arange(n)[None]
    _, layer = attend(layer, q[:, :-1], k[:, :-1], v[:, :-1], pos[:, :-1], d**-0.5)
    out, _ = attend(layer, q[:, -1:], k[:, -1:], v[:, -1:], pos[:, -1:], d**-0.5)
    kk, vv, qq = k[0].astype(np.float64), v[0].astype(np.float64), q[0, -1].astype(np.float64)
    # Quantization steps from the data (INT2 everywhere: an upper bound), per page and channel.
    step_k = np.zeros_like(kk)
    for start in range(32, n - 100, 128):
        blk = kk[start: start + 128]
        step_k[start: start + 128] = (blk.max(0) - blk.min(0)) / 3
    step_k += 2.0**-10 * np.abs(kk) * 4  # FP16 storage and metadata rounding
    step_v = np.zeros_like(vv)
    quantized_v = slice(32, 32 + 2 * 128)  # value pages packed after a 128-token local window
    step_v[quantized_v] = (vv[quantized_v].max(-1, keepdims=True) - vv[quantized_v].min(-1, keepdims=True)) / 3
    step_v += 2.0**-10 * np.abs(vv) * 4
    for head in range(h):
        g = head // (h // kvh)
        s = kk[:, g] @ qq[head] * d**-0.5
        p = np.exp(s - s.max())
        p /= p.sum()
        exact = p @ vv[:, g]
        eps = d**-0.5 * (np.abs(qq[head]) * step_k[:, g] / 2).sum(-1).max()
        bound = (np.exp(2 * eps) - 1) * np.abs(vv[:, g]).max() + (step_v[:, g] / 2).max()
        err = np.abs(np.asarray(out)[0, 0, head] - exact).max()
        assert 0 < err <= bound, (head, err, bound)


def test_bytes_hand_computed():
    """Qwen3-8B-like: 8 KV heads, head_dim 128, kitty-pro boosts 32 channels."""
    cfg = ModelConfig("qwen3", 16, 16, 16, 2, 32, 8, 128)
    h, d = 8, 128
    n = 4096
    sink = 2 * 32 * h * d * 2  # keys and values, FP16
    key_ring = 127 * (h * d * 2 + 4)  # Q-buffer: 127 FP16 slots (the 128th is packed at once) + slot positions
    key_page = d * 32 + 32 * 32 + d + 2 * d * 2  # low plane, high plane, boost_idx, FP16 scale and min
    key_pages = (n - 32) // 128  # 31
    value_ring = 255 * (h * d * 2 + 4)  # local window 128 + value Q-buffer 127
    value_page = 128 * d // 4 + 2 * 128 * 2  # codes, FP16 scale and min per token
    value_pages = (n - 32 - 128) // 128  # 30
    want = sink + key_ring + key_pages * h * key_page + value_ring + value_pages * h * value_page
    fmt = kvcache.get("kitty-pro")
    assert fmt.bytes_for(cfg, n) == want == 3_449_336
    assert fmt.bytes_per_token(cfg) == want / n
    # 2.5 bits per key element: the page codes alone take (2 + 2 * 32 / 128) / 8 bytes per element.
    assert (d * 32 + 32 * 32) / (128 * d) == 2.5 / 8
    cache = fmt.init(cfg, 3, n)
    assert cache.nbytes == 3 * 2 * want
    plain = kvcache.get("kitty")  # 16 boosted channels
    assert fmt.bytes_for(cfg, n) - plain.bytes_for(cfg, n) == key_pages * h * 16 * 32
