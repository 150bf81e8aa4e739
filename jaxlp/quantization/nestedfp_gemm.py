"""NestedFP FP16-mode ``QuantizedLinear`` products through GEMMs that rebuild the FP16 weight from its
two byte planes inside the GEMM: the Pallas Mosaic GPU kernel (``implementation="nestedfp_pallas"``;
:mod:`jaxlp.pallas.nestedfp_matmul`) and CUTLASS's mixed-input mainloop through FFI
(``"nestedfp_cutlass"``; :func:`jaxlp.ffi.cutlass_gemm.nestedfp16_matmul`, K a multiple of 16 and N
of 8), any number of tokens.

``"auto"`` takes them on a GPU for the FP16 mode past 8 tokens (``"nestedfp_cuda"`` takes 1..8):
CUTLASS outside :data:`PALLAS_TOKENS` (its register design up to 512 tokens, the producer warpgroup's
merges past 768), Pallas within, all before XLA's merge-then-dot
(:mod:`jaxlp.quantization.native_dot`), though still behind XLA's FP16 dot on plain FP16 weights
(0.6-0.9x; docs/perf.md sessions 18, 27 and 30).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from jaxlp.ffi import cutlass_gemm
from jaxlp.pallas import nestedfp_matmul as kernel
from jaxlp.quantization import nestedfp_dispatch

IMPLEMENTATION = "nestedfp_pallas"
CUTLASS_IMPLEMENTATION = "nestedfp_cutlass"
# "auto" takes the Pallas kernel for these token counts, CUTLASS outside them. Up to 512 tokens
# CUTLASS's register design (H200, docs/perf.md session 27: at 128 tokens 24.9 / 80.1 / 49.4 / 22.9
# us against Pallas's 40.5 / 114.6 / 130.7 / 39.6 on 6144 x 4096 / 28672 x 4096 / 4096 x 14336 /
# 4096 x 4096); past 768 the transform kernel (H100, session 30: at 1024 tokens 108.0 / 387.9 / 189.0
# / 57.3 against 110.8 / 406.7 / 191.6 / 56.5; at 2048 165.3 / 767.1 / 369.2 / 110.5 against 173.4 /
# 807.4 / 392.5 / 114.3; cutlass_gemm.TRANSFORM_MIN_TOKENS).
PALLAS_TOKENS = range(513, cutlass_gemm.TRANSFORM_MIN_TOKENS + 1)


def why_not(layer, x: jax.Array) -> str | None:
    """``None`` if :func:`matmul` computes this layer on ``x`` here, else the reason it does not."""
    if (reason := nestedfp_dispatch.layer_reason(layer, x)) is not None:
        return reason
    if layer.mode != "fp16":
        return f"mode {layer.mode!r} (the kernel computes the FP16 mode)"
    if math.prod(x.shape[:-1]) == 0:
        return "no tokens"
    if jax.default_backend() != "gpu":
        return f"the Mosaic GPU kernel needs a GPU (backend {jax.default_backend()!r})"
    return None


def why_not_cutlass(layer, x: jax.Array) -> str | None:
    """:func:`why_not` for ``"nestedfp_cutlass"``: also the CUTLASS kernel's shape rules and library."""
    return why_not(layer, x) or cutlass_gemm.why_not_here(
        math.prod(x.shape[:-1]), layer.weight.get_value().shape[0], x.shape[-1])


def auto_declines_cutlass(layer, x: jax.Array) -> str | None:
    """Why ``"auto"`` passes over ``"nestedfp_cutlass"`` for ``x`` although it computes the layer:
    for :data:`PALLAS_TOKENS` tokens the Pallas kernel measured faster."""
    m = math.prod(x.shape[:-1])
    if m in PALLAS_TOKENS:
        return f"{m} tokens: the Pallas kernel is faster from {PALLAS_TOKENS.start} to {PALLAS_TOKENS.stop - 1}"
    return None


def matmul(layer, x: jax.Array) -> jax.Array:
    """The layer's product before bias (``QuantizedLinear.reference``'s math), in x's dtype, for a
    layer :func:`why_not` accepts."""
    return _matmul(layer, x, kernel.nestedfp_matmul)


def matmul_cutlass(layer, x: jax.Array, *, config: str | None = None) -> jax.Array:
    """:func:`matmul` through CUTLASS for a layer :func:`why_not_cutlass` accepts; ``config``: a
    :data:`jaxlp.ffi.cutlass_gemm.NESTEDFP_CONFIGS` name (default: its default of M, N, K)."""
    return _matmul(layer, x, lambda x2, w: cutlass_gemm.nestedfp16_matmul(x2, w, config=config))


def _matmul(layer, x, gemm):
    w = layer.weight.get_value()
    lead, k = x.shape[:-1], x.shape[-1]
    y = gemm(x.reshape(-1, k), w)
    if layer.out_scale != 1.0:
        y = (y.astype(jnp.float32) * layer.out_scale).astype(x.dtype)
    return y.reshape(*lead, w.shape[0])
