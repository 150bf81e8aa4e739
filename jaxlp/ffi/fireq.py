"""FireQ W4A8 products for 1..32 tokens as a CUDA kernel on tensor cores, and the INT4 weight
decoded to E4M3 in memory (sm_90).

    y = gemv(x8, codes, scales)   # float32 [M, N]: x8 [M <= 32, K] float8_e4m3fn times W8.T
    y = gemv(x8, codes, scales, token_scale=s, multiplier=1 / p, out_dtype=jnp.bfloat16)  # (x8 @ W8.T) * s * (1/p)
    w8 = decode(codes, scales)    # float8_e4m3fn [N, K]: W8
    t = tables(scales)            # uint8 [K/128, N, 8]: e4m3(q * s) for q = -8 .. -1 (the CUTLASS GEMM's)

with ``W8 = e4m3(q * s)`` the FireQ INT4 weight's exact FP8 values
(:meth:`jaxlp.formats.int4_fp8.Int4FP8Array.fp8_values`: ``codes [N, K/2]`` two INT4 per byte,
``scales [N, K/128]`` E4M3). :mod:`jaxlp.quantization.fireq_dispatch` runs a FireQ
``QuantizedLinear`` through it (with the activation scales and PTS's ``1/p``). Design
(``fireq.cu``): ``mma.sync`` m16n8k32 E4M3 with the weights as the register operand (16
output features per CTA on the MMA's M, the tokens on its N = 8, 2 or 4 token groups past 8), each
thread loading 32 consecutive K of its rows (16 bytes of codes) and tokens straight into the MMA
fragments, 1, 2 or 4 windows ahead (``unroll``: fewer registers and more CTAs per SM the fewer), and
turning each 8 codes into ``e4m3(q * s)`` with FP16 pair arithmetic (exact) and one rounding
conversion per pair; the FP8 weight never exists in memory. The K range is split over ``splits``
(1..8) CTAs per row block (8 warps each), one thread-block cluster whose first CTA adds the others'
FP32 sums through distributed shared memory and writes the scaled product in the output dtype
(``jaxlp/ffi/gemv_epilogue.cuh``): one kernel per product. Shapes: ``N`` a multiple of 16, ``K``
of 128 (the scale group). :func:`decode` writes ``W8`` with the same arithmetic, 32 K per thread
(the FP8 GEMM of many tokens reads it); :func:`tables` the lookup tables of
:func:`jaxlp.ffi.cutlass_gemm.fireq_matmul` (its reference: :func:`jaxlp.ffi.cutlass_gemm.fireq_tables`),
one 8-byte entry per thread. The library is compiled by ``nvcc`` on first use
(:mod:`jaxlp.ffi.build`).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from jaxlp.ffi import build

TARGET = "jaxlp_fireq_gemv"
DECODE_TARGET = "jaxlp_fireq_decode"
TABLES_TARGET = "jaxlp_fireq_tables"
LIBRARY = build.Library("fireq", {TARGET: "JaxlpFireqGemv", DECODE_TARGET: "JaxlpFireqDecode",
                                  TABLES_TARGET: "JaxlpFireqTables"})
MAX_TOKENS = 32  # four token groups of the MMA's N = 8
MAX_SPLITS = 8  # CTAs per cluster (the portable cluster size)
OUT_DTYPES = (jnp.float32, jnp.float16, jnp.bfloat16)
ROWS = 16  # output features per CTA (the MMA's M)
WINDOW = 128  # K per warp step: one scale group
WARPS = 8  # per CTA
UNROLLS = (1, 2, 4)
DEFAULT_UNROLL = 1  # the fastest at 1..16 tokens (H100, docs/perf.md "session 20")


def available() -> bool:
    """True when JAX runs on a GPU and the kernel builds and loads (never raises)."""
    return LIBRARY.available()


def default_splits(n: int, k: int, num_sms: int = 132) -> int:
    """K splits per block of 16 rows: 1 where there are ``num_sms`` blocks or more (every split of
    28672 x 4096, 6144 x 4096, 4096 x 4096 and 4096 x 14336 measured slower than none at 1 and 16
    tokens, H100, docs/perf.md "session 20"), else about one CTA per SM in all, each warp left with
    at least two K windows."""
    windows = k // WINDOW
    return max(1, min(math.ceil(num_sms / max(n // ROWS, 1)), windows // (2 * WARPS), MAX_SPLITS))


def gemv(x8: jax.Array, codes: jax.Array, scales: jax.Array, *, splits: int | None = None,
         unroll: int = DEFAULT_UNROLL, token_scale: jax.Array | None = None, multiplier: float = 1.0,
         bf16_token_scale: bool = False, out_dtype=jnp.float32) -> jax.Array:
    """``((x8 @ e4m3(q * s).T) * token_scale[:, None]) * multiplier`` in ``out_dtype`` (float32,
    float16 or bfloat16; FP32 sums). token_scale: float32 per token ``[M]`` (or ``[M, 1]``; default
    none), rounded to BF16 by the kernel first with ``bf16_token_scale`` (FireQ's stored scale);
    splits: CTAs per 16 rows along K (1..8, default :func:`default_splits`); unroll: K
    windows per pipelined step (1, 2 or 4; past 16 tokens always 1)."""
    if unroll not in UNROLLS:
        raise ValueError(f"fireq gemv: unroll must be one of {UNROLLS}, got {unroll!r}")
    if jnp.dtype(out_dtype) not in [jnp.dtype(d) for d in OUT_DTYPES]:
        raise ValueError(f"fireq gemv: out_dtype must be float32, float16 or bfloat16, got {out_dtype}")
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
    if token_scale is not None and token_scale.size != m:
        raise ValueError(f"fireq gemv: token_scale must hold one value per token ({m}), got shape {token_scale.shape}")
    splits = splits or default_splits(n, k)
    if not 1 <= splits <= MAX_SPLITS:
        raise ValueError(f"fireq gemv: splits must be 1..{MAX_SPLITS}, got {splits}")
    if build.on_gpu():
        LIBRARY.load()
    ts = jnp.ones((m,), jnp.float32) if token_scale is None else token_scale.reshape(m).astype(jnp.float32)
    call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct((m, n), out_dtype))
    return call(x8, codes, scales, ts, splits=np.int32(splits), unroll=np.int32(unroll),
                multiplier=np.float32(multiplier), bf16_token_scale=np.int32(bf16_token_scale))


def decode(codes: jax.Array, scales: jax.Array) -> jax.Array:
    """``e4m3(q * s)``: the FireQ weight's E4M3 values ``[N, K]`` from its codes ``[N, K/2]`` and
    scales ``[N, K/128]`` (:meth:`jaxlp.formats.int4_fp8.Int4FP8Array.fp8_values`, bit for bit)."""
    if codes.ndim != 2 or scales.ndim != 2 or codes.dtype != jnp.uint8 or scales.dtype != jnp.dtype(jnp.float8_e4m3fn):
        raise ValueError(f"fireq decode: codes must be uint8 [N, K/2] and scales float8_e4m3fn [N, K/128], got "
                         f"{codes.dtype} {codes.shape} and {scales.dtype} {scales.shape}")
    n, k = codes.shape[0], codes.shape[1] * 2
    if k % WINDOW or scales.shape != (n, k // WINDOW):
        raise ValueError(f"fireq decode: K = {k} must be a multiple of {WINDOW} and scales [N, K/128] = "
                         f"[{n}, {k // WINDOW}], got {scales.shape}")
    if build.on_gpu():
        LIBRARY.load()
    return jax.ffi.ffi_call(DECODE_TARGET, jax.ShapeDtypeStruct((n, k), jnp.float8_e4m3fn))(codes, scales)


def tables(scales: jax.Array) -> jax.Array:
    """The CUTLASS FireQ GEMM's lookup tables from a FireQ weight's scales ``[N, K/128]`` E4M3:
    uint8 ``[K/128, N, 8]``, entry ``(g, n)`` the bytes of ``e4m3(q * s[n, g])`` for ``q = -8 .. -1``
    (:func:`jaxlp.ffi.cutlass_gemm.fireq_tables`, bit for bit)."""
    if scales.ndim != 2 or scales.dtype != jnp.dtype(jnp.float8_e4m3fn):
        raise ValueError(f"fireq tables: scales must be float8_e4m3fn [N, K/128], got {scales.dtype} {scales.shape}")
    n, groups = scales.shape
    if build.on_gpu():
        LIBRARY.load()
    return jax.ffi.ffi_call(TABLES_TARGET, jax.ShapeDtypeStruct((groups, n, 8), jnp.uint8))(scales)
