"""NVFP4 matmul kernels and activation quantization as XLA FFI custom calls (CUDA, sm_90).

    y = nvfp4_gemv(x, w)                          # W4A16: x [M, K] bf16/f32, w NVFP4Array [N, K]
    y = nvfp4_gemv(x, w, act_tensor_scale=g_x)    # W4A4: x quantized to NVFP4 inside the call
    y = nvfp4_gemv(x, w, config=GemvConfig(kernel="gemm"))  # any M: the tensor-core GEMM
    xq = quantize_activations(x, g_x)             # NVFP4Array of x (ModelOpt numerics, bit-exact)

Four kernels (``GemvConfig.kernel``), all exact products with FP32 sums:

- ``"regs"`` (M <= 32): the first GEMV; FP16 tensor cores, activations staged to FP16 by a
  separate kernel (W4A16: a power of two per 256-element chunk); any K multiple of 16.
- ``"pipe"`` (M <= 32): the GEMV with a cp.async shared-memory ring per warp, BF16 tensor cores,
  persistent clusters with split-K; W4A16 reads BF16 ``x`` directly (no staging kernel). Needs
  ``K % 64 == 0`` and BF16 ``x`` for W4A16.
- ``"pipe16"`` (M <= 32): the ``"pipe"`` kernel's memory pipeline with the ``"regs"`` kernel's
  arithmetic (FP16 decode, 11 integer ops per 8 nibbles instead of 16, FP16 tensor cores on the
  staged FP16 activations, one staging kernel per call). Needs ``K % 64 == 0``; BF16 or FP32 ``x``.
- Variants of ``"regs"`` and ``"pipe16"`` for M <= 8 (session 3; ``GemvConfig`` fields, name suffixes):
  ``blocks_per_sm=3`` (``B3``, regs with R = 1: a register budget of 80 for 3 CTAs = 24 warps per
  SM instead of 2), ``accumulators=2`` (``A2``: two independent MMA chains per item instead of one
  chain of 16), ``stages=2`` (``S2``, pipe16: a 2-stage ring, 4 CTAs per SM at R = 1, 2 at R = 2).
- ``"gemm"`` (any M): 128 x ``block_m`` CTA tiles, weights decoded to BF16 in registers, BF16
  ``mma.sync`` with FP32 accumulation. Needs ``K % 64 == 0`` and BF16 ``x`` for W4A16.

``y[m, n] = sum_k act(x)[m, k] * dequant(w)[n, k]`` in FP32, returned in ``x.dtype``, for
``1 <= M <= 32``. For W4A4, ``act(x)`` is ``nvfp4.quantize(x, tensor_scale=g_x)`` dequantized (the
static tensor scale ``g_x = amax / 2688`` and dynamic E4M3 scales per 16 elements of each token,
see :func:`jaxlp.formats.nvfp4.quantize`); every product is exact, so only the FP32 summation
order differs from the pure-JAX reference. For W4A16, ``x`` enters the FP16 tensor-core
products scaled by a power of two per 256-element chunk (exact for BF16 inputs; FP32 inputs are
rounded to FP16's 11 bits). The design is described at the top of ``nvfp4_gemv.cu``.

The library is compiled by ``nvcc`` on first use (:mod:`jaxlp.ffi.build`) and its FFI targets are
registered for the CUDA platform when it loads. The custom calls lower on any machine (for
example to inspect the StableHLO under ``lowering_platforms=("cuda",)``); compiling or running
them needs a CUDA GPU. Packed FP4 crosses the boundary as ``uint8`` and E4M3 scales as their
bits (``uint8``).
"""

from __future__ import annotations

import ctypes
import dataclasses

import jax
import jax.numpy as jnp

from jaxlp.ffi import build
from jaxlp.formats.nvfp4 import BLOCK_SIZE, NVFP4Array

