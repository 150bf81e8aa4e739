"""NestedFP FP16-mode ``QuantizedLinear`` products through GEMMs that rebuild the FP16 weight from its
two byte planes inside the GEMM: the Pallas Mosaic GPU kernel (``implementation="nestedfp_pallas"``;
:mod:`jaxlp.pallas.nestedfp_matmul`) and CUTLASS's mixed-input mainloop through FFI
(``"nestedfp_cutlass"``; :func:`jaxlp.ffi.cutlass_gemm.nestedfp16_matmul`, K a multiple of 16 and N
of 8), any number of tokens.

``"auto"`` takes CUTLASS on a GPU for the FP16 mode past 16 tokens (``"nestedfp_cuda"`` takes 1..16,
and to 32 on narrow layers;
:func:`jaxlp.ffi.cutlass_gemm.nestedfp_default_config` picks the kernel: past 512 tokens mostly the
one whose producer warpgroup rebuilds the weights), the Pallas kernel where CUTLASS does not take the
shape, both before XLA's merge-then-dot (:mod:`jaxlp.quantization.native_dot`), though still behind
XLA's FP16 dot on plain FP16 weights (0.65-0.9x, 0.81-0.87x past 512 tokens where the tiles fill the
GPU; docs/perf.md sessions 18, 27 and 30).
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
