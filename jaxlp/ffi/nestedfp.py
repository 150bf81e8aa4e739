"""NestedFP products for 1..8 tokens as a CUDA kernel on tensor cores (sm_90).

    y = matmul(layer, x)      # a QuantizedLinear with NestedFP weights, x [..., K] with <= 8 tokens

- FP16 mode: ``x @ merge(upper, lower).T`` with FP16 activations, the FP16 weight rebuilt from
  its two bytes in registers inside the kernel (never in memory), FP32 accumulation;
- FP8 mode: ``(e4m3(x * s) @ e4m3(upper).T) / s * 2**-8`` with the per-token scale ``s`` of the
  ``nestedfp_fp8`` activation quantizer (:mod:`jaxlp.quantization.activations`): E4M3 MMAs on the
  upper bytes alone, half the bytes of FP16 mode.

The same math as :mod:`jaxlp.quantization.native_dot` (XLA's dots, which take over past 8 tokens),
to summation order. Design (``nestedfp_gemv.cu``): ``mma.sync`` with the weights as the register
operand (16 output features per CTA on the MMA's M, the tokens on its N = 8), each thread loading
16 consecutive K of its rows and token straight into the MMA fragments, a few windows ahead; the K
range is split over ``splits`` CTAs per row block (8 warps each) whose float32 partial sums XLA
adds. Shapes: ``N`` a multiple of 16, ``K`` a multiple of 64 (:func:`why_not` names what does not
fit). The library is compiled by ``nvcc`` on first use (:mod:`jaxlp.ffi.build`).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from jaxlp.ffi import build
from jaxlp.formats import nestedfp

IMPLEMENTATION = "nestedfp_cuda"
TARGETS = {"fp16": "jaxlp_nestedfp16_gemv", "fp8": "jaxlp_nestedfp8_gemv"}
LIBRARY = build.Library("nestedfp_gemv", {TARGETS["fp16"]: "JaxlpNestedFP16Gemv", TARGETS["fp8"]: "JaxlpNestedFP8Gemv"})
MAX_TOKENS = 8  # the MMA's N
ROWS = 16  # output features per CTA (the MMA's M)
WINDOW = 64  # K per warp step
WARPS = 8  # per CTA
TARGET_CTAS = 2 * 132  # with 2-4 windows of loads in flight per warp: enough to stream the weights


def available() -> bool:
    """True when JAX runs on a GPU and the kernel builds and loads (never raises)."""
    return LIBRARY.available()


def default_splits(n: int, k: int) -> int:
    """K splits per block of 16 rows: about :data:`TARGET_CTAS` CTAs in all, each warp left with
    at least two K windows."""
    windows = k // WINDOW
    return max(1, min(math.ceil(TARGET_CTAS / max(n // ROWS, 1)), windows // (2 * WARPS)))


def why_not(layer, x: jax.Array) -> str | None:
    """``None`` if :func:`matmul` computes this layer on ``x`` here, else the reason it does not."""
    w = layer.weight.get_value()
    if getattr(w, "format", None) != nestedfp.NestedFPArray.format:
        return f"weight format {getattr(w, 'format', None)!r} (only 'nestedfp')"
    if layer.activation is not None:
        return f"NestedFP with an activation quantizer {layer.activation!r}"
    if len(w.shape) != 2:
        return f"needs a 2-D weight, got shape {w.shape}"
    n, k = w.shape
    tokens = math.prod(x.shape[:-1])
    if not 1 <= tokens <= MAX_TOKENS:
        return f"{tokens} tokens (the kernel takes 1 to {MAX_TOKENS})"
    if n % ROWS or k % WINDOW:
        return f"weight {n} x {k}: N must be a multiple of {ROWS} and K of {WINDOW}"
    if layer.mode != "fp8" and jnp.dtype(x.dtype) != jnp.dtype(jnp.float16):
        return f"NestedFP's FP16 mode needs float16 activations (an FP16 model), got {x.dtype}"
    if not available():
        return f"the CUDA library is not available: {LIBRARY.unavailable_reason()}"
    return None


def gemv(x: jax.Array, upper: jax.Array, lower: jax.Array | None, *, splits: int | None = None) -> jax.Array:
    """The kernel's float32 ``[M, N]`` product of ``x [M, K]`` (float16: FP16 mode with ``lower``;
    float8_e4m3fn: FP8 mode on ``upper`` alone, ``lower`` None) and the ``[N, K]`` weight bytes."""
    m, k = x.shape
    n = upper.shape[0]
    fp8 = lower is None
    want = jnp.float8_e4m3fn if fp8 else jnp.float16
    if jnp.dtype(x.dtype) != jnp.dtype(want):
        raise ValueError(f"nestedfp gemv: {'FP8' if fp8 else 'FP16'} mode takes {jnp.dtype(want).name} x, got {x.dtype}")
    if upper.shape != (n, k) or upper.dtype != jnp.uint8 or (not fp8 and (lower.shape != (n, k) or lower.dtype != jnp.uint8)):
        raise ValueError(f"nestedfp gemv: weight bytes must be uint8 [N, {k}] like x's K, got upper {upper.dtype} "
                         f"{upper.shape}" + ("" if fp8 else f", lower {lower.dtype} {lower.shape}"))
    if not 1 <= m <= MAX_TOKENS or n % ROWS or k % WINDOW:
        raise ValueError(f"nestedfp gemv: takes 1..{MAX_TOKENS} tokens, N a multiple of {ROWS}, K of {WINDOW}; "
                         f"got M={m}, N={n}, K={k}")
    splits = splits or default_splits(n, k)
    if build.on_gpu():
        LIBRARY.load()
    call = jax.ffi.ffi_call(TARGETS["fp8" if fp8 else "fp16"], jax.ShapeDtypeStruct((splits, m, n), jnp.float32))
    return call(x, upper, upper if fp8 else lower).sum(axis=0)


def matmul(layer, x: jax.Array) -> jax.Array:
    """The layer's product before bias (``QuantizedLinear.reference``'s math), in x's dtype, for a
    layer :func:`why_not` accepts."""
    from jaxlp.quantization import activations  # here: jaxlp.quantization imports this module

    w = layer.weight.get_value()
    lead, k = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, k)
    if layer.mode == "fp8":
        x8, scale = activations.nestedfp_fp8(x2.astype(jnp.float32))
        y = gemv(x8, w.upper, None) / scale * nestedfp.FP8_SCALE
    else:
        y = gemv(x2, w.upper, w.lower)
    if layer.out_scale != 1.0:
        y = y * layer.out_scale
    return y.reshape(*lead, w.shape[0]).astype(x.dtype)
