"""Decode attention over a dense cache (one query token per row): the dispatch.

    out = decode_attention(q, k, v, lengths, starts, scale=..., softcap=None, implementation="auto")

q ``[B, H, D]``; k, v ``[B, L, KVH, D]`` (the cache, H a multiple of KVH); row ``b`` attends
to slots ``starts[b] <= j < lengths[b]``. Implementations:

* ``"xla"``: :func:`jaxlp.pallas.decode_attention.reference`, i.e.
  :func:`jaxlp.attention.reference.causal_attention` (the reference, and the CPU path);
* ``"pallas"``: the flash-decoding kernel :func:`jaxlp.pallas.decode_attention.decode_attention`
  (a GPU; q and the cache in BF16 or FP16: a q of the other half type is cast to the cache's
  dtype for the kernel and the output back, e.g. a NestedFP16 model's FP16 queries over a BF16
  cache, whose keys hold BF16's precision already; the XLA path would instead cast the whole
  cache to q's dtype at every step);
* ``"interpret"``: the same kernel in Pallas' interpret mode (CPU tests);
* ``"auto"``: ``"pallas"`` where it applies, else ``"xla"``;
* ``"cuda"``: names the CUDA kernel of the quantized caches
  (:mod:`jaxlp.ffi.quantized_decode_attention`); a dense cache has none and refuses it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxlp.pallas import decode_attention as kernel

IMPLEMENTATIONS = ("auto", "xla", "pallas", "interpret", "cuda")


def check_implementation(implementation: str) -> None:
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"attention implementation must be one of {IMPLEMENTATIONS}, got {implementation!r}")


HALF = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def kernel_applies(q: jax.Array, k: jax.Array) -> bool:
    """Whether the Pallas kernel runs these operands compiled: a GPU, q and cache each BF16 or FP16."""
    return jax.default_backend() == "gpu" and jnp.dtype(q.dtype) in HALF and jnp.dtype(k.dtype) in HALF


def choose(q: jax.Array, k: jax.Array, implementation: str) -> str:
    """The implementation a call runs: ``"auto"`` resolved; ``"pallas"`` checked."""
    check_implementation(implementation)
    if implementation == "cuda":
        raise ValueError("the dense cache has no CUDA decode-attention kernel (only the quantized caches do); "
                         "use attention='auto', 'pallas' or 'xla'")
    if implementation == "auto":
        return "pallas" if kernel_applies(q, k) else "xla"
    if implementation == "pallas" and not kernel_applies(q, k):
        raise ValueError(f"the Pallas decode-attention kernel needs a GPU and q and the cache in BF16 or FP16; "
                         f"got backend {jax.default_backend()!r}, q {q.dtype}, cache {k.dtype}")
    return implementation


def decode_attention(q, k, v, lengths, starts=None, *, scale: float, softcap: float | None = None,
                     implementation: str = "auto") -> jax.Array:
    """Attention of one query per row over cache slots ``[starts, lengths)``: ``[B, H, D]`` in q's dtype
    (the kernels take q in the cache's dtype: module doc)."""
    chosen = choose(q, k, implementation)
    if chosen == "xla":
        return kernel.reference(q, k, v, lengths, starts, scale=scale, softcap=softcap)
    out = kernel.decode_attention(q.astype(k.dtype), k, v, lengths, starts, scale=scale, softcap=softcap,
                                  interpret=chosen == "interpret")
    return out.astype(q.dtype)
