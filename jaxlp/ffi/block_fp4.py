"""MXFP4 and DialectFP4 products on the NVFP4 kernels (CUDA, sm_90): the "pipe" GEMV and the "gemm".

    y = block_fp4.matmul(x, w)                              # x [M, K] bf16, w MXFP4Array / DialectFP4Array [N, K]
    y = block_fp4.matmul(x, w, config=Config(rows_per_warp=1, split=2))           # the GEMV, 1..32 tokens
    y = block_fp4.matmul(x, w, config=Config(kernel="gemm", block_n=128, split=2))  # any M

``y[m, n] = sum_k x[m, k] * dequant(w)[n, k]`` in FP32, returned in BF16 (or FP32). The kernels are
NVFP4's ``pipe_kernel`` (``nvfp4_pipe.cu``: a cp.async ring per warp, persistent clusters, 1..32
tokens) and ``gemm_kernel`` (``nvfp4_gemm.cu``: CTA tiles of 64/128 rows x 64/128 tokens) with the
format as a template parameter: BF16 ``mma.sync`` with FP32 accumulators and a
block decode by table lookup in registers (``decode_word_lut`` in ``nvfp4_common.cuh``): each code's
3-bit index selects one of its block's 8 magnitudes (E2M1's for MXFP4, the block's dialect for
DialectFP4), held as BF16 patterns in half units (:func:`magnitude_tables`), and the block's
power-of-two scale multiplies it in BF16. Every ``magnitude * scale`` of both formats is exact in
BF16 and every product with a BF16 activation is exact in FP32, so the kernel equals the float64
product of the dequantized operands up to FP32 summation order. W4A4 (``activation="mxfp4"`` or
``"dialect_fp4"``): a staging kernel first quantizes ``x`` per 32-element block exactly as
:func:`jaxlp.quantization.activations.fake_quantize` does (DialectFP4: two-stage selection with the
default formatbook; four threads per block) and writes the decoded values (exact in BF16) to a
workspace; the GEMV starts behind it with programmatic dependent launch, the GEMM after it ends.

Shapes: ``K % 128 == 0`` (whole 4-byte words of block scales per 128 k), block size 32, BF16 ``x``.
:func:`why_not` says which rule a call breaks. The gemm reads the scales and dialect ids packed per
64-k stage (:func:`gemm_metadata`, a small XLA op per call), so that a stage's copy is NVFP4's.
The library is the NVFP4 one (:mod:`jaxlp.ffi.nvfp4`), built on first use.
"""

from __future__ import annotations

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np

from jaxlp.ffi import nvfp4 as ffi_nvfp4
from jaxlp.formats import dialect_fp4
from jaxlp.formats.dialect_fp4 import DialectFP4Array
from jaxlp.formats.mxfp4 import MXFP4Array

TARGET = ffi_nvfp4.BLOCK_FP4_TARGET
DECODE_TARGET = ffi_nvfp4.BLOCK_FP4_DECODE_TARGET
FORMATS = {"mxfp4": 1, "dialect_fp4": 2}  # the kernel's WeightFormat
K_MULTIPLE = 128
BLOCK_SIZE = 32
MAX_M = ffi_nvfp4.MAX_M  # tokens of the "pipe" GEMV
KERNELS = {"pipe": 1, "gemm": 2}
OUT_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32))

available = ffi_nvfp4.available
unavailable_reason = ffi_nvfp4.unavailable_reason


