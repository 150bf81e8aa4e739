"""FP8 x FP8 ``QuantizedLinear`` products through the Pallas Mosaic GPU GEMM with scales in its
epilogue (``implementation="fp8_pallas"``; :mod:`jaxlp.pallas.fp8_matmul`):

- NestedFP, FP8 mode: ``(e4m3(x * s) @ upper.T) * (2**-8 / s)`` with the per-token scale ``s`` of
  the ``nestedfp_fp8`` activation quantizer, the upper-byte plane read as E4M3;
- W8A8-FP8 (FP8 weights with ``fp8_token`` activations): ``(e4m3(x / s_x) @ W8.T) * s_x * s_w``.

The math of :mod:`jaxlp.quantization.native_dot` (XLA's FP8 dot, then a separate scale pass over
its output), to summation order, with the scales applied to the FP32 sums before the one rounding
to x's dtype (BF16 or FP16), each step's FP8 sums promoted to FP32 registers. ``"auto"`` takes it
on a GPU before XLA's dots (for NestedFP past the 8 tokens of ``"nestedfp_cuda"``): at their speed
or faster at the measured shapes (0.96-1.15x of XLA's FP8 path, 1.1-1.4x the FP16 / BF16 dot), and
more exact (H100, docs/perf.md "session 18").

``"fp8_pallas_fast"`` (explicit only) keeps the tensor cores' own FP8 accumulation over the whole
K (``MatmulConfig(promote=False)``): 1.6-1.8x the FP16 / BF16 dot at M = 1024..2048 where
``"fp8_pallas"`` is 1.3x, at about 1.3e-3 relative error at K = 4096 and 2.9e-3 at K = 14336
(``"fp8_pallas"`` and XLA's FP8 dot: 2.4e-4 and 3.4e-4 at K = 4096; H100, docs/perf.md).

``"fp8_cutlass"`` / ``"fp8_cutlass_fast"``: the same product through CUTLASS's SM90 kernels
(:mod:`jaxlp.ffi.cutlass_gemm`; pingpong and cooperative warp-specialized schedules, which the
Pallas kernel cannot express), promoted or not, where K is a multiple of 16 and N of 8.

The activations are quantized by the one-pass CUDA kernels of :mod:`jaxlp.ffi.fp8_activations`
when that library is available (the bits XLA:CPU computes for the XLA quantizers), else by the XLA
quantizers.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from jaxlp.ffi import cutlass_gemm
from jaxlp.ffi import fp8_activations as quantize_cuda
from jaxlp.formats import fp8, nestedfp
from jaxlp.pallas import fp8_matmul as kernel
from jaxlp.quantization import nestedfp_dispatch

IMPLEMENTATION = "fp8_pallas"
FAST_IMPLEMENTATION = "fp8_pallas_fast"  # the tensor cores' own FP8 sums: faster, less exact (module doc)
CUTLASS_IMPLEMENTATION = "fp8_cutlass"
CUTLASS_FAST_IMPLEMENTATION = "fp8_cutlass_fast"
# "auto" takes CUTLASS past this many tokens, the Pallas kernel up to it (H100 / H200, docs/perf.md
# session 27: at 16 tokens Pallas 18.0 / 33.0 / 34.3 us against CUTLASS's 22.2 / 33.7 / 38.8 on
# 12288 x 4096 / 4096 x 14336 / 28672 x 4096; at 128: 22.6 / 40.5 / 42.7 against 21.6 / 34.1 / 40.7).
CUTLASS_MIN_TOKENS = 64


def why_not(layer, x: jax.Array) -> str | None:
    """``None`` if :func:`matmul` computes this layer on ``x`` here, else the reason it does not."""
    w = layer.weight.get_value()
    fmt = getattr(w, "format", None)
    if fmt == nestedfp.NestedFPArray.format:
        if layer.mode != "fp8" or layer.activation is not None:
            return "NestedFP outside its FP8 mode (the kernel multiplies FP8 by FP8)"
    elif fmt == fp8.FORMAT:
        if layer.activation != "fp8_token":
            return f"FP8 weights with activation {layer.activation!r} (only 'fp8_token': W8A8)"
    else:
        return f"weight format {fmt!r} (only 'nestedfp' in FP8 mode and {fp8.FORMAT!r} with FP8 activations)"
    if len(w.shape) != 2:
        return f"needs a 2-D weight, got shape {w.shape}"
    if jnp.dtype(x.dtype) not in kernel.OUT_DTYPES:
        return f"needs bfloat16 or float16 activations, got {x.dtype}"
    if math.prod(x.shape[:-1]) == 0:
        return "no tokens"
    if jax.default_backend() != "gpu":
        return f"the Mosaic GPU kernel needs a GPU (backend {jax.default_backend()!r})"
    return None


def why_not_cutlass(layer, x: jax.Array) -> str | None:
    """:func:`why_not` for the CUTLASS kernels (``"fp8_cutlass"``): also their shape rules and the
    library (built on first use)."""
    return why_not(layer, x) or cutlass_gemm.why_not_here(
        math.prod(x.shape[:-1]), layer.weight.get_value().shape[0], x.shape[-1])


def matmul(layer, x: jax.Array, *, config: kernel.MatmulConfig | None = None) -> jax.Array:
    """The layer's product before bias (``QuantizedLinear.reference``'s math), in x's dtype, for a
    layer :func:`why_not` accepts; ``config``: the GEMM's tiling (default: its default of M, N)."""
    return _matmul(layer, x, lambda *a, out_dtype: kernel.fp8_matmul(*a, out_dtype=out_dtype, config=config))


