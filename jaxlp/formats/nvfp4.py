"""NVFP4 (NVIDIA ModelOpt numerics): E2M1 elements, an E4M3 scale per 16 elements, an FP32 tensor scale.

For ``x`` of shape ``[..., K]`` (K a multiple of 16), all arithmetic in FP32 as ModelOpt does:

- tensor scale ``g = amax(|x|) / (6 * 448)``, or a static (calibrated) value: ``tensor_scale=g``
  directly, or ``amax=A`` giving ``g = A / (6 * 448)``. An all-zero tensor (dynamic amax 0)
  gets ``g = 1``. ``g`` is floored at ``2**-117`` so that ``e4m3(s) * g >= 2**-126`` stays a
  normal FP32 number (XLA flushes FP32 subnormals to zero); this only matters for tensors
  with amax below ~1.6e-32, which then use less of the E4M3 scale range.
- block scale ``s = block_amax / (6 * g)``; ``s == 0`` (an all-zero block) becomes 1.0; clamp
  to ``[2**-9, 448]`` (``scale_clamp="modelopt"``, the smallest E4M3 subnormal) or
  ``[2**-6, 448]`` (``scale_clamp="torchao"``, the smallest E4M3 normal); cast to E4M3 with
  round-to-nearest-even.
- element ``q = rne_e2m1(clip(x / (e4m3(s) * g), -6, 6))`` (the denominator is rounded to FP32
  first). With a static scale, values above the calibrated amax saturate (s = 448, q = +-6).

  The sign bit is ModelOpt's ``quotient < 0`` (a quotient that underflows to -0 encodes as +0).

Divisions are IEEE divisions (:func:`~jaxlp.formats.base.exact_divide`; XLA's own division is
not correctly rounded) and the E4M3 rounding of ``s`` is kept with
:func:`~jaxlp.formats.base.cast_rounded` (XLA on GPU would fold the round trip away), so codes
and scales match ModelOpt bit for bit on CPU and GPU (checked on an H100).
Dequantization: ``(e2m1(q) * e4m3(s)) * g`` in FP32 (the first product is exact), then cast.
Storage: 4 bits per element + 8 bits per 16 + 32 bits per tensor = 4.5 bits + 32/size.
"""

from __future__ import annotations

import functools
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from jaxlp.formats import e2m1
from jaxlp.formats.base import (
    QuantizedArray,
    cast_rounded,
    check_blocks,
    check_field,
    check_finite,
    exact_divide,
    register_array,
    register_format,
    static_field,
    to_blocks,
)

FORMAT = "nvfp4"
BLOCK_SIZE = 16
E4M3_MAX = 448.0
E2M1_MAX = 6.0
SCALE_MIN = {"modelopt": 2.0**-9, "torchao": 2.0**-6}
TENSOR_SCALE_MIN = 2.0**-117


