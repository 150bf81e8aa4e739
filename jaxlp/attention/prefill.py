"""Prompt (prefill) attention without the [S, S] score matrix: blockwise on XLA, cuDNN and Mosaic on GPUs.

:func:`jaxlp.attention.reference.causal_attention` materialises float32 scores
``[B, KVH, G, S, T]``; at batch 8 x 32K-token prompts that is 8 * 32 * 32K * 32K * 4 bytes =
1 TiB. The prompt call of prefill is self-attention of the prompt, and needs none of it.

Math (the reference's, exactly)
-------------------------------
``q [B, S, H, D]``, ``k, v [B, S, KVH, D]``, ``lengths [B]``: row ``b`` holds prompt tokens at
positions ``0 .. lengths[b] - 1`` and right padding after them. Query head ``h`` reads KV head
``h // (H // KVH)`` (GQA). For the query at position ``p`` and the key at ``j``::

    s = (q_p . k_j) * scale                          # float32 accumulation
    s = tanh(s / softcap) * softcap                  # softcap only, before masking
    visible = j <= p  and  (window is None or j > p - window)     # transformers' rule
    out_p = sum_j softmax_j(s | visible) * v_j       # softmax in float32,
                                                     # probabilities in v's dtype

Right padding needs no mask of its own: a padding key sits at ``j >= lengths[b] > p`` for every
real query ``p``, so causality hides it. Output rows ``p >= lengths[b]`` are **zero** in every
implementation (not the reference's values: callers must ignore them; zeros keep them finite,
so a 0-probability times padding product can never turn a later layer's real rows into NaN).

Implementations
---------------
``"xla"`` (every backend, every dtype, softcap, any head size)
    Pure-JAX flash attention: a ``fori_loop`` over query blocks of ``block_q`` rows, inside it a
    ``fori_loop`` over key blocks of ``block_k`` with the online softmax (running max ``m``,
    sum ``l``, float32 accumulator). Only key blocks that intersect the causal band are visited:
    ``[floor((q0 - window + 1) / block_k), ceil(min(q0 + block_q, max(lengths)) / block_k))``, so
    causal prompts cost about half the dense FLOPs, windows ``O(S * window)``, and query blocks
    past the longest prompt cost nothing. Peak memory beyond the inputs and output is a few
    ``[B, H, block_q, block_k]`` float32 arrays. The probabilities are cast to v's dtype
    unnormalised (in [0, 1], relative to the running max) rather than normalised as in the
    reference: a difference of one rounding of v's dtype. On an H100 it runs at 40-53 TFLOP/s
    for S >= 4K (bound by the float32 score blocks' memory traffic), about 10x slower than
    cuDNN: the path for CPUs and for what the GPU kernels lack (float32, softcap).
``"cudnn"`` (GPU; bf16/fp16 q, k, v of one dtype; no softcap; head_dim a multiple of 8 and
<= 256 on Hopper, 128 before)
    ``jax.nn.dot_product_attention(implementation="cudnn")``, layout BTNH, ``is_causal=True``,
    ``query_seq_lengths = key_value_seq_lengths = lengths`` (cuDNN's PADDING_CAUSAL mask) and
    ``local_window_size = (window - 1, 0)``: jax's left window ``w`` keeps keys ``j >= p - w``,
    and it hands cuDNN ``sliding_window_length = w + 1`` = ``window``, whose band is
    ``(p - window, p]``: transformers' rule exactly. A window ``>= S`` is dropped (it hides
    nothing).
``"mosaic"`` (Hopper; bf16/fp16; no softcap; no window smaller than S; head_dim a multiple of 64)
    jax's Pallas Mosaic GPU FA3-style kernel (``jax.experimental.pallas.ops.gpu.attention_mgpu``,
    ``causal=True``, GQA native). Its shared-memory buffers are float16 in jax 0.11.2, so bf16
    inputs are converted to fp16 (values beyond +-65504 overflow; fp16 keeps more mantissa bits
    than bf16, so nothing else is lost) and the output back to q's dtype. It has no scale
    argument (q is scaled in float32 and rounded to fp16 once) and no padding lengths (none
    needed: right padding is causally hidden), and it needs S a multiple of ``2 * block_q`` and
    of ``block_kv`` (q, k, v are zero-padded at the end, which real queries never see). No
    sliding window, no softcap: those calls raise. The kernel uses approximate exp2. On an H100
    it runs at about cuDNN's speed (on par at batch 1, up to 15% slower at 8 x 32K) but covers fewer
    cases, so ``"auto"`` never picks it.
``"auto"``
    ``"cudnn"`` when the default backend is a GPU and the call meets the cuDNN conditions above
    (bf16/fp16, one dtype, no softcap, head_dim % 8 == 0 and <= 256/128); ``"xla"`` otherwise
    (CPU, float32 inputs, softcap layers such as Gemma 2's, odd head sizes). If cuDNN refuses
    the call at trace time (NotImplementedError / RuntimeError: no cuDNN, an unsupported
    shape), ``"auto"`` falls back to ``"xla"``.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax

IMPLEMENTATIONS = ("auto", "xla", "cudnn", "mosaic")

_NEG = float(jnp.finfo(jnp.float32).min)


def prefill_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    lengths: jax.Array,
    *,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
    implementation: str = "auto",
    block_q: int | None = None,
    block_k: int | None = None,
) -> jax.Array:
    """Causal self-attention of right-padded prompts: ``q [B, S, H, D]``, ``k, v [B, S, KVH, D]``,
    ``lengths [B]`` (integer, each in ``[0, S]``) -> ``[B, S, H, D]`` in q's dtype; rows
    ``>= lengths[b]`` are zero.

    ``window``: sliding window (query ``p`` sees ``p - window < j <= p``); ``softcap``: tanh cap
    of the scaled scores. ``implementation``: one of :data:`IMPLEMENTATIONS` (see the module
    docstring). ``block_q`` / ``block_k``: tile sizes of the ``"xla"`` path (default 512 / 512,
    clipped to S) and of ``"mosaic"`` (its ``block_q`` / ``block_kv``, multiples of 64, default
    64 / 128 as in jax's own benchmark); ignored by ``"cudnn"``.
    """
    _validate(q, k, v, lengths, window, softcap, block_q, block_k)
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"unknown implementation {implementation!r}: choose one of {IMPLEMENTATIONS}")
    s = q.shape[1]
    if window is not None and window >= s:
        window = None  # the band (p - window, p] then holds every causal key
    if implementation == "auto":
        if cudnn_supported(q, k, v, softcap=softcap):
            try:
                return _cudnn(q, k, v, lengths, scale=scale, window=window)
            except (NotImplementedError, RuntimeError):
                pass
        implementation = "xla"
    if implementation == "xla":
        return _xla(q, k, v, lengths, scale=scale, window=window, softcap=softcap,
                    block_q=block_q or 512, block_k=block_k or 512)
    if softcap is not None:
        raise ValueError(f"implementation {implementation!r} has no softcap: use 'xla'")
    if implementation == "cudnn":
        return _cudnn(q, k, v, lengths, scale=scale, window=window)
    if window is not None:
        raise ValueError(f"implementation 'mosaic' has no sliding window (got {window} < S = {s}): use 'cudnn' or 'xla'")
    return _mosaic(q, k, v, lengths, scale=scale, block_q=block_q or 64, block_k=block_k or 128)


def cudnn_supported(q, k, v, *, softcap=None) -> bool:
    """Whether ``"auto"`` sends this call to cuDNN (static checks only; see the module docstring)."""
    if jax.default_backend() != "gpu" or softcap is not None:
        return False
    if not (q.dtype == k.dtype == v.dtype) or q.dtype not in (jnp.bfloat16, jnp.float16):
        return False
    d = q.shape[-1]
    try:
        cc = tuple(int(x) for x in jax.devices()[0].compute_capability.split("."))
    except (AttributeError, ValueError):
        return False
    return d % 8 == 0 and d <= (256 if cc >= (9, 0) else 128)


def _validate(q, k, v, lengths, window, softcap, block_q, block_k):
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        raise ValueError(f"q, k, v must be [B, S, heads, D], got shapes {q.shape}, {k.shape}, {v.shape}")
    b, s, h, d = q.shape
    if k.shape != v.shape:
        raise ValueError(f"k {k.shape} and v {v.shape} differ in shape")
    if k.shape[0] != b or k.shape[1] != s:
        raise ValueError(f"q {q.shape} and k/v {k.shape} differ in batch or sequence length (self-attention of the prompt)")
    if k.shape[3] != d:
        raise ValueError(f"q head size {d} != k/v head size {k.shape[3]}")
    if h % k.shape[2]:
        raise ValueError(f"{h} query heads are not a multiple of {k.shape[2]} KV heads")
    if lengths.shape != (b,) or not jnp.issubdtype(lengths.dtype, jnp.integer):
        raise ValueError(f"lengths must be an integer array of shape ({b},), got {lengths.dtype}{lengths.shape}")
    if window is not None and window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    if softcap is not None and not softcap > 0:
        raise ValueError(f"softcap must be > 0, got {softcap}")
    if (block_q is not None and block_q < 1) or (block_k is not None and block_k < 1):
        raise ValueError(f"block sizes must be positive, got block_q={block_q}, block_k={block_k}")


def _pad_seq(x, n):
    return x if x.shape[1] == n else jnp.pad(x, ((0, 0), (0, n - x.shape[1]), (0, 0), (0, 0)))


def _zero_padding_rows(out, lengths):
    valid = jnp.arange(out.shape[1])[None, :] < lengths[:, None]
    return jnp.where(valid[:, :, None, None], out, jnp.zeros((), out.dtype))


@functools.partial(jax.jit, static_argnames=("scale", "window", "softcap", "block_q", "block_k"))
def _xla(q, k, v, lengths, *, scale, window, softcap, block_q, block_k):
    b, s, h, d = q.shape
    kvh = k.shape[2]
    g = h // kvh
    bq, bk = min(block_q, s), min(block_k, s)
    nq, nk = -(-s // bq), -(-s // bk)
    qg = _pad_seq(q, nq * bq).reshape(b, nq * bq, kvh, g, d)
    kp, vp = _pad_seq(k, nk * bk), _pad_seq(v, nk * bk)
    lengths = jnp.clip(lengths.astype(jnp.int32), 0, s)
    used_k_blocks = (jnp.max(lengths) + bk - 1) // bk  # key blocks past the longest prompt: never visible

    def q_block(i, out):
        q0 = i * bq
        qb = lax.dynamic_slice_in_dim(qg, q0, bq, axis=1)  # [b, bq, kvh, g, d]
        qpos = q0 + jnp.arange(bq, dtype=jnp.int32)
        hi = jnp.minimum((q0 + bq - 1) // bk + 1, used_k_blocks)
        lo = 0 if window is None else jnp.maximum(q0 - window + 1, 0) // bk

        def k_block(j, carry):
            m, l, acc = carry
            k0 = j * bk
            kb = lax.dynamic_slice_in_dim(kp, k0, bk, axis=1)
            vb = lax.dynamic_slice_in_dim(vp, k0, bk, axis=1)
            sc = jnp.einsum("bqkgd,btkd->bkgqt", qb, kb, preferred_element_type=jnp.float32) * scale
            if softcap is not None:
                sc = jnp.tanh(sc / softcap) * softcap
            kpos = k0 + jnp.arange(bk, dtype=jnp.int32)
            visible = kpos[None, :] <= qpos[:, None]
            if window is not None:
                visible &= kpos[None, :] > qpos[:, None] - window
            sc = jnp.where(visible, sc, _NEG)
            m_new = jnp.maximum(m, jnp.max(sc, axis=-1))
            p = jnp.where(visible, jnp.exp(sc - m_new[..., None]), 0.0)
            alpha = jnp.exp(m - m_new)
            pv = jnp.einsum("bkgqt,btkd->bkgqd", p.astype(v.dtype), vb, preferred_element_type=jnp.float32)
            return m_new, l * alpha + jnp.sum(p, axis=-1), acc * alpha[..., None] + pv

        init = (
            jnp.full((b, kvh, g, bq), _NEG, jnp.float32),
            jnp.zeros((b, kvh, g, bq), jnp.float32),
            jnp.zeros((b, kvh, g, bq, d), jnp.float32),
        )
        _, l, acc = lax.fori_loop(lo, hi, k_block, init)
        o = acc / jnp.where(l > 0, l, 1.0)[..., None]
        o = jnp.transpose(o, (0, 3, 1, 2, 4)).astype(q.dtype)  # [b, bq, kvh, g, d]
        return lax.dynamic_update_slice_in_dim(out, o, q0, axis=1)

    out = lax.fori_loop(0, nq, q_block, jnp.zeros_like(qg))
    return _zero_padding_rows(out[:, :s].reshape(b, s, h, d), lengths)


def _cudnn(q, k, v, lengths, *, scale, window):
    lengths = lengths.astype(jnp.int32)
    out = jax.nn.dot_product_attention(
        q, k, v,
        scale=scale,
        is_causal=True,
        query_seq_lengths=lengths,
        key_value_seq_lengths=lengths,
        local_window_size=None if window is None else (window - 1, 0),
        implementation="cudnn",
    )
    return _zero_padding_rows(out, lengths)


def _mosaic(q, k, v, lengths, *, scale, block_q, block_k):
    from jax.experimental.pallas.ops.gpu import attention_mgpu

    b, s, h, d = q.shape
    if not (q.dtype == k.dtype == v.dtype) or q.dtype not in (jnp.bfloat16, jnp.float16):
        raise ValueError(f"implementation 'mosaic' needs bf16/fp16 q, k, v of one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if d % 64:
        raise ValueError(f"implementation 'mosaic' needs head_dim % 64 == 0, got {d}")
    if block_q % 64 or block_k % 64:
        raise ValueError(f"implementation 'mosaic' needs block sizes that are multiples of 64, got {block_q}, {block_k}")
    bq, bkv = block_q, block_k
    step = math.lcm(2 * bq, bkv)
    n = -(-max(s, 2 * bkv) // step) * step  # at least two KV blocks: the kernel double-buffers
    config = attention_mgpu.TuningConfig(block_q=bq, block_kv=bkv, max_concurrent_steps=2, causal=True)
    # The kernel's shared-memory buffers are float16 (jax 0.11.2), so bf16 inputs run as fp16.
    qs = (q.astype(jnp.float32) * scale).astype(jnp.float16)
    kh, vh = k.astype(jnp.float16), v.astype(jnp.float16)
    out = attention_mgpu.attention(_pad_seq(qs, n), _pad_seq(kh, n), _pad_seq(vh, n), config)
    return _zero_padding_rows(out[:, :s].astype(q.dtype), lengths.astype(jnp.int32))
