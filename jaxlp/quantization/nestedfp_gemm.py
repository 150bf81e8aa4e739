"""NestedFP FP16-mode ``QuantizedLinear`` products through the Pallas Mosaic GPU GEMM
(``implementation="nestedfp_pallas"``; :mod:`jaxlp.pallas.nestedfp_matmul`): WGMMA with the FP16
weight rebuilt from its two byte planes in registers, any number of tokens.

Explicit only for now: ``"auto"`` reaches XLA's dots (:mod:`jaxlp.quantization.native_dot`) first,
because this kernel measured 0.57-0.78x of XLA's FP16 dot (H100, 12288 x 4096 and 4096 x 4096,
M = 128..2048; docs/perf.md), faster than XLA's merge-then-dot only at M = 128.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from jaxlp.formats import nestedfp
from jaxlp.pallas import nestedfp_matmul as kernel

IMPLEMENTATION = "nestedfp_pallas"


def why_not(layer, x: jax.Array) -> str | None:
    """``None`` if :func:`matmul` computes this layer on ``x`` here, else the reason it does not."""
    w = layer.weight.get_value()
    if getattr(w, "format", None) != nestedfp.NestedFPArray.format:
        return f"weight format {getattr(w, 'format', None)!r} (only 'nestedfp')"
    if layer.activation is not None:
        return f"NestedFP with an activation quantizer {layer.activation!r}"
    if layer.mode != "fp16":
        return f"mode {layer.mode!r} (the kernel computes the FP16 mode)"
    if len(w.shape) != 2:
        return f"needs a 2-D weight, got shape {w.shape}"
    if jnp.dtype(x.dtype) != jnp.dtype(jnp.float16):
        return f"NestedFP's FP16 mode needs float16 activations (an FP16 model), got {x.dtype}"
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
