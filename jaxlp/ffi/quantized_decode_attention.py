"""Decode attention over the packed units of Kitty and 2- / 4-bit KIVI caches, as a CUDA kernel (sm_90).

    out, m, l = attend_units(q, k_store, v_store, k_codec, v_codec, lo, hi, scale=..., softcap=None)

Same contract as :func:`jaxlp.pallas.quantized_decode_attention.attend_units` (its
:func:`~jaxlp.pallas.quantized_decode_attention.reference` is this kernel's reference too):
``q [B, H, D]`` against the non-sink stream indices ``[lo[b], hi[b])`` whose keys and values are
both held quantized; ``out [B, H, D]`` float32 normalized by ``l``, ``m [B, H]`` the max scaled
(soft-capped) score, ``l [B, H] = sum exp(s - m)``.

Layouts read (the kernel's block is 128 tokens; bit packing planar as in :mod:`jaxlp.kvcache.quant`):

* keys, channel-major codes per 128-token block: Kitty pages (2-bit ``low [D, 32]``, the boosted
  channels' ``high [n_boost, 32]`` rows addressed by ``boost_idx [D]``, FP16 ``scale, min [D]``)
  and KIVI key blocks of 2 or 4 bits (``codes [D, 16 bits]``, FP16 ``scale, min [4, D]``, one per
  32-token group: 2-bit plane ``t`` = tokens ``[32 t, 32 t + 32)``, 4-bit low / high nibble =
  tokens ``[0, 64)`` / ``[64, 128)``);
* values, token-major codes per token: Kitty pages of 128 tokens (2-bit ``[D/4]``, FP16 ``scale,
  min`` per token) and KIVI value tokens of 2 or 4 bits (``[D bits / 8]``; FP16 ``scale, min`` per
  token and group of channels: a multiple of ``8 bits`` channels, :func:`layout`).

    out, m, l = attend_cache(q, k_store, v_store, k_codec, v_codec, bounds, rings, sinks, new, ...)

The whole one-token step of a cache in one kernel (:func:`attend_cache`): the stream range runs
to the row's last token, whose newest keys and values the kernel reads from the FP16 rings where
they hold them (else their units, as the cache's reference view does), and one more block holds
the FP16 sink and the new token.

Design (``quantized_decode_attention.cu``), two paths in one launch, both flash-decoding with
``mma.sync`` (FP32 softmax):

* packed (head_dim 128, <= 8 query heads per KV head, 2-bit codes: Kitty pages with 16 or 32
  boosted channels and KIVI-2 with value groups of 32 channels, :func:`packed_reads`; taken
  wherever it reads unless ``packed=False``): each warp walks its own fully packed blocks, copied
  by ``cp.async``, and feeds the 2-bit codes straight from the packed words to 8-bit integer MMAs
  (m16n8k32, exact int32 sums): ``Q * key scale`` and ``P * value scale`` as 16-bit fixed point
  split into high and low bytes (the MMA's rows ``g`` and ``g + 8``), the codes as bytes, one LOP3
  per 4 codes; about ``2e-4`` relative of the float32 reference. KIVI-2's key scale group ``t``
  (32 tokens) is plane ``t`` of the key codes and its value channel group ``u`` (32 channels)
  plane ``u`` of the value codes: a block takes four ``Q * key scale`` fixed-point sets (one range
  over the four, each its own ``q . min``), four ``P * value scale`` sets and four ``P . value min``
  sums, one per plane;
* staged (other layouts, 4-bit KIVI keys or values among them, other head dims, more than 8
  query heads per KV head, and a whole-cache call's blocks holding FP16 ring tokens or the sink):
  one CTA unpacks each block into shared memory as FP16 (``code * scale + min`` by HFMA2; never to
  global memory), copies the ring tokens over it, and reads it with ``ldmatrix``, FP16 m16n8k16
  MMAs with the query heads as the 16 rows; within about ``1e-3`` of the reference.

Splits along the sequence are merged in float32 by a second launch of the same call
(``split_merge.cuh``: one kernel instead of XLA's two or three fusions of
:func:`jaxlp.attention.reference.merge_splits`, the reference it follows).

The library is compiled by ``nvcc`` on first use (:mod:`jaxlp.ffi.build`).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jaxlp.ffi import build

TARGET = "jaxlp_quantized_decode_attention"
LIBRARY = build.Library("quantized_decode_attention", {TARGET: "JaxlpQuantizedDecodeAttention"})
BLOCK = 128  # tokens per block: a Kitty page, a KIVI key block
HEAD_DIMS = (64, 128, 256)
MAX_GROUP = 16  # query heads per KV head (the mma's 16 rows)
CTAS_PER_SM = 3  # what the staged path's shared memory allows at head_dim 128
PACKED_CTAS_PER_SM = 2  # the packed path: two resident per SM (its registers and shared memory), one wave
# The split merge takes a warp per (row, query) up to this many splits (split_merge.cuh's
# split_merge_queries_kernel), else 8 warps per (row, query): 0 (always the latter) until measured.
QUERY_MERGE_SPLITS = 0
MIN_BLOCKS = 8  # packed path, a grid past one wave: the fewest blocks per packed CTA (two per warp)
GENERAL_SPLITS = 4  # whole-cache calls: the staged splits that take the ring and tail blocks (one block each)


@dataclasses.dataclass(frozen=True)
class Layout:
    """What the kernel reads of a pair of codecs (see :func:`layout`)."""

    n_boost: int  # Kitty's boosted key channels (0: KIVI)
    key_groups: int  # key scale groups per 128-token block: 1 (Kitty) or 4 (KIVI, 32 tokens each)
    value_tokens: int  # tokens per value unit: 128 (Kitty pages) or 1 (KIVI)
    value_group: int  # channels per value scale
    key_bits: int = 2  # bits per key code: 2, or 4 (KIVI)
    value_bits: int = 2  # bits per value code: 2, or 4 (KIVI)


def layout(k_codec, v_codec, head_dim: int, group: int) -> Layout:
    """The kernel's reading of these codecs at ``head_dim`` with ``group`` query heads per KV head;
    ValueError naming what is not supported."""
    if head_dim not in HEAD_DIMS:
        raise ValueError(f"the CUDA quantized-cache attention kernel takes head_dim {HEAD_DIMS}, got {head_dim}")
    if not 1 <= group <= MAX_GROUP:
        raise ValueError(f"the CUDA quantized-cache attention kernel takes 1 to {MAX_GROUP} query heads per KV "
                         f"head, got {group}")
    k_layout, v_layout = getattr(k_codec, "layout", ""), getattr(v_codec, "layout", "")
    if k_layout == "kitty_keys" and k_codec.unit == BLOCK:
        n_boost, key_groups, key_bits = k_codec.n_boost, 1, 2
    elif k_layout == "kivi_keys" and k_codec.unit == BLOCK and k_codec.bits in (2, 4) and k_codec.group == 32:
        n_boost, key_groups, key_bits = 0, 4, k_codec.bits
    else:
        raise ValueError(f"the CUDA quantized-cache attention kernel reads Kitty pages and 2- or 4-bit KIVI key "
                         f"blocks (128 tokens, groups of 32), not {k_codec!r}")
    if v_layout == "kitty_values" and v_codec.unit == BLOCK:
        value_tokens, value_group, value_bits = BLOCK, head_dim, 2
    elif v_layout == "kivi_values" and v_codec.unit == 1 and v_codec.bits in (2, 4):
        # A thread's share of a token row, 8 bits bytes (one 16-byte piece at 2 bits, two at 4),
        # holds 8 bits consecutive channels of each plane: it takes one scale per plane where the
        # groups are a multiple of 8 bits channels (16 at 2 bits, 32 at 4).
        value_tokens, value_group, value_bits = 1, v_codec.group, v_codec.bits
        if head_dim % value_group or value_group % (8 * value_bits):
            raise ValueError(f"the CUDA quantized-cache attention kernel reads {value_bits}-bit KIVI values in "
                             f"groups of a multiple of {8 * value_bits} channels dividing head_dim (a thread's "
                             f"{8 * value_bits} channels of a plane take one scale), not groups of {value_group} "
                             f"at head_dim {head_dim} ({v_codec!r})")
    else:
        raise ValueError(f"the CUDA quantized-cache attention kernel reads Kitty value pages and 2- or 4-bit KIVI "
                         f"values, not {v_codec!r}")
    return Layout(n_boost, key_groups, value_tokens, value_group, key_bits, value_bits)


def supports(k_codec, v_codec, head_dim: int, group: int) -> bool:
    """Whether :func:`attend_units` reads these codecs (:func:`layout` without raising)."""
    try:
        layout(k_codec, v_codec, head_dim, group)
    except ValueError:
        return False
    return True


def available() -> bool:
    """True when JAX runs on a GPU and the kernel builds and loads (never raises)."""
    return LIBRARY.available()


def default_splits(batch: int, kv_heads: int, blocks: int, num_sms: int = 132) -> int:
    """Splits along the sequence: at most :data:`CTAS_PER_SM` CTAs per SM (one wave, no tail wave),
    and no more than a row of ``blocks`` blocks fills at ``ceil(blocks / splits)`` blocks each (no
    empty split to launch and merge)."""
    most = max(1, min(CTAS_PER_SM * num_sms // (batch * kv_heads), blocks))
    per = -(-blocks // most)
    return max(1, -(-blocks // per))


def packed_reads(lay: Layout, head_dim: int, group: int) -> bool:
    """Whether the packed path (no shared-memory FP16 tile, integer MMAs; the .cu file's ``packed``
    namespace) reads this layout: head_dim 128, at most 8 query heads per KV head, 2-bit codes (a
    4-bit KIVI key or value stream takes the staged path), and either Kitty pages (keys with 16 or
    32 boosted channels, value pages) or KIVI-2 (key blocks of four 32-token scale groups, value
    tokens with groups of 32 channels: one scale group per 2-bit plane). ``packed=None`` takes it
    wherever it reads."""
    if head_dim != 128 or group > 8 or lay.key_bits != 2 or lay.value_bits != 2:
        return False
    kitty = lay.key_groups == 1 and lay.n_boost in (16, 32) and lay.value_tokens == BLOCK
    kivi = lay.key_groups == 4 and lay.n_boost == 0 and lay.value_tokens == 1 and lay.value_group == 32
    return kitty or kivi


def packed_splits(batch: int, kv_heads: int, blocks: int, num_sms: int = 132) -> int:
    """Splits of the packed path: about :data:`PACKED_CTAS_PER_SM` CTAs per SM, at least one block
    per warp (4 warps), no empty split."""
    most = max(1, min(PACKED_CTAS_PER_SM * num_sms // (batch * kv_heads), -(-blocks // 4)))
    per = -(-blocks // most)
    return max(1, -(-blocks // per))


def default_staged_splits(batch: int, kv_heads: int, num_sms: int = 132) -> int:
    """Staged CTAs per (row, KV head) of a whole-cache call on the packed path: :data:`GENERAL_SPLITS`
    (a block each: the ring's one or two blocks, the tail block) while the packed CTAs leave room
    for them, one (the blocks in turn) once ``batch x kv_heads`` fills over half the GPU's resident
    packed CTAs (:func:`packed_splits` gives one), where thousands of one-block CTAs would queue in
    waves behind them."""
    return 1 if 2 * batch * kv_heads > PACKED_CTAS_PER_SM * num_sms else GENERAL_SPLITS


def default_min_blocks(batch: int, kv_heads: int, splits: int, num_sms: int = 132) -> int:
    """The fewest blocks a packed CTA takes of its row (the kernel's ``min_per``; a row's packed
    splits past its blocks exit at once). 1 while the grid's ``batch x kv_heads x splits`` CTAs are
    resident together (:data:`PACKED_CTAS_PER_SM` per SM): every split runs beside the others.
    Past that, :data:`MIN_BLOCKS` (two blocks per warp): the packed splits are sized by the
    allocated length, and a shorter row's surplus ones then exit and leave their slots to the
    staged CTAs queued behind them."""
    return 1 if batch * kv_heads * splits <= PACKED_CTAS_PER_SM * num_sms else MIN_BLOCKS


def attend_units(q, k_store, v_store, k_codec, v_codec, lo, hi, *, scale: float, softcap: float | None = None,
                 splits: int | None = None, packed: bool | None = None, min_blocks: int | None = None,
                 query_merge_splits: int = QUERY_MERGE_SPLITS):
    """Attention of ``q [B, H, D]`` over the quantized stream indices ``[lo, hi)`` of each row:
    ``(out [B, H, D] float32 normalized, m [B, H], l [B, H])`` (module doc). ``hi`` must not pass
    the quantized tokens of either store. ``packed``: the packed path (True; ValueError where
    :func:`packed_reads` says no), the staged one (False), or the packed one where it reads (None);
    ``splits``: the path's splits along the sequence (default: one wave); ``min_blocks``: the packed
    path's fewest blocks per CTA (default :func:`default_min_blocks`); ``query_merge_splits``: the
    split merge takes a warp per (row, query) up to this many splits (at most 32; 0: never)."""
    b, h, d = q.shape
    kvh = jax.tree.leaves(k_store)[0].shape[2]
    lo, hi = lo.astype(jnp.int32), hi.astype(jnp.int32)
    zero = jnp.zeros_like(lo)
    bounds = jnp.stack([lo, hi, hi, hi, zero, zero, zero, zero], axis=1)
    ring = jnp.zeros((b, 0, kvh, d), jnp.float16), jnp.zeros((b, 0), jnp.int32)
    new = jnp.zeros((b, kvh, d), jnp.float16)
    return _call(q, k_store, v_store, k_codec, v_codec, bounds, ring, ring, (ring[0], ring[0]), (new, new),
                 tail=False, scale=scale, softcap=softcap, splits=splits, packed=packed, min_blocks=min_blocks,
                 query_merge_splits=query_merge_splits)


def attend_cache(q, k_store, v_store, k_codec, v_codec, bounds, k_ring, v_ring, sink, new, *, scale: float,
                 softcap: float | None = None, splits: int | None = None, packed: bool | None = None,
                 staged_splits: int | None = None, min_blocks: int | None = None,
                 query_merge_splits: int = QUERY_MERGE_SPLITS):
    """One query per row ``q [B, H, D]`` over a whole quantized cache (module doc):
    ``bounds [B, 8]`` int32 per row: the stream range ``lo, hi`` (hi: the row's non-sink tokens),
    ``qk, qv`` (its quantized keys and values), the visible sink tokens ``[sink_lo, sink_hi)``,
    ``new_ok`` (the new token is seen), 0; ``k_ring, v_ring``: ``(ring [B, R, KVH, D], slot
    positions [B, R])``; ``sink``: keys and values ``[B, OFF, KVH, D]`` (OFF < 128); ``new``: the new
    token's key and value ``[B, KVH, D]``. Rings, sink and new token go to the kernel as FP16
    (clipped to its range). ``staged_splits``: the staged CTAs per (row, KV head) that take the
    ring and tail blocks beside the packed ones (default :func:`default_staged_splits`; the packed
    path only, ValueError off it); ``min_blocks``, ``query_merge_splits``: as :func:`attend_units`'s.
    Returns ``(out [B, H, D] float32 normalized, m, l)``."""
    if sink[0].shape[1] >= BLOCK:
        raise ValueError(f"attend_cache: the sink and the new token must fit one {BLOCK}-token block, "
                         f"got a sink of {sink[0].shape[1]}")
    k_ring = fp16_clipped(k_ring[0]), k_ring[1].astype(jnp.int32)
    v_ring = fp16_clipped(v_ring[0]), v_ring[1].astype(jnp.int32)
    return _call(q, k_store, v_store, k_codec, v_codec, bounds.astype(jnp.int32), k_ring, v_ring,
                 tuple(map(fp16_clipped, sink)), tuple(map(fp16_clipped, new)), tail=True, scale=scale,
                 softcap=softcap, splits=splits, packed=packed, staged_splits=staged_splits,
                 min_blocks=min_blocks, query_merge_splits=query_merge_splits)


def split_outputs(b: int, kvh: int, splits: int, g: int, d: int) -> tuple:
    """The results of a flash-decoding call whose handler merges its splits (``split_merge.cuh``):
    the partials ``o [B, KVH, S, G, D], m, l [B, KVH, S, G]`` (the merge's input, unused after),
    then the merged ``out [B, KVH, G, D], m, l [B, KVH, G]``, all float32."""
    f32 = jnp.float32
    return (jax.ShapeDtypeStruct((b, kvh, splits, g, d), f32), jax.ShapeDtypeStruct((b, kvh, splits, g), f32),
            jax.ShapeDtypeStruct((b, kvh, splits, g), f32), jax.ShapeDtypeStruct((b, kvh, g, d), f32),
            jax.ShapeDtypeStruct((b, kvh, g), f32), jax.ShapeDtypeStruct((b, kvh, g), f32))


def fp16_clipped(x):
    """``x`` as FP16, clipped to its range (no inf from a large BF16 / float32 number)."""
    if x.dtype == jnp.float16:
        return x
    fmax = float(jnp.finfo(jnp.float16).max)
    return jnp.clip(x.astype(jnp.float32), -fmax, fmax).astype(jnp.float16)


def _call(q, k_store, v_store, k_codec, v_codec, bounds, k_ring, v_ring, sink, new, *, tail, scale, softcap, splits,
          packed, staged_splits=None, min_blocks=None, query_merge_splits=QUERY_MERGE_SPLITS):
    b, h, d = q.shape
    kleaves = jax.tree.leaves(k_store)
    kvh = kleaves[0].shape[2]
    if h % kvh:
        raise ValueError(f"attend_units: {h} query heads are not a multiple of {kvh} KV heads")
    g = h // kvh
    lay = layout(k_codec, v_codec, d, g)
    if lay.n_boost:
        k_low, k_high, k_boost, k_scale, k_min = k_store.low, k_store.high, k_store.boost_idx, k_store.scale, k_store.min
    else:
        k_low, k_scale, k_min = k_store.codes, k_store.scale, k_store.min
        k_high = k_boost = jnp.zeros((1,), jnp.uint8)
    v_codes = v_store.codes
    k_row, v_row = BLOCK * lay.key_bits // 8, d * lay.value_bits // 8  # bytes per key channel / value token
    if lay.value_tokens == 1:  # [B, T, KVH, 1, D bits / 8]: one-token units
        v_codes = v_codes.reshape(v_codes.shape[:3] + (1, v_codes.shape[-1]))
    for name, x, shape in (("key codes", k_low, (b, k_low.shape[1], kvh, d, k_row)),
                           ("value codes", v_codes, (b, v_codes.shape[1], kvh, lay.value_tokens, v_row))):
        if x.shape != shape or x.dtype != jnp.uint8:
            raise ValueError(f"attend_units: {name} must be uint8 {shape}, got {x.dtype} {x.shape}")
    if packed and not packed_reads(lay, d, g):
        raise ValueError(f"attend_units: the packed path does not read {lay} at head_dim {d} with {g} query heads "
                         f"per KV head (packed_reads: head_dim 128, <= 8 query heads per KV head, 2-bit codes of "
                         f"Kitty pages with 16 or 32 boosted channels or KIVI-2 with value groups of 32)")
    on_packed = packed_reads(lay, d, g) if packed is None else packed
    if staged_splits is not None and (staged_splits < 1 or not on_packed):
        raise ValueError(f"attend_cache: staged_splits must be >= 1 and takes the packed path (packed_reads), got "
                         f"{staged_splits} with the {'packed' if on_packed else 'staged'} path")
    if min_blocks is not None and min_blocks < 1:
        raise ValueError(f"attend_units: min_blocks must be >= 1, got {min_blocks}")
    if not 0 <= query_merge_splits <= 32:
        raise ValueError(f"attend_units: query_merge_splits must be in [0, 32], got {query_merge_splits}")
    if on_packed:  # the staged path: ring and tail blocks only
        splits = splits or packed_splits(b, kvh, k_low.shape[1])
        general = (staged_splits or default_staged_splits(b, kvh)) if tail else 0
        splits += general
    else:
        blocks = k_low.shape[1] + (-(-max(k_ring[0].shape[1], v_ring[0].shape[1]) // BLOCK) + 1 if tail else 0)
        splits = general = splits or default_splits(b, kvh, blocks)
    if build.on_gpu():
        LIBRARY.load()
    qg = q.astype(jnp.float32).reshape(b, kvh, g, d) * jnp.float32(scale)
    call = jax.ffi.ffi_call(TARGET, split_outputs(b, kvh, splits, g, d))
    half = lambda x: x.astype(jnp.float16)  # noqa: E731
    *_, out, m_all, den = call(qg, bounds, k_low, k_high, k_boost, half(k_scale), half(k_min), v_codes,
                               half(v_store.scale), half(v_store.min), *k_ring, *v_ring, *sink, *new,
                               nb=np.int64(lay.n_boost), kg=np.int64(lay.key_groups), vt=np.int64(lay.value_tokens),
                               v_group=np.int64(lay.value_group), kbits=np.int64(lay.key_bits),
                               vbits=np.int64(lay.value_bits), tail=np.int64(tail), gsplits=np.int64(general),
                               min_per=np.int64(min_blocks or default_min_blocks(b, kvh, splits)),
                               few_splits=np.int64(query_merge_splits),
                               softcap=np.float32(softcap or 0.0))
    return out.reshape(b, h, d), m_all.reshape(b, h), den.reshape(b, h)
