"""BlockDialect DialectFP4: per-block choice of one of 16 FP4 "dialects" with a shared exponent.

Blocks of ``block_size`` (16, 32, 64) run along the last axis. Per block:

* shared exponent ``e = floor(log2(block_amax)) - 2``, so the scaled block ``y = |x| * 2**-e``
  has its maximum in ``[4, 8)``. Stored as a 5-bit code ``floor(log2(block_amax)) + 16``
  clamped to ``[0, 31]`` (one uint8): block maxima in ``[2**-16, 2**16)`` are exact, which
  covers every FP16 block maximum; smaller blocks (and all-zero blocks, code 0) use
  ``e = -18`` and underflow gracefully, larger ones (``e = 13``) saturate at the dialect max;
* a 4-bit dialect id (uint8) choosing a row of the formatbook: 8 magnitudes on the 0.5 grid
  in ``[0, 7.5]``, stored in half units (integers 0..15, ascending);
* per element a sign bit and the 3-bit index of the nearest magnitude of that dialect
  (``code = sign << 3 | index``), two codes per uint8 byte (element ``2i`` in the low nibble).

Element rounding: nearest representable magnitude, ties to the larger magnitude. All
midpoints of half-grid values are multiples of 0.25, so this is exactly what the paper's
hardware computes from its 5-bit intermediate (3 integer + 2 fraction bits, truncated)
with round-half-up; the same holds for both selection stages below.

Dialect selection:

* ``"mse"`` (weights, offline): all 16 dialects, smallest squared error in the block wins
  (ties: the lowest id).
* ``"two_stage"`` (activations, one pass): stage 1 rounds the scaled block max to the 0.5
  grid (half up) and takes the pair of dialects ``(2p, 2p + 1)`` whose shared maximum is
  nearest (ties: the larger maximum; a rounded max of 8 takes the 7.5 pair). Stage 2 counts,
  for each member, the elements in its "beneficial range": the values whose nearest point
  among the union of both members' magnitudes is that member's own differing value (the
  half-open interval between the midpoints to its neighbours, e.g. ``[4.5, 5.75)`` for
  dialect 4). More elements wins; ties go to the even member.

Storage is ``4 + 12/block_size`` bits per element (4.375 at 32): the dialect ids two per byte
(block ``2i`` in the low nibble, as the codes), the exponents a byte each, so that a kernel reads
a block's id with its codes and its exponent as one byte. The format's information content,
:attr:`DialectFP4Array.effective_bits`, is ``4 + 9/block_size`` (4.28 at 32), what packing the
5-bit exponents too would take.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxlp.formats.base import (
    QuantizedArray,
    check_blocks,
    check_field,
    check_finite,
    register_array,
    register_format,
    static_field,
    to_blocks,
)

FORMATBOOK = np.array(
    [
        [0, 1, 2, 3, 4, 6, 11, 15],
        [0, 1, 2, 3, 4, 6, 9, 15],
        [0, 1, 2, 3, 4, 6, 11, 14],
        [0, 1, 2, 3, 4, 6, 9, 14],
        [0, 1, 2, 3, 4, 6, 10, 13],
        [0, 1, 2, 3, 4, 6, 8, 13],
        [0, 1, 2, 3, 4, 6, 10, 12],
        [0, 1, 2, 3, 4, 6, 8, 12],  # = FP4 E2M1: 0, 0.5, 1, 1.5, 2, 3, 4, 6
        [0, 1, 2, 3, 4, 6, 9, 11],
        [0, 1, 2, 3, 4, 6, 7, 11],
        [0, 1, 2, 3, 4, 6, 9, 10],
        [0, 1, 2, 3, 4, 6, 7, 10],
        [0, 1, 2, 3, 4, 6, 8, 9],
        [0, 1, 2, 3, 4, 6, 7, 9],
        [0, 1, 2, 3, 4, 6, 7, 8],
        [0, 1, 2, 3, 4, 5, 6, 8],
    ],
    dtype=np.int8,
)
"""The 16-dialect DialectFP4 formatbook in half units (magnitude = 0.5 * entry), index order.

