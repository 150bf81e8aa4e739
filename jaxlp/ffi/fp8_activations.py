"""Per-token FP8 (E4M3) activation quantization in one CUDA pass (sm_90): the activation side of
the FP8 GEMMs (:mod:`jaxlp.quantization.fp8_gemm`).

    codes, scale = token_fp8(x)      # codes [M, K] float8_e4m3fn, scale [M] float32
    codes, scale = nestedfp_fp8(x)   # codes [M, K] float8_e4m3fn, scale [M, 1] float32
    codes, scale = fireq_fp8(x)      # codes [M, K] float8_e4m3fn, scale [M, 1] bfloat16

``x [M, K]`` bfloat16, float16 or float32. The results are bit for bit those of the XLA functions
as XLA:CPU computes them:

* :func:`token_fp8`: ``jaxlp.formats.fp8.quantize_arrays(x, granularity="token")``: ``scale =
  max(amax / 448, 2**-126)`` (1 for an all-zero row), ``codes = e4m3(clip(x / scale, -448, 448))``,
  the divisions correctly rounded (``exact_divide``; the kernel's ``__fdiv_rn``).
* :func:`nestedfp_fp8`: ``jaxlp.quantization.activations.nestedfp_fp8(x.astype(float32))``:
  ``scale = clip(float32(0.7 * 448) / max(amax, 1e-5), 0.1, 50)``, ``codes = e4m3(clip(x * scale,
  -448, 448))``.
* :func:`fireq_fp8`: ``jaxlp.formats.int4_fp8.quantize_activation_fp8(x)``: ``scale = amax / 448``
  (BF16), ``codes = e4m3(clip(x / where(scale > 0, scale, 1), -448, 448))``.

where ``amax = max |x|`` over the row in float32. Like XLA:CPU (which runs with denormals
flushed), a float32-subnormal ``|x|`` (bfloat16 / float32 inputs) counts as 0 in ``amax``, and
:func:`token_fp8` quantizes it to a signed zero. Non-finite inputs (which :func:`jaxlp.formats.fp8.quantize`
rejects, but the traced functions compute through): ``+-inf`` saturates to ``+-448`` where the
row's scale is finite, a row holding NaN gets the scale NaN (``0x7FC00000``, as XLA:CPU writes it)
and NaN codes, a row holding ``inf`` (and no NaN) gets :func:`token_fp8`'s scale ``inf`` (zeros
for its finite elements, NaN for the infinite ones) and :func:`nestedfp_fp8`'s scale 0.1. NaN codes
are ``0x7F`` or ``0xFF``: their sign bit follows the host CPU's NaN rules in the references (x86:
``inf / inf`` is a negative NaN), the kernel's is the PTX ``cvt``'s; it is the one difference.

Design (``fp8_activations.cu``): :func:`row_layout` threads per row, each holding a few 16-byte
vectors of the row in registers (loaded once, before the amax, reused by the quantize step),
the amax an integer max over the bits of ``|x|`` (``max.u16x2``, ``redux.sync``, shared memory
across warps), then one correctly rounded division (or product) and one
``cvt.rn.satfinite.e4m3x2.f32`` per pair of elements, codes stored 8 (float32: 4) bytes per
vector. Rows beyond the register budget (16-bit K > 65536, float32 K > 32768), a K that is not a
multiple of the vector (8 elements; float32: 4) or misaligned buffers take a streaming variant
that reads the row twice. The library is compiled by ``nvcc`` on first use (:mod:`jaxlp.ffi.build`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxlp.ffi import build

TARGETS = {"token": "jaxlp_fp8_token_quantize", "nested": "jaxlp_nestedfp_fp8_quantize",
           "fireq": "jaxlp_fireq_fp8_quantize"}
LIBRARY = build.Library("fp8_activations",
                        {TARGETS["token"]: "JaxlpFp8TokenQuantize", TARGETS["nested"]: "JaxlpNestedFp8Quantize",
                         TARGETS["fireq"]: "JaxlpFireqFp8Quantize"})
DTYPES = (jnp.bfloat16, jnp.float16, jnp.float32)
MAX_K = 1 << 30
# (vectors of 16 bytes per row at most, threads per row, vectors per thread): fp8_activations.cu's
# `dispatch`; past the last row, 1024 threads per row stream it (vectors per thread 0).
LAYOUTS = ((32, 32, 1), (64, 32, 2), (128, 32, 4), (256, 64, 4), (512, 128, 4), (1024, 256, 4),
           (2048, 512, 4), (4096, 512, 8), (8192, 1024, 8))


def available() -> bool:
    """True when JAX runs on a GPU and the kernels build and load (never raises)."""
    return LIBRARY.available()


def unavailable_reason() -> str | None:
    """Why :func:`available` returned False (``None`` before it was asked or when it is True)."""
    return LIBRARY.unavailable_reason()


def row_layout(k: int, dtype) -> tuple[int, int]:
    """``(threads per row, 16-byte vectors per thread)`` the kernel runs a row of ``k`` elements
    of ``dtype`` with (aligned buffers); vectors per thread 0: the streaming variant (the row read
    twice; threads per row 256 when ``k`` is not a multiple of the vector)."""
    vec = 16 // jnp.dtype(dtype).itemsize
    if k % vec:
        return 256, 0
    for most, threads, items in LAYOUTS:
        if k // vec <= most:
            return threads, items
    return 1024, 0


def _check(x: jax.Array, name: str) -> tuple[int, int]:
    if x.ndim != 2:
        raise ValueError(f"{name}: x must be [M, K] (2-D), got shape {tuple(x.shape)}")
    if jnp.dtype(x.dtype) not in [jnp.dtype(d) for d in DTYPES]:
        raise ValueError(f"{name}: x must be bfloat16, float16 or float32, got {x.dtype}")
    m, k = x.shape
    if not 1 <= k <= MAX_K or m >= 1 << 31:
        raise ValueError(f"{name}: needs 1 <= K <= 2**30 and M < 2**31, got M={m}, K={k}")
    return m, k


def _call(target: str, x: jax.Array, scale_shape: tuple[int, ...]) -> tuple[jax.Array, jax.Array]:
    if build.on_gpu():
        LIBRARY.load()
    out = (jax.ShapeDtypeStruct(x.shape, jnp.float8_e4m3fn), jax.ShapeDtypeStruct(scale_shape, jnp.float32))
    codes, scale = jax.ffi.ffi_call(target, out)(x)
    return codes, scale


def token_fp8(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``(codes [M, K] float8_e4m3fn, scale [M] float32)`` of ``x [M, K]``: bit for bit
    ``jaxlp.formats.fp8.quantize_arrays(x, granularity="token")`` (module doc)."""
    m, _ = _check(x, "token_fp8")
    return _call(TARGETS["token"], x, (m,))


