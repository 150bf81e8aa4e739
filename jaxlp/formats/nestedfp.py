"""NestedFP: an FP16 weight stored as two bytes whose upper byte is also an FP8 E4M3 weight.

For an FP16 word ``a`` (sign ``s``, exponent ``e`` = bits 14..10, mantissa ``m`` = bits 9..0)
with ``e[4] == 0`` (``|w| < 2``):

* ``lower = a & 0xFF`` (the low 8 mantissa bits);
* ``c = (s << 7) | (e[3:0] << 3) | m[9:7]``, then round to nearest even on the 7 dropped bits
  ``m[6:0]``: ``c += 1`` if ``m[6:0] > 64`` or (``m[6:0] == 64`` and ``c`` is odd); the carry
  may run into the exponent. Exception: ``e[3:0] == 15 and m[9:7] == 6`` stays unrounded so
  that 448 never rounds up into the E4M3 NaN code. ``upper = c``.

Read as ``float8_e4m3fn``, ``upper`` is ``w * 2**8`` rounded to nearest even (saturating at
448) for every ``|w| < 1.875``; the FP8 GEMM multiplies its output by ``2**-8``.

Merge (lossless): ``e_ = ((upper - (lower >> 7)) >> 1) & 0x3F`` and
``fp16 = (((upper & 0x80) | e_) << 8) | lower``. The subtraction undoes the rounding carry
(``lower >> 7`` is the unrounded LSB of ``c``), so the merge is bit-exact for every word with
``e[4] == 0`` except ``|w|`` in ``[1.9375, 2)``, where the rounding carry overflows into the
sign bit; ``|w|`` in ``[1.875, 1.9375)`` gives the E4M3 NaN byte. Hence the eligibility
threshold must be below 1.875. FP16 subnormals reconstruct exactly; their upper byte is the
E4M3 subnormal nearest ``w * 2**8`` (zero only for ``|w| <= 2**-18``).

Eligibility threshold: the default is the paper's ``|w| <= 1.75`` (the released serving code
uses 1.8192). With 1.75 every upper byte is the exact RNE E4M3 cast of ``w * 2**8`` with no
saturation; thresholds in ``(1.75, 1.875)`` are accepted and saturate those weights to 448
in FP8 mode (FP16 mode stays lossless).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxlp.formats.base import QuantizedArray, check_field, register_array, register_format, static_field

DEFAULT_THRESHOLD = 1.75
"""Default eligibility threshold on ``|w|`` (inclusive), the NestedFP paper's value."""

MAX_THRESHOLD = 1.875
"""Thresholds must be below this: ``|w|`` in ``[1.875, 1.9375)`` gives the E4M3 NaN byte."""

FP8_SCALE = 2.0**-8
"""The upper byte read as E4M3 is ``w / FP8_SCALE``; FP8-mode outputs are multiplied by it."""


def _check_threshold(threshold: float) -> float:
    threshold = float(threshold)
    if not (0.0 < threshold < MAX_THRESHOLD):
        raise ValueError(
            f"nestedfp: threshold must be in (0, {MAX_THRESHOLD}) so that every eligible weight has a "
            f"valid FP8 upper byte and an exact reconstruction; got {threshold}"
        )
    return threshold