def matmul_fast(layer, x: jax.Array) -> jax.Array:
    """:func:`matmul` without promoting the step sums (``"fp8_pallas_fast"``, module doc)."""
    m, n = math.prod(x.shape[:-1]), layer.weight.get_value().shape[0]
    return matmul(layer, x, config=kernel.default_config(m, n, promote=False))


def matmul_cutlass(layer, x: jax.Array, *, config: str | None = None,
                   promote_k: int = cutlass_gemm.PROMOTE_K) -> jax.Array:
    """:func:`matmul` through CUTLASS (``"fp8_cutlass"``) for a layer :func:`why_not_cutlass`
    accepts; ``config``: a :data:`jaxlp.ffi.cutlass_gemm.CONFIGS` name (default: its default of M),
    ``promote_k``: K per promoted step sum."""
    return _matmul(layer, x, lambda *a, out_dtype: cutlass_gemm.fp8_matmul(*a, out_dtype=out_dtype, config=config,
                                                                          promote_k=promote_k))


def matmul_cutlass_fast(layer, x: jax.Array) -> jax.Array:
    """:func:`matmul_cutlass` without promoting the step sums (``"fp8_cutlass_fast"``)."""
    m, (n, k) = math.prod(x.shape[:-1]), layer.weight.get_value().shape
    return matmul_cutlass(layer, x, config=cutlass_gemm.default_config(m, n, k, promote=False))


def auto_declines_cutlass(layer, x: jax.Array) -> str | None:
    """Why ``"auto"`` passes over ``"fp8_cutlass"`` for ``x`` although it computes the layer: up to
    :data:`CUTLASS_MIN_TOKENS` tokens the Pallas kernel measured as fast or faster."""
    m = math.prod(x.shape[:-1])
    return f"{m} tokens: the Pallas kernel is as fast up to {CUTLASS_MIN_TOKENS}" if m <= CUTLASS_MIN_TOKENS else None


def _matmul(layer, x, gemm):
    """The product with ``gemm(x8, w8, token_scale, channel_scale, out_dtype=)`` as the FP8 GEMM."""
    w = layer.weight.get_value()
    lead, k = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, k)
    n = w.shape[0]
    if w.format == fp8.FORMAT:
        if quantize_cuda.available():  # one pass, the same bits (jaxlp.ffi.fp8_activations)
            x8, x_scale = quantize_cuda.token_fp8(x2)
        else:
            x8, x_scale = fp8.quantize_arrays(x2, granularity="token")
        channel = jnp.broadcast_to(w.scale.astype(jnp.float32), (n,))
        y = gemm(x8, w.data, x_scale, channel * layer.out_scale, out_dtype=x.dtype)
    else:
        x8, scale = nestedfp_dispatch.fp8_tokens(x2)
        token = nestedfp.FP8_SCALE * layer.out_scale / scale[:, 0]
        y = gemm(x8, w.upper_as_fp8(), token, jnp.ones((n,), jnp.float32), out_dtype=x.dtype)
    return y.reshape(*lead, n)
