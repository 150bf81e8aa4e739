"""FireQ W4A8 ``QuantizedLinear`` products on tensor cores: INT4 weights with E4M3 group scales
(:mod:`jaxlp.formats.int4_fp8`) times per-token FP8 activations (the ``fireq_fp8`` quantizer),
``(x8 @ e4m3(q * s).T) * s_x * out_scale`` (``out_scale``: PTS's ``1/p``), the FP8 weight decoded in
registers, never in memory:

- ``implementation="fireq_cuda"`` (:mod:`jaxlp.ffi.fireq`): 1..16 tokens, and up to 32 where the
  GEMM's tiles would not fill the GPU (:func:`gemv_tokens`), a CUDA GEMV streaming the 4-bit
  weights through ``mma.sync`` E4M3 MMAs;
- ``implementation="fireq_pallas"``: any number of tokens, by ``design`` (:data:`GEMM_DESIGNS`):
  ``"in_kernel"`` (:mod:`jaxlp.pallas.int4_fp8_matmul`: a Pallas Mosaic GPU FP8 WGMMA GEMM decoding
  the weight tiles in registers) or ``"decoded"`` (the CUDA decode writes the E4M3 weight, then the
  Pallas FP8 GEMM of :mod:`jaxlp.pallas.fp8_matmul` reads it: one more pass over the weight, which
  pays where many tokens share it); the default by tokens and the layer's width
  (:func:`default_design`).

``implementation="fireq_cutlass"``: any number of tokens through CUTLASS, by ``design``
(:data:`CUTLASS_DESIGNS`): ``"mixed"`` (:func:`jaxlp.ffi.cutlass_gemm.fireq_matmul`), CUTLASS's
mixed-input mainloop, the INT4 codes turned into E4M3 in registers by a per-group lookup table
(built from the scales in the same program, :func:`jaxlp.ffi.fireq.tables`), the FP8 sums promoted;
``"decoded"``, the CUDA decode writes the E4M3 weight, then CUTLASS's promoted FP8 GEMM
(:func:`jaxlp.ffi.cutlass_gemm.fp8_matmul`) reads it, from :data:`CUTLASS_DECODED_FROM_TOKENS` tokens
on by default.

``"auto"`` on a GPU: CUTLASS past the GEMV's 16 tokens (:func:`auto_declines_cutlass`; H100,
docs/perf.md sessions 29 and 34: the FFN of Llama-3-8B 1.4-1.6x BF16 at 32-128 tokens, 1.24x at 2048),
the GEMV up to 16, the Pallas GEMM where CUTLASS does not take the layer, then XLA's FP8 dot on the
materialized FP8 weight (:mod:`jaxlp.quantization.native_dot`). The
math of ``QuantizedLinear.reference`` to summation order (FP32 sums of exact E4M3 products), the
activation scale applied to the FP32 sums before the one rounding to x's dtype.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from jaxlp.ffi import cutlass_gemm
from jaxlp.ffi import fireq as gemv_kernel
from jaxlp.ffi import fp8_activations as quantize_cuda
from jaxlp.formats import int4_fp8
from jaxlp.pallas import fp8_matmul as fp8_kernel
from jaxlp.pallas import int4_fp8_matmul as gemm_kernel
from jaxlp.pallas import wgmma_tiles

GEMV_IMPLEMENTATION = "fireq_cuda"
GEMM_IMPLEMENTATION = "fireq_pallas"
CUTLASS_IMPLEMENTATION = "fireq_cutlass"
GEMM_DESIGNS = ("in_kernel", "decoded")
CUTLASS_DESIGNS = ("mixed", "decoded")
GEMV_TOKENS = 16  # the GEMV takes this many tokens on any layer
DECODED_FROM_TOKENS = 512  # H100, docs/perf.md "session 20": the decoded design from here on
# The decoded CUTLASS design from here on (H100, docs/perf.md session 34: the FFN at 1024 tokens 443.3 us
# against the mixed-input kernel's 448.3, at 2048 724.0 against 873.5; at 768 386.8 against 386.7).
CUTLASS_DECODED_FROM_TOKENS = 1024


def default_design(tokens: int, n: int, num_sms: int | None = None) -> str:
    """The GEMM design for ``tokens`` tokens and ``n`` output features, where the CUDA library is
    available (else ``"in_kernel"``): ``"decoded"`` from :data:`DECODED_FROM_TOKENS` tokens on, and
    wherever the in-kernel GEMM's 128-row CTA tiles would not fill the SMs (its FP8 GEMM splits
    its tiles finer); ``"in_kernel"`` otherwise (H100: 4096 x 14336 at 256 tokens 81 vs 97 us,
    28672 x 4096 121.7 vs 154.2)."""
    if not gemv_kernel.available():
        return "in_kernel"
    narrow = -(-n // 128) < (num_sms or wgmma_tiles.num_sms())
    return "decoded" if tokens >= DECODED_FROM_TOKENS or narrow else "in_kernel"


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


def gemv_tokens(n: int, num_sms: int | None = None) -> int:
    """The most tokens the GEMV takes on a layer of ``n`` output features: :data:`GEMV_TOKENS`, and
    up to ``jaxlp.ffi.fireq.MAX_TOKENS`` where the GEMM's 128-row CTA tiles would not fill the
    ``num_sms`` SMs (default: the device's; the GEMM has no split over K: 4096 x 14336 at 32
    tokens runs 32 CTAs)."""
    return gemv_kernel.MAX_TOKENS if -(-n // 128) < (num_sms or wgmma_tiles.num_sms()) else GEMV_TOKENS


def why_not_gemv(layer, x: jax.Array) -> str | None:
    """``None`` if :func:`matmul_gemv` computes this layer on ``x`` here, else the reason."""
    if (reason := layer_reason(layer, x)) is not None:
        return reason
    n = layer.weight.get_value().shape[0]
    tokens = math.prod(x.shape[:-1])
    if tokens > (most := gemv_tokens(n)):
        return f"{tokens} tokens (the GEMV takes 1 to {most} on {n} output features)"
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


def why_not_cutlass(layer, x: jax.Array) -> str | None:
    """``None`` if :func:`matmul_cutlass` computes this layer on ``x`` here, else the reason."""
    if (reason := layer_reason(layer, x)) is not None:
        return reason
    n, k = layer.weight.get_value().shape
    return cutlass_gemm.why_not_here(math.prod(x.shape[:-1]), n, k)


def auto_declines_cutlass(layer, x: jax.Array) -> str | None:
    """Why ``"auto"`` passes the CUTLASS GEMM over where it computes the layer: the GEMV's tokens
    (1..16), or without the CUDA library of the table builder and the decode (XLA's build of the
    tables took ~30 us per product)."""
    tokens = math.prod(x.shape[:-1])
    if tokens <= GEMV_TOKENS:
        return f"{tokens} tokens: the GEMV's (1 to {GEMV_TOKENS})"
    if not gemv_kernel.available():
        return "the CUDA table builder and decode (jaxlp.ffi.fireq) are not available"
    return None


def _quantized_tokens(x):
    """``(lead shape, x8 [T, K], s_x [T] float32)``: the ``fireq_fp8`` codes and their BF16 scale,
    by the one-pass CUDA quantizer where its library is available (:func:`jaxlp.ffi.fp8_activations.fireq_fp8`:
    the XLA quantizer's bits), else by XLA. The scale's rounding is a ``reduce_precision``: XLA on a
    GPU may drop a float32 -> BF16 -> float32 round trip inside a fusion (excess precision), which
    measured +0.2% on every output."""
    lead, k = x.shape[:-1], x.shape[-1]
    quantize = quantize_cuda.fireq_fp8 if quantize_cuda.available() else int4_fp8.quantize_activation_fp8
    x8, x_scale = quantize(x.reshape(-1, k))
    return lead, x8, jax.lax.reduce_precision(x_scale[:, 0].astype(jnp.float32), exponent_bits=8, mantissa_bits=7)


def matmul_gemv(layer, x: jax.Array, *, unroll: int | None = None) -> jax.Array:
    """The layer's product before bias through the CUDA GEMV (1..32 tokens); ``unroll``: its K
    windows per pipelined step (default ``jaxlp.ffi.fireq.DEFAULT_UNROLL``)."""
    w = layer.weight.get_value()
    options = dict(unroll=unroll or gemv_kernel.DEFAULT_UNROLL, multiplier=layer.out_scale, out_dtype=x.dtype)
    if quantize_cuda.available():  # the quantizer's float32 scale straight to the GEMV, which rounds it to BF16
        lead, k = x.shape[:-1], x.shape[-1]
        x8, x_scale = quantize_cuda.fireq_fp8(x.reshape(-1, k), bf16_scale=False)
        y = gemv_kernel.gemv(x8, w.codes, w.scales, token_scale=x_scale, bf16_token_scale=True, **options)
    else:
        lead, x8, x_scale = _quantized_tokens(x)
        y = gemv_kernel.gemv(x8, w.codes, w.scales, token_scale=x_scale, **options)
    return y.reshape(*lead, w.shape[0])


def matmul_gemm(layer, x: jax.Array, *, design: str | None = None, config=None) -> jax.Array:
    """The layer's product before bias through a Pallas GEMM: ``design`` one of
    :data:`GEMM_DESIGNS` (default :func:`default_design`), ``config`` its kernel's tiling
    (:class:`jaxlp.pallas.int4_fp8_matmul.MatmulConfig` or :class:`jaxlp.pallas.fp8_matmul.MatmulConfig`)."""
    w = layer.weight.get_value()
    lead, x8, x_scale = _quantized_tokens(x)
    design = design or default_design(x8.shape[0], w.shape[0])
    if design not in GEMM_DESIGNS:
        raise ValueError(f"unknown FireQ GEMM design {design!r}; the designs are {GEMM_DESIGNS}")
    token_scale = x_scale * layer.out_scale
    if design == "decoded":
        w8 = gemv_kernel.decode(w.codes, w.scales)
        y = fp8_kernel.fp8_matmul(x8, w8, token_scale, jnp.ones((w.shape[0],), jnp.float32), out_dtype=x.dtype,
                                  config=config)
    else:
        y = gemm_kernel.int4_fp8_matmul(x8, w, token_scale, out_dtype=x.dtype, config=config)
    return y.reshape(*lead, w.shape[0])


def default_cutlass_design(tokens: int) -> str:
    """The CUTLASS design for ``tokens`` tokens: ``"decoded"`` from :data:`CUTLASS_DECODED_FROM_TOKENS`
    on, where the weight's extra pass costs less than the mixed-input kernel's per-tile decode, else
    ``"mixed"``."""
    return "decoded" if tokens >= CUTLASS_DECODED_FROM_TOKENS else "mixed"


def matmul_cutlass(layer, x: jax.Array, *, design: str | None = None, config: str | None = None,
                   tables=None) -> jax.Array:
    """The layer's product before bias through CUTLASS, by ``design`` (:data:`CUTLASS_DESIGNS`,
    default :func:`default_cutlass_design`): ``"mixed"``, the mixed-input GEMM
    (:func:`jaxlp.ffi.cutlass_gemm.fireq_matmul`; ``config`` one of its ``FIREQ_CONFIGS``) on the
    weight's codes, ``tables`` its lookup tables (:func:`jaxlp.ffi.cutlass_gemm.fireq_tables`) built
    beforehand, else built in the same program from the scales (by :func:`jaxlp.ffi.fireq.tables`
    where its library is available); ``"decoded"``, the CUDA decode writes the E4M3 weight
    (:func:`jaxlp.ffi.fireq.decode`), then CUTLASS's promoted FP8 GEMM
    (:func:`jaxlp.ffi.cutlass_gemm.fp8_matmul`; ``config`` one of its ``CONFIGS``) reads it."""
    w = layer.weight.get_value()
    design = design or default_cutlass_design(math.prod(x.shape[:-1]))
    if design not in CUTLASS_DESIGNS:
        raise ValueError(f"unknown FireQ CUTLASS design {design!r}; the designs are {CUTLASS_DESIGNS}")
    lead, x8, x_scale = _quantized_tokens(x)
    if design == "decoded":
        if tables is not None:
            raise ValueError("the decoded CUTLASS design reads no lookup tables")
        w8 = gemv_kernel.decode(w.codes, w.scales)
        y = cutlass_gemm.fp8_matmul(x8, w8, x_scale * layer.out_scale, jnp.ones((w.shape[0],), jnp.float32),
                                    out_dtype=x.dtype, config=config)
        return y.reshape(*lead, w.shape[0])
    if tables is None:
        tables = gemv_kernel.tables(w.scales) if gemv_kernel.available() else cutlass_gemm.fireq_tables(w)
    y = cutlass_gemm.fireq_matmul(x8, w.codes, tables, x_scale * layer.out_scale, out_dtype=x.dtype, config=config)
    return y.reshape(*lead, w.shape[0])
