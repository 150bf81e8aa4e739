"""Decode attention over the packed units of a quantized KV cache (Kitty, KIVI, FireQ), in Pallas (Triton).

    out, m, l = attend_units(q, k_store, v_store, k_codec, v_codec, lo, hi, scale=..., softcap=None)

The bulk of a decode step of :class:`jaxlp.kvcache.quantized.QuantizedLayerCache`: query
``q [B, H, D]`` (as the cache attends it, e.g. FireQ's ``q / k_scale`` through FP8) against the
non-sink stream indices ``j`` in ``[lo[b], hi[b])`` whose keys *and* values are held quantized,
read straight from the packed units; the dequantized cache is never built. The caller (the
sink, the full-precision ring, the new token) merges the result: ``out [B, H, D]`` float32 is
normalized by ``l``, ``m [B, H]`` is the row max of the scaled (soft-capped) scores and
``l [B, H] = sum exp(s - m)``; an empty range gives ``out = 0, m = -inf, l = 0``.

Layout read (unit pytrees with leaves ``[B, U, KVH, ...]``; bit packing is planar, see
:mod:`jaxlp.kvcache.quant`: plane ``t`` of a byte row is a run of contiguous elements):

* Kitty keys (:class:`jaxlp.kvcache.kitty.KeyPage`, pages of 128 tokens): ``low [D, 32]``
  (plane ``t`` = tokens ``[32t, 32t + 32)``), ``high [n_boost, 32]`` (same planes, row = rank),
  ``boost_idx [D]``, FP16 ``scale, min [D]``.
* KIVI keys (:class:`jaxlp.kvcache.kivi.KeyBlock`, blocks of 128 tokens): ``codes [D, 128 b / 8]``
  (2 bits: plane ``t`` = scale group ``t`` of 32 tokens; 4 bits: plane ``t`` = groups ``2t``
  (bytes ``[0, 32)``) and ``2t + 1`` (bytes ``[32, 64)``)), FP16 ``scale, min [4, D]``.
* Token-major codes (Kitty value pages ``[128, D/4]``; KIVI values ``[T, D b / 8]`` per token
  with FP16 ``scale, min`` per 32 channels; FireQ ``Int4Tokens [T, D/2]``, signed nibbles, one
  FP8 scale per token, channel ``i`` low and ``i + D/2`` high): plane ``u`` of a token's bytes
  = channels ``[u D b / 8, (u + 1) D b / 8)``.

Math: codes ``c`` are never multiplied element-wise by a scale (a shift and a mask give them;
``q`` already holds the softmax ``scale``):

* channel-wise keys (Kitty, KIVI), per 32-token sub-tile of a page (one plane, where every
  scale is uniform): ``s = (q * key_scale) @ c + q . key_min``; Kitty's boosted high bits add
  ``4 ((q * key_scale) @ onehot) @ high``, ``onehot [D, n_boost] = (boost_idx == r)`` (no
  gather). The four sub-tiles are joined into the block's ``[16, 128]`` scores;
* token-wise keys (FireQ), per block: ``s = (q_lo @ c_lo^T + q_hi @ c_hi^T) * token_scale``
  (``q_lo, q_hi`` the two halves of the head, matching the low / high nibbles);
* values (per token scale, optional min, per group of channels), per block: for each plane /
  channel group ``u``, ``o_u += (p * v_scale) @ c_u + (p . v_min)``.

Scores, softmax and sums are float32. In every dot the right side holds small integers (codes,
one-hot), exact in bfloat16; with ``precision="bf16x2"`` (default) the float32 left side
(``q * scale``, ``p * v_scale``) goes in as a bfloat16 part plus its bfloat16 remainder (two
dots, 16 significant bits), which keeps the outputs within about ``1e-5`` relative of float32
(one bfloat16 dot: about ``4e-3``; TF32 variants in :class:`UnitsConfig`).

Grid: ``(B, KVH, query-head blocks of 16, splits)``. A program loops over the blocks of
``block_k`` tokens (64 by default: half a page, two 32-token planes) that intersect its row's
``[lo, hi)``, the row's blocks shared out evenly among the splits (ragged rows stay balanced),
with an online softmax; tokens outside the range are masked. The query heads of one KV head share every tile (GQA; padded to 16 rows for the
tensor-core dot, more than 16 in several head blocks). The splits' partial results are merged
in float32 afterwards (XLA). :func:`reference` is the same computation from ``codec.decode`` of
the units (what the tests and a CPU path compare against). Written for Pallas' Triton backend
(as :mod:`jaxlp.pallas.decode_attention`), ``interpret=True`` on a CPU.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jaxlp.attention.reference import merge_splits

HEAD_BLOCK = 16  # query heads per program (the dot's minimum M)
PAGE = 128  # tokens of a Kitty page / KIVI key block
SUB = 32  # tokens of a key scale group (Kitty low/high plane, KIVI group)
PRECISIONS = ("bf16x2", "bf16", "tf32x2", "tf32", "ieee")


@dataclasses.dataclass(frozen=True)
class UnitsConfig:
    """Kernel knobs. ``block_k``: tokens per loop step, a power of two in [32, 256], at most a
    page (128) when a stream is paged (Kitty, KIVI keys); ``splits``: programs along the sequence per
    (row, KV head, head block); ``precision`` of the dots (the codes are exact in all):
    "bf16x2" (the float32 side as two bfloat16 parts, two dots: about 1e-5 relative), "tf32x2"
    (two TF32 parts, about 1e-6), "bf16" / "tf32" (one dot: about 4e-3 / 1e-3), "ieee" (float32
    FMA dots, slow). The 32-token key sub-tiles and the value channel chunks follow from the
    layout."""

    block_k: int = 64
    splits: int = 1
    num_warps: int = 4
    num_stages: int = 2
    precision: str = "bf16x2"

    def check(self) -> None:
        if self.block_k not in (32, 64, 128, 256):
            raise ValueError(f"block_k must be 32, 64, 128 or 256, got {self.block_k}")
        if self.splits < 1:
            raise ValueError(f"splits must be >= 1, got {self.splits}")
        if self.num_warps < 1 or self.num_warps & (self.num_warps - 1):
            raise ValueError(f"num_warps must be a power of two, got {self.num_warps}")
        if self.num_stages < 1:
            raise ValueError(f"num_stages must be >= 1, got {self.num_stages}")
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {PRECISIONS}, got {self.precision!r}")


def default_config(batch: int, kv_heads: int, max_tokens: int, num_sms: int = 132, head_blocks: int = 1) -> UnitsConfig:
    """At most about two programs per SM (one wave: the kernel holds two per SM), no split
    shorter than two 128-token blocks."""
    programs = batch * kv_heads * head_blocks
    blocks = -(-max_tokens // PAGE)
    splits = max(1, min(2 * num_sms // programs, blocks // 2))
    return UnitsConfig(splits=splits)


# ---------------------------------------------------------------------------------------------
# In-kernel helpers


def _tf32_hi(a):
    """``a`` with its mantissa cut to TF32's 10 bits (exact on the tensor cores)."""
    bits = lax.bitcast_convert_type(a, jnp.uint32) & jnp.uint32(0xFFFFE000)
    return lax.bitcast_convert_type(bits, jnp.float32)


