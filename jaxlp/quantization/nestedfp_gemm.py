"""NestedFP FP16-mode ``QuantizedLinear`` products through the Pallas Mosaic GPU GEMM
(``implementation="nestedfp_pallas"``; :mod:`jaxlp.pallas.nestedfp_matmul`): WGMMA with the FP16
weight rebuilt from its two byte planes inside the GEMM, any number of tokens.

``"auto"`` takes it on a GPU for the FP16 mode past 8 tokens (``"nestedfp_cuda"`` takes 1..8),
before XLA's merge-then-dot (:mod:`jaxlp.quantization.native_dot`): faster than that at every
measured shape and M (H100, docs/perf.md "session 18"), though still behind XLA's FP16 dot on
plain FP16 weights.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from jaxlp.pallas import nestedfp_matmul as kernel
from jaxlp.quantization import nestedfp_dispatch

IMPLEMENTATION = "nestedfp_pallas"


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


def matmul(layer, x: jax.Array) -> jax.Array:
    """The layer's product before bias (``QuantizedLinear.reference``'s math), in x's dtype, for a
    layer :func:`why_not` accepts."""
    w = layer.weight.get_value()
    lead, k = x.shape[:-1], x.shape[-1]
    y = kernel.nestedfp_matmul(x.reshape(-1, k), w)
    if layer.out_scale != 1.0:
        y = (y.astype(jnp.float32) * layer.out_scale).astype(x.dtype)
    return y.reshape(*lead, w.shape[0])
