"""XLA's own low-precision dots for the FP8 and NestedFP linears (``implementation="xla_native"``).

No hand-written kernel: each product is one ``dot_general`` on the stored low-precision
operands with FP32 accumulation, which XLA lowers to cuBLASLt FP8 / FP16 GEMMs on Hopper
(both operands contract their last axis: the "TN" layout FP8 tensor cores need). Scales are
applied to the FP32 product, after the dot; ``QuantizedLinear.reference`` applies them to the
operands before it, so the two differ by rounding of the scale products and summation order.

- FP8 weights (``fp8_e4m3``, per channel or per tensor ``s_w``), no activation quantizer (W8A16):
  ``(x @ f(W8).T) * s_w`` with ``f`` the exact cast of E4M3 to x's dtype (BF16 or FP16).
- FP8 weights, ``fp8_token`` activations (W8A8): ``(e4m3(x / s_x) @ W8.T) * s_x * s_w`` with
  ``s_x = amax(x) / 448`` per token (:mod:`jaxlp.formats.fp8`).
- NestedFP, FP8 mode: ``(e4m3(x * s) @ upper.T) / s * 2**-8``, ``s`` the per-token scale of
  the ``nestedfp_fp8`` activation quantizer (:mod:`jaxlp.quantization.activations`).
- NestedFP, FP16 mode, FP16 activations: ``x @ merge(upper, lower).T`` (the FP16 weight rebuilt
  from its two bytes inside the jitted program; XLA may fuse the merge into its GEMM).
- FireQ INT4 (``int4_fp8``) with ``fireq_fp8`` activations (W4A8): ``(x8 @ W8.T) * s_x`` with
  ``W8 = e4m3(q * s_group)`` (the exact pre-scaled FP8 weight, materialized by XLA before its
  FP8 GEMM), ``x8, s_x`` the per-token FP8 codes and BF16 scale of
  :func:`jaxlp.formats.int4_fp8.quantize_activation_fp8`; without an activation quantizer
  (W4A16) ``x @ f(W8).T``.

:func:`why_not` names what does not run here; ``"auto"`` takes this path only on a GPU, where
it is the fast one (on a CPU these dots are emulated and the reference is the CPU path).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxlp.formats import fp8, int4_fp8, nestedfp
from jaxlp.quantization import activations

IMPLEMENTATION = "xla_native"
HALF_ACTIVATIONS = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def why_not(layer, x: jax.Array) -> str | None:
    """``None`` if :func:`matmul` computes this layer on ``x``, else the reason it does not."""
    w = layer.weight.get_value()
    fmt = getattr(w, "format", None)
    if len(w.shape) != 2:
        return f"needs a 2-D weight, got shape {w.shape}"
    if fmt == fp8.FORMAT:
        if layer.activation not in (None, "fp8_token"):
            return f"FP8 weights with activation {layer.activation!r} (only none or 'fp8_token')"
        if layer.activation is None and jnp.dtype(x.dtype) not in HALF_ACTIVATIONS:
            return f"W8A16 needs bfloat16 or float16 activations, got {x.dtype}"
        return None
    if fmt == nestedfp.NestedFPArray.format:
        if layer.activation is not None:
            return f"NestedFP with an activation quantizer {layer.activation!r}"
        if layer.mode != "fp8" and jnp.dtype(x.dtype) != jnp.dtype(jnp.float16):
            return f"NestedFP's FP16 mode needs float16 activations (an FP16 model), got {x.dtype}"
        return None
    if fmt == int4_fp8.Int4FP8Array.format:
        if layer.activation not in (None, "fireq_fp8"):
            return f"FireQ INT4 weights with activation {layer.activation!r} (only none or 'fireq_fp8')"
        if layer.activation is None and jnp.dtype(x.dtype) not in HALF_ACTIVATIONS:
            return f"W4A16 needs bfloat16 or float16 activations, got {x.dtype}"
        return None
    return f"weight format {fmt!r} (only {fp8.FORMAT!r}, 'nestedfp' and {int4_fp8.Int4FP8Array.format!r})"


def _dot(a: jax.Array, b: jax.Array, out_dtype=jnp.float32) -> jax.Array:
    """``a [..., K] @ b [N, K].T`` with FP32 accumulation, as one 2-D dot (rows = tokens), written
    as ``out_dtype``."""
    lead = a.shape[:-1]
    y = jax.lax.dot_general(a.reshape(-1, a.shape[-1]), b, (((1,), (1,)), ((), ())),
                            preferred_element_type=out_dtype)
    return y.reshape(*lead, b.shape[0])


def _fp8_product_dtype(x: jax.Array):
    """The dtype an FP8 x FP8 dot writes before its scales: BF16 for BF16 activations (the GEMM
    writes half the bytes and the scale pass reads half: one more BF16 rounding, far below the FP8
    error, and BF16's range holds any E4M3 product sum), else FP32."""
    return jnp.bfloat16 if x.dtype == jnp.bfloat16 else jnp.float32


def matmul(layer, x: jax.Array) -> jax.Array:
    """The layer's product before bias (``QuantizedLinear.reference``'s math), in x's dtype, for a
    layer :func:`why_not` accepts (``QuantizedLinear`` asks it first). Every scale is applied in one
    expression after the dot (one elementwise pass)."""
    w = layer.weight.get_value()
    f32 = jnp.float32
    if w.format == fp8.FORMAT:
        if layer.activation is None:
            y = _dot(x, w.data.astype(x.dtype)) * w.scale  # [N] broadcasts over the last axis
        else:
            x8, x_scale = fp8.quantize_arrays(x, granularity="token")
            y = _dot(x8, w.data, _fp8_product_dtype(x)).astype(f32) * (x_scale[..., None] * w.scale)
    elif w.format == int4_fp8.Int4FP8Array.format:
        if layer.activation is None:
            y = _dot(x, w.fp8_values().astype(x.dtype))
        else:
            x8, x_scale = int4_fp8.quantize_activation_fp8(x)
            y = _dot(x8, w.fp8_values(), _fp8_product_dtype(x)).astype(f32) * x_scale.astype(f32)
    elif layer.mode == "fp8":
        x8, scale = activations.nestedfp_fp8(x.astype(f32))
        y = _dot(x8, w.upper_as_fp8()) * (nestedfp.FP8_SCALE / scale)
    else:
        y = _dot(x, nestedfp.merge(w.upper, w.lower))
    if layer.out_scale != 1.0:
        y = y * layer.out_scale
    return y.astype(x.dtype)