def split(w_fp16: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Split FP16 weights (other float dtypes are cast to float16 first) into ``(upper, lower)`` uint8.

    Bit-level, defined for every FP16 word (the exponent MSB is dropped); only words with
    ``|w| < 1.9375`` reconstruct exactly, see the module docstring.
    """
    w = jnp.asarray(w_fp16)
    if not jnp.issubdtype(w.dtype, jnp.floating):
        raise ValueError(f"nestedfp.split: expects floating-point weights, got dtype {w.dtype}")
    a = jax.lax.bitcast_convert_type(w.astype(jnp.float16), jnp.uint16).astype(jnp.uint32)
    lower = a & 0xFF
    sign = (a >> 15) & 0x1
    exp_low = (a >> 10) & 0xF  # e[3:0]
    mant_high = (a >> 7) & 0x7  # m[9:7]
    dropped = a & 0x7F  # m[6:0]
    c = (sign << 7) | (exp_low << 3) | mant_high
    round_up = (dropped > 64) | ((dropped == 64) & ((c & 1) == 1))
    keep_448 = (exp_low == 15) & (mant_high == 6)
    c = (c + (round_up & ~keep_448).astype(jnp.uint32)) & 0xFF
    return c.astype(jnp.uint8), lower.astype(jnp.uint8)


def merge(upper: jax.Array, lower: jax.Array) -> jax.Array:
    """Rebuild the FP16 weights from NestedFP ``(upper, lower)`` uint8 bytes (exact inverse of :func:`split`)."""
    upper = jnp.asarray(upper)
    lower = jnp.asarray(lower)
    if upper.dtype != jnp.uint8 or lower.dtype != jnp.uint8:
        raise ValueError(f"nestedfp.merge: expects uint8 bytes, got {upper.dtype} and {lower.dtype}")
    if upper.shape != lower.shape:
        raise ValueError(f"nestedfp.merge: upper shape {upper.shape} differs from lower shape {lower.shape}")
    u = upper.astype(jnp.uint32)
    low = lower.astype(jnp.uint32)
    e_ = ((u - (low >> 7)) >> 1) & 0x3F
    word = ((((u & 0x80) | e_) << 8) | low).astype(jnp.uint16)
    return jax.lax.bitcast_convert_type(word, jnp.float16)


def is_eligible(w: jax.Array, threshold: float = DEFAULT_THRESHOLD) -> bool:
    """Whether every weight (cast to float16) is finite with ``|w| <= threshold`` (needs a concrete ``w``)."""
    threshold = _check_threshold(threshold)
    w16 = jnp.asarray(w).astype(jnp.float16)
    return bool(jnp.all(jnp.abs(w16.astype(jnp.float32)) <= threshold))


@register_array
class NestedFPArray(QuantizedArray):
    """NestedFP weights: ``upper``/``lower`` uint8 bytes of the logical shape.

    ``dequantize`` (FP16 mode) is the exact FP16 weight; ``dequantize_fp8`` (FP8 mode) is the
    upper byte read as ``float8_e4m3fn`` times ``2**-8``.
    """

    format = "nestedfp"

    upper: jax.Array
    lower: jax.Array
    shape: tuple[int, ...] = static_field()
    threshold: float = static_field(default=DEFAULT_THRESHOLD)

    def __post_init__(self):
        object.__setattr__(self, "shape", tuple(int(d) for d in self.shape))
        object.__setattr__(self, "threshold", float(self.threshold))

    def check(self) -> None:
        _check_threshold(self.threshold)
        check_field("nestedfp", "upper", self.upper, self.shape, jnp.uint8)
        check_field("nestedfp", "lower", self.lower, self.shape, jnp.uint8)

    def dequantize(self, dtype=jnp.float32) -> jax.Array:
        """FP16 mode: the exact FP16 weights, cast to ``dtype``."""
        return merge(self.upper, self.lower).astype(dtype)

    def upper_as_fp8(self) -> jax.Array:
        """The upper bytes viewed as ``float8_e4m3fn`` (equal to ``w * 2**8`` rounded to E4M3)."""
        return jax.lax.bitcast_convert_type(self.upper, jnp.float8_e4m3fn)

    def dequantize_fp8(self, dtype=jnp.float32) -> jax.Array:
        """FP8 mode: ``float8_e4m3fn(upper) * 2**-8``, cast to ``dtype``."""
        return (self.upper_as_fp8().astype(jnp.float32) * FP8_SCALE).astype(dtype)


def quantize(x: jax.Array, *, threshold: float = DEFAULT_THRESHOLD) -> NestedFPArray:
    """Cast ``x`` to float16 and split it into NestedFP bytes.

    Raises ValueError if any weight is NaN/Inf or has ``|w| > threshold`` (checked only for
    concrete inputs; under ``jit`` check with :func:`is_eligible` first). Such a tensor must
    stay plain FP16 (an "exception layer").
    """
    threshold = _check_threshold(threshold)
    x = jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise ValueError(f"nestedfp: expects floating-point weights, got dtype {x.dtype}")
    w16 = x.astype(jnp.float16)
    if not isinstance(w16, jax.core.Tracer):
        mag = np.abs(np.asarray(w16, dtype=np.float32))
        if not np.all(np.isfinite(mag)):
            raise ValueError(
                "nestedfp: input holds NaN or Inf (after the float16 cast), which the format cannot represent"
            )
        if mag.size and float(mag.max()) > threshold:
            raise ValueError(
                f"nestedfp: max |w| = {float(mag.max())} (as float16) exceeds the eligibility threshold {threshold}; "
                "keep this tensor in FP16 (an exception layer)"
            )
    upper, lower = split(w16)
    return NestedFPArray(upper=upper, lower=lower, shape=tuple(x.shape), threshold=threshold)


register_format("nestedfp", quantize, NestedFPArray)
