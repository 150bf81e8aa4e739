"""FP4 E2M1 elements: encoding with round-to-nearest-even, decoding, nibble packing.

An E2M1 code is 4 bits: a sign bit (``0x8``) and a 3-bit magnitude index into
``MAGNITUDES = (0, 0.5, 1, 1.5, 2, 3, 4, 6)``. Shared by NVFP4 and MXFP4 (and the GPU kernels).

Encoding clips to +-6 and rounds to nearest, ties to the even code (even mantissa bit): the
tie points 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5 go to 0, 1, 1, 2, 2, 4, 4. The sign bit is set
when ``x < 0`` (as ModelOpt does), so -0.1 encodes as -0 (``0x8``) but -0.0 encodes as +0.

Packing: two codes per byte along the last axis, the even index in the low nibble.

On Hopper there is no FP4 conversion instruction; :func:`fp16_bits` gives the 16-bit pattern
``((n & 8) << 12) | ((n & 7) << 9)`` which, read as FP16, equals ``e2m1(n) * 2**-14`` exactly
(the codes 1 = 0.5 land on the FP16 subnormal 2**-15). Fold ``2**FP16_BITS_EXPONENT`` into the
block scale.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
VALUES = MAGNITUDES + tuple(-m for m in MAGNITUDES)  # code -> value; code 8 is -0.0
MAX = 6.0
SIGN_BIT = 0x8
# Midpoints between consecutive magnitudes; a tie rounds towards the even code.
TIE_POINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
FP16_BITS_EXPONENT = 14  # fp16_bits(n) read as FP16 == e2m1(n) * 2**-14


def _check_float(x: jax.Array, what: str) -> None:
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise ValueError(f"{what}: expected a floating-point array, got dtype {x.dtype}")


def _sign_bits(x: jax.Array) -> jax.Array:
    """``x < 0`` from the bit pattern, as uint8 0/1; a negative subnormal counts as negative.

    XLA compiles with subnormals flushed to zero and LLVM may turn an integer test on a bitcast
    float back into a float comparison (then a subnormal is zero); the optimization barrier on
    the integer bits keeps the test bitwise.
    """
    bits = jnp.finfo(x.dtype).bits
    u = jax.lax.optimization_barrier(jax.lax.bitcast_convert_type(x, jnp.dtype(f"uint{bits}")))
    sign = (u >> (bits - 1)) & 1
    nonzero = (u & ((1 << (bits - 1)) - 1)) != 0
    return (sign.astype(jnp.uint8) & nonzero.astype(jnp.uint8)).astype(jnp.uint8)


@jax.jit
def encode(x: jax.Array, sign_of: jax.Array | None = None) -> jax.Array:
    """Round ``x`` to E2M1 codes (uint8 0..15): clip to +-6, nearest, ties to even.

    sign_of: take the sign bit from ``sign_of < 0`` instead of ``x < 0`` (same shape), for
    callers that clip or rescale before encoding: XLA flushes FP32 subnormals to zero in
    arithmetic, which would drop the sign of a tiny value. The sign is read from the bits, so a
    negative subnormal counts as negative. NaN encodes as 0 (callers reject NaN before encoding).
    """
    x = jnp.asarray(x)
    _check_float(x, "e2m1.encode")
    sign_src = x if sign_of is None else jnp.asarray(sign_of)
    _check_float(sign_src, "e2m1.encode sign_of")
    if sign_src.shape != x.shape:
        raise ValueError(f"e2m1.encode: sign_of has shape {sign_src.shape}, expected {x.shape}")
    if jnp.finfo(x.dtype).bits < 16:
        x = x.astype(jnp.float32)
    a = jnp.abs(x)
    code = jnp.zeros(x.shape, jnp.uint8)
    for j, t in enumerate(TIE_POINTS):
        # Between code j and j + 1 a tie goes to the even one: up iff j is odd.
        up = (a >= t) if j % 2 else (a > t)
        code = code + up.astype(jnp.uint8)
    return code | (_sign_bits(sign_src) << 3)


@functools.partial(jax.jit, static_argnames=("dtype",))
def decode(codes: jax.Array, dtype=jnp.float32) -> jax.Array:
    """E2M1 codes (any integer dtype, low 4 bits used) to values of ``dtype`` (exact)."""
    codes = jnp.asarray(codes)
    if not jnp.issubdtype(codes.dtype, jnp.integer):
        raise ValueError(f"e2m1.decode: expected integer codes, got dtype {codes.dtype}")
    table = jnp.asarray(np.asarray(VALUES, np.float32)).astype(dtype)
    return jnp.take(table, (codes & 0xF).astype(jnp.int32), mode="clip")


@jax.jit
def pack(codes: jax.Array) -> jax.Array:
    """``uint8 codes [..., K] -> uint8 [..., K/2]``, the even index in the low nibble."""
    codes = jnp.asarray(codes)
    if codes.ndim == 0 or codes.shape[-1] % 2:
        raise ValueError(f"e2m1.pack: last axis must have an even size, got shape {codes.shape}")
    codes = codes.astype(jnp.uint8)
    return (codes[..., 0::2] & 0xF) | ((codes[..., 1::2] & 0xF) << 4)


@jax.jit
def unpack(packed: jax.Array) -> jax.Array:
    """``uint8 [..., K/2] -> uint8 codes [..., K]`` (inverse of :func:`pack`)."""
    packed = jnp.asarray(packed)
    if packed.dtype != jnp.uint8 or packed.ndim == 0:
        raise ValueError(f"e2m1.unpack: expected a uint8 array of rank >= 1, got {packed.dtype}{packed.shape}")
    pairs = jnp.stack([packed & 0xF, packed >> 4], axis=-1)
    return pairs.reshape(*packed.shape[:-1], 2 * packed.shape[-1])


@jax.jit
def fp16_bits(codes: jax.Array) -> jax.Array:
    """The uint16 pattern ``((n & 8) << 12) | ((n & 7) << 9)``: as FP16 it is ``e2m1(n) * 2**-14``."""
    n = jnp.asarray(codes).astype(jnp.uint16)
    return ((n & 8) << 12) | ((n & 7) << 9)


@jax.jit
def decode_fp16_scaled(codes: jax.Array) -> jax.Array:
    """Decode by bit manipulation (the Hopper path): FP16 values ``e2m1(n) * 2**-14``."""
    return jax.lax.bitcast_convert_type(fp16_bits(codes), jnp.float16)
