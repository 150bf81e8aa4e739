"""Integer quantization helpers for KV caches: asymmetric min-max, symmetric absmax, bit packing.

Asymmetric min-max over ``axis`` with ``b`` bits (KIVI, Kitty):

    scale = max((max - min) * (1 / (2**b - 1)), 1e-6)        # stored FP16, as is min
    code  = clamp(floor((x - min) * (1 / scale) + 0.5), 0, 2**b - 1)
    x_hat = code * scale + min

The codes are computed from the FP16-rounded scale and min (the values that dequantization
reads), in float32; the roundings pass :func:`jaxlp.formats.base.cast_rounded`, since XLA:GPU
drops a float32 -> float16 -> float32 round trip. Both divisions are multiplications by the
float32 reciprocal, written out because that is what XLA makes of a division by a broadcast or a
constant: the rule is then the same on every backend and in the CUDA store
(:mod:`jaxlp.ffi.quantized_cache_store`). It differs from a true division only where ``(x - min) / scale`` is exactly ``k + 0.5`` (with FP16 operands,
about one code in 7,500; the reciprocal then rounds 2% of those down), where the two neighbouring
codes are equally close. Symmetric absmax INT4 with FP8 E4M3 scales (FireQ), the divisions
likewise products with the float32 reciprocal:

    scale = e4m3(max(|x|) / 7)   (round to nearest, at least the smallest subnormal 2**-9)
    code  = clamp(round_half_even(x / scale), -8, 7);   x_hat = code * scale

Packing is *planar*: for a last axis of ``N`` elements, ``per = 8 // bits`` codes per byte and
``M = N // per`` bytes, element ``i`` goes to byte ``i % M`` at bits ``[t * bits, (t + 1) * bits)``
with ``t = i // M``. Plane ``t`` of a byte row, ``(byte >> (t * bits)) & (2**bits - 1)``, thus
holds the *contiguous* elements ``[t * M, (t + 1) * M)``, which is what a kernel wants: one
load of a ``[rows, M]`` byte tile and a shift give a ``[rows, M]`` tile of codes of
contiguous elements (tokens of a channel-major key page, channels of a token-major value row).
Examples: 2-bit codes of 128 tokens: plane ``t`` = tokens ``[32 t, 32 t + 32)``; signed INT4
of ``D`` channels (:func:`pack_int4`): channel ``i`` in the low nibble, ``i + D/2`` in the high
nibble of byte ``i`` (the rotate-half RoPE pairing).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxlp.formats.base import cast_rounded

SCALE_FLOOR = 1e-6
FP8 = jnp.float8_e4m3fn
FP8_MAX = 448.0
FP8_MIN_SUBNORMAL = 2.0**-9


def minmax_quantize(x: jax.Array, bits: int, axis: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Asymmetric ``bits``-bit codes (uint8) of ``x`` over ``axis``; scale and min in FP16 (keepdims)."""
    if bits not in (1, 2, 4, 8):
        raise ValueError(f"bits must be 1, 2, 4 or 8, got {bits}")
    return minmax_quantize_levels(x, 2**bits - 1, axis)