GEMV_TARGET = "jaxlp_nvfp4_gemv"
MATMUL_TARGET = "jaxlp_nvfp4_matmul"
QUANTIZE_TARGET = "jaxlp_nvfp4_quantize"
LIBRARY = "nvfp4_gemv"
MAX_M = 32  # tokens per GEMV launch
CHUNK_K = 256  # k per warp step; the x_eff workspace is K rounded up to this
ACT_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32))
QUANTIZE_LANES = 4  # threads per 16-element block of the standalone activation quantizer
MODES = {"w4a16": 0, "w4a4": 1}
KERNELS = {"regs": 0, "pipe": 1, "gemm": 2, "pipe16": 3}
GEMV_KERNELS = ("regs", "pipe16")  # the kernels behind GEMV_TARGET (FP16 x_eff staging)
BF16_KERNEL_K = 64  # "pipe", "pipe16" and "gemm" need K % 64 == 0
SMALL_M_VARIANT_MAX = 8  # the blocks_per_sm / accumulators / stages variants: one 8-token MMA group


@dataclasses.dataclass(frozen=True)
class GemvConfig:
    """Launch configuration of the NVFP4 matmul kernels.

    kernel: ``"regs"`` (the first GEMV), ``"pipe"`` (the cp.async GEMV), ``"pipe16"`` (its FP16
        variant) or ``"gemm"`` (large M).
    rows_per_warp: 16-row tiles per warp (1 or 2): ``"regs"``, ``"pipe"`` and ``"pipe16"``.
    k_split: warps per CTA splitting K (2, 4 or 8): ``"regs"``.
    split: CTAs of a cluster splitting K (1, 2 or 4): ``"pipe"``, ``"pipe16"`` and ``"gemm"``.
    block_m: tokens per CTA tile (64 or 128): ``"gemm"``.
    block_n: weight rows per CTA tile (64 or 128): ``"gemm"``.
    pdl: launch the matmul with programmatic dependent launch after the activation-staging
        kernel (``"regs"``, and W4A4 of the others), overlapping its weight stream with it.
    blocks_per_sm: ``"regs"`` with ``rows_per_warp=1``, M <= 8: 0 (its default register budget,
        2 CTAs per SM) or 3 (at most 80 registers per thread: 3 CTAs per SM).
    accumulators: ``"regs"`` and ``"pipe16"``, M <= 8: 1 or 2 independent MMA accumulator chains
        per (tile, 256-k) item.
    stages: ``"pipe16"``, M <= 8: 0 (its default 3-stage ring per warp) or 2 (a 2-stage ring:
        4 CTAs per SM at ``rows_per_warp=1``, 2 at 2).
    """

    rows_per_warp: int = 1
    k_split: int = 8
    pdl: bool = True
    kernel: str = "regs"
    split: int = 1
    block_m: int = 128
    block_n: int = 128
    blocks_per_sm: int = 0
    accumulators: int = 1
    stages: int = 0

    def __post_init__(self):
        if self.kernel not in KERNELS:
            raise ValueError(f"kernel must be one of {tuple(KERNELS)}, got {self.kernel!r}")
        if self.rows_per_warp not in (1, 2):
            raise ValueError(f"rows_per_warp must be 1 or 2, got {self.rows_per_warp}")
        if self.k_split not in (2, 4, 8):
            raise ValueError(f"k_split must be 2, 4 or 8, got {self.k_split}")
        if self.split not in (1, 2, 4):
            raise ValueError(f"split must be 1, 2 or 4, got {self.split}")
        if self.block_m not in (64, 128):
            raise ValueError(f"block_m must be 64 or 128, got {self.block_m}")
        if self.block_n not in (64, 128):
            raise ValueError(f"block_n must be 64 or 128, got {self.block_n}")
        if self.blocks_per_sm not in (0, 3):
            raise ValueError(f"blocks_per_sm must be 0 (the default) or 3, got {self.blocks_per_sm}")
        if self.blocks_per_sm and (self.kernel != "regs" or self.rows_per_warp != 1):
            raise ValueError("blocks_per_sm=3 is a variant of the regs kernel with rows_per_warp=1")
        if self.accumulators not in (1, 2):
            raise ValueError(f"accumulators must be 1 or 2, got {self.accumulators}")
        if self.accumulators == 2 and self.kernel not in GEMV_KERNELS:
            raise ValueError(f"accumulators=2 is a variant of the {GEMV_KERNELS} kernels, not {self.kernel!r}")
        if self.stages not in (0, 2):
            raise ValueError(f"stages must be 0 (the default, 3) or 2, got {self.stages}")
        if self.stages and self.kernel != "pipe16":
            raise ValueError("stages=2 is a variant of the pipe16 kernel")

    @property
    def is_small_m_variant(self) -> bool:
        """True for the M <= 8 variants (``blocks_per_sm``, ``accumulators`` or ``stages`` set)."""
        return bool(self.blocks_per_sm or self.accumulators != 1 or self.stages)

    @property
    def name(self) -> str:
        """Short label: ``R1KS8`` (regs), ``P1C2`` (pipe: rows, split), ``H1C2`` (pipe16: rows, split),
        ``G128x64S2`` (gemm: rows x tokens, split); the M <= 8 variants append ``B3`` (blocks_per_sm),
        ``S2`` (stages) and ``A2`` (accumulators): ``R1KS8B3A2``, ``H1C1S2A2``."""
        if self.kernel == "pipe":
            return f"P{self.rows_per_warp}C{self.split}"
        acc = "A2" if self.accumulators == 2 else ""
        if self.kernel == "pipe16":
            return f"H{self.rows_per_warp}C{self.split}" + ("S2" if self.stages == 2 else "") + acc
        if self.kernel == "gemm":
            return f"G{self.block_n}x{self.block_m}" + (f"S{self.split}" if self.split > 1 else "")
        return f"R{self.rows_per_warp}KS{self.k_split}" + ("B3" if self.blocks_per_sm == 3 else "") + acc

    @staticmethod
    def from_name(name: str) -> "GemvConfig":
        """Inverse of :attr:`name`."""
        import re

        if m := re.fullmatch(r"R([12])KS([248])(B3)?(A2)?", name):
            return GemvConfig(int(m[1]), int(m[2]), blocks_per_sm=3 if m[3] else 0, accumulators=2 if m[4] else 1)
        if m := re.fullmatch(r"P([12])C([124])", name):
            return GemvConfig(int(m[1]), kernel="pipe", split=int(m[2]))
        if m := re.fullmatch(r"H([12])C([124])(S2)?(A2)?", name):
            return GemvConfig(int(m[1]), kernel="pipe16", split=int(m[2]), stages=2 if m[3] else 0,
                              accumulators=2 if m[4] else 1)
        if m := re.fullmatch(r"G(64|128)x(64|128)(?:S([24]))?", name):
            return GemvConfig(kernel="gemm", block_n=int(m[1]), block_m=int(m[2]), split=int(m[3] or 1))
        raise ValueError(f"not a kernel configuration name: {name!r}")

    def unsupported(self, m: int, k: int, dtype, w4a4: bool) -> str | None:
        """Why this configuration cannot run ``M`` tokens of ``K`` with ``dtype`` activations, or None."""
        dtype = jnp.dtype(dtype)
        if dtype not in ACT_DTYPES:
            return f"activations must be bfloat16 or float32, got {dtype}"
        if self.kernel != "gemm" and not 1 <= m <= MAX_M:
            return f"M = {m} tokens; the {self.kernel} kernel takes 1..{MAX_M}"
        if self.is_small_m_variant and m > SMALL_M_VARIANT_MAX:
            return f"M = {m} tokens; the {self.name} variant takes 1..{SMALL_M_VARIANT_MAX}"
        if self.kernel == "regs":
            return None if k % BLOCK_SIZE == 0 else f"K = {k} is not a multiple of {BLOCK_SIZE}"
        if k % BF16_KERNEL_K or k == 0:
            return f"K = {k} is not a positive multiple of {BF16_KERNEL_K} (the {self.kernel} kernel)"
        if self.kernel == "pipe16":
            return None  # the staging kernel takes BF16 and FP32 activations in both modes
        if self.kernel == "gemm" and k < BF16_KERNEL_K * self.split:
            return f"K = {k} is below {BF16_KERNEL_K} x split ({self.split})"
        if not w4a4 and dtype != jnp.dtype(jnp.bfloat16):
            return f"W4A16 through the {self.kernel} kernel takes bfloat16 activations, got {dtype}"
        return None