@dataclasses.dataclass(frozen=True)
class Config:
    """Launch configuration, as NVFP4's kernels (:class:`jaxlp.ffi.nvfp4.GemvConfig`):
    ``kernel`` ``"pipe"`` (1..32 tokens) or ``"gemm"`` (any M); ``rows_per_warp`` 16-row tiles per
    warp (1 or 2, pipe); ``split`` CTAs of a cluster splitting K (1, 2 or 4); ``block_m`` tokens and
    ``block_n`` weight rows per CTA tile (64 or 128, gemm)."""

    rows_per_warp: int = 2
    split: int = 1
    kernel: str = "pipe"
    block_m: int = 64
    block_n: int = 128

    def __post_init__(self):
        if self.kernel not in KERNELS:
            raise ValueError(f"kernel must be one of {tuple(KERNELS)}, got {self.kernel!r}")
        if self.rows_per_warp not in (1, 2):
            raise ValueError(f"rows_per_warp must be 1 or 2, got {self.rows_per_warp}")
        if self.split not in (1, 2, 4):
            raise ValueError(f"split must be 1, 2 or 4, got {self.split}")
        if self.block_m not in (64, 128) or self.block_n not in (64, 128):
            raise ValueError(f"block_m and block_n must be 64 or 128, got {self.block_m}, {self.block_n}")

    @property
    def name(self) -> str:
        """``P2C1`` (pipe: rows per warp, split) or ``G128x64S2`` (gemm: rows x tokens, split)."""
        if self.kernel == "gemm":
            return f"G{self.block_n}x{self.block_m}" + (f"S{self.split}" if self.split > 1 else "")
        return f"P{self.rows_per_warp}C{self.split}"

    @staticmethod
    def from_name(name: str) -> "Config":
        """Inverse of :attr:`name`."""
        if m := re.fullmatch(r"P([12])C([124])", name):
            return Config(int(m[1]), int(m[2]))
        if m := re.fullmatch(r"G(64|128)x(64|128)(?:S([24]))?", name):
            return Config(kernel="gemm", block_n=int(m[1]), block_m=int(m[2]), split=int(m[3] or 1))
        raise ValueError(f"not a block_fp4 launch name: {name!r}")


def magnitude_tables(formatbook) -> np.ndarray:
    """``uint8 [16, 16]``: per dialect, its 8 magnitudes (half units) as BF16 bit patterns split into
    bytes, in ``decode_word_lut``'s order: low bytes of entries 0..3, of 4..7, high bytes of 0..3,
    of 4..7 (entry ``i`` of a group of four in byte ``i``)."""
    book = np.asarray(dialect_fp4.as_formatbook(formatbook), np.float32)  # [16, 8]
    bits = (book.view(np.uint32) >> 16).astype(np.uint16)  # integers 0..15: exact in BF16
    lo, hi = (bits & 0xFF).astype(np.uint8), (bits >> 8).astype(np.uint8)
    return np.concatenate([lo[:, :4], lo[:, 4:], hi[:, :4], hi[:, 4:]], axis=1)


def selection_tables(formatbook=dialect_fp4.DEFAULT_FORMATBOOK) -> np.ndarray:
    """float32 ``[168]``: the two-stage selection's tables for the staging kernel: the formatbook
    ``[16, 8]`` (half units), the beneficial ranges ``[16, 2]`` (half-open, +-inf at the ends) and the
    pairs' shared maxima ``[8]``."""
    book = np.asarray(dialect_fp4.as_formatbook(formatbook), np.float32)
    ranges = dialect_fp4.beneficial_ranges(formatbook).astype(np.float32)
    return np.concatenate([book.ravel(), ranges.ravel(), book[0::2, -1]])


def gemm_metadata(w) -> jax.Array:
    """The gemm's per-stage metadata of ``w``: uint8 ``[N, K/16]``, per (row, 64-k stage) the scale
    bytes of its two 32-blocks (E8M0 / exponent codes), their dialect-id byte (0 for MXFP4), a zero."""
    scales = jax.lax.bitcast_convert_type(w.scale, jnp.uint8) if isinstance(w, MXFP4Array) else w.exponents
    ids = w.dialect_pairs if isinstance(w, DialectFP4Array) else jnp.zeros_like(scales[:, 0::2])
    meta = jnp.stack([scales[:, 0::2], scales[:, 1::2], ids, jnp.zeros_like(ids)], axis=-1)
    return meta.reshape(scales.shape[0], 2 * scales.shape[1])


def why_not(w, m: int, dtype, config: Config | None = None) -> str | None:
    """Why the kernel (``config``'s, default the GEMV) cannot compute ``x [m, K] @ w.T`` (None if it can)."""
    fmt = getattr(w, "format", None)
    if fmt not in FORMATS:
        return f"the weight format is {fmt!r}; the kernel takes {tuple(FORMATS)}"
    if len(w.shape) != 2:
        return f"the weight must be 2-D [N, K], got shape {w.shape}"
    if w.block_size != BLOCK_SIZE:
        return f"{fmt} blocks of {w.block_size}; the kernel takes blocks of {BLOCK_SIZE}"
    k = w.shape[1]
    if k % K_MULTIPLE or k == 0:
        return f"K = {k} is not a positive multiple of {K_MULTIPLE}"
    gemm = config is not None and config.kernel == "gemm"
    if m < 1 or (not gemm and m > MAX_M):
        return f"M = {m} tokens; the GEMV takes 1..{MAX_M}"
    if gemm and k < 64 * config.split:
        return f"K = {k} is below 64 x split ({config.split})"
    if jnp.dtype(dtype) != jnp.dtype(jnp.bfloat16):
        return f"the kernel takes bfloat16 activations, got {jnp.dtype(dtype)}"
    return None


