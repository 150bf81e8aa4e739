"""NestedFP products for 1..8 tokens as a CUDA kernel on tensor cores (sm_90).

    y = gemv(x, upper, lower)   # float32 [M, N]: x [M <= 8, K] float16 times merge(upper, lower).T
    y = gemv(x8, upper, None)   # x8 [M, K] float8_e4m3fn times e4m3(upper).T (FP8 mode)

:mod:`jaxlp.quantization.nestedfp_dispatch` runs a NestedFP ``QuantizedLinear`` through it (with
the FP8 mode's activation scales). Design (``nestedfp_gemv.cu``): ``mma.sync`` with the weights as
the register operand (16 output features per CTA on the MMA's M, the tokens on its N = 8), each
thread loading 16 consecutive K of its rows and token straight into the MMA fragments, a few
windows ahead; FP16 mode rebuilds the FP16 weights in registers (never in memory), FP8 mode reads
the upper bytes alone. The K range is split over ``splits`` CTAs per row block (8 warps each)
whose float32 partial sums XLA adds. Shapes: ``N`` a multiple of 16, ``K`` a multiple of 64. The
library is compiled by ``nvcc`` on first use (:mod:`jaxlp.ffi.build`).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from jaxlp.ffi import build

TARGETS = {"fp16": "jaxlp_nestedfp16_gemv", "fp8": "jaxlp_nestedfp8_gemv"}
LIBRARY = build.Library("nestedfp_gemv",
                        {TARGETS["fp16"]: "JaxlpNestedFP16Gemv", TARGETS["fp8"]: "JaxlpNestedFP8Gemv"})
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


def gemv(x: jax.Array, upper: jax.Array, lower: jax.Array | None, *, splits: int | None = None) -> jax.Array:
    """The kernel's float32 ``[M, N]`` product of ``x [M, K]`` (float16: FP16 mode with ``lower``;
    float8_e4m3fn: FP8 mode on ``upper`` alone, ``lower`` None) and the ``[N, K]`` weight bytes."""
    m, k = x.shape
    n = upper.shape[0]
    fp8 = lower is None
    want = jnp.float8_e4m3fn if fp8 else jnp.float16
    if jnp.dtype(x.dtype) != jnp.dtype(want):
        mode = "FP8" if fp8 else "FP16"
        raise ValueError(f"nestedfp gemv: {mode} mode takes {jnp.dtype(want).name} x, got {x.dtype}")
    bad_lower = not fp8 and (lower.shape != (n, k) or lower.dtype != jnp.uint8)
    if upper.shape != (n, k) or upper.dtype != jnp.uint8 or bad_lower:
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
