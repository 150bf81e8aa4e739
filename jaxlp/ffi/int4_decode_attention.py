"""Decode attention over per-token INT4 KV units (FireQ's cache), as a CUDA kernel (sm_90).

    out, m, l = attend_units(q, k_store, v_store, k_codec, v_codec, lo, hi, scale=..., softcap=None,
                             new=(k, v, ok), query_scaling=None)

Same contract as :func:`jaxlp.pallas.quantized_decode_attention.attend_units` (its
:func:`~jaxlp.pallas.quantized_decode_attention.reference` is this kernel's reference too):
``q [B, H, D]`` (as the cache attends it, or as the model gives it with ``query_scaling``, a
:class:`jaxlp.kvcache.quantized.QueryScaling`: FireQ's ``q / k_scale`` through FP8, done in the
kernel) against the stream
indices ``[lo[b], hi[b])`` of per-token INT4 units (:class:`jaxlp.kvcache.fireq.Int4Tokens`: codes
``[B, T, KVH, 1, D/2]``, signed nibbles, channel ``i`` low and ``i + D/2`` high; one FP8 E4M3 scale
per token); ``out [B, H, D]`` float32 normalized by ``l``, ``m [B, H]`` the max scaled (soft-capped)
score, ``l [B, H] = sum exp(s - m)``. ``new = (k, v, ok)``: the new token's key and value ``[B, KVH,
D]`` (as FP16), attended where ``ok [B]``: with it, the call is a whole FireQ decode step (no sink,
no full-precision ring).

Design (``int4_decode_attention.cu``): flash-decoding, one CTA of 4 warps per (KV head, row, split);
a warp takes 32 tokens at a time, loads their codes straight into registers, converts them to FP16
exactly (one LOP3 per two codes and an HSUB2 / HFMA2) and runs S = Q K^T and O += (P * value scale) V
on ``mma.sync`` m16n8k16 (the query heads of the KV head as the 16 rows, FP32 accumulators; the
token's key scale multiplies its scores). Queries and ``P * value scale`` enter as FP16: about
``1e-4`` relative of the float64 result. Splits are merged in float32 by a second launch of the
same call (``split_merge.cuh``, following :func:`jaxlp.attention.reference.merge_splits`). Head dims
64 and 128, 1..16 query heads per KV head.

The library is compiled by ``nvcc`` on first use (:mod:`jaxlp.ffi.build`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxlp.ffi import build
from jaxlp.ffi.quantized_decode_attention import fp16_clipped, split_outputs

TARGET = "jaxlp_int4_decode_attention"
LIBRARY = build.Library("int4_decode_attention", {TARGET: "JaxlpInt4DecodeAttention"})
HEAD_DIMS = (64, 128)
MAX_GROUP = 16  # query heads per KV head (the mma's 16 rows)
CHUNK = 128  # tokens a CTA's 4 warps take per round (32 each)
CTAS_PER_SM = 2  # resident at head_dim 128 (194 registers a thread, 41.5 KB of shared memory)


def check(k_codec, v_codec, head_dim: int, group: int) -> None:
    """ValueError naming what the kernel does not read: it takes per-token INT4 keys and values
    (:class:`jaxlp.kvcache.fireq.TokenCodec`) at head_dim 64 or 128 with 1..16 query heads per KV head."""
    for what, codec in (("keys", k_codec), ("values", v_codec)):
        if getattr(codec, "layout", "") != "int4_tokens" or codec.unit != 1:
            raise ValueError(f"the CUDA INT4 decode-attention kernel reads per-token INT4 {what} (FireQ), not {codec!r}")
    if head_dim not in HEAD_DIMS:
        raise ValueError(f"the CUDA INT4 decode-attention kernel takes head_dim {HEAD_DIMS}, got {head_dim}")
    if not 1 <= group <= MAX_GROUP:
        raise ValueError(f"the CUDA INT4 decode-attention kernel takes 1 to {MAX_GROUP} query heads per KV head, "
                         f"got {group}")


def supports(k_codec, v_codec, head_dim: int, group: int) -> bool:
    """Whether :func:`attend_units` reads these codecs (:func:`check` without raising)."""
    try:
        check(k_codec, v_codec, head_dim, group)
    except ValueError:
        return False
    return True


def available() -> bool:
    """True when JAX runs on a GPU and the kernel builds and loads (never raises)."""
    return LIBRARY.available()


def default_splits(batch: int, kv_heads: int, tokens: int, num_sms: int = 132) -> int:
    """Splits along the sequence: one wave of :data:`CTAS_PER_SM` CTAs per SM, at least
    :data:`CHUNK` tokens per split (a round of its 4 warps), no empty split."""
    most = max(1, min(CTAS_PER_SM * num_sms // max(batch * kv_heads, 1), -(-tokens // CHUNK)))
    per = -(-tokens // most)
    return max(1, -(-tokens // per))


def attend_units(q, k_store, v_store, k_codec, v_codec, lo, hi, *, scale: float, softcap: float | None = None,
                 new=None, splits: int | None = None, query_scaling=None):
    """Attention of ``q [B, H, D]`` over the INT4 units ``[lo, hi)`` of each row, plus the new token
    ``new = (k, v, ok)`` where given (module doc): ``(out [B, H, D] float32 normalized, m [B, H], l
    [B, H])``. ``splits``: along the sequence (default :func:`default_splits`). ``query_scaling``
    (``channel_scales [KVH, D]``, ``fp8``): the queries are divided by the channel scales and, with
    ``fp8``, taken through FP8 per query head inside the kernel (as ``query_scaling(q)`` would)."""
    b, h, d = q.shape
    codes = k_store.codes
    if codes.ndim != 5 or codes.shape[0] != b or codes.shape[3] != 1:
        raise ValueError(f"attend_units: INT4 key codes must be [B={b}, T, KVH, 1, D/2], got {codes.shape}")
    kvh, tokens = codes.shape[2], codes.shape[1]
    if h % kvh:
        raise ValueError(f"attend_units: {h} query heads are not a multiple of {kvh} KV heads")
    g = h // kvh
    check(k_codec, v_codec, d, g)
    for name, st in (("key", k_store), ("value", v_store)):
        if st.codes.shape != (b, tokens, kvh, 1, d // 2) or st.codes.dtype != jnp.uint8:
            raise ValueError(f"attend_units: {name} codes must be uint8 {(b, tokens, kvh, 1, d // 2)}, got "
                             f"{st.codes.dtype} {st.codes.shape}")
        if st.scale.shape != (b, tokens, kvh, 1) or st.scale.dtype != jnp.float8_e4m3fn:
            raise ValueError(f"attend_units: {name} scales must be float8_e4m3fn {(b, tokens, kvh, 1)}, got "
                             f"{st.scale.dtype} {st.scale.shape}")
    if new is None:
        zeros = jnp.zeros((b, kvh, d), jnp.float16)
        new = (zeros, zeros, jnp.zeros((b,), bool))
    new_k, new_v, new_ok = new
    for name, x in (("key", new_k), ("value", new_v)):
        if x.shape != (b, kvh, d):
            raise ValueError(f"attend_units: the new {name} must be [B, KVH, D] = {(b, kvh, d)}, got {x.shape}")
    splits = default_splits(b, kvh, tokens) if splits is None else splits
    if splits < 1:
        raise ValueError(f"attend_units: splits must be >= 1, got {splits}")
    if build.on_gpu():
        LIBRARY.load()
    bounds = jnp.stack([lo.astype(jnp.int32), hi.astype(jnp.int32), jnp.asarray(new_ok).astype(jnp.int32),
                        jnp.zeros((b,), jnp.int32)], axis=1)
    if query_scaling is None:
        channel_scales, fp8 = jnp.ones((kvh, d), jnp.float32), False
    else:
        channel_scales, fp8 = query_scaling.channel_scales.astype(jnp.float32), query_scaling.fp8
        if channel_scales.shape != (kvh, d):
            raise ValueError(f"attend_units: query channel scales must be [KVH, D] = {(kvh, d)}, got "
                             f"{channel_scales.shape}")
    call = jax.ffi.ffi_call(TARGET, split_outputs(b, kvh, splits, g, d))
    as_u8 = lambda x: jax.lax.bitcast_convert_type(x, jnp.uint8)  # noqa: E731
    flat = lambda st: st.codes.reshape(b, tokens, kvh, d // 2)  # noqa: E731
    *_, out, m_all, den = call(q.astype(jnp.float32).reshape(b, kvh, g, d), channel_scales, bounds,
                               flat(k_store), as_u8(k_store.scale[..., 0]), flat(v_store),
                               as_u8(v_store.scale[..., 0]), fp16_clipped(new_k), fp16_clipped(new_v),
                               scale=np.float32(scale), softcap=np.float32(softcap or 0.0), fp8_queries=np.int32(fp8))
    return out.reshape(b, h, d), m_all.reshape(b, h), den.reshape(b, h)