BLOCK_FP4_TARGET = "jaxlp_block_fp4_matmul"  # the kernels on MXFP4 / DialectFP4 weights (jaxlp.ffi.block_fp4)
BLOCK_FP4_DECODE_TARGET = "jaxlp_block_fp4_decode"
_library = build.Library(
    LIBRARY, {GEMV_TARGET: "JaxlpNvfp4Gemv", MATMUL_TARGET: "JaxlpNvfp4Matmul", QUANTIZE_TARGET: "JaxlpNvfp4Quantize",
              BLOCK_FP4_TARGET: "JaxlpBlockFp4Matmul", BLOCK_FP4_DECODE_TARGET: "JaxlpBlockFp4Decode"}
)
on_gpu = build.on_gpu


def load() -> ctypes.CDLL:
    """Build the CUDA library if needed, load it and register its FFI targets (once)."""
    return _library.load()


def available() -> bool:
    """True when JAX runs on a GPU and the kernel library builds and loads. Never raises;
    :func:`unavailable_reason` says why not."""
    return _library.available()


def unavailable_reason() -> str | None:
    return _library.unavailable_reason()


def padded_k(k: int) -> int:
    return -(-k // CHUNK_K) * CHUNK_K


def _scale_bits(block_scale: jax.Array) -> jax.Array:
    return jax.lax.bitcast_convert_type(block_scale, jnp.uint8)


def _check_x(x: jax.Array, k: int, what: str) -> None:
    if x.ndim != 2:
        raise ValueError(f"{what}: x must be 2-D [M, K], got shape {x.shape}")
    if x.shape[1] != k:
        raise ValueError(f"{what}: x has K = {x.shape[1]}, the weight has K = {k}")
    if jnp.dtype(x.dtype) not in ACT_DTYPES:
        raise ValueError(f"{what}: x must be bfloat16 or float32, got {x.dtype}")


def _act_scale_operand(act_tensor_scale, act_amax) -> tuple[jax.Array | None, int]:
    """(the W4A4 scale operand or None for W4A16, 1 if it is an amax for the kernel to convert)."""
    if act_tensor_scale is not None and act_amax is not None:
        raise ValueError("give act_tensor_scale or act_amax, not both")
    if act_amax is not None:
        return jnp.asarray(act_amax, jnp.float32).reshape(()), 1
    if act_tensor_scale is not None:
        return jnp.asarray(act_tensor_scale, jnp.float32).reshape(()), 0
    return None, 0


def gemv_call(
    x: jax.Array,
    data: jax.Array,
    block_scale_bits: jax.Array,
    w_tensor_scale: jax.Array,
    act_tensor_scale: jax.Array | None = None,
    *,
    config: GemvConfig = GemvConfig(),
    probe: bool = False,
    act_amax: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The raw custom call: ``(y [M, N], x_eff f16 [M, Kp], chunk_scales f32 [M, Kp/256])``.

    ``x_eff`` and the chunk scales are the kernel's activation workspace (returned for tests):
    each group of 8 values is stored in the order x0 x4 x1 x5 x2 x6 x3 x7.
    probe: a diagnostic for benchmarks (M <= 8): the same memory traffic with no arithmetic; y is
    meaningless (the default variants, and pipe16 with ``stages=2``).
    config.kernel: ``"regs"`` or ``"pipe16"`` (both read this staging workspace).
    """
    if config.kernel not in GEMV_KERNELS:
        raise ValueError(f"gemv_call runs the {GEMV_KERNELS} kernels; use matmul_call for {config.kernel!r}")
    if data.ndim != 2 or data.dtype != jnp.uint8:
        raise ValueError(f"nvfp4_gemv: data must be uint8 [N, K/2], got {data.dtype}{data.shape}")
    n, k = data.shape[0], 2 * data.shape[1]
    _check_x(x, k, "nvfp4_gemv")
    m = x.shape[0]
    if not 1 <= m <= MAX_M:
        raise ValueError(f"nvfp4_gemv: M = {m} tokens; the kernel takes 1..{MAX_M}")
    if k % BLOCK_SIZE:
        raise ValueError(f"nvfp4_gemv: K = {k} is not a multiple of {BLOCK_SIZE}")
    why = config.unsupported(m, k, x.dtype, act_tensor_scale is not None or act_amax is not None)
    if why:
        raise ValueError(f"nvfp4 {config.kernel}: {why}")
    if probe and m > 8:
        raise ValueError(f"nvfp4_gemv: the probe takes M <= 8, got {m}")
    if probe and (config.blocks_per_sm or config.accumulators != 1):
        raise ValueError("nvfp4_gemv: the probe runs the default variants (and pipe16's stages=2)")
    if block_scale_bits.shape != (n, k // BLOCK_SIZE) or block_scale_bits.dtype != jnp.uint8:
        raise ValueError(
            f"nvfp4_gemv: block scales must be uint8 [{n}, {k // BLOCK_SIZE}], got "
            f"{block_scale_bits.dtype}{block_scale_bits.shape}"
        )
    xg, xg_amax = _act_scale_operand(act_tensor_scale, act_amax)
    mode = MODES["w4a4"] if xg is not None else MODES["w4a16"]
    if probe:
        mode = 2
    wg = jnp.asarray(w_tensor_scale, jnp.float32).reshape(())
    xg = jnp.ones((), jnp.float32) if xg is None else xg
    kp = padded_k(k)
    if on_gpu():
        load()
    call = jax.ffi.ffi_call(
        GEMV_TARGET,
        (
            jax.ShapeDtypeStruct((m, n), x.dtype),
            jax.ShapeDtypeStruct((m, kp), jnp.float16),
            jax.ShapeDtypeStruct((m, kp // CHUNK_K), jnp.float32),
        ),
    )
    return call(
        x, data, block_scale_bits, wg, xg,
        mode=mode, rows_per_warp=config.rows_per_warp, k_split=config.k_split, pdl=int(config.pdl), xg_amax=xg_amax,
        kernel=KERNELS[config.kernel], split=config.split, blocks_per_sm=config.blocks_per_sm,
        accumulators=config.accumulators, stages=config.stages,
    )


def matmul_call(
    x: jax.Array,
    data: jax.Array,
    block_scale_bits: jax.Array,
    w_tensor_scale: jax.Array,
    act_tensor_scale: jax.Array | None = None,
    *,
    config: GemvConfig,
    act_amax: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    """The raw custom call of the ``"pipe"`` and ``"gemm"`` kernels: ``(y [M, N], x_eff)``.

    ``x_eff`` is the W4A4 activation workspace, BF16 ``[M, K]`` in natural order holding
    ``e2m1(q) * e4m3(s)`` (without ``g_x``); ``[1, 8]`` and unused for W4A16.
    """
    if config.kernel not in ("pipe", "gemm"):  # pipe16 runs through gemv_call
        raise ValueError(f"matmul_call runs the pipe and gemm kernels, not {config.kernel!r}")
    if data.ndim != 2 or data.dtype != jnp.uint8:
        raise ValueError(f"nvfp4 {config.kernel}: data must be uint8 [N, K/2], got {data.dtype}{data.shape}")
    n, k = data.shape[0], 2 * data.shape[1]
    _check_x(x, k, f"nvfp4 {config.kernel}")
    m = x.shape[0]
    xg, xg_amax = _act_scale_operand(act_tensor_scale, act_amax)
    w4a4 = xg is not None
    why = config.unsupported(m, k, x.dtype, w4a4)
    if why:
        raise ValueError(f"nvfp4 {config.kernel}: {why}")
    if block_scale_bits.shape != (n, k // BLOCK_SIZE) or block_scale_bits.dtype != jnp.uint8:
        raise ValueError(
            f"nvfp4 {config.kernel}: block scales must be uint8 [{n}, {k // BLOCK_SIZE}], got "
            f"{block_scale_bits.dtype}{block_scale_bits.shape}"
        )
    wg = jnp.asarray(w_tensor_scale, jnp.float32).reshape(())
    xg = xg if w4a4 else jnp.ones((), jnp.float32)
    if on_gpu():
        load()
    call = jax.ffi.ffi_call(
        MATMUL_TARGET,
        (
            jax.ShapeDtypeStruct((m, n), x.dtype),
            jax.ShapeDtypeStruct((m, k) if w4a4 else (1, 8), jnp.bfloat16),
        ),
    )
    return call(
        x, data, block_scale_bits, wg, xg,
        mode=MODES["w4a4" if w4a4 else "w4a16"], kernel=KERNELS[config.kernel],
        rows_per_warp=config.rows_per_warp, split=config.split, block_m=config.block_m, block_n=config.block_n,
        pdl=int(config.pdl), xg_amax=xg_amax,
    )


def nvfp4_gemv(
    x: jax.Array,
    w: NVFP4Array,
    *,
    act_tensor_scale: jax.Array | None = None,
    config: GemvConfig | None = None,
    act_amax: jax.Array | None = None,
) -> jax.Array:
    """``x [M, K] @ dequant(w [N, K]).T -> [M, N]`` in ``x.dtype`` (FP32 accumulation).

    act_tensor_scale: the static NVFP4 tensor scale ``g_x`` of the activations (W4A4); None
    multiplies the activations as they are (W4A16).
    act_amax: instead of ``act_tensor_scale``, the calibrated amax it derives from: the kernels
    compute ``g_x = max(max(amax, 1e-12) / 2688, 2^-117)`` themselves (correctly rounded, as
    :func:`jaxlp.quantization.nvfp4_dispatch.act_tensor_scale`), so no XLA op runs for it.
    config: the kernel and its launch parameters (default: the ``"regs"`` GEMV, M <= 32);
    :meth:`GemvConfig.unsupported` says which shapes and dtypes each kernel takes.
    """
    if not isinstance(w, NVFP4Array) or len(w.shape) != 2:
        raise ValueError(f"nvfp4_gemv: w must be a 2-D NVFP4Array, got {type(w).__name__}")
    config = config or GemvConfig()
    if config.kernel in GEMV_KERNELS:
        y, _, _ = gemv_call(x, w.data, _scale_bits(w.block_scale), w.tensor_scale, act_tensor_scale, config=config,
                            act_amax=act_amax)
    else:
        y, _ = matmul_call(x, w.data, _scale_bits(w.block_scale), w.tensor_scale, act_tensor_scale, config=config,
                           act_amax=act_amax)
    return y


nvfp4_matmul = nvfp4_gemv


def quantize_activations(x: jax.Array, tensor_scale: jax.Array, *, lanes: int = QUANTIZE_LANES) -> NVFP4Array:
    """NVFP4 of ``x [M, K]`` with a static tensor scale, by the CUDA kernel (ModelOpt numerics).

    Bit-identical to ``nvfp4.quantize(x, tensor_scale=tensor_scale)`` for finite ``x`` and a
    tensor scale at least ``2**-117``. lanes: threads per 16-element block (1, 2 or 4; a tuning
    knob, the result does not depend on it).
    """
    if x.ndim != 2:
        raise ValueError(f"quantize_activations: x must be 2-D [M, K], got shape {x.shape}")
    m, k = x.shape
    if k % BLOCK_SIZE or k == 0:
        raise ValueError(f"quantize_activations: K = {k} is not a positive multiple of {BLOCK_SIZE}")
    if jnp.dtype(x.dtype) not in ACT_DTYPES:
        raise ValueError(f"quantize_activations: x must be bfloat16 or float32, got {x.dtype}")
    if lanes not in (1, 2, 4):
        raise ValueError(f"quantize_activations: lanes must be 1, 2 or 4, got {lanes}")
    g = jnp.asarray(tensor_scale, jnp.float32).reshape(())
    if on_gpu():
        load()
    call = jax.ffi.ffi_call(
        QUANTIZE_TARGET,
        (jax.ShapeDtypeStruct((m, k // 2), jnp.uint8), jax.ShapeDtypeStruct((m, k // BLOCK_SIZE), jnp.uint8)),
    )
    codes, scale_bits = call(x, g, lanes=lanes)
    return NVFP4Array(
        data=codes,
        block_scale=jax.lax.bitcast_convert_type(scale_bits, jnp.float8_e4m3fn),
        tensor_scale=g,
        shape=(int(m), int(k)),
    )