def _mm(a, b, precision, trans_b=False):
    """``a @ b`` (or ``a @ b.T``) with float32 accumulation for float32 ``a`` and a right side ``b``
    of small integers (codes, one-hot; int32), which bfloat16 and TF32 hold exactly. "bf16x2":
    ``a`` as a bfloat16 part plus its bfloat16 remainder (16 significant bits, two dots)."""
    if precision in ("bf16x2", "bf16"):
        b = b.astype(jnp.bfloat16)
        hi = a.astype(jnp.bfloat16)
        out = plgpu.dot(hi, b, trans_b=trans_b)
        if precision == "bf16x2":
            out = out + plgpu.dot((a - hi.astype(jnp.float32)).astype(jnp.bfloat16), b, trans_b=trans_b)
        return out
    b = b.astype(jnp.float32)
    if precision == "ieee":
        return plgpu.dot(a, b, trans_b=trans_b, allow_tf32=False)
    if precision == "tf32":
        return plgpu.dot(a, b, trans_b=trans_b, allow_tf32=True)
    hi = _tf32_hi(a)
    return plgpu.dot(hi, b, trans_b=trans_b, allow_tf32=True) + plgpu.dot(a - hi, b, trans_b=trans_b, allow_tf32=True)


def _plane(x, t, bits, signed=False):
    """Plane ``t`` of int32 bytes ``x`` as int32 codes (signed: two's complement)."""
    c = x & (2**bits - 1) if isinstance(t, int) and t == 0 else (x >> (t * bits)) & (2**bits - 1)
    if signed:
        c = c - ((c & (1 << (bits - 1))) << 1)
    return c


