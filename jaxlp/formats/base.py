"""Quantized arrays: the common base class, the format registry, and block helpers.

Every format is a registered dataclass pytree (a subclass of :class:`QuantizedArray`):
array fields hold packed data and scales, static fields (``dataclasses.field(metadata=
dict(static=True))``) hold the format metadata (logical shape, block size, options). The
static fields are plain Python values (ints, floats, strings, tuples) so that they can be
written to JSON by :mod:`jaxlp.checkpoint` and the abstract tree rebuilt from it.

Blocks run along the last axis (the reduction axis K of a ``[N, K]`` weight or of a
``[..., K]`` activation) unless a format says otherwise.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, ClassVar

import jax
import jax.numpy as jnp
import numpy as np


class QuantizedArray:
    """Base class of quantized arrays. Subclasses set ``format`` and implement ``dequantize``."""

    format: ClassVar[str] = ""
    shape: tuple[int, ...]  # logical (unquantized) shape, a static field of each subclass

    def dequantize(self, dtype=jnp.float32) -> jax.Array:
        raise NotImplementedError

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        """True storage bytes: the sum over the array fields (packed data, scales, metadata)."""
        return sum(int(np.prod(leaf.shape)) * jnp.dtype(leaf.dtype).itemsize for leaf in jax.tree.leaves(self))

    @property
    def bits_per_element(self) -> float:
        return 8.0 * self.nbytes / self.size

    def check(self) -> None:
        """Raise ValueError if the array fields disagree with the static fields.

        Works on abstract trees too (leaves with ``.shape`` and ``.dtype``, such as
        ``jax.ShapeDtypeStruct``); :mod:`jaxlp.checkpoint` calls it on load. The default checks
        nothing; formats override it (see :func:`check_field`).
        """

    def static_fields(self) -> dict[str, Any]:
        """The format metadata (static dataclass fields) as a dict of plain Python values."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.metadata.get("static")}


def static_field(**kwargs):
    """A dataclass field that is pytree metadata (hashable, saved as JSON in checkpoints)."""
    return dataclasses.field(metadata=dict(static=True), **kwargs)


def register_array(cls):
    """Decorator: frozen dataclass + pytree registration (static fields become metadata)."""
    cls = dataclasses.dataclass(frozen=True)(cls)
    return jax.tree_util.register_dataclass(cls)


_FORMATS: dict[str, tuple[Callable[..., QuantizedArray], type]] = {}


def register_format(name: str, quantize_fn: Callable[..., QuantizedArray], cls: type) -> None:
    """Make ``quantize(x, name, **options)`` call ``quantize_fn(x, **options)``."""
    _FORMATS[name] = (quantize_fn, cls)


def formats() -> tuple[str, ...]:
    """Names accepted by :func:`quantize`."""
    return tuple(sorted(_FORMATS))


def array_class(name: str) -> type:
    """The QuantizedArray subclass of a format name (used to rebuild checkpoints)."""
    if name not in _FORMATS:
        raise ValueError(f"unknown quantization format {name!r}; known formats: {', '.join(formats())}")
    return _FORMATS[name][1]


def quantize(x: jax.Array, fmt: str, **options) -> QuantizedArray:
    """Quantize ``x`` to format ``fmt`` (see :func:`formats`); options are the format's own."""
    if fmt not in _FORMATS:
        raise ValueError(f"unknown quantization format {fmt!r}; known formats: {', '.join(formats())}")
    return _FORMATS[fmt][0](x, **options)


def dequantize(q: QuantizedArray, dtype=jnp.float32) -> jax.Array:
    """Reverse :func:`quantize` (up to the format's rounding) into a dense array of ``dtype``."""
    if not isinstance(q, QuantizedArray):
        raise TypeError(f"dequantize expects a QuantizedArray, got {type(q).__name__}")
    return q.dequantize(dtype)


def check_blocks(shape: tuple[int, ...], block_size: int, fmt: str) -> None:
    """Raise a clear ValueError unless the last axis is a positive multiple of ``block_size``."""
    if len(shape) == 0:
        raise ValueError(f"{fmt}: cannot quantize a scalar; blocks run along the last axis")
    if shape[-1] == 0 or shape[-1] % block_size:
        raise ValueError(
            f"{fmt}: last axis (K) has size {shape[-1]}, which is not a positive multiple of the block size {block_size}"
        )


def to_blocks(x: jax.Array, block_size: int) -> jax.Array:
    """``[..., K] -> [..., K // block_size, block_size]``."""
    return x.reshape(*x.shape[:-1], x.shape[-1] // block_size, block_size)


@jax.jit
def _all_finite(x: jax.Array) -> jax.Array:
    return jnp.all(jnp.isfinite(x))


def check_finite(x: jax.Array, fmt: str) -> None:
    """Raise if ``x`` holds NaN or Inf (only when ``x`` is concrete; traced values pass)."""
    if isinstance(x, jax.core.Tracer):
        return
    if not bool(_all_finite(x)):
        raise ValueError(f"{fmt}: input holds NaN or Inf, which the format cannot represent")


def check_field(fmt: str, name: str, leaf: Any, shape: tuple[int, ...], dtype) -> None:
    """Raise a clear ValueError unless array field ``name`` has exactly ``shape`` and ``dtype``."""
    got_shape = tuple(getattr(leaf, "shape", ()))
    got_dtype = getattr(leaf, "dtype", None)
    if got_shape != tuple(shape) or got_dtype is None or jnp.dtype(got_dtype) != jnp.dtype(dtype):
        raise ValueError(
            f"{fmt}: field {name!r} should be {jnp.dtype(dtype).name}{list(shape)}, "
            f"got {getattr(got_dtype, 'name', got_dtype)}{list(got_shape)}"
        )


def exact_divide(x: jax.Array, divisor) -> jax.Array:
    """``x / divisor`` (broadcast) as correctly rounded IEEE divisions, also under ``jit``.

    XLA rewrites a division by a constant or by a broadcast value into a multiplication by
    the rounded reciprocal, which can be off by one ulp and flip a later rounding (an FP8 cast
    or an integer rounding at a tie), so results would depend on how the divisor was built.
    Broadcasting the divisor to the full shape behind an optimization barrier keeps the true
    division.
    """
    x = jnp.asarray(x)
    divisor = jnp.asarray(divisor, x.dtype)
    shape = jnp.broadcast_shapes(x.shape, divisor.shape)
    return jnp.broadcast_to(x, shape) / jax.lax.optimization_barrier(jnp.broadcast_to(divisor, shape))


def exact_divide(a: jax.Array, b: jax.Array) -> jax.Array:
    """``a / b`` correctly rounded (IEEE), elementwise with broadcasting.

    XLA's algebraic simplifier rewrites a division by a constant or by a broadcast value into a
    multiplication by the reciprocal, which rounds differently (for ``x / 2688`` about a quarter
    of FP32 results change). Reference quantizers (ModelOpt, torchao, ml_dtypes, NumPy) divide,
    so scales and rounding decisions would not match bit for bit. Here the divisor is broadcast
    to the result's shape and passed through an optimization barrier, so the rewrite cannot
    apply (the broadcast divisor is materialized).
    """
    a, b = jnp.asarray(a), jnp.asarray(b)
    shape = jnp.broadcast_shapes(a.shape, b.shape)
    dtype = jnp.result_type(a, b)
    a = jnp.broadcast_to(a.astype(dtype), shape)
    b = jax.lax.optimization_barrier(jnp.broadcast_to(b.astype(dtype), shape))
    return a / b
