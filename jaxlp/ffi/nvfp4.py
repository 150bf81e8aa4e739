"""NVFP4 small-M GEMV and activation quantization as XLA FFI custom calls (CUDA, sm_90).

    y = nvfp4_gemv(x, w)                          # W4A16: x [M, K] bf16/f32, w NVFP4Array [N, K]
    y = nvfp4_gemv(x, w, act_tensor_scale=g_x)    # W4A4: x quantized to NVFP4 inside the call
    xq = quantize_activations(x, g_x)             # NVFP4Array of x (ModelOpt numerics, bit-exact)

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
import threading

import jax
import jax.numpy as jnp

from jaxlp.ffi import build
from jaxlp.formats.nvfp4 import BLOCK_SIZE, NVFP4Array

GEMV_TARGET = "jaxlp_nvfp4_gemv"
QUANTIZE_TARGET = "jaxlp_nvfp4_quantize"
LIBRARY = "nvfp4_gemv"
MAX_M = 32  # tokens per GEMV launch
CHUNK_K = 256  # k per warp step; the x_eff workspace is K rounded up to this
ACT_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32))
MODES = {"w4a16": 0, "w4a4": 1}


@dataclasses.dataclass(frozen=True)
class GemvConfig:
    """Launch parameters of the GEMV kernel.

    rows_per_warp: 16-row tiles per warp (1 or 2): a CTA computes ``16 * rows_per_warp`` rows.
    k_split: warps per CTA (2, 4 or 8), each taking a contiguous share of K.
    pdl: launch the GEMV with programmatic dependent launch, overlapping its weight stream with
        the activation-staging kernel.
    """

    rows_per_warp: int = 1
    k_split: int = 8
    pdl: bool = True

    def __post_init__(self):
        if self.rows_per_warp not in (1, 2):
            raise ValueError(f"rows_per_warp must be 1 or 2, got {self.rows_per_warp}")
        if self.k_split not in (2, 4, 8):
            raise ValueError(f"k_split must be 2, 4 or 8, got {self.k_split}")


_lock = threading.Lock()
_state: dict = {"lib": None, "error": None}


def load() -> ctypes.CDLL:
    """Build the CUDA library if needed, load it and register its FFI targets (once)."""
    with _lock:
        if _state["lib"] is None:
            path = build.build(LIBRARY)
            lib = ctypes.cdll.LoadLibrary(str(path))
            jax.ffi.register_ffi_target(GEMV_TARGET, jax.ffi.pycapsule(lib.JaxlpNvfp4Gemv), platform="CUDA")
            jax.ffi.register_ffi_target(QUANTIZE_TARGET, jax.ffi.pycapsule(lib.JaxlpNvfp4Quantize), platform="CUDA")
            _state["lib"] = lib
        return _state["lib"]


def on_gpu() -> bool:
    try:
        return jax.default_backend() == "gpu"
    except RuntimeError:
        return False


def available() -> bool:
    """True when JAX runs on a GPU and the kernel library builds and loads. Never raises;
    :func:`unavailable_reason` says why not."""
    if not on_gpu():
        _state["error"] = "the default JAX backend is not a GPU"
        return False
    if _state["lib"] is not None:
        return True
    try:
        load()
        return True
    except Exception as e:  # noqa: BLE001 - any build or load failure means "not available"
        _state["error"] = f"{type(e).__name__}: {e}"
        return False


def unavailable_reason() -> str | None:
    return _state["error"]


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


def gemv_call(
    x: jax.Array,
    data: jax.Array,
    block_scale_bits: jax.Array,
    w_tensor_scale: jax.Array,
    act_tensor_scale: jax.Array | None = None,
    *,
    config: GemvConfig = GemvConfig(),
    probe: bool = False,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The raw custom call: ``(y [M, N], x_eff f16 [M, Kp], chunk_scales f32 [M, Kp/256])``.

    ``x_eff`` and the chunk scales are the kernel's activation workspace (returned for tests):
    each group of 8 values is stored in the order x0 x4 x1 x5 x2 x6 x3 x7.
    probe: a diagnostic for benchmarks (M <= 8): the same memory traffic with no arithmetic; y is
    meaningless.
    """
    if data.ndim != 2 or data.dtype != jnp.uint8:
        raise ValueError(f"nvfp4_gemv: data must be uint8 [N, K/2], got {data.dtype}{data.shape}")
    n, k = data.shape[0], 2 * data.shape[1]
    _check_x(x, k, "nvfp4_gemv")
    m = x.shape[0]
    if not 1 <= m <= MAX_M:
        raise ValueError(f"nvfp4_gemv: M = {m} tokens; the kernel takes 1..{MAX_M}")
    if k % BLOCK_SIZE:
        raise ValueError(f"nvfp4_gemv: K = {k} is not a multiple of {BLOCK_SIZE}")
    if block_scale_bits.shape != (n, k // BLOCK_SIZE) or block_scale_bits.dtype != jnp.uint8:
        raise ValueError(
            f"nvfp4_gemv: block scales must be uint8 [{n}, {k // BLOCK_SIZE}], got "
            f"{block_scale_bits.dtype}{block_scale_bits.shape}"
        )
    mode = MODES["w4a16"] if act_tensor_scale is None else MODES["w4a4"]
    if probe:
        mode = 2
    wg = jnp.asarray(w_tensor_scale, jnp.float32).reshape(())
    xg = jnp.ones((), jnp.float32) if act_tensor_scale is None else jnp.asarray(act_tensor_scale, jnp.float32).reshape(())
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
        mode=mode, rows_per_warp=config.rows_per_warp, k_split=config.k_split, pdl=int(config.pdl),
    )


