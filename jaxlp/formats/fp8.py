"""FP8 E4M3 with an FP32 scale per tensor, per output channel or per token.

For ``x`` of shape ``[..., K]``, in FP32:

- granularity ``"tensor"``: one scale for the whole array, shape ``()``.
- granularity ``"channel"``: one scale per output channel of a ``[N, K]`` weight, i.e. per row
  (reduce over the last axis K), scale shape ``x.shape[:-1]``.
- granularity ``"token"``: one scale per token of a ``[..., K]`` activation: the same math as
  ``"channel"`` (reduce over the last axis), named for what the rows are.

Dynamic scale ``scale = amax / 448`` (an all-zero tensor/row gets 1.0; the scale is floored at
``2**-126`` so that it stays a normal FP32 number), or a static ``scale=`` (a positive scalar,
or for channel/token an array broadcastable to ``x.shape[:-1]``). The division ``x / scale`` is
an IEEE division (:func:`~jaxlp.formats.base.exact_divide`), as in PyTorch.
Values ``e4m3(clip(x / scale, -448, 448))`` (round-to-nearest-even cast); activations above
a static scale saturate at +-448. Dequantization: ``f32(data) * scale``, then cast.
"""

from __future__ import annotations

import functools
from typing import ClassVar

import jax
import jax.numpy as jnp

from jaxlp.formats.base import (
    QuantizedArray,
    check_field,
    check_finite,
    exact_divide,
    register_array,
    register_format,
    static_field,
)

FORMAT = "fp8_e4m3"
E4M3_MAX = 448.0
GRANULARITIES = ("tensor", "channel", "token")
SCALE_MIN = 2.0**-126


def scale_shape(shape: tuple[int, ...], granularity: str) -> tuple[int, ...]:
    """Shape of the scale array of a ``shape`` input at ``granularity``."""
    return () if granularity == "tensor" else tuple(shape[:-1])


@register_array
class FP8Array(QuantizedArray):
    """FP8 E4M3 array: data float8_e4m3fn of the logical shape; scale float32 (see :func:`scale_shape`)."""

    format: ClassVar[str] = FORMAT

    data: jax.Array
    scale: jax.Array
    shape: tuple[int, ...] = static_field()
    granularity: str = static_field(default="tensor")

    def check(self) -> None:
        if self.granularity not in GRANULARITIES:
            raise ValueError(f"{FORMAT}: granularity must be one of {GRANULARITIES}, got {self.granularity!r}")
        if self.granularity != "tensor" and len(self.shape) == 0:
            raise ValueError(f"{FORMAT}: granularity {self.granularity!r} needs an array of rank >= 1")
        check_field(FORMAT, "data", self.data, self.shape, jnp.float8_e4m3fn)
        check_field(FORMAT, "scale", self.scale, scale_shape(self.shape, self.granularity), jnp.float32)

    def dequantize(self, dtype=jnp.float32) -> jax.Array:
        return _dequantize(self.data, self.scale, dtype=jnp.dtype(dtype), per_row=self.granularity != "tensor")


@functools.partial(jax.jit, static_argnames=("dtype", "per_row"))
def _dequantize(data: jax.Array, scale: jax.Array, *, dtype, per_row: bool) -> jax.Array:
    return (data.astype(jnp.float32) * (scale[..., None] if per_row else scale)).astype(dtype)


@functools.partial(jax.jit, static_argnames=("granularity",))
def quantize_arrays(x: jax.Array, scale: jax.Array | None = None, *, granularity: str):
    """``(E4M3 data, FP32 scale)`` of :func:`quantize` without its checks (traceable: the GEMMs
    quantize activations with it); one compiled program per shape."""
    xf = x.astype(jnp.float32)
    if scale is None:
        axis = None if granularity == "tensor" else -1
        amax = jnp.max(jnp.abs(xf), axis=axis)
        dyn = jnp.maximum(exact_divide(amax, jnp.float32(E4M3_MAX)), jnp.float32(SCALE_MIN))
        scale = jnp.where(amax == 0, jnp.float32(1.0), dyn)
    s_b = scale if granularity == "tensor" else scale[..., None]
    data = jnp.clip(exact_divide(xf, s_b), -E4M3_MAX, E4M3_MAX).astype(jnp.float8_e4m3fn)
    return data, scale


def quantize(x: jax.Array, *, granularity: str = "tensor", scale=None) -> FP8Array:
    """Quantize ``x [..., K]`` to FP8 E4M3 (see the module docstring)."""
    x = jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise ValueError(f"{FORMAT}: expected a floating-point input, got dtype {x.dtype}")
    if granularity not in GRANULARITIES:
        raise ValueError(f"{FORMAT}: granularity must be one of {GRANULARITIES}, got {granularity!r}")
    if granularity != "tensor" and x.ndim == 0:
        raise ValueError(f"{FORMAT}: granularity {granularity!r} reduces over the last axis; got a scalar")
    check_finite(x, FORMAT)

    target = scale_shape(x.shape, granularity)
    if scale is not None:
        s = jnp.asarray(scale, jnp.float32)
        if granularity == "tensor" and s.shape != ():
            raise ValueError(f"{FORMAT}: a static per-tensor scale must be a scalar, got shape {s.shape}")
        try:
            s = jnp.broadcast_to(s, target)
        except ValueError as e:
            raise ValueError(f"{FORMAT}: static scale of shape {s.shape} does not broadcast to {target}") from e
        if not isinstance(s, jax.core.Tracer) and not bool(jnp.all(jnp.isfinite(s) & (s > 0))):
            raise ValueError(f"{FORMAT}: static scale must be positive and finite")
    data, s = quantize_arrays(x, s if scale is not None else None, granularity=granularity)
    return FP8Array(data=data, scale=s, shape=tuple(int(d) for d in x.shape), granularity=granularity)


def dequantize(q: FP8Array, dtype=jnp.float32) -> jax.Array:
    """``f32(data) * scale``, cast to ``dtype``."""
    return q.dequantize(dtype)


register_format(FORMAT, quantize, FP8Array)
