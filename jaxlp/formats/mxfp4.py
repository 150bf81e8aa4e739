"""MXFP4 (OCP Microscaling v1.0): E2M1 elements sharing a power-of-two E8M0 scale per block.

For ``x`` of shape ``[..., K]``, blocks of ``block_size`` (32 by default; 16 and 64 allowed)
consecutive elements along K, in FP32:

- ``shared_exp = floor(log2(block_amax)) - 2`` (2 = largest exponent of E2M1), clamped to the
  E8M0 range ``[-127, 127]``. ``floor(log2)`` is read from the FP32 exponent bits (exact).
  An all-zero block (and any block with amax below ``2**-124``) gets ``-127``, as the OCP
  reference library (microxcaling) does.
- element ``q = rne_e2m1(clip(x / 2**shared_exp, -6, 6))``; the division is exact (a power of two),
  the sign bit is ``x < 0``. FP32 subnormal inputs count as zero in magnitude (XLA flushes them).

Dequantization: ``e2m1(q) * 2**shared_exp`` in FP32, then cast (results below ``2**-126`` are
flushed to zero by XLA). Scales are stored as ``float8_e8m0fnu`` (the biased exponent
``shared_exp + 127`` as a byte; bitcast to uint8 for kernels).
Storage: 4 bits per element + 8 bits per block = 4.25 bits at block size 32.
"""

from __future__ import annotations

import functools
from typing import ClassVar

import jax
import jax.numpy as jnp

from jaxlp.formats import e2m1
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

FORMAT = "mxfp4"
BLOCK_SIZES = (16, 32, 64)
E2M1_EMAX = 2
E2M1_MAX = 6.0
SCALE_EMIN, SCALE_EMAX = -127, 127
SCALE_BIAS = 127


@register_array
class MXFP4Array(QuantizedArray):
    """MXFP4 array of logical shape ``[..., K]``.

    data: uint8 ``[..., K/2]`` packed E2M1 codes (even index in the low nibble);
    scale: float8_e8m0fnu ``[..., K/block_size]`` (the power of two ``2**shared_exp``).
    """

    format: ClassVar[str] = FORMAT

    data: jax.Array
    scale: jax.Array
    shape: tuple[int, ...] = static_field()
    block_size: int = static_field(default=32)

    def check(self) -> None:
        if self.block_size not in BLOCK_SIZES:
            raise ValueError(f"{FORMAT}: block_size must be one of {BLOCK_SIZES}, got {self.block_size}")
        check_blocks(self.shape, self.block_size, FORMAT)
        lead, k = tuple(self.shape[:-1]), self.shape[-1]
        check_field(FORMAT, "data", self.data, lead + (k // 2,), jnp.uint8)
        check_field(FORMAT, "scale", self.scale, lead + (k // self.block_size,), jnp.float8_e8m0fnu)

    def shared_exponent(self) -> jax.Array:
        """The unbiased shared exponents, int32 ``[..., K/block_size]``."""
        biased = jax.lax.bitcast_convert_type(self.scale, jnp.uint8)
        return biased.astype(jnp.int32) - SCALE_BIAS

    def dequantize(self, dtype=jnp.float32) -> jax.Array:
        return _dequantize(self.data, self.scale, dtype=jnp.dtype(dtype), block_size=self.block_size)


@functools.partial(jax.jit, static_argnames=("dtype", "block_size"))
def _dequantize(data: jax.Array, scale: jax.Array, *, dtype, block_size: int) -> jax.Array:
    values = to_blocks(e2m1.decode(e2m1.unpack(data), jnp.float32), block_size)
    x = values * scale.astype(jnp.float32)[..., None]
    return x.reshape(*data.shape[:-1], 2 * data.shape[-1]).astype(dtype)


def _pow2(e: jax.Array) -> jax.Array:
    """``2.0**e`` in FP32 for integer ``e`` in the normal range [-126, 127], built from bits."""
    return jax.lax.bitcast_convert_type(((e + 127).astype(jnp.uint32)) << 23, jnp.float32)


@functools.partial(jax.jit, static_argnames=("block_size",))
def _quantize_arrays(x: jax.Array, *, block_size: int):
    """(packed codes, E8M0 scales); one compiled program per shape."""
    blocks = to_blocks(x.astype(jnp.float32), block_size)
    block_amax = jnp.max(jnp.abs(blocks), axis=-1)
    bits = jax.lax.bitcast_convert_type(block_amax, jnp.uint32)
    floor_log2 = ((bits >> 23) & 0xFF).astype(jnp.int32) - 127  # zero and subnormals: -127
    shared_exp = jnp.clip(floor_log2 - E2M1_EMAX, SCALE_EMIN, SCALE_EMAX)

    # x / 2**e == x * 2**-e exactly; -e lies in [-125, 127] for FP32 inputs, a normal power of two.
    scaled = blocks * _pow2(-shared_exp)[..., None]
    codes = e2m1.encode(jnp.clip(scaled, -E2M1_MAX, E2M1_MAX), sign_of=blocks).reshape(x.shape)
    scale = jax.lax.bitcast_convert_type((shared_exp + SCALE_BIAS).astype(jnp.uint8), jnp.float8_e8m0fnu)
    return e2m1.pack(codes), scale


def quantize(x: jax.Array, *, block_size: int = 32) -> MXFP4Array:
    """Quantize ``x [..., K]`` to MXFP4 with the OCP rule (see the module docstring)."""
    x = jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise ValueError(f"{FORMAT}: expected a floating-point input, got dtype {x.dtype}")
    if block_size not in BLOCK_SIZES:
        raise ValueError(f"{FORMAT}: block_size must be one of {BLOCK_SIZES}, got {block_size}")
    check_blocks(x.shape, block_size, FORMAT)
    check_finite(x, FORMAT)

    data, scale = _quantize_arrays(x, block_size=block_size)
    return MXFP4Array(
        data=data,
        scale=scale,
        shape=tuple(int(d) for d in x.shape),
        block_size=block_size,
    )


def dequantize(q: MXFP4Array, dtype=jnp.float32) -> jax.Array:
    """``e2m1(q) * 2**shared_exp`` in FP32, cast to ``dtype``."""
    return q.dequantize(dtype)


register_format(FORMAT, quantize, MXFP4Array)
