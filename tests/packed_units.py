"""Shared by the packed-unit decode-attention tests (Pallas and CUDA): the codecs under test,
float64 NumPy decoding of the planar layouts (independent of the codecs' decode), exact
attention over them, and random caches encoded by the real codecs."""

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxlp.kvcache import fireq, kitty, kivi

CODECS = {
    "kitty": (kitty.KeyCodec(8), kitty.ValueCodec()),  # 12.5% of 64 channels boosted
    "kitty-pro": (kitty.KeyCodec(16), kitty.ValueCodec()),  # 25%
    "kivi-k2v2": (kivi.KeyCodec(2), kivi.ValueCodec(2)),
    "kivi-k4v4": (kivi.KeyCodec(4), kivi.ValueCodec(4)),
    "kivi-k2v4": (kivi.KeyCodec(2), kivi.ValueCodec(4)),
    "kivi-k4v2": (kivi.KeyCodec(4), kivi.ValueCodec(2)),
    "fireq": (fireq.TokenCodec(), fireq.TokenCodec()),
}


# --- float64 NumPy decoding of the planar layout (independent of the codecs' decode) ------------


def np_unpack(packed, bits):
    """Planar: plane t of byte i is element t * M + i of the row (M bytes per row)."""
    x = np.asarray(packed).astype(np.int64)
    planes = [(x >> (t * bits)) & (2**bits - 1) for t in range(8 // bits)]
    return np.concatenate(planes, axis=-1)


def f64(a):
    return np.asarray(jnp.asarray(a).astype(jnp.float32), np.float64)


def np_decode(codec, store):
    """[B, U, KVH, ...] units -> [B, N, KVH, D] float64."""
    if isinstance(codec, kitty.KeyCodec):
        low = np_unpack(store.low, 2)  # [B, U, KVH, D, 128]
        code = low.copy()
        if codec.n_boost:
            high = np_unpack(store.high, 2)  # [B, U, KVH, nb, 128]
            idx = np.asarray(store.boost_idx).astype(np.int64)  # [B, U, KVH, D]
            boosted = idx < codec.n_boost
            rows = np.broadcast_to(np.minimum(idx, codec.n_boost - 1)[..., None], low.shape)
            picked = np.take_along_axis(high, rows, axis=-2)  # [B, U, KVH, D, 128]: channel's high bits
            code = code + np.where(boosted[..., None], picked, 0) * 4
        x = code * f64(store.scale)[..., None] + f64(store.min)[..., None]  # [B, U, KVH, D, 128]
        x = np.swapaxes(x, -1, -2)
    elif isinstance(codec, kitty.ValueCodec):
        x = np_unpack(store.codes, 2) * f64(store.scale)[..., None] + f64(store.min)[..., None]
    elif isinstance(codec, kivi.KeyCodec):
        code = np.swapaxes(np_unpack(store.codes, codec.bits), -1, -2)  # [B, U, KVH, 128, D]
        group = np.arange(128) // 32
        x = code * f64(store.scale)[..., group, :] + f64(store.min)[..., group, :]
    elif isinstance(codec, kivi.ValueCodec):
        code = np_unpack(store.codes, codec.bits)  # [B, T, KVH, 1, D]
        group = np.arange(code.shape[-1]) // codec.group
        x = code * f64(store.scale)[..., group] + f64(store.min)[..., group]
    elif isinstance(codec, fireq.TokenCodec):
        code = np_unpack(store.codes, 4)
        code = np.where(code >= 8, code - 16, code)
        x = code * f64(store.scale)[..., None]
    else:
        raise TypeError(codec)
    b, u, kvh, t, d = x.shape
    return np.moveaxis(x, 3, 2).reshape(b, u * t, kvh, d)


def exact(q, k, v, lo, hi, scale, softcap=None):
    """float64 (out, m, l) of each row over [lo, hi) of the decoded k, v [B, N, KVH, D]."""
    q = np.asarray(q, np.float64)
    b, h, d = q.shape
    g = h // k.shape[2]
    out, m, l = np.zeros((b, h, d)), np.full((b, h), -np.inf), np.zeros((b, h))
    for r in range(b):
        a, z = int(lo[r]), int(hi[r])
        if z <= a:
            continue
        for head in range(h):
            s = k[r, a:z, head // g] @ q[r, head] * scale
            if softcap is not None:
                s = np.tanh(s / softcap) * softcap
            m[r, head] = s.max()
            p = np.exp(s - s.max())
            l[r, head] = p.sum()
            out[r, head] = p @ v[r, a:z, head // g] / p.sum()
    return out, m, l


# --- inputs built by the real codecs ------------------------------------------------------------


@functools.cache
def _encoder(codec):
    return jax.jit(codec.encode)


def stores(codec_pair, k, v):
    """Encode k, v [B, N, KVH, D] (N a multiple of 128) into unit stores [B, U, KVH, ...]."""
    out = []
    for codec, x in zip(codec_pair, (k, v)):
        b, n, kvh, d = x.shape
        units = np.moveaxis(np.asarray(x, np.float32).reshape(b, n // codec.unit, codec.unit, kvh, d), 2, 3)
        out.append(_encoder(codec)(jnp.asarray(units)))
    return out


def random_kv(seed, b, n, kvh, d):
    """Keys with channels of very different magnitudes and offsets (FP16 values, as the cache
    holds them), values per token of different magnitudes."""
    rng = np.random.default_rng(seed)
    k = rng.normal(size=(b, n, kvh, d)) * np.exp(rng.normal(size=(1, 1, kvh, d))) + rng.normal(size=(1, 1, kvh, d))
    v = rng.normal(size=(b, n, kvh, d)) * np.exp(0.5 * rng.normal(size=(b, n, kvh, 1)))
    return k.astype(np.float16).astype(np.float32), v.astype(np.float16).astype(np.float32)


def rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))