def minmax_quantize_levels(x: jax.Array, levels, axis: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """As :func:`minmax_quantize` with ``levels = 2**bits - 1`` given directly (it may be an
    array broadcasting against the reduced shape, for mixed precision)."""
    x = x.astype(jnp.float32)
    lo = jnp.min(x, axis=axis, keepdims=True)
    hi = jnp.max(x, axis=axis, keepdims=True)
    levels = jnp.asarray(levels, jnp.float32)
    scale = cast_rounded(jnp.maximum((hi - lo) * (1 / levels), SCALE_FLOOR), jnp.float16)
    lo = cast_rounded(lo, jnp.float16)
    codes = jnp.floor((x - lo.astype(jnp.float32)) * (1 / scale.astype(jnp.float32)) + 0.5)
    return jnp.clip(codes, 0, levels).astype(jnp.uint8), scale, lo


def minmax_dequantize(codes: jax.Array, scale: jax.Array, lo: jax.Array) -> jax.Array:
    """``codes * scale + min`` in float32 (scale and min broadcast against codes)."""
    return codes.astype(jnp.float32) * scale.astype(jnp.float32) + lo.astype(jnp.float32)


def fp8_scale(absmax: jax.Array, qmax: float) -> jax.Array:
    """``absmax / qmax`` rounded to FP8 E4M3 (saturating at 448), at least ``2**-9``."""
    s = jnp.clip(absmax.astype(jnp.float32) * (1 / qmax), FP8_MIN_SUBNORMAL, FP8_MAX)
    return cast_rounded(s, FP8)


def absmax_int4_quantize(x: jax.Array, axis: int = -1) -> tuple[jax.Array, jax.Array]:
    """Symmetric INT4 codes (int8 in [-8, 7]) over ``axis`` and FP8 E4M3 scales (keepdims)."""
    x = x.astype(jnp.float32)
    scale = fp8_scale(jnp.max(jnp.abs(x), axis=axis, keepdims=True), 7.0)
    codes = jnp.clip(jnp.round(x * (1 / scale.astype(jnp.float32))), -8, 7)
    return codes.astype(jnp.int8), scale


def fake_quantize_fp8(x: jax.Array, axis: int = -1) -> jax.Array:
    """``x`` through FP8 E4M3 with a float32 scale ``max|x| / 448`` over ``axis`` (float32 out)."""
    x = x.astype(jnp.float32)
    s = jnp.max(jnp.abs(x), axis=axis, keepdims=True) / FP8_MAX
    s = jnp.where(s > 0, s, 1.0)
    return cast_rounded(x / s, FP8).astype(jnp.float32) * s


def pack_bits(codes: jax.Array, bits: int) -> jax.Array:
    """Pack unsigned ``bits``-bit codes along the last axis, planar (module doc):
    ``[..., N] -> uint8 [..., N * bits / 8]``, element ``i`` in byte ``i % (N * bits / 8)``."""
    if bits not in (1, 2, 4, 8):
        raise ValueError(f"bits must be 1, 2, 4 or 8, got {bits}")
    per = 8 // bits
    if codes.shape[-1] % per:
        raise ValueError(f"last axis {codes.shape[-1]} is not a multiple of {per} ({bits}-bit codes per byte)")
    c = codes.astype(jnp.uint8).reshape(*codes.shape[:-1], per, codes.shape[-1] // per)  # [..., plane, byte]
    shifts = (jnp.arange(per, dtype=jnp.uint8) * bits).astype(jnp.uint8)[:, None]
    mask = jnp.uint8(2**bits - 1)
    parts = ((c & mask) << shifts).astype(jnp.uint32)
    return jnp.sum(parts, axis=-2).astype(jnp.uint8)  # disjoint bit fields: the sum is the or


def unpack_bits(packed: jax.Array, bits: int) -> jax.Array:
    """Inverse of :func:`pack_bits`: ``uint8 [..., M] -> uint8 [..., M * 8 / bits]`` (plane ``t``
    of the bytes gives elements ``[t * M, (t + 1) * M)``)."""
    if bits not in (1, 2, 4, 8):
        raise ValueError(f"bits must be 1, 2, 4 or 8, got {bits}")
    per = 8 // bits
    shifts = (jnp.arange(per, dtype=jnp.uint8) * bits).astype(jnp.uint8)[:, None]
    out = (packed[..., None, :] >> shifts) & jnp.uint8(2**bits - 1)  # [..., plane, byte]
    return out.reshape(*packed.shape[:-1], packed.shape[-1] * per)


def pack_int4(codes: jax.Array) -> jax.Array:
    """Signed INT4 codes (two's complement nibbles) packed two per byte along the last axis,
    planar: of ``N`` codes, element ``i < N/2`` in the low nibble of byte ``i``, element ``i + N/2``
    in its high nibble."""
    return pack_bits(codes.astype(jnp.int8).astype(jnp.uint8) & jnp.uint8(0xF), 4)


def unpack_int4(packed: jax.Array) -> jax.Array:
    """Inverse of :func:`pack_int4`: int8 codes in [-8, 7]."""
    u = unpack_bits(packed, 4).astype(jnp.int8)
    return jnp.where(u >= 8, u - 16, u).astype(jnp.int8)