def _cat(a, b):
    """``[m, n]`` and ``[m, n]`` side by side: ``[m, 2n]`` (Triton: a join, a transpose, a reshape)."""
    x = jnp.swapaxes(jnp.stack([a, b], axis=-1), -1, -2)  # [m, 2, n]
    return x.reshape(a.shape[0], 2 * a.shape[1])


def _join_tiles(tiles):
    """Score tiles of consecutive tokens (a power of two of them, equal widths) as one ``[16, block]``."""
    offsets = [t0 for t0, _, _ in tiles]
    assert offsets == sorted(offsets) and len({w for _, w, _ in tiles}) == 1, offsets
    parts = [s for _, _, s in tiles]
    while len(parts) > 1:
        parts = [_cat(parts[i], parts[i + 1]) for i in range(0, len(parts), 2)]
    return parts[0]


def _pow2_at_least(n, floor=16):
    p = floor
    while p < n:
        p *= 2
    return p


# ---------------------------------------------------------------------------------------------
# Readers: one per storage format, generating the in-kernel code of a key or value stream.


class _Keys:
    """Scores of one block: ``tiles(refs, q, j0, lo, hi) -> [(offset, width, s [16, width])]``
    with ``s = q . k`` (``q`` holds the softmax scale)."""

    paged = False

    def leaves(self, store) -> list:
        raise NotImplementedError


