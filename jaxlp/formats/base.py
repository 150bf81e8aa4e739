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
    shape = tuple(getattr(x, "shape", ()))
    if 0 in shape:
        raise ValueError(f"{fmt}: cannot quantize an empty array (shape {shape})")
    return _FORMATS[fmt][0](x, **options)


def concatenate_rows(arrays: list[QuantizedArray]) -> QuantizedArray:
    """Stack quantized ``[N_i, K]`` arrays of one format into ``[sum N_i, K]``, bit-exact.

    Row-wise fields (leading axis ``N_i``: packed data, block or channel scales) are
    concatenated; every other field (a tensor scale) and every format option must be equal
    across the inputs, since one array has one of each: NVFP4 weights to be fused must share
    their tensor scale (ModelOpt and llm-compressor export fused q/k/v and gate/up that way).
    """
    if not arrays:
        raise ValueError("concatenate_rows needs at least one array")
    first = arrays[0]
    for a in arrays:
        if type(a) is not type(first):
            raise ValueError(f"cannot concatenate {first.format} with {getattr(a, 'format', type(a).__name__)}")
        if len(a.shape) != 2 or a.shape[1] != first.shape[1]:
            raise ValueError(f"{first.format}: concatenate_rows needs [N, K] arrays of one K, got {[x.shape for x in arrays]}")
        options = {k: v for k, v in a.static_fields().items() if k != "shape"}
        if options != {k: v for k, v in first.static_fields().items() if k != "shape"}:
            raise ValueError(f"{first.format}: format options differ ({options} vs {first.static_fields()})")
    fields = {}
    for f in dataclasses.fields(first):
        if f.metadata.get("static"):
            continue
        leaves = [getattr(a, f.name) for a in arrays]
        if all(leaf.ndim >= 1 and leaf.shape[0] == a.shape[0] for leaf, a in zip(leaves, arrays)):
            fields[f.name] = jnp.concatenate(leaves, axis=0)
        elif all(leaf.shape == leaves[0].shape and bool(jnp.all(leaf == leaves[0])) for leaf in leaves):
            fields[f.name] = leaves[0]
        else:
            raise ValueError(
                f"{first.format}: field {f.name!r} is per tensor and differs between the arrays; they cannot "
                "share one (quantize the concatenated weight instead, which gives them one tensor scale)"
            )
    out = dataclasses.replace(first, **fields, shape=(sum(a.shape[0] for a in arrays), first.shape[1]))
    out.check()
    return out


def take_rows(q: QuantizedArray, rows) -> QuantizedArray:
    """Rows ``rows`` (integer indices, in that order) of a quantized ``[N, K]`` array, bit-exact:
    every row-wise field (leading axis ``N``) is indexed, every other field (a tensor scale) kept,
    so that ``dequantize(take_rows(q, r)) == dequantize(q)[r]``."""
    if not isinstance(q, QuantizedArray) or len(q.shape) != 2:
        raise ValueError(f"take_rows needs a quantized [N, K] array, got {type(q).__name__} {getattr(q, 'shape', '')}")
    n = q.shape[0]
    rows = np.asarray(rows)
    ok = rows.ndim == 1 and np.issubdtype(rows.dtype, np.integer)
    if not ok or (rows.size and (rows.min() < 0 or rows.max() >= n)):
        raise ValueError(f"{q.format}: take_rows needs a 1-D array of row indices in [0, {n}), got {rows!r}")
    fields = {}
    for f in dataclasses.fields(q):
        leaf = getattr(q, f.name)
        if not f.metadata.get("static") and leaf.ndim >= 1 and leaf.shape[0] == n:
            fields[f.name] = leaf[rows]
    out = dataclasses.replace(q, **fields, shape=(int(rows.size), q.shape[1]))
    out.check()
    return out


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