def nvfp4_gemv(
    x: jax.Array,
    w: NVFP4Array,
    *,
    act_tensor_scale: jax.Array | None = None,
    config: GemvConfig | None = None,
) -> jax.Array:
    """``x [M, K] @ dequant(w [N, K]).T -> [M, N]`` in ``x.dtype`` (FP32 accumulation), M <= 32.

    act_tensor_scale: the static NVFP4 tensor scale ``g_x`` of the activations (W4A4); None
    multiplies the activations as they are (W4A16).
    """
    if not isinstance(w, NVFP4Array) or len(w.shape) != 2:
        raise ValueError(f"nvfp4_gemv: w must be a 2-D NVFP4Array, got {type(w).__name__}")
    y, _, _ = gemv_call(
        x, w.data, _scale_bits(w.block_scale), w.tensor_scale, act_tensor_scale, config=config or GemvConfig()
    )
    return y


def quantize_activations(x: jax.Array, tensor_scale: jax.Array) -> NVFP4Array:
    """NVFP4 of ``x [M, K]`` with a static tensor scale, by the CUDA kernel (ModelOpt numerics).

    Bit-identical to ``nvfp4.quantize(x, tensor_scale=tensor_scale)`` for finite ``x`` and a
    tensor scale at least ``2**-117``.
    """
    if x.ndim != 2:
        raise ValueError(f"quantize_activations: x must be 2-D [M, K], got shape {x.shape}")
    m, k = x.shape
    if k % BLOCK_SIZE or k == 0:
        raise ValueError(f"quantize_activations: K = {k} is not a positive multiple of {BLOCK_SIZE}")
    if jnp.dtype(x.dtype) not in ACT_DTYPES:
        raise ValueError(f"quantize_activations: x must be bfloat16 or float32, got {x.dtype}")
    g = jnp.asarray(tensor_scale, jnp.float32).reshape(())
    if on_gpu():
        load()
    call = jax.ffi.ffi_call(
        QUANTIZE_TARGET,
        (jax.ShapeDtypeStruct((m, k // 2), jnp.uint8), jax.ShapeDtypeStruct((m, k // BLOCK_SIZE), jnp.uint8)),
    )
    codes, scale_bits = call(x, g)
    return NVFP4Array(
        data=codes,
        block_scale=jax.lax.bitcast_convert_type(scale_bits, jnp.float8_e4m3fn),
        tensor_scale=g,
        shape=(int(m), int(k)),
    )
