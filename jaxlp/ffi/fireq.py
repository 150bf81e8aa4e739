"""FireQ W4A8 products for 1..16 tokens as a CUDA kernel on tensor cores (sm_90).

    y = gemv(x8, codes, scales)   # float32 [M, N]: x8 [M <= 16, K] float8_e4m3fn times W8.T

with ``W8 = e4m3(q * s)`` the FireQ INT4 weight's exact FP8 values
(:meth:`jaxlp.formats.int4_fp8.Int4FP8Array.fp8_values`: ``codes [N, K/2]`` two INT4 per byte,
``scales [N, K/128]`` E4M3). :mod:`jaxlp.quantization.fireq_dispatch` runs a FireQ
``QuantizedLinear`` through it (with the activation scales and PTS's ``1/p``). Design
(``fireq_gemv.cu``): ``mma.sync`` m16n8k32 E4M3 with the weights as the register operand (16
output features per CTA on the MMA's M, the tokens on its N = 8, two token groups past 8), each
thread loading 32 consecutive K of its rows (16 bytes of codes) and tokens straight into the MMA
fragments, four windows ahead, and turning each 8 codes into ``e4m3(q * s)`` with FP16 pair
arithmetic (exact) and one rounding conversion per pair; the FP8 weight never exists in memory.
The K range is split over ``splits`` CTAs per row block (8 warps each) whose float32 partial sums
XLA adds. Shapes: ``N`` a multiple of 16, ``K`` of 128 (the scale group). The library is compiled
by ``nvcc`` on first use (:mod:`jaxlp.ffi.build`).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from jaxlp.ffi import build

TARGET = "jaxlp_fireq_gemv"
LIBRARY = build.Library("fireq_gemv", {TARGET: "JaxlpFireqGemv"})
MAX_TOKENS = 16  # two token groups of the MMA's N = 8
ROWS = 16  # output features per CTA (the MMA's M)
WINDOW = 128  # K per warp step: one scale group
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


def gemv(x8: jax.Array, codes: jax.Array, scales: jax.Array, *, splits: int | None = None) -> jax.Array:
    """The kernel's float32 ``[M, N]`` product ``x8 @ e4m3(q * s).T`` (no activation scale)."""
    if x8.ndim != 2 or codes.ndim != 2 or scales.ndim != 2:
        raise ValueError(f"fireq gemv: x8 [M, K], codes [N, K/2] and scales [N, K/128] must be 2-D, got "
                         f"{x8.shape}, {codes.shape}, {scales.shape}")
    m, k = x8.shape
    n = codes.shape[0]
    e4m3 = jnp.dtype(jnp.float8_e4m3fn)
    if x8.dtype != e4m3 or scales.dtype != e4m3 or codes.dtype != jnp.uint8:
        raise ValueError(f"fireq gemv: x8 and scales must be float8_e4m3fn and codes uint8, got {x8.dtype}, "
                         f"{scales.dtype}, {codes.dtype}")
    if not 1 <= m <= MAX_TOKENS or n % ROWS or k % WINDOW:
        raise ValueError(f"fireq gemv: takes 1..{MAX_TOKENS} tokens, N a multiple of {ROWS}, K of {WINDOW}; "
                         f"got M={m}, N={n}, K={k}")
    if codes.shape != (n, k // 2) or scales.shape != (n, k // WINDOW):
        raise ValueError(f"fireq gemv: codes must be [N, K/2] = [{n}, {k // 2}] and scales [N, K/128] = "
                         f"[{n}, {k // WINDOW}] for x8's K = {k}, got {codes.shape} and {scales.shape}")
    splits = splits or default_splits(n, k)
    if build.on_gpu():
        LIBRARY.load()
    call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct((splits, m, n), jnp.float32))
    return call(x8, codes, scales).sum(axis=0)
