"""FireQ W4A8 ``QuantizedLinear`` products on tensor cores: INT4 weights with E4M3 group scales
(:mod:`jaxlp.formats.int4_fp8`) times per-token FP8 activations (the ``fireq_fp8`` quantizer),
``(x8 @ e4m3(q * s).T) * s_x * out_scale`` (``out_scale``: PTS's ``1/p``), the FP8 weight decoded in
registers, never in memory:

- ``implementation="fireq_cuda"`` (:mod:`jaxlp.ffi.fireq`): 1..16 tokens, a CUDA GEMV streaming the
  4-bit weights through ``mma.sync`` E4M3 MMAs;
- ``implementation="fireq_pallas"`` (:mod:`jaxlp.pallas.int4_fp8_matmul`): any number of tokens, a
  Pallas Mosaic GPU FP8 WGMMA GEMM.

``"auto"`` tries them in that order on a GPU (so the GEMV up to 16 tokens, the GEMM past them),
before XLA's FP8 dot on the materialized FP8 weight (:mod:`jaxlp.quantization.native_dot`). The
math of ``QuantizedLinear.reference`` to summation order (FP32 sums of exact E4M3 products), the
activation scale applied to the FP32 sums before the one rounding to x's dtype.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from jaxlp.ffi import fireq as gemv_kernel
from jaxlp.formats import int4_fp8
from jaxlp.pallas import int4_fp8_matmul as gemm_kernel

GEMV_IMPLEMENTATION = "fireq_cuda"
GEMM_IMPLEMENTATION = "fireq_pallas"


def layer_reason(layer, x: jax.Array) -> str | None:
    """What both kernels need (``None`` if met, else the reason): a 2-D FireQ INT4 weight with
    groups of 128, the ``fireq_fp8`` activation quantizer, BF16 or FP16 activations, some tokens."""
    w = layer.weight.get_value()
    if getattr(w, "format", None) != int4_fp8.Int4FP8Array.format:
        return f"weight format {getattr(w, 'format', None)!r} (only 'int4_fp8')"
    if layer.activation != "fireq_fp8":
        return f"activation {layer.activation!r} (the kernels multiply FP8 by FP8: only 'fireq_fp8', W4A8)"
    if len(w.shape) != 2 or w.group_size != int4_fp8.GROUP_SIZE:
        return f"needs a 2-D weight with groups of {int4_fp8.GROUP_SIZE}, got shape {w.shape}, group {w.group_size}"
    if jnp.dtype(x.dtype) not in gemm_kernel.OUT_DTYPES:
        return f"needs bfloat16 or float16 activations, got {x.dtype}"
    if math.prod(x.shape[:-1]) == 0:
        return "no tokens"
    return None


def why_not_gemv(layer, x: jax.Array) -> str | None:
    """``None`` if :func:`matmul_gemv` computes this layer on ``x`` here, else the reason."""
    if (reason := layer_reason(layer, x)) is not None:
        return reason
    n = layer.weight.get_value().shape[0]
    tokens = math.prod(x.shape[:-1])
    if tokens > gemv_kernel.MAX_TOKENS:
        return f"{tokens} tokens (the GEMV takes 1 to {gemv_kernel.MAX_TOKENS})"
    if n % gemv_kernel.ROWS:
        return f"N = {n} is not a multiple of {gemv_kernel.ROWS}"
    if not gemv_kernel.available():
        return f"the CUDA library is not available: {gemv_kernel.LIBRARY.unavailable_reason()}"
    return None


def why_not_gemm(layer, x: jax.Array) -> str | None:
    """``None`` if :func:`matmul_gemm` computes this layer on ``x`` here, else the reason."""
    if (reason := layer_reason(layer, x)) is not None:
        return reason
    if jax.default_backend() != "gpu":
        return f"the Mosaic GPU kernel needs a GPU (backend {jax.default_backend()!r})"
    return None


def _quantized_tokens(layer, x):
    lead, k = x.shape[:-1], x.shape[-1]
    x8, x_scale = int4_fp8.quantize_activation_fp8(x.reshape(-1, k))
    return lead, x8, x_scale[:, 0].astype(jnp.float32)


def matmul_gemv(layer, x: jax.Array) -> jax.Array:
    """The layer's product before bias through the CUDA GEMV (1..16 tokens)."""
    w = layer.weight.get_value()
    lead, x8, x_scale = _quantized_tokens(layer, x)
    y = gemv_kernel.gemv(x8, w.codes, w.scales) * x_scale[:, None]
    if layer.out_scale != 1.0:
        y = y * layer.out_scale
    return y.reshape(*lead, w.shape[0]).astype(x.dtype)


def matmul_gemm(layer, x: jax.Array, *, config: gemm_kernel.MatmulConfig | None = None) -> jax.Array:
    """The layer's product before bias through the Pallas GEMM; ``config``: its tiling."""
    w = layer.weight.get_value()
    lead, x8, x_scale = _quantized_tokens(layer, x)
    y = gemm_kernel.int4_fp8_matmul(x8, w, x_scale * layer.out_scale, out_dtype=x.dtype, config=config)
    return y.reshape(*lead, w.shape[0])
