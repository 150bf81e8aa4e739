"""FireQ W4A8-FP: INT4 weights with FP8 E4M3 group scales, FP8 per-token activations, PTS and CAS.

Weights ``[..., K]``, groups of ``group_size`` (128) along K, symmetric:

* ``s = fp8_e4m3(max(absmax, 1e-5) / 7)`` (RNE), scales below ``2**-9`` (the smallest E4M3
  subnormal, i.e. a scale that rounded to 0) clamped up to ``2**-9``;
* ``q = clamp(rne(w / s), -8, 7)``;
* dequantized weight ``fp8_e4m3(q * s)``: the kernel converts INT4 to FP8 through a per-group
  table of pre-scaled FP8 values, so the product is itself rounded to E4M3.

Saturation (unreachable for real weights): ``absmax / 7`` above 448 saturates the scale to
448 and ``q * s`` beyond +-448 saturates to +-448 instead of becoming the E4M3 NaN.

Storage: codes two per uint8 byte (element ``2i`` in the low nibble, ``2i + 1`` in the high
nibble, two's complement), scales ``float8_e4m3fn [..., K / group_size]``: 4 + 8/128 bits
per element.

Activations: per-token dynamic FP8 (:func:`quantize_activation_fp8`). PTS
(:func:`pts_factor`) and CAS (:func:`cas_scales`) are the offline weight rescalings.
"""

from __future__ import annotations

import functools
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxlp.formats.base import (
    cast_rounded,
    QuantizedArray,
    check_blocks,
    check_field,
    check_finite,
    exact_divide,
    register_array,
    register_format,
    static_field,
    to_blocks,
)

GROUP_SIZE = 128
FP8_MAX = 448.0
MIN_SCALE = 2.0**-9
"""Smallest E4M3 subnormal: group scales are clamped up to it."""
ABSMAX_FLOOR = 1e-5
PTS_EXPONENTS = tuple(range(15))
"""PTS candidates ``p = 2**i`` for these ``i``."""
PTS_UNDERFLOW = 7 * 2.0**-9
"""A group whose absmax is below this gets a scale below ``2**-9`` (clamped)."""


def _fp8(x: jax.Array) -> jax.Array:
    """Round float32 to float8_e4m3fn (RNE), saturating at +-448 instead of overflowing to NaN."""
    return cast_rounded(jnp.clip(x, -FP8_MAX, FP8_MAX), jnp.float8_e4m3fn)


def _check_group_size(group_size) -> None:
    if not isinstance(group_size, int) or isinstance(group_size, bool) or group_size <= 0 or group_size % 2:
        raise ValueError(f"int4_fp8: group_size must be a positive even int, got {group_size!r}")