def exact_divide(a: jax.Array, b: jax.Array) -> jax.Array:
    """``a / b`` in FP32, correctly rounded (IEEE round-to-nearest-even), with broadcasting.

    XLA does not divide exactly: its simplifier turns a division by a constant or a broadcast
    value into a multiplication by the reciprocal, and on NVIDIA GPUs it emits ``div.full.f32``
    (about a quarter of quotients 1 ulp off). Reference quantizers (ModelOpt and torchao in
    PyTorch, ml_dtypes, NumPy) divide exactly, so scales and rounding decisions would differ.
    This computes the quotient of the significands by integer long division (uint32, exact on
    every backend) and rounds it to nearest even.

    Subnormal results are produced as IEEE does (gradual underflow; note that XLA flushes FP32
    subnormals to zero in later arithmetic on CPU and GPU, but their sign bit survives bitwise
    use). A zero or subnormal ``a`` gives a signed zero; a zero, subnormal, infinite or NaN
    ``b`` or an infinite or NaN ``a`` falls back to the plain division. Inputs are cast to
    float32.
    """
    a = jnp.asarray(a, jnp.float32)
    b = jnp.asarray(b, jnp.float32)
    shape = jnp.broadcast_shapes(a.shape, b.shape)
    a, b = jnp.broadcast_to(a, shape), jnp.broadcast_to(b, shape)
    ua = jax.lax.bitcast_convert_type(a, jnp.uint32)
    ub = jax.lax.bitcast_convert_type(b, jnp.uint32)
    sign = (ua ^ ub) & jnp.uint32(0x80000000)
    ea = ((ua >> 23) & 0xFF).astype(jnp.int32)
    eb = ((ub >> 23) & 0xFF).astype(jnp.int32)
    ma = (ua & 0x7FFFFF) | jnp.uint32(0x800000)
    mb = (ub & 0x7FFFFF) | jnp.uint32(0x800000)
    shift = ma < mb
    num = jnp.where(shift, ma << 1, ma)  # in [mb, 2 mb), so the quotient is in [1, 2)
    exp = ea - eb + 127 - shift.astype(jnp.int32)
    q = jnp.ones_like(num)
    r = num - mb
    for bits in (7, 7, 7, 3):  # 24 more quotient bits; r < mb < 2**24, so r << 7 fits in 31 bits
        r = r << bits
        d = r // mb
        r = r - d * mb
        q = (q << bits) | d
    # q = floor(num * 2**24 / mb) in [2**24, 2**25): 24 significand bits and a round bit.
    sticky = (r != 0).astype(jnp.uint32)
    mant = (q >> 1) + ((q & 1) & (sticky | ((q >> 1) & 1)))
    carry = mant >> 24
    mant, exp = mant >> carry, exp + carry.astype(jnp.int32)
    normal = sign | (jnp.clip(exp, 1, 254).astype(jnp.uint32) << 23) | (mant & 0x7FFFFF)
    # Gradual underflow: value = q * 2**(exp - 151) = (q / 2**(2 - exp)) * 2**-149 for exp <= 0.
    s = jnp.clip(1 - exp, 1, 25).astype(jnp.uint32)
    sub_round = (q >> s) & 1
    sub_sticky = ((q & ((jnp.uint32(1) << s) - 1)) != 0).astype(jnp.uint32) | sticky
    sub_mant = (q >> (s + 1)) + (sub_round & (sub_sticky | ((q >> (s + 1)) & 1)))
    subnormal = sign | sub_mant  # a carry into bit 23 gives the smallest normal, as it should
    inf = sign | jnp.uint32(0x7F800000)
    out = jax.lax.bitcast_convert_type(jnp.where(exp >= 255, inf, jnp.where(exp <= 0, subnormal, normal)), jnp.float32)
    signed_zero = jax.lax.bitcast_convert_type(sign, jnp.float32)
    a_zero = ea == 0
    special = (eb == 0) | (eb == 255) | (ea == 255)
    return jnp.where(special, a / b, jnp.where(a_zero, signed_zero, out))


def cast_rounded(x: jax.Array, dtype) -> jax.Array:
    """``x.astype(dtype)`` whose rounding survives a later cast back to a wider type.

    With ``xla_allow_excess_precision`` (on by default) XLA on GPU folds a round trip such as
    float32 -> float8_e4m3fn -> float32 into nothing, dropping the rounding. An optimization
    barrier after the narrowing cast keeps it.
    """
    return jax.lax.optimization_barrier(jnp.asarray(x).astype(dtype))
