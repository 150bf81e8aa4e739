"""NestedFP products for 1..8 tokens (FP16 mode: 1..64) as CUDA kernels on tensor cores (sm_90).

    y = gemv(x, upper, lower)   # float32 [M, N]: x [M <= 64, K] float16 times merge(upper, lower).T
    y = gemv(x8, upper, None)   # x8 [M, K] float8_e4m3fn times e4m3(upper).T (FP8 mode)
    y = gemv(x8, upper, None, divisor=s, multiplier=2**-8, out_dtype=jnp.float16)  # (x8 @ W8.T / s) * 2**-8

:mod:`jaxlp.quantization.nestedfp_dispatch` runs a NestedFP ``QuantizedLinear`` through it (with
the FP8 mode's activation scales). Design (``nestedfp_gemv.cu``): ``mma.sync`` with the weights as
the register operand (16 output features per CTA on the MMA's M, the tokens on its N = 8), each
thread loading 16 consecutive K of its rows and token straight into the MMA fragments, 1, 2 or 4
windows ahead (``unroll``: fewer registers and more CTAs per SM the fewer); FP16 mode rebuilds the
FP16 weights in registers (never in memory), FP8 mode reads the upper bytes alone. The K range is
split over ``splits`` (1..8) CTAs per row block (8 warps each), one thread-block cluster whose
first CTA adds the others' FP32 sums through distributed shared memory and writes the scaled
product in the output dtype: one kernel per product. Shapes: ``N`` a multiple of 16, ``K`` a
multiple of 64. In FP16 mode the GEMV takes up to 16 tokens (two MMAs per merged weight fragment
past 8), and the skinny GEMM of the same file up to 64: a CTA's 8 warps own 128 rows over the same
K, both byte planes and the tokens (2, 4 or 8 MMAs of 8 tokens per merged weight fragment) streamed
through a 4- to 8-stage cp.async ring in shared memory, so the tokens cross L2 ``M / 128`` times the
weight bytes instead of ``M / 16``; ``splits`` CTAs per 128 rows along K (a cluster;
:func:`default_skinny_splits`). The library is compiled by ``nvcc`` on first
use (:mod:`jaxlp.ffi.build`).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from jaxlp.ffi import build

TARGETS = {"fp16": "jaxlp_nestedfp16_gemv", "fp8": "jaxlp_nestedfp8_gemv"}
LIBRARY = build.Library("nestedfp_gemv",
                        {TARGETS["fp16"]: "JaxlpNestedFP16Gemv", TARGETS["fp8"]: "JaxlpNestedFP8Gemv"})
MAX_TOKENS = 8  # the MMA's N: the GEMV's tokens (FP8 mode's limit)
SKINNY_MAX_TOKENS = 64  # FP16 mode: the skinny GEMM from 9 tokens to here
SKINNY_ROWS = 128  # output features per CTA of the skinny GEMM (8 warps x 16)
DESIGNS = ("gemv", "skinny")
GEMV_FP16_DEFAULT_TOKENS = 16  # FP16 mode: the GEMV (two token groups past 8) up to here, the skinny GEMM past it
MAX_SPLITS = 8  # CTAs per cluster (the portable cluster size)
ROWS = 16  # output features per CTA (the MMA's M)
WINDOW = 64  # K per warp step
WARPS = 8  # per CTA
UNROLLS = (1, 2, 4)
# Windows in flight per warp by mode, for a grid that fits one wave at 3 CTAs per SM and for a
# larger one (H100, docs/perf.md "session 21": fewer registers win while every CTA is resident).
DEFAULT_UNROLL = {"fp16": (1, 2), "fp8": (2, 4)}
OUT_DTYPES = (jnp.float32, jnp.float16, jnp.bfloat16)


def available() -> bool:
    """True when JAX runs on a GPU and the kernel builds and loads (never raises)."""
    return LIBRARY.available()


def default_splits(n: int, k: int, num_sms: int = 132) -> int:
    """K splits per block of 16 rows: 1 where the blocks give each of ``num_sms`` SMs a CTA
    (clusters of more CTAs measured slower there), else about two CTAs per SM in all, at most
    :data:`MAX_SPLITS`, each warp left with at least two K windows."""
    blocks, windows = max(n // ROWS, 1), k // WINDOW
    if blocks >= num_sms:
        return 1
    return max(1, min(math.ceil(2 * num_sms / blocks), windows // (2 * WARPS), MAX_SPLITS))


def default_unroll(mode: str, n: int, splits: int, num_sms: int = 132) -> int:
    """K windows per pipelined step (:data:`DEFAULT_UNROLL`): the first where the grid of ``n / 16``
    row blocks x ``splits`` fits one wave at 3 CTAs on each of ``num_sms`` SMs, else the second."""
    return DEFAULT_UNROLL[mode][0 if (n // ROWS) * splits <= 3 * num_sms else 1]


def default_skinny_splits(n: int, k: int, target_ctas: int = 64) -> int:
    """K splits per 128-row tile of the skinny GEMM: about ``target_ctas`` CTAs in all, at most
    :data:`MAX_SPLITS`, each CTA left with at least 8 windows. H100, docs/perf.md session 33: 64 to 96
    CTAs ran fastest (32 tiles: 2 splits 20.4 us, 4 splits 28.4; 8 tiles: 8 splits 11.5, 2 18.4)."""
    tiles, windows = -(-n // SKINNY_ROWS), k // WINDOW
    return max(1, min(-(-target_ctas // tiles), windows // 8, MAX_SPLITS))


def max_tokens(mode: str, design: str | None = None) -> int:
    """The tokens :func:`gemv` takes in ``mode`` ("fp16" or "fp8") with ``design`` (None: either)."""
    if mode != "fp16":
        return MAX_TOKENS
    return 2 * MAX_TOKENS if design == "gemv" else SKINNY_MAX_TOKENS


def default_design(m: int) -> str:
    """The kernel for ``m`` tokens in FP16 mode: the GEMV (two token groups past 8) up to
    :data:`GEMV_FP16_DEFAULT_TOKENS`, the skinny GEMM past it."""
    return "gemv" if m <= GEMV_FP16_DEFAULT_TOKENS else "skinny"


def gemv(x: jax.Array, upper: jax.Array, lower: jax.Array | None, *, splits: int | None = None,
         unroll: int | None = None, design: str | None = None, divisor: jax.Array | None = None,
         multiplier: float = 1.0, out_dtype=jnp.float32) -> jax.Array:
    """``((x @ W.T) / divisor[:, None]) * multiplier`` in ``out_dtype`` (float32, float16 or
    bfloat16; FP32 sums) for ``x [M, K]`` (float16: FP16 mode, ``W = merge(upper, lower)``, M <= 64;
    float8_e4m3fn: FP8 mode, ``W = e4m3(upper)``, ``lower`` None, M <= 8) and the ``[N, K]`` weight
    bytes. design: ``"gemv"`` (M <= 8, FP16 mode <= 16) or ``"skinny"`` (FP16 mode; default
    :func:`default_design`); divisor: float32 per token ``[M]`` (or ``[M, 1]``; default none);
    splits: CTAs per 16 rows (skinny: per 128 rows) along K (1..8, default :func:`default_splits` /
    :func:`default_skinny_splits`); unroll: the GEMV's K windows per pipelined step (1, 2 or 4; 1 or
    2 past 8 tokens; default :func:`default_unroll`), 1 for the skinny GEMM."""
    m, k = x.shape
    n = upper.shape[0]
    fp8 = lower is None
    design = design or ("gemv" if fp8 else default_design(m))
    if design not in DESIGNS:
        raise ValueError(f"nestedfp gemv: design must be one of {DESIGNS}, got {design!r}")
    if design == "skinny":
        if fp8:
            raise ValueError("nestedfp gemv: the skinny GEMM computes the FP16 mode (float16 x and both byte planes)")
        if unroll not in (None, 1):
            raise ValueError(f"nestedfp gemv: the skinny GEMM streams one window per stage (unroll 1), got {unroll!r}")
        unroll, splits = 1, splits or default_skinny_splits(n, k)
    else:
        splits = splits or default_splits(n, k)
        unroll = unroll or default_unroll("fp8" if fp8 else "fp16", n, splits)
        if m > MAX_TOKENS and unroll == 4:
            raise ValueError("nestedfp gemv: two token groups take unroll 1 or 2 (4 spills registers)")
    if unroll not in UNROLLS:
        raise ValueError(f"nestedfp gemv: unroll must be one of {UNROLLS}, got {unroll!r}")
    if jnp.dtype(out_dtype) not in [jnp.dtype(d) for d in OUT_DTYPES]:
        raise ValueError(f"nestedfp gemv: out_dtype must be float32, float16 or bfloat16, got {out_dtype}")
    if divisor is not None and divisor.size != m:
        raise ValueError(f"nestedfp gemv: divisor must hold one value per token ({m}), got shape {divisor.shape}")
    want = jnp.float8_e4m3fn if fp8 else jnp.float16
    if jnp.dtype(x.dtype) != jnp.dtype(want):
        mode = "FP8" if fp8 else "FP16"
        raise ValueError(f"nestedfp gemv: {mode} mode takes {jnp.dtype(want).name} x, got {x.dtype}")
    bad_lower = not fp8 and (lower.shape != (n, k) or lower.dtype != jnp.uint8)
    if upper.shape != (n, k) or upper.dtype != jnp.uint8 or bad_lower:
        raise ValueError(f"nestedfp gemv: weight bytes must be uint8 [N, {k}] like x's K, got upper {upper.dtype} "
                         f"{upper.shape}" + ("" if fp8 else f", lower {lower.dtype} {lower.shape}"))
    limit = max_tokens("fp8" if fp8 else "fp16", design)
    if not 1 <= m <= limit or n % ROWS or k % WINDOW:
        raise ValueError(f"nestedfp gemv: the {design} design takes 1..{limit} tokens in {'FP8' if fp8 else 'FP16'} "
                         f"mode, N a multiple of {ROWS}, K of {WINDOW}; got M={m}, N={n}, K={k}")
    if not 1 <= splits <= MAX_SPLITS:
        raise ValueError(f"nestedfp gemv: splits must be 1..{MAX_SPLITS}, got {splits}")
    if build.on_gpu():
        LIBRARY.load()
    div = jnp.ones((m,), jnp.float32) if divisor is None else divisor.reshape(m).astype(jnp.float32)
    call = jax.ffi.ffi_call(TARGETS["fp8" if fp8 else "fp16"], jax.ShapeDtypeStruct((m, n), out_dtype))
    return call(x, upper, upper if fp8 else lower, div, splits=np.int32(splits), unroll=np.int32(unroll),
                skinny=np.int32(design == "skinny"), multiplier=np.float32(multiplier))