@functools.lru_cache(maxsize=None)
def _tables(formatbook) -> np.ndarray:
    return magnitude_tables(formatbook)


@functools.lru_cache(maxsize=None)
def _selection_tables() -> np.ndarray:
    return selection_tables()


def _operands(w) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """(codes, scale bytes, dialect ids, tables) of ``w`` as the custom call takes them."""
    if isinstance(w, MXFP4Array):
        scales = jax.lax.bitcast_convert_type(w.scale, jnp.uint8)
        return w.data, scales, jnp.zeros((1, 4), jnp.uint8), jnp.zeros((16, 16), jnp.uint8)
    assert isinstance(w, DialectFP4Array)
    return w.codes, w.exponents, w.dialect_pairs, jnp.asarray(_tables(w.formatbook))


def decode(w: MXFP4Array | DialectFP4Array) -> jax.Array:
    """``w`` decoded to BF16 ``[N, K]`` by a CUDA kernel (the GEMV's table decode, exact): equal to
    ``w.dequantize(jnp.bfloat16)``. Any K multiple of 32, block size 32."""
    fmt = getattr(w, "format", None)
    if fmt not in FORMATS or len(w.shape) != 2 or w.block_size != BLOCK_SIZE:
        raise ValueError(f"block_fp4.decode: takes 2-D {tuple(FORMATS)} arrays in blocks of {BLOCK_SIZE}, got "
                         f"{fmt!r} {getattr(w, 'shape', None)}")
    codes, scales, dialects, tables = _operands(w)
    if ffi_nvfp4.on_gpu():
        ffi_nvfp4.load()
    call = jax.ffi.ffi_call(DECODE_TARGET, jax.ShapeDtypeStruct(tuple(w.shape), jnp.bfloat16))
    return call(codes, scales, dialects, tables, format=FORMATS[fmt])


def matmul(x: jax.Array, w: MXFP4Array | DialectFP4Array, *, config: Config = Config(),
           out_dtype=jnp.bfloat16, activation: str | None = None) -> jax.Array:
    """``act(x) [M, K] @ dequant(w).T`` through the kernel: ``[M, N]`` in ``out_dtype`` (bfloat16 or
    float32), the FP32 sums rounded once; ``activation``: None (W4A16), ``"mxfp4"`` or
    ``"dialect_fp4"`` (W4A4, quantized in the call; module doc)."""
    if x.ndim != 2:
        raise ValueError(f"block_fp4.matmul: x must be 2-D [M, K], got shape {x.shape}")
    if len(w.shape) == 2 and x.shape[1] != w.shape[1]:
        raise ValueError(f"block_fp4.matmul: x has K = {x.shape[1]}, the weight has K = {w.shape[1]}")
    reason = why_not(w, x.shape[0], x.dtype, config)
    if reason is not None:
        raise ValueError(f"block_fp4.matmul: {reason}")
    if activation is not None and activation not in FORMATS:
        raise ValueError(f"block_fp4.matmul: activation must be None or one of {tuple(FORMATS)}, got {activation!r}")
    if jnp.dtype(out_dtype) not in OUT_DTYPES:
        raise ValueError(f"block_fp4.matmul: out_dtype must be bfloat16 or float32, got {jnp.dtype(out_dtype)}")
    codes, scales, dialects, tables = _operands(w)
    if config.kernel == "gemm":
        scales = gemm_metadata(w)
    if ffi_nvfp4.on_gpu():
        ffi_nvfp4.load()
    workspace = x.shape if activation is not None else (1, 8)
    call = jax.ffi.ffi_call(TARGET, (jax.ShapeDtypeStruct((x.shape[0], w.shape[0]), out_dtype),
                                     jax.ShapeDtypeStruct(workspace, jnp.bfloat16)))
    sel = jnp.asarray(_selection_tables() if activation == "dialect_fp4" else np.zeros(1, np.float32))
    y, _ = call(x, codes, scales, dialects, tables, sel, format=FORMATS[w.format],
                act=0 if activation is None else FORMATS[activation], kernel=KERNELS[config.kernel],
                rows_per_warp=config.rows_per_warp, split=config.split, block_m=config.block_m, block_n=config.block_n)
    return y