def pack_int4(q: jax.Array) -> jax.Array:
    """Pack int4 values ``[..., K]`` (K even, values in [-8, 7]) two per uint8 (even index low nibble)."""
    nib = (q.astype(jnp.int32) & 0xF).astype(jnp.uint8)
    nib = nib.reshape(*nib.shape[:-1], nib.shape[-1] // 2, 2)
    return nib[..., 0] | (nib[..., 1] << 4)


def unpack_int4(packed: jax.Array) -> jax.Array:
    """Inverse of :func:`pack_int4`: ``[..., K/2]`` uint8 -> ``[..., K]`` int8 in [-8, 7]."""
    lo = (packed & 0xF).astype(jnp.int8)
    hi = (packed >> 4).astype(jnp.int8)
    both = jnp.stack([lo, hi], axis=-1).reshape(*packed.shape[:-1], packed.shape[-1] * 2)
    return jnp.where(both >= 8, both - 16, both).astype(jnp.int8)


@register_array
class Int4FP8Array(QuantizedArray):
    """FireQ INT4 weights.

    ``codes`` uint8 ``[..., K/2]`` (two int4 per byte), ``scales`` float8_e4m3fn ``[..., K/group_size]``.
    """

    format = "int4_fp8"

    codes: jax.Array
    scales: jax.Array
    shape: tuple[int, ...] = static_field()
    group_size: int = static_field(default=GROUP_SIZE)

    def __post_init__(self):
        object.__setattr__(self, "shape", tuple(int(d) for d in self.shape))
        object.__setattr__(self, "group_size", int(self.group_size))

    def check(self) -> None:
        _check_group_size(self.group_size)
        check_blocks(self.shape, self.group_size, "int4_fp8")
        lead, k = self.shape[:-1], self.shape[-1]
        check_field("int4_fp8", "codes", self.codes, lead + (k // 2,), jnp.uint8)
        check_field("int4_fp8", "scales", self.scales, lead + (k // self.group_size,), jnp.float8_e4m3fn)

    def int4_values(self) -> jax.Array:
        """The int4 codes ``q`` as int8 ``[..., K]``."""
        return unpack_int4(self.codes)

    def dequantize(self, dtype=jnp.float32) -> jax.Array:
        """``fp8_e4m3(q * s)`` (the kernel's pre-scaled FP8 table), cast to ``dtype``."""
        return _dequantize(self.codes, self.scales, self.group_size).astype(dtype)

    def table(self) -> jax.Array:
        """The pre-scaled FP8 table of each group, ``fp8_e4m3(q * s)`` for ``q = -8 .. 7``:
        float8_e4m3fn ``[..., K / group_size, 16]`` (entry ``q + 8``)."""
        return _fp8(self.scales.astype(jnp.float32)[..., None] * jnp.arange(-8, 8, dtype=jnp.float32))

    def fp8_values(self) -> jax.Array:
        """``fp8_e4m3(q * s)`` as ``float8_e4m3fn [..., K]``: the FP8 operand of the GEMM."""
        return _dequantize(self.codes, self.scales, self.group_size)


@functools.partial(jax.jit, static_argnames="group_size")
def _dequantize(codes: jax.Array, scales: jax.Array, group_size: int) -> jax.Array:
    q = to_blocks(unpack_int4(codes).astype(jnp.float32), group_size)
    w = _fp8(q * scales.astype(jnp.float32)[..., None])
    return w.reshape(*w.shape[:-2], w.shape[-2] * group_size)


@functools.partial(jax.jit, static_argnames="group_size")
def _quantize_groups(x: jax.Array, group_size: int) -> tuple[jax.Array, jax.Array]:
    w = to_blocks(x.astype(jnp.float32), group_size)
    absmax = jnp.max(jnp.abs(w), axis=-1)
    scale = jnp.maximum(_fp8(exact_divide(jnp.maximum(absmax, ABSMAX_FLOOR), 7.0)).astype(jnp.float32), MIN_SCALE)
    # A correctly rounded float32 quotient rounds like the exact one: w has 24 significant bits
    # and s at most 4, so it never lands on (or crosses) a half-integer unless it is one. (A
    # reciprocal multiply, XLA's rewrite of a broadcast division, would break this.)
    q = jnp.clip(jnp.round(exact_divide(w, scale[..., None])), -8, 7).astype(jnp.int8)
    return pack_int4(q.reshape(x.shape)), scale.astype(jnp.float8_e4m3fn)


def quantize(x: jax.Array, *, group_size: int = GROUP_SIZE) -> Int4FP8Array:
    """Quantize weights ``[..., K]`` to FireQ INT4 with E4M3 group scales (see the module docstring)."""
    x = jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise ValueError(f"int4_fp8: expects floating-point input, got dtype {x.dtype}")
    _check_group_size(group_size)
    check_blocks(x.shape, group_size, "int4_fp8")
    check_finite(x, "int4_fp8")
    codes, scales = _quantize_groups(x, group_size)
    return Int4FP8Array(codes=codes, scales=scales, shape=tuple(x.shape), group_size=group_size)


@jax.jit
def _quantize_tokens(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    xf = x.astype(jnp.float32)
    scale = exact_divide(jnp.max(jnp.abs(xf), axis=-1, keepdims=True), FP8_MAX)
    safe = jnp.where(scale > 0, scale, 1.0)
    x_fp8 = _fp8(exact_divide(xf, safe))
    return x_fp8, scale.astype(jnp.bfloat16)


def quantize_activation_fp8(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Per-token dynamic FP8: ``x [..., K] -> (x_fp8 [..., K] float8_e4m3fn, scale [..., 1] bfloat16)``.

    ``scale = absmax / 448`` in float32 (absmax over the last axis), ``x_fp8 = fp8(clip(x /
    scale, -448, 448))`` with the float32 scale, and the GEMM output is multiplied by the scale
    rounded to BF16 (so ``x ~ x_fp8 * scale_bf16``). A row of zeros gets scale 0 and zero codes
    (it is divided by 1 instead of 0), so it dequantizes to exact zeros.
    """
    x = jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise ValueError(f"quantize_activation_fp8: expects floating-point input, got dtype {x.dtype}")
    if x.ndim == 0 or x.shape[-1] == 0:
        raise ValueError(f"quantize_activation_fp8: needs a non-empty last (token feature) axis, got shape {x.shape}")
    check_finite(x, "quantize_activation_fp8")
    return _quantize_tokens(x)


def dequantize_activation_fp8(x_fp8: jax.Array, scale: jax.Array, dtype=jnp.float32) -> jax.Array:
    """``x_fp8 * scale`` in float32, cast to ``dtype`` (inverse of :func:`quantize_activation_fp8`)."""
    return (x_fp8.astype(jnp.float32) * scale.astype(jnp.float32)).astype(dtype)


def pts_scores(w: jax.Array, *, group_size: int = GROUP_SIZE) -> tuple[jax.Array, jax.Array]:
    """PTS scores and validity of the candidates ``p = 2**i``, ``i = 0..14`` (see :func:`pts_factor`).

    ``score(p) = sum_groups max(0, 7*2**-9 - absmax(W*p)) / (7*2**-9)``; ``valid(p)`` is False
    from the first ``p`` at which some group absmax exceeds 448 on.
    """
    w = jnp.asarray(w)
    check_blocks(w.shape, group_size, "pts_factor")
    return _pts_scores(w, group_size)


@functools.partial(jax.jit, static_argnames="group_size")
def _pts_scores(w: jax.Array, group_size: int) -> tuple[jax.Array, jax.Array]:
    absmax = jnp.max(jnp.abs(to_blocks(w.astype(jnp.float32), group_size)), axis=-1).reshape(-1)
    p = jnp.asarray([2.0**i for i in PTS_EXPONENTS], jnp.float32)
    scaled = absmax[None, :] * p[:, None]  # exact: power-of-two scaling
    scores = jnp.sum(jnp.maximum(0.0, PTS_UNDERFLOW - scaled), axis=-1) / PTS_UNDERFLOW
    overflow = jnp.any(scaled > FP8_MAX, axis=-1)
    valid = jnp.cumsum(overflow.astype(jnp.int32)) == 0
    return scores, valid


def pts_factor(w: jax.Array, *, group_size: int = GROUP_SIZE) -> jax.Array:
    """Per-tensor power-of-two scaling: the factor ``p = 2**i`` (float32 scalar) to multiply W (and bias) by.

    Candidates ``i = 0..14``, stopping at the first ``p`` where a group absmax of ``W*p`` exceeds
    448; the smallest underflow score wins, ties going to the smallest ``p``. The GEMM output
    is multiplied by ``1/p``. If even ``p = 1`` overflows, returns 1 (no scaling).
    """
    scores, valid = pts_scores(w, group_size=group_size)
    best = jnp.argmin(jnp.where(valid, scores, jnp.inf))  # first minimum = smallest p
    best = jnp.where(valid[0], best, 0)
    return jnp.exp2(jnp.asarray(PTS_EXPONENTS, jnp.float32)[best])


def cas_scales(weights: Sequence[jax.Array], c: float) -> jax.Array:
    """Channel-wise absmean scaling: ``s_j = c / mean_i |W_ij|`` over the rows of all ``[N, K]`` weights.

    The weights sharing one input (e.g. gate and up projections) are scaled as ``W * s``
    (columns) and ``1/s`` is folded into what produces their input. A column that is zero in
    every weight gets ``s_j = 1``.
    """
    if isinstance(weights, (jax.Array, np.ndarray)) or len(weights) == 0:
        raise ValueError("cas_scales: expects a non-empty list of [N, K] weights")
    weights = [jnp.asarray(w) for w in weights]
    for w in weights:
        if w.ndim != 2:
            raise ValueError(f"cas_scales: every weight must be [N, K], got shape {w.shape}")
    k = weights[0].shape[1]
    if any(w.shape[1] != k for w in weights):
        raise ValueError(f"cas_scales: weights disagree on K: {[w.shape for w in weights]}")
    if not c > 0:
        raise ValueError(f"cas_scales: target absmean c must be positive, got {c}")
    total = sum(jnp.sum(jnp.abs(w.astype(jnp.float32)), axis=0) for w in weights)
    mean = total / sum(w.shape[0] for w in weights)
    return jnp.where(mean > 0, c / jnp.where(mean > 0, mean, 1.0), 1.0).astype(jnp.float32)


register_format("int4_fp8", quantize, Int4FP8Array)