def fireq_fp8(x: jax.Array, *, bf16_scale: bool = True) -> tuple[jax.Array, jax.Array]:
    """``(codes [M, K] float8_e4m3fn, scale [M, 1] bfloat16)`` of ``x [M, K]``: bit for bit
    ``jaxlp.formats.int4_fp8.quantize_activation_fp8(x)`` as XLA:CPU computes it (module doc): the
    codes divided by 1 where the float32 scale is not positive there (a zero or NaN row, or a
    float32-subnormal ``amax / 448``, which XLA:CPU flushes), then the scale rounded to BF16.
    ``bf16_scale=False``: the float32 scale ``[M]`` before that rounding, as the kernel writes it
    (for a consumer that rounds it itself: no XLA conversion between the two kernels)."""
    m, _ = _check(x, "fireq_fp8")
    codes, scale = _call(TARGETS["fireq"], x, (m,))
    return (codes, scale.astype(jnp.bfloat16)[:, None]) if bf16_scale else (codes, scale)


def nestedfp_fp8(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``(codes [M, K] float8_e4m3fn, scale [M, 1] float32)`` of ``x [M, K]``: bit for bit
    ``jaxlp.quantization.activations.nestedfp_fp8(x.astype(jnp.float32))`` (module doc)."""
    m, _ = _check(x, "nestedfp_fp8")
    return _call(TARGETS["nested"], x, (m, 1))