Provisional: a third-party transcription of the paper's Figure 4 (see the formats notes);
pairs ``(2p, 2p + 1)`` share the maximum ``7.5 - 0.5p`` and differ in one value.
"""
FORMATBOOK.setflags(write=False)

BLOCK_SIZES = (16, 32, 64)
SELECTIONS = ("mse", "two_stage")
EXPONENT_BIAS = 16
"""Stored exponent code = ``floor(log2(block_amax)) + EXPONENT_BIAS``, clamped to [0, 31]."""
EXPONENT_CODES = 32
SCALE_OFFSET = 2
"""The shared scale exponent is ``code - EXPONENT_BIAS - SCALE_OFFSET``."""

Formatbook = tuple[tuple[int, ...], ...]


def as_formatbook(table) -> Formatbook:
    """Validate a formatbook (16 rows of 8 ascending integers in [0, 15], half units) as a tuple of tuples."""
    arr = np.asarray(table)
    if arr.shape != (16, 8):
        raise ValueError(f"dialect_fp4: a formatbook has shape [16, 8] (16 dialects x 8 magnitudes), got {arr.shape}")
    if not np.issubdtype(arr.dtype, np.number) or not np.all(arr == np.round(arr)):
        raise ValueError("dialect_fp4: formatbook entries must be integers (magnitudes in half units)")
    arr = arr.astype(np.int64)
    if arr.min() < 0 or arr.max() > 15:
        raise ValueError("dialect_fp4: formatbook entries must lie in [0, 15] (magnitudes 0..7.5 in half units)")
    if np.any(np.diff(arr, axis=1) <= 0):
        raise ValueError("dialect_fp4: every formatbook row must be strictly increasing")
    return tuple(tuple(int(v) for v in row) for row in arr)


DEFAULT_FORMATBOOK: Formatbook = as_formatbook(FORMATBOOK)


def beneficial_ranges(formatbook=FORMATBOOK) -> np.ndarray:
    """``[16, 2]`` half-open beneficial ranges ``[lo, hi)`` in half units, for two-stage selection.

    Dialect ``d``'s differing value ``v`` (the one its pair partner lacks) is the nearest point
    of the pair's union for ``lo <= 2y < hi``. Raises ValueError unless each pair ``(2p, 2p+1)``
    shares its maximum and differs in exactly one value.
    """
    book = as_formatbook(formatbook)
    ranges = np.zeros((16, 2), np.float64)
    for d in range(16):
        own, partner = set(book[d]), set(book[d ^ 1])
        if book[d][-1] != book[d ^ 1][-1] or len(own - partner) != 1:
            raise ValueError(
                f"dialect_fp4: two-stage selection needs dialects {d & ~1} and {d | 1} to share their maximum "
                "and differ in exactly one value"
            )
        (v,) = own - partner
        union = sorted(own | partner)
        i = union.index(v)
        ranges[d, 0] = (union[i - 1] + v) / 2 if i > 0 else -np.inf
        ranges[d, 1] = (v + union[i + 1]) / 2 if i + 1 < len(union) else np.inf
    return ranges


def _check_options(block_size, selection) -> None:
    if block_size not in BLOCK_SIZES or isinstance(block_size, bool):
        raise ValueError(f"dialect_fp4: block_size must be one of {BLOCK_SIZES}, got {block_size!r}")
    if selection not in SELECTIONS:
        raise ValueError(f"dialect_fp4: selection must be one of {SELECTIONS}, got {selection!r}")


def _pow2(k: jax.Array) -> jax.Array:
    """Exact float32 ``2**k`` for integer ``k`` in the normal range."""
    return jax.lax.bitcast_convert_type(((k.astype(jnp.int32) + 127) << 23), jnp.float32)


def _nearest(h: jax.Array, row_values: jax.Array) -> jax.Array:
    """Index of the nearest of 8 ascending values, ties up: ``h [..., nb, B]``, ``row_values [..., nb, 8]``."""
    idx = jnp.zeros(h.shape, jnp.int32)
    for k in range(7):
        mid = (row_values[..., k] + row_values[..., k + 1]) * 0.5
        idx = idx + (h >= mid[..., None]).astype(jnp.int32)
    return idx


@functools.partial(jax.jit, static_argnames=("block_size", "selection", "formatbook"))
def _quantize_blocks(x: jax.Array, block_size: int, selection: str, formatbook: Formatbook):
    book = np.asarray(formatbook, np.float32)  # [16, 8] half units, a trace-time constant
    xb = to_blocks(x.astype(jnp.float32), block_size)
    mag = jnp.abs(xb)
    amax = jnp.max(mag, axis=-1)
    _, frexp_exp = jnp.frexp(amax)  # amax = m * 2**frexp_exp, m in [0.5, 1)
    code = jnp.where(amax >= 2.0 ** -EXPONENT_BIAS, jnp.clip(frexp_exp - 1 + EXPONENT_BIAS, 0, EXPONENT_CODES - 1), 0)
    e = code - EXPONENT_BIAS - SCALE_OFFSET
    h = mag * _pow2(1 - e)[..., None]  # the scaled block in half units (2 * |x| * 2**-e), exact

    if selection == "mse":
        book_j = jnp.asarray(book)

        def try_dialect(d, carry):
            best_err, best = carry
            row = book_j[d]
            q = jnp.full(h.shape, row[0], jnp.float32)
            for k in range(7):
                q = q + jnp.where(h >= (row[k] + row[k + 1]) * 0.5, row[k + 1] - row[k], 0.0)
            err = jnp.sum(jnp.square(h - q), axis=-1)
            better = err < best_err  # strict: ties keep the lower id
            return jnp.where(better, err, best_err), jnp.where(better, d, best)

        init = (jnp.full(amax.shape, jnp.inf, jnp.float32), jnp.zeros(amax.shape, jnp.int32))
        _, dialect = jax.lax.fori_loop(0, 16, try_dialect, init)
    else:
        pair_max = book[0::2, -1]  # [8]
        rounded = jnp.floor(jnp.max(h, axis=-1) + 0.5)  # block max on the 0.5 grid, in half units
        key = 2 * jnp.abs(pair_max - rounded[..., None]) + (pair_max < rounded[..., None])
        pair = jnp.argmin(key, axis=-1).astype(jnp.int32)
        ranges = jnp.asarray(beneficial_ranges(formatbook), jnp.float32)  # [16, 2]
        lo_even, hi_even = ranges[2 * pair, 0], ranges[2 * pair, 1]
        lo_odd, hi_odd = ranges[2 * pair + 1, 0], ranges[2 * pair + 1, 1]
        count_even = jnp.sum((h >= lo_even[..., None]) & (h < hi_even[..., None]), axis=-1)
        count_odd = jnp.sum((h >= lo_odd[..., None]) & (h < hi_odd[..., None]), axis=-1)
        dialect = jnp.where(count_even >= count_odd, 2 * pair, 2 * pair + 1)

    idx = _nearest(h, jnp.asarray(book)[dialect])
    nibbles = (jnp.where(xb < 0, 8, 0) | idx).astype(jnp.uint8).reshape(x.shape)
    nibbles = nibbles.reshape(*x.shape[:-1], x.shape[-1] // 2, 2)
    codes = nibbles[..., 0] | (nibbles[..., 1] << 4)
    return codes, dialect.astype(jnp.uint8), code.astype(jnp.uint8)


def pack_dialects(ids: jax.Array) -> jax.Array:
    """Dialect ids uint8 ``[..., nb]`` (0..15) two per byte ``[..., ceil(nb/2)]``: block ``2i`` in
    the low nibble, ``2i + 1`` in the high one (0 past an odd count)."""
    ids = jnp.asarray(ids, jnp.uint8)
    if ids.shape[-1] % 2:
        ids = jnp.pad(ids, [(0, 0)] * (ids.ndim - 1) + [(0, 1)])
    return ids[..., 0::2] | (ids[..., 1::2] << 4)


def unpack_dialects(packed: jax.Array, num_blocks: int) -> jax.Array:
    """The inverse of :func:`pack_dialects`: uint8 ids ``[..., num_blocks]``."""
    ids = jnp.stack([packed & 0xF, packed >> 4], axis=-1).reshape(*packed.shape[:-1], packed.shape[-1] * 2)
    return ids[..., :num_blocks]


@functools.partial(jax.jit, static_argnames=("block_size", "formatbook"))
def _dequantize_blocks(codes, dialects, exponents, block_size: int, formatbook: Formatbook):
    book = jnp.asarray(np.asarray(formatbook, np.float32))
    nib = jnp.stack([codes & 0xF, codes >> 4], axis=-1).reshape(*codes.shape[:-1], codes.shape[-1] * 2)
    nib = to_blocks(nib.astype(jnp.int32), block_size)
    half_units = jnp.take_along_axis(book[dialects.astype(jnp.int32)], nib & 7, axis=-1)
    e = exponents.astype(jnp.int32) - EXPONENT_BIAS - SCALE_OFFSET
    mag = half_units * _pow2(e - 1)[..., None]
    vals = jnp.where(nib >= 8, -mag, mag)
    return vals.reshape(*vals.shape[:-2], vals.shape[-2] * block_size)


@register_array
class DialectFP4Array(QuantizedArray):
    """BlockDialect DialectFP4 blocks.

    ``codes`` uint8 ``[..., K/2]`` (two sign + index nibbles per byte), ``dialect_pairs`` uint8
    ``[..., ceil(K/block_size / 2)]`` (two dialect ids per byte, see :func:`pack_dialects`; the
    ids themselves: :attr:`dialects`), ``exponents`` uint8 ``[..., K/block_size]``.

    ``exponents`` holds the 5-bit code ``floor(log2(block_amax)) + 16`` (see the module
    docstring); the block scale is ``2**(code - 18)``.
    """

    format = "dialect_fp4"

    codes: jax.Array
    dialect_pairs: jax.Array
    exponents: jax.Array
    shape: tuple[int, ...] = static_field()
    block_size: int = static_field(default=32)
    selection: str = static_field(default="mse")
    formatbook: Formatbook = static_field(default=DEFAULT_FORMATBOOK)

    def __post_init__(self):
        object.__setattr__(self, "shape", tuple(int(d) for d in self.shape))
        object.__setattr__(self, "block_size", int(self.block_size))
        object.__setattr__(self, "formatbook", as_formatbook(self.formatbook))

    def check(self) -> None:
        _check_options(self.block_size, self.selection)
        check_blocks(self.shape, self.block_size, "dialect_fp4")
        lead, k = self.shape[:-1], self.shape[-1]
        check_field("dialect_fp4", "codes", self.codes, lead + (k // 2,), jnp.uint8)
        check_field("dialect_fp4", "dialect_pairs", self.dialect_pairs, lead + (-(-k // self.block_size // 2),),
                    jnp.uint8)
        check_field("dialect_fp4", "exponents", self.exponents, lead + (k // self.block_size,), jnp.uint8)

    @property
    def dialects(self) -> jax.Array:
        """The dialect id of each block, uint8 ``[..., K/block_size]``."""
        return unpack_dialects(self.dialect_pairs, self.shape[-1] // self.block_size)

    @property
    def effective_bits(self) -> float:
        """Bits per element of the format itself: ``4 + 9/block_size`` (id and exponent bit-packed)."""
        return 4.0 + 9.0 / self.block_size

    def block_exponents(self) -> jax.Array:
        """The shared scale exponents ``e`` (int32 ``[..., K/block_size]``): block values are ``magnitude * 2**e``."""
        return self.exponents.astype(jnp.int32) - EXPONENT_BIAS - SCALE_OFFSET

    def dequantize(self, dtype=jnp.float32) -> jax.Array:
        """``sign * 0.5 * formatbook[dialect][index] * 2**e``, cast to ``dtype``."""
        vals = _dequantize_blocks(self.codes, self.dialects, self.exponents, self.block_size, self.formatbook)
        return vals.astype(dtype)


def quantize(x: jax.Array, *, block_size: int = 32, selection: str = "mse", formatbook=None) -> DialectFP4Array:
    """Quantize ``x [..., K]`` to DialectFP4 along the last axis (see the module docstring).

    ``selection``: ``"mse"`` (weights) or ``"two_stage"`` (activations); ``formatbook``: a
    ``[16, 8]`` table in half units replacing :data:`FORMATBOOK`.
    """
    x = jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise ValueError(f"dialect_fp4: expects floating-point input, got dtype {x.dtype}")
    _check_options(block_size, selection)
    book = DEFAULT_FORMATBOOK if formatbook is None else as_formatbook(formatbook)
    if selection == "two_stage":
        beneficial_ranges(book)  # validates the pair structure
    check_blocks(x.shape, block_size, "dialect_fp4")
    check_finite(x, "dialect_fp4")
    codes, dialects, exponents = _quantize_blocks(x, block_size, selection, book)
    return DialectFP4Array(
        codes=codes,
        dialect_pairs=pack_dialects(dialects),
        exponents=exponents,
        shape=tuple(x.shape),
        block_size=block_size,
        selection=selection,
        formatbook=book,
    )


register_format("dialect_fp4", quantize, DialectFP4Array)