@register_array
class NVFP4Array(QuantizedArray):
    """NVFP4 array of logical shape ``[..., K]``.

    data: uint8 ``[..., K/2]`` packed E2M1 codes (even index in the low nibble);
    block_scale: float8_e4m3fn ``[..., K/16]``; tensor_scale: float32 scalar ``g``.
    """

    format: ClassVar[str] = FORMAT
    block_size: ClassVar[int] = BLOCK_SIZE

    data: jax.Array
    block_scale: jax.Array
    tensor_scale: jax.Array
    shape: tuple[int, ...] = static_field()
    scale_clamp: str = static_field(default="modelopt")

    def check(self) -> None:
        check_blocks(self.shape, BLOCK_SIZE, FORMAT)
        lead, k = tuple(self.shape[:-1]), self.shape[-1]
        check_field(FORMAT, "data", self.data, lead + (k // 2,), jnp.uint8)
        check_field(FORMAT, "block_scale", self.block_scale, lead + (k // BLOCK_SIZE,), jnp.float8_e4m3fn)
        check_field(FORMAT, "tensor_scale", self.tensor_scale, (), jnp.float32)
        if self.scale_clamp not in SCALE_MIN:
            raise ValueError(f"{FORMAT}: unknown scale_clamp {self.scale_clamp!r}")

    def dequantize(self, dtype=jnp.float32) -> jax.Array:
        return _dequantize(self.data, self.block_scale, self.tensor_scale, dtype=jnp.dtype(dtype))


@functools.partial(jax.jit, static_argnames=("dtype",))
def _dequantize(data: jax.Array, block_scale: jax.Array, tensor_scale: jax.Array, *, dtype) -> jax.Array:
    values = to_blocks(e2m1.decode(e2m1.unpack(data), jnp.float32), BLOCK_SIZE)
    x = (values * block_scale.astype(jnp.float32)[..., None]) * tensor_scale
    return x.reshape(*data.shape[:-1], 2 * data.shape[-1]).astype(dtype)


def _static_scalar(value, name: str) -> jax.Array:
    v = jnp.asarray(value, jnp.float32)
    if v.shape != ():
        raise ValueError(f"{FORMAT}: {name} must be a scalar, got shape {v.shape}")
    if not isinstance(v, jax.core.Tracer):  # checked on the host: works inside a jit trace too
        f = float(np.asarray(v))
        if not (np.isfinite(f) and f > 0):
            raise ValueError(f"{FORMAT}: {name} must be positive and finite, got {f}")
    return v


def tensor_scale_from_amax(amax) -> jax.Array:
    """The FP32 tensor scale ``g = amax / (6 * 448)`` of a calibrated amax."""
    return exact_divide(jnp.asarray(amax, jnp.float32), jnp.float32(E2M1_MAX * E4M3_MAX))


@functools.partial(jax.jit, static_argnames=("mode", "scale_clamp"))
def _quantize_arrays(x: jax.Array, static: jax.Array, *, mode: str, scale_clamp: str):
    """(packed codes, E4M3 block scales, FP32 tensor scale); one compiled program per shape."""
    xf = x.astype(jnp.float32)
    if mode == "tensor_scale":
        g = static
    elif mode == "amax":
        g = tensor_scale_from_amax(static)
    else:
        dyn_amax = jnp.max(jnp.abs(xf))
        g = jnp.where(dyn_amax == 0, jnp.float32(1.0), tensor_scale_from_amax(dyn_amax))
    g = jnp.maximum(g, jnp.float32(TENSOR_SCALE_MIN))

    blocks = to_blocks(xf, BLOCK_SIZE)
    block_amax = jnp.max(jnp.abs(blocks), axis=-1)
    s = exact_divide(block_amax, jnp.float32(E2M1_MAX) * g)
    s = jnp.where(s == 0, jnp.float32(1.0), s)
    s = jnp.clip(s, jnp.float32(SCALE_MIN[scale_clamp]), jnp.float32(E4M3_MAX))
    block_scale = cast_rounded(s, jnp.float8_e4m3fn)  # XLA on GPU would otherwise skip the rounding

    denom = block_scale.astype(jnp.float32) * g
    scaled = exact_divide(blocks, denom[..., None])
    # Sign from the quotient's bits: ModelOpt's ``scaled < 0`` (a quotient that underflows to -0
    # is not negative; a subnormal one is, though XLA would flush it in the clip).
    codes = e2m1.encode(jnp.clip(scaled, -E2M1_MAX, E2M1_MAX), sign_of=scaled).reshape(x.shape)
    return e2m1.pack(codes), block_scale, g.astype(jnp.float32)


def quantize(
    x: jax.Array,
    *,
    tensor_scale=None,
    amax=None,
    scale_clamp: str = "modelopt",
) -> NVFP4Array:
    """Quantize ``x [..., K]`` to NVFP4 (see the module docstring).

    tensor_scale: static FP32 tensor scale ``g`` (ModelOpt's ``weight_scale_2`` /
    ``input_scale``); amax: static amax instead (``g = amax / 2688``); give at most one.
    Without either, ``g`` comes from the amax of ``x`` (dynamic).
    """
    x = jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise ValueError(f"{FORMAT}: expected a floating-point input, got dtype {x.dtype}")
    check_blocks(x.shape, BLOCK_SIZE, FORMAT)
    check_finite(x, FORMAT)
    if scale_clamp not in SCALE_MIN:
        raise ValueError(f"{FORMAT}: scale_clamp must be one of {sorted(SCALE_MIN)}, got {scale_clamp!r}")
    if tensor_scale is not None and amax is not None:
        raise ValueError(f"{FORMAT}: give tensor_scale or amax, not both")

    if tensor_scale is not None:
        mode, static = "tensor_scale", _static_scalar(tensor_scale, "tensor_scale")
    elif amax is not None:
        mode, static = "amax", _static_scalar(amax, "amax")
    else:
        mode, static = "dynamic", jnp.float32(0.0)
    data, block_scale, g = _quantize_arrays(x, static, mode=mode, scale_clamp=scale_clamp)
    return NVFP4Array(
        data=data,
        block_scale=block_scale,
        tensor_scale=g,
        shape=tuple(int(d) for d in x.shape),
        scale_clamp=scale_clamp,
    )


def dequantize(q: NVFP4Array, dtype=jnp.float32) -> jax.Array:
    """``(e2m1(q) * e4m3(s)) * g`` computed in FP32, cast to ``dtype``."""
    return q.dequantize(dtype)


register_format(FORMAT, quantize, NVFP4Array)