@dataclasses.dataclass(frozen=True)
class _KittyKeys(_Keys):
    n_boost: int
    paged = True

    def leaves(self, s):
        return [s.low, s.scale, s.min] + ([s.high, s.boost_idx] if self.n_boost else [])

    def tiles(self, refs, q, j0, lo, hi, precision, *, width):
        low_ref, scale_ref, min_ref = refs[:3]
        u = j0 // PAGE
        g0 = (j0 % PAGE) // SUB if width < PAGE else 0  # first 32-token plane of the step
        qs = q * scale_ref[u, :].astype(jnp.float32)[None, :]
        qm = jnp.sum(q * min_ref[u, :].astype(jnp.float32)[None, :], axis=1)[:, None]
        low = low_ref[u, :, :].astype(jnp.int32)  # [D, 32]: plane t = tokens [32t, 32t + 32)
        if self.n_boost:
            high_ref, idx_ref = refs[3:]
            nbp = _pow2_at_least(self.n_boost)
            r = jnp.arange(nbp)
            onehot = (idx_ref[u, :].astype(jnp.int32)[:, None] == r[None, :]).astype(jnp.int32)  # [D, nbp]
            qb = _mm(qs, onehot, precision)  # [16, nbp]: q * scale of the channel ranked r
            high = plgpu.load(high_ref.at[u, pl.ds(0, nbp), :], mask=(r < self.n_boost)[:, None], other=0)
            high = high.astype(jnp.int32)
        out = []
        for i in range(width // SUB):
            t = g0 + i
            s = _mm(qs, _plane(low, t, 2), precision) + qm
            if self.n_boost:
                s = s + 4.0 * _mm(qb, _plane(high, t, 2), precision)
            out.append((i * SUB, SUB, s))
        return out


@dataclasses.dataclass(frozen=True)
class _KiviKeys(_Keys):
    bits: int
    paged = True

    def leaves(self, s):
        return [s.codes, s.scale, s.min]

    def tiles(self, refs, q, j0, lo, hi, precision, *, width):
        codes_ref, scale_ref, min_ref = refs
        u = j0 // PAGE
        nbytes = PAGE * self.bits // 8
        cols = nbytes // SUB  # 32-byte column ranges per plane
        loaded = {}
        out = []
        for i in range(width // SUB):
            if width == PAGE:  # static planes and columns: group i
                g = i
                plane, col = divmod(i, cols)
                key = col
            else:  # a step of part of a page: group, plane, column from j0
                g = (j0 % PAGE) // SUB + i
                plane, col = g // cols, g % cols
                key = i
            if key not in loaded:
                loaded[key] = codes_ref[u, :, pl.ds(col * SUB, SUB)].astype(jnp.int32)  # [D, 32]
            qs = q * scale_ref[u, g, :].astype(jnp.float32)[None, :]
            qm = jnp.sum(q * min_ref[u, g, :].astype(jnp.float32)[None, :], axis=1)[:, None]
            s = _mm(qs, _plane(loaded[key], plane, self.bits), precision) + qm
            out.append((i * SUB, SUB, s))
        return out


@dataclasses.dataclass(frozen=True)
class _Int4TokenKeys(_Keys):
    """FireQ: q halves against the low / high nibbles, times the token's FP8 scale."""

    def leaves(self, s):
        return [s.codes, s.scale]

    def tiles(self, refs, q, j0, lo, hi, precision, *, width):
        codes_ref, scale_ref = refs
        q_lo, q_hi = q
        rows = j0 + jnp.arange(width)
        ok = (rows >= lo) & (rows < hi)
        x = plgpu.load(codes_ref.at[pl.ds(j0, width), :], mask=ok[:, None], other=0).astype(jnp.int32)
        ks = plgpu.load(scale_ref.at[pl.ds(j0, width)], mask=ok, other=0.0).astype(jnp.float32)
        s = _mm(q_lo, _plane(x, 0, 4, True), precision, True) + _mm(q_hi, _plane(x, 1, 4, True), precision, True)
        return [(0, width, s * ks[None, :])]


@dataclasses.dataclass(frozen=True)
class _TokenValues:
    """Token-major value codes: ``bits`` per code (``signed``: two's complement, no min), one
    scale (and min) per token and group of ``group`` channels; ``paged``: Kitty pages of 128
    tokens (``[U, 128, ...]``), else one unit per token (``[T, ...]``)."""

    bits: int
    group: int
    head_dim: int
    paged: bool
    signed: bool = False

    def leaves(self, s):
        return [s.codes, s.scale] if self.signed else [s.codes, s.scale, s.min]

    @property
    def per(self):
        return 8 // self.bits

    def chunks(self):
        """``(plane, byte column, channel offset, width, group)`` of each output chunk."""
        pw = self.head_dim // self.per  # channels per plane
        cw = min(pw, self.group)
        out = []
        for t in range(self.per):
            for col in range(0, pw, cw):
                c0 = t * pw + col
                out.append((t, col, c0, cw, c0 // self.group))
        return out

    def accumulate(self, refs, acc, tiles, j0, lo, hi, precision):
        codes_ref, scale_ref = refs[:2]
        min_ref = None if self.signed else refs[2]
        grouped = len(scale_ref.shape) == 2 and not self.paged  # KIVI: [T, D / group]
        acc = list(acc)
        for t0, w, p in tiles:
            if self.paged:  # rows of page j0 // 128
                lead, ok = (j0 // PAGE, pl.ds((j0 % PAGE) + t0, w)), None
            else:  # token rows, masked to the range (loads past the units read nothing)
                lead = (pl.ds(j0 + t0, w),)
                idx = j0 + t0 + jnp.arange(w)
                ok = (idx >= lo) & (idx < hi)
            load = functools.partial(_load_rows, lead=lead, ok=ok)
            codes, weights = {}, {}
            for i, (plane, col, c0, cw, g) in enumerate(self.chunks()):
                if col not in codes:
                    codes[col] = load(codes_ref, pl.ds(col, cw)).astype(jnp.int32)  # [w, cw]
                if g not in weights:
                    vs = (load(scale_ref, jnp.int32(g)) if grouped else load(scale_ref)).astype(jnp.float32)
                    pv = p * vs[None, :]
                    pm = None
                    if min_ref is not None:
                        vm = (load(min_ref, jnp.int32(g)) if grouped else load(min_ref)).astype(jnp.float32)
                        pm = jnp.sum(p * vm[None, :], axis=1)[:, None]
                    weights[g] = (pv, pm)
                pv, pm = weights[g]
                term = _mm(pv, _plane(codes[col], plane, self.bits, self.signed), precision)
                acc[i] = acc[i] + (term if pm is None else term + pm)
        return acc


def _load_rows(ref, *rest, lead, ok):
    """``ref[*lead, *rest]`` whose first indexed axis runs over tokens; rows where ``ok`` is
    False (if given) read as zeros."""
    view = ref.at[(*lead, *rest)]
    if ok is None:
        return plgpu.load(view)
    mask = ok if len(view.shape) == 1 else ok[:, None]
    return plgpu.load(view, mask=mask, other=0 if jnp.issubdtype(ref.dtype, jnp.integer) else 0.0)


def _readers(k_codec, v_codec, head_dim: int):
    """The key and value readers for these codecs (ValueError for anything unsupported). A codec
    names the packed layout it writes in its ``layout`` attribute (:class:`jaxlp.kvcache.quantized.Codec`):
    "kitty_keys", "kitty_values", "kivi_keys", "kivi_values" or "int4_tokens" (FireQ)."""
    d = head_dim
    k_layout, v_layout = getattr(k_codec, "layout", ""), getattr(v_codec, "layout", "")
    if d & (d - 1) or not 32 <= d <= 256:
        raise ValueError(f"attend_units: head_dim {d} not supported (a power of two in [32, 256])")
    if k_layout == "kitty_keys":
        if k_codec.unit != PAGE:
            raise ValueError(f"attend_units: Kitty key pages of {k_codec.unit} tokens not supported (only {PAGE})")
        keys = _KittyKeys(k_codec.n_boost)
    elif k_layout == "kivi_keys":
        if k_codec.unit != PAGE or k_codec.group != SUB or k_codec.bits not in (2, 4):
            raise ValueError(f"attend_units: KIVI keys of {k_codec.bits} bits in groups of {k_codec.group} "
                             f"tokens, blocks of {k_codec.unit}, not supported (2 or 4 bits, {SUB}, {PAGE})")
        keys = _KiviKeys(k_codec.bits)
    elif k_layout == "int4_tokens":
        if k_codec.unit != 1:
            raise ValueError(f"attend_units: FireQ units of {k_codec.unit} tokens not supported (only 1)")
        keys = _Int4TokenKeys()
    else:
        raise ValueError(f"attend_units: unknown key codec {k_codec!r} (Kitty, KIVI or FireQ)")
    if v_layout == "kitty_values":
        if v_codec.unit != PAGE:
            raise ValueError(f"attend_units: Kitty value pages of {v_codec.unit} tokens not supported (only {PAGE})")
        values = _TokenValues(2, d, d, paged=True)
    elif v_layout == "kivi_values":
        if v_codec.unit != 1 or v_codec.bits not in (2, 4) or d % v_codec.group or v_codec.group & (v_codec.group - 1):
            raise ValueError(f"attend_units: KIVI values of {v_codec.bits} bits in groups of {v_codec.group} "
                             f"channels not supported for head_dim {d}")
        values = _TokenValues(v_codec.bits, v_codec.group, d, paged=False)
    elif v_layout == "int4_tokens":
        if v_codec.unit != 1:
            raise ValueError(f"attend_units: FireQ units of {v_codec.unit} tokens not supported (only 1)")
        values = _TokenValues(4, d, d, paged=False, signed=True)
    else:
        raise ValueError(f"attend_units: unknown value codec {v_codec!r} (Kitty, KIVI or FireQ)")
    narrow = min(cw for *_, cw, _ in values.chunks())
    if narrow < 16:
        raise ValueError(f"attend_units: head_dim {d} not supported for {v_codec!r} "
                         f"(value chunks of {narrow} < 16 channels)")
    return keys, values


def supports(k_codec, v_codec, head_dim: int) -> bool:
    """Whether :func:`attend_units` reads these codecs' units at this head_dim."""
    try:
        _readers(k_codec, v_codec, head_dim)
    except ValueError:
        return False
    return True


# ---------------------------------------------------------------------------------------------


def _kernel(lo_ref, hi_ref, q_ref, *refs, keys, values, nk, nv, softcap, block, splits, precision, head_dim):
    krefs, vrefs = refs[:nk], refs[nk: nk + nv]
    o_ref, m_ref, l_ref = refs[nk + nv:]
    split = pl.program_id(3)
    lo, hi = lo_ref[()], hi_ref[()]
    d = head_dim
    if isinstance(keys, _Int4TokenKeys):
        q = (q_ref[:, pl.ds(0, d // 2)], q_ref[:, pl.ds(d // 2, d // 2)])
    else:
        q = q_ref[...]
    tiles_fn = functools.partial(keys.tiles, width=block)
    first_all = lo // block
    count = jnp.where(hi > lo, pl.cdiv(hi, block) - first_all, 0)
    per_split = pl.cdiv(count, splits)
    first = first_all + split * per_split
    steps = jnp.clip(count - split * per_split, 0, per_split)
    chunks = values.chunks()

    def body(i, carry):
        acc, m, l = carry
        j0 = (first + i) * block
        s = _join_tiles(tiles_fn(krefs, q, j0, lo, hi, precision))  # [16, block]
        if softcap is not None:
            s = jnp.tanh(s / softcap) * softcap
        idx = j0 + jnp.arange(block)
        s = jnp.where(((idx >= lo) & (idx < hi))[None, :], s, -jnp.inf)
        m_new = jnp.maximum(m, s.max(axis=1))
        m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
        corr = jnp.exp(m - m_safe)
        p = jnp.exp(s - m_safe[:, None])
        l_new = corr * l + p.sum(axis=1)
        acc = [corr[:, None] * a for a in acc]
        acc = values.accumulate(vrefs, acc, [(0, block, p)], j0, lo, hi, precision)
        return tuple(acc), m_new, l_new

    init = (tuple(jnp.zeros((HEAD_BLOCK, cw), jnp.float32) for *_, cw, _ in chunks),
            jnp.full((HEAD_BLOCK,), -jnp.inf, jnp.float32), jnp.zeros((HEAD_BLOCK,), jnp.float32))
    acc, m, l = lax.fori_loop(0, steps, body, init)
    for (_, _, c0, cw, _), a in zip(chunks, acc):
        o_ref[:, pl.ds(c0, cw)] = a
    m_ref[...] = m
    l_ref[...] = l


def _store_tokens(codec, store) -> int:
    leaf = jax.tree.leaves(store)[0]
    return leaf.shape[1] * codec.unit


def check_shapes(q, k_store, v_store, k_codec, v_codec, lo, hi) -> None:
    """ValueError naming what does not fit (shapes of q, the unit stores and the ranges)."""
    if q.ndim != 3:
        raise ValueError(f"attend_units: q must be [B, H, D], got shape {q.shape}")
    b, h, d = q.shape
    _readers(k_codec, v_codec, d)
    for what, store, codec in (("k_store", k_store, k_codec), ("v_store", v_store, v_codec)):
        want = jax.eval_shape(codec.encode, jax.ShapeDtypeStruct((codec.unit, d), jnp.float32))
        leaves, want_leaves = jax.tree.leaves(store), jax.tree.leaves(want)
        if type(store) is not type(want) or jax.tree.structure(store) != jax.tree.structure(want):
            raise ValueError(f"attend_units: {what} is not a unit store of {codec!r}: {jax.tree.structure(store)}")
        lead = leaves[0].shape[:3] if leaves[0].ndim >= 3 else None
        for leaf, w in zip(leaves, want_leaves):
            if lead is None or leaf.shape[:3] != lead or leaf.shape[3:] != w.shape or leaf.dtype != w.dtype:
                raise ValueError(f"attend_units: {what} leaves must be [B, U, KVH, ...] units of {codec!r} for "
                                 f"head_dim {d} (a unit: {w.shape} {w.dtype}), got {leaf.shape} {leaf.dtype}")
        if lead[0] != b:
            raise ValueError(f"attend_units: {what} has batch {lead[0]}, q {b}")
    kvh = jax.tree.leaves(k_store)[0].shape[2]
    if jax.tree.leaves(v_store)[0].shape[2] != kvh:
        raise ValueError(f"attend_units: k_store has {kvh} KV heads, v_store {jax.tree.leaves(v_store)[0].shape[2]}")
    if h % kvh:
        raise ValueError(f"attend_units: {h} query heads are not a multiple of {kvh} KV heads")
    if lo.shape != (b,) or hi.shape != (b,):
        raise ValueError(f"attend_units: lo and hi must be [{b}], got {lo.shape}, {hi.shape}")


@functools.partial(jax.jit, static_argnames=("k_codec", "v_codec", "scale", "softcap", "config", "interpret"))
def attend_units(q, k_store, v_store, k_codec, v_codec, lo, hi, *, scale: float, softcap: float | None = None,
                 config: UnitsConfig | None = None, interpret: bool = False):
    """Attention of ``q [B, H, D]`` over the quantized stream indices ``[lo, hi)`` of each row
    (module doc): ``(out [B, H, D] float32 normalized, m [B, H], l [B, H])``. ``hi`` must not pass
    the quantized tokens of either store."""
    check_shapes(q, k_store, v_store, k_codec, v_codec, lo, hi)
    b, h, d = q.shape
    keys, values = _readers(k_codec, v_codec, d)
    kvh = jax.tree.leaves(k_store)[0].shape[2]
    g = h // kvh
    hb = -(-g // HEAD_BLOCK)
    gp = hb * HEAD_BLOCK
    max_tokens = min(_store_tokens(k_codec, k_store), _store_tokens(v_codec, v_store))
    config = config or default_config(b, kvh, max_tokens, head_blocks=hb)
    config.check()
    if (keys.paged or values.paged) and not SUB <= config.block_k <= PAGE:
        raise ValueError(f"attend_units: block_k must be in [{SUB}, {PAGE}] (at most a page) for {k_codec!r}, "
                         f"{v_codec!r}, got {config.block_k}")
    qg = q.astype(jnp.float32).reshape(b, kvh, g, d) * jnp.float32(scale)
    qg = jnp.pad(qg, ((0, 0), (0, 0), (0, gp - g), (0, 0)))
    kleaves, vleaves = keys.leaves(k_store), values.leaves(v_store)

    def unit_spec(x, codec):
        # [B, U, KVH, ...]: a row's units of one KV head; one-token units lose their token axis.
        rest = x.shape[3:]
        block = (None, x.shape[1], None) + ((None,) + rest[1:] if codec.unit == 1 else rest)
        return pl.BlockSpec(block, lambda bi, hi_, gi, si: (bi, 0, hi_) + (0,) * len(rest))

    splits = config.splits
    kernel = functools.partial(_kernel, keys=keys, values=values, nk=len(kleaves), nv=len(vleaves), softcap=softcap,
                               block=config.block_k, splits=splits, precision=config.precision, head_dim=d)
    row = pl.BlockSpec((None,), lambda bi, hi_, gi, si: (bi,))
    o, m, l = pl.pallas_call(
        kernel,
        grid=(b, kvh, hb, splits),
        in_specs=[row, row, pl.BlockSpec((None, None, HEAD_BLOCK, d), lambda bi, hi_, gi, si: (bi, hi_, gi, 0))]
        + [unit_spec(x, k_codec) for x in kleaves] + [unit_spec(x, v_codec) for x in vleaves],
        out_specs=[pl.BlockSpec((None, None, None, HEAD_BLOCK, d), lambda bi, hi_, gi, si: (bi, hi_, si, gi, 0)),
                   pl.BlockSpec((None, None, None, HEAD_BLOCK), lambda bi, hi_, gi, si: (bi, hi_, si, gi)),
                   pl.BlockSpec((None, None, None, HEAD_BLOCK), lambda bi, hi_, gi, si: (bi, hi_, si, gi))],
        out_shape=[jax.ShapeDtypeStruct((b, kvh, splits, gp, d), jnp.float32),
                   jax.ShapeDtypeStruct((b, kvh, splits, gp), jnp.float32),
                   jax.ShapeDtypeStruct((b, kvh, splits, gp), jnp.float32)],
        compiler_params=plgpu.CompilerParams(num_warps=config.num_warps, num_stages=config.num_stages),
        interpret=interpret,
        name="jaxlp_quantized_decode_attention",
    )(lo.astype(jnp.int32), hi.astype(jnp.int32), qg, *kleaves, *vleaves)
    out, m_all, den = merge_splits(o, m, l)  # o [B, KVH, S, Gp, D] unnormalized, m, l [B, KVH, S, Gp]
    return out[:, :, :g].reshape(b, h, d), m_all[:, :, :g].reshape(b, h), den[:, :, :g].reshape(b, h)


def decode_units(codec, store) -> jax.Array:
    """``[B, U, KVH, ...]`` units to ``[B, U * unit, KVH, D]`` float32 through ``codec.decode``."""
    x = codec.decode(store)  # [B, U, KVH, unit, D]
    b, u, kvh, t, d = x.shape
    return jnp.moveaxis(x, 3, 2).reshape(b, u * t, kvh, d)


@functools.partial(jax.jit, static_argnames=("k_codec", "v_codec", "scale", "softcap"))
def reference(q, k_store, v_store, k_codec, v_codec, lo, hi, *, scale: float, softcap: float | None = None):
    """:func:`attend_units` through ``codec.decode`` of the whole stores and float32 attention
    (highest-precision dots) over ``[lo, hi)``; same outputs."""
    check_shapes(q, k_store, v_store, k_codec, v_codec, lo, hi)
    b, h, d = q.shape
    k, v = decode_units(k_codec, k_store), decode_units(v_codec, v_store)
    n = min(k.shape[1], v.shape[1])
    k, v = k[:, :n], v[:, :n]
    kvh = k.shape[2]
    qg = q.astype(jnp.float32).reshape(b, kvh, h // kvh, d)
    hp = lax.Precision.HIGHEST
    s = jnp.einsum("bkgd,bjkd->bkgj", qg, k, precision=hp) * jnp.float32(scale)
    if softcap is not None:
        s = jnp.tanh(s / softcap) * softcap
    j = jnp.arange(n)
    ok = (j[None, :] >= lo[:, None]) & (j[None, :] < hi[:, None])
    s = jnp.where(ok[:, None, None, :], s, -jnp.inf)
    m = s.max(axis=-1)
    p = jnp.exp(s - jnp.where(m == -jnp.inf, 0.0, m)[..., None])
    l = p.sum(axis=-1)
    o = jnp.einsum("bkgj,bjkd->bkgd", p, v, precision=hp)
    o = jnp.where(l[..., None] > 0, o / jnp.where(l > 0, l, 1.0)[..., None], 0.0)
    return o.reshape(b, h, d), m.reshape(b, h), l.reshape(b, h)


__all__ = ["UnitsConfig", "attend_units", "check_shapes", "decode_units", "default_config", "reference", "supports"]
