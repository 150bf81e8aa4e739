"""MXFP4 and DialectFP4 linears on the GPU: NVFP4's GEMV and GEMM with a table decode of the blocks.

:class:`~jaxlp.quantization.QuantizedLinear` lists it as ``"block_fp4_cuda"`` (and ``"auto"``
takes it on a GPU) for MXFP4 and DialectFP4 weights in blocks of 32, with no activation quantizer
(W4A16) or the weight's own (``"mxfp4"`` / ``"dialect_fp4"``, W4A4), and BF16 activations:

- W4A4 activations are quantized in the kernels' call (a staging kernel, bit-exact with
  :func:`activations.fake_quantize`), or by ``fake_quantize`` itself before :func:`dequantize_dot`,
  exact in BF16 for both formats (E2M1 or dialect magnitudes times a power of two);
- :func:`jaxlp.ffi.block_fp4.matmul` with the launch of :func:`default_config`: NVFP4's ``"pipe"``
  GEMV up to :data:`PIPE_MAX_TOKENS` tokens, its ``"gemm"`` above, both decoding the weight blocks
  by table lookup in registers;
- :func:`dequantize_dot` (the weight decoded to BF16, exact, and one XLA dot with FP32 accumulation)
  where :func:`default_config` gives None.

Both equal the reference (:meth:`QuantizedLinear.reference`) up to FP32 summation order.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from jaxlp.ffi import block_fp4
from jaxlp.quantization import activations

IMPLEMENTATION = "block_fp4_cuda"
ACTIVATIONS = {"mxfp4": (None, "mxfp4"), "dialect_fp4": (None, "dialect_fp4")}  # by weight format
PIPE_MAX_TOKENS = 16  # the GEMV up to here, then the GEMM up to GEMM_MAX_TOKENS, then dequantize_dot
GEMM_MAX_TOKENS = 64


def default_config(tokens: int, n: int, k: int) -> block_fp4.Config | None:
    """The kernel launch for ``tokens`` x ``[n, k]``, or None for :func:`dequantize_dot`: the fastest
    on the Qwen3-8B shapes (qkv, o, gate_up, down, fused gate_up) at 1..2048 tokens, H100 (docs/perf.md
    "Session 31"). The GEMV (two 16-row tiles per warp, no split-K cluster) up to 16 tokens; the GEMM
    with 64-token tiles and 2-way split-K up to 64 (128-row tiles on layers of 6144 rows and more);
    above, the dot (at 256 tokens it beat every GEMM tiling on every shape)."""
    del k
    if tokens <= PIPE_MAX_TOKENS:
        return block_fp4.Config(rows_per_warp=2, split=1)
    if tokens <= GEMM_MAX_TOKENS:
        return block_fp4.Config(kernel="gemm", block_n=128 if n >= 6144 else 64, block_m=64, split=2)
    return None


def dequantize_dot(x: jax.Array, w) -> jax.Array:
    """``x [M, K] @ dequant(w).T`` as the weight decoded to BF16 (exact: :func:`jaxlp.ffi.block_fp4.decode`
    where the CUDA library is available, else ``w.dequantize``) and one XLA dot with FP32 accumulation:
    the path where :func:`default_config` gives None. FP32 ``[M, N]``."""
    wd = block_fp4.decode(w) if block_fp4.available() else w.dequantize(jnp.bfloat16)
    return jnp.einsum("mk,nk->mn", x, wd, preferred_element_type=jnp.float32)


def why_not(layer, x: jax.Array) -> str | None:
    """``None`` if :func:`matmul` computes this layer on ``x`` here, else the reason."""
    w = layer.weight.get_value()
    if w.format not in ACTIVATIONS:
        return f"it takes {tuple(ACTIVATIONS)} weights, not {w.format!r}"
    if layer.activation not in ACTIVATIONS[w.format]:
        return f"{w.format} weights take no activation quantizer or {w.format!r}, not {layer.activation!r}"
    if w.block_size != block_fp4.BLOCK_SIZE:
        return f"{w.format} blocks of {w.block_size}; the kernels take blocks of {block_fp4.BLOCK_SIZE}"
    if jnp.dtype(x.dtype) != jnp.dtype(jnp.bfloat16):
        return f"it takes bfloat16 activations, got {jnp.dtype(x.dtype)}"
    tokens = math.prod(x.shape[:-1])
    config = default_config(tokens, *w.shape)
    if config is None:
        return None if jax.default_backend() == "gpu" else f"it runs on a GPU (backend {jax.default_backend()!r})"
    if (reason := block_fp4.why_not(w, tokens, x.dtype, config)) is not None:
        return reason
    if not block_fp4.available():
        return f"the CUDA library is not available: {block_fp4.unavailable_reason()}"
    return None


def matmul(layer, x: jax.Array, *, config: block_fp4.Config | None = None) -> jax.Array:
    """The layer's product before bias (module doc); ``config``: the kernel's launch (default
    :func:`default_config`)."""
    w = layer.weight.get_value()
    lead, k = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, k)
    config = config or default_config(x2.shape[0], *w.shape)
    if config is not None:
        y = block_fp4.matmul(x2, w, config=config, activation=layer.activation)
    else:
        if layer.activation is not None:
            x2 = activations.fake_quantize(x2, layer.activation).astype(jnp.bfloat16)  # exact (module doc)
        y = dequantize_dot(x2, w)
    if layer.out_scale != 1.0:
        y = y.astype(jnp.float32) * layer.out_scale
    return y.astype(x.dtype).reshape(*lead, w.shape[0])
