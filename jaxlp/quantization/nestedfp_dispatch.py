"""NestedFP ``QuantizedLinear`` products for a few tokens through the CUDA kernels
(``implementation="nestedfp_cuda"``; :mod:`jaxlp.ffi.nestedfp`): the GEMV for 1..8 tokens in
either mode (FP16 mode: 1..16), FP16 mode's skinny GEMM past 16 tokens up to 64.

- FP16 mode: ``x @ merge(upper, lower).T`` with FP16 activations, the FP16 weight rebuilt from
  its two bytes in registers inside the kernel (never in memory), FP32 accumulation;
- FP8 mode: ``(e4m3(x * s) @ e4m3(upper).T) / s * 2**-8`` with the per-token scale ``s`` of the
  ``nestedfp_fp8`` activation quantizer (:mod:`jaxlp.quantization.activations`): E4M3 MMAs on the
  upper bytes alone, half the bytes of FP16 mode.

The same math as :mod:`jaxlp.quantization.native_dot` (XLA's dots), to summation order. ``"auto"``
takes these kernels up to :data:`AUTO_MAX_TOKENS` tokens (FP8 mode: 8), and FP16 mode's skinny GEMM
up to :data:`SKINNY_AUTO_MAX_TOKENS` on layers of at most :data:`SKINNY_MAX_ROWS` rows.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from jaxlp.ffi import fp8_activations as quantize_cuda
from jaxlp.ffi import nestedfp as kernel
from jaxlp.formats import nestedfp
from jaxlp.quantization import activations

IMPLEMENTATION = "nestedfp_cuda"
# "auto" (H100, docs/perf.md session 33): the GEMV up to 16 tokens (FP16 mode at 9..16 tokens on
# Qwen3-8B's layers: 0.59-0.99x the FP16 dot, 1.03-2.6x faster than CUTLASS); the skinny GEMM from
# 17 to 32 on layers of at most SKINNY_MAX_ROWS rows (1024 x 4096: 1.5x faster than CUTLASS, which
# is faster on the wider layers); CUTLASS past them.
AUTO_MAX_TOKENS = 16
SKINNY_AUTO_MAX_TOKENS = 32
SKINNY_MAX_ROWS = 1024


def layer_reason(layer, x: jax.Array) -> str | None:
    """What every NestedFP kernel needs (``None`` if met, else the reason): NestedFP weights of 2
    dimensions, no activation quantizer, FP16 activations in FP16 mode."""
    w = layer.weight.get_value()
    if getattr(w, "format", None) != nestedfp.NestedFPArray.format:
        return f"weight format {getattr(w, 'format', None)!r} (only 'nestedfp')"
    if layer.activation is not None:
        return f"NestedFP with an activation quantizer {layer.activation!r}"
    if len(w.shape) != 2:
        return f"needs a 2-D weight, got shape {w.shape}"
    if layer.mode != "fp8" and jnp.dtype(x.dtype) != jnp.dtype(jnp.float16):
        return f"NestedFP's FP16 mode needs float16 activations (an FP16 model), got {x.dtype}"
    return None


def why_not(layer, x: jax.Array) -> str | None:
    """``None`` if :func:`matmul` computes this layer on ``x`` here, else the reason it does not."""
    if (reason := layer_reason(layer, x)) is not None:
        return reason
    n, k = layer.weight.get_value().shape
    tokens = math.prod(x.shape[:-1])
    limit = kernel.max_tokens(layer.mode)
    if not 1 <= tokens <= limit:
        return f"{tokens} tokens (the kernels take 1 to {limit} in {layer.mode.upper()} mode)"
    if n % kernel.ROWS or k % kernel.WINDOW:
        return f"weight {n} x {k}: N must be a multiple of {kernel.ROWS} and K of {kernel.WINDOW}"
    if not kernel.available():
        return f"the CUDA library is not available: {kernel.LIBRARY.unavailable_reason()}"
    return None


def auto_declines(layer, x: jax.Array) -> str | None:
    """Why ``"auto"`` passes these kernels over for a layer :func:`why_not` accepts (None: it takes
    them): past :data:`AUTO_MAX_TOKENS` tokens, but for FP16 mode's skinny GEMM on narrow layers."""
    tokens = math.prod(x.shape[:-1])
    if tokens <= AUTO_MAX_TOKENS:
        return None
    if layer.weight.get_value().shape[0] <= SKINNY_MAX_ROWS and tokens <= SKINNY_AUTO_MAX_TOKENS:
        return None
    return f"{tokens} tokens: CUTLASS measured faster here"


def matmul(layer, x: jax.Array, *, splits: int | None = None, unroll: int | None = None,
           design: str | None = None) -> jax.Array:
    """The layer's product before bias (``QuantizedLinear.reference``'s math), in x's dtype, for a
    layer :func:`why_not` accepts; ``splits``, ``unroll`` and ``design``: the kernel's
    (:func:`jaxlp.ffi.nestedfp.gemv`), its defaults when None."""
    w = layer.weight.get_value()
    lead, k = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, k)
    options = dict(splits=splits, unroll=unroll, design=design, out_dtype=x.dtype)
    if layer.mode == "fp8":
        x8, scale = fp8_tokens(x2)
        y = kernel.gemv(x8, w.upper, None, divisor=scale, multiplier=nestedfp.FP8_SCALE * layer.out_scale, **options)
    else:
        y = kernel.gemv(x2, w.upper, w.lower, multiplier=layer.out_scale, **options)
    return y.reshape(*lead, w.shape[0])


def fp8_tokens(x2: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``(codes [T, K], scale [T, 1] float32)``: the ``nestedfp_fp8`` activations of ``x2 [T, K]``
    by the one-pass CUDA quantizer where its library is available (the same bits,
    :func:`jaxlp.ffi.fp8_activations.nestedfp_fp8`), else by XLA."""
    if quantize_cuda.available():
        return quantize_cuda.nestedfp_fp8(x2)
    return activations.nestedfp_fp8(x2.astype(jnp.float32))
