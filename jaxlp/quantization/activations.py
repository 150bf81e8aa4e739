"""Activation quantizers of the weight-activation recipes, as fake quantization in float32.

Each maps ``x [..., K]`` to the values the low-precision GEMM actually multiplies,
``dequantize(quantize(x))`` in float32; a GEMM on these values with FP32 accumulation is the
reference every kernel is tested against.

- ``nvfp4``: ModelOpt NVFP4 with a static tensor scale from the calibrated amax (values above
  it saturate) and dynamic E4M3 block scales per 16 elements of each token.
- ``mxfp4``: OCP MXFP4, dynamic, blocks of 32.
- ``fp8_token``: FP8 E4M3, dynamic scale ``absmax / 448`` per token.
- ``fireq_fp8``: FireQ per-token FP8 whose scale is stored (and applied) in BF16.
- ``nestedfp_fp8``: NestedFP's FP8 mode, per-token scale ``clamp(0.7 * 448 / max(absmax, 1e-5),
  0.1, 50)``: ``x_fp8 = e4m3(x * scale)``, ``x ~ x_fp8 / scale``.
- ``dialect_fp4``: BlockDialect two-stage (one-pass) dialect selection, blocks of 32.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxlp.formats import dialect_fp4, fp8, int4_fp8, mxfp4, nvfp4
from jaxlp.formats.base import cast_rounded

STATIC = {"nvfp4"}  # activation formats that need a calibrated amax


def nestedfp_fp8(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """NestedFP's FP8 activations of float32 ``x [..., K]``: ``(e4m3(x * s), s)`` with the
    per-token scale ``s [..., 1]`` (module docstring); ``x ~ codes / s``."""
    absmax = jnp.max(jnp.abs(x), axis=-1, keepdims=True)
    scale = jnp.clip(0.7 * 448.0 / jnp.maximum(absmax, 1e-5), 0.1, 50.0)
    return cast_rounded(jnp.clip(x * scale, -448.0, 448.0), jnp.float8_e4m3fn), scale


def fake_quantize(x: jax.Array, kind: str, amax: jax.Array | None = None) -> jax.Array:
    """``x`` as the GEMM sees it after quantization of kind ``kind`` (float32 out)."""
    x = x.astype(jnp.float32)
    if kind == "nvfp4":
        if amax is None:
            raise ValueError("nvfp4 activations need a calibrated amax (quantize_model(..., calibration=...))")
        # A zero amax (a layer that never saw a non-zero input) keeps a usable scale.
        return nvfp4.quantize(x, amax=jnp.maximum(amax, 1e-12)).dequantize(jnp.float32)
    if kind == "mxfp4":
        return mxfp4.quantize(x).dequantize(jnp.float32)
    if kind == "fp8_token":
        return fp8.quantize(x, granularity="token").dequantize(jnp.float32)
    if kind == "fireq_fp8":
        return int4_fp8.dequantize_activation_fp8(*int4_fp8.quantize_activation_fp8(x), jnp.float32)
    if kind == "nestedfp_fp8":
        codes, scale = nestedfp_fp8(x)
        return codes.astype(jnp.float32) / scale
    if kind == "dialect_fp4":
        return dialect_fp4.quantize(x, selection="two_stage").dequantize(jnp.float32)
    raise ValueError(f"unknown activation quantizer {kind!r}")


KINDS = ("nvfp4", "mxfp4", "fp8_token", "fireq_fp8", "nestedfp_fp8", "dialect_fp4")
