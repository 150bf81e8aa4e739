"""Reference causal attention with grouped-query heads, sliding windows and soft-capping.

Masks come from positions alone: query at position ``p`` sees key at position ``j`` iff
``j <= p`` and, on sliding layers, ``j > p - window`` (transformers' rule). A cache slot
that holds padding or stale data always sits at a position the query may not see yet, so
batches of prompts with different lengths need no separate padding mask.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def causal_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    q_positions: jax.Array,
    kv_positions: jax.Array,
    *,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
) -> jax.Array:
    """Attention of ``q [B, S, H, D]`` over ``k, v [B, T, KVH, D]``.

    ``q_positions [B, S]``, ``kv_positions [B, T]`` or ``[T]``. H must be a multiple of
    KVH (query head h uses KV head ``h // (H // KVH)``). Scores and softmax in float32;
    the output has q's dtype.
    """
    b, s, h, d = q.shape
    kvh = k.shape[2]
    if h % kvh:
        raise ValueError(f"{h} query heads are not a multiple of {kvh} KV heads")
    qg = q.reshape(b, s, kvh, h // kvh, d)
    scores = jnp.einsum("bskgd,btkd->bkgst", qg, k, preferred_element_type=jnp.float32) * scale
    if softcap is not None:
        scores = jnp.tanh(scores / softcap) * softcap
    kv_positions = jnp.broadcast_to(kv_positions, (b, k.shape[1]))
    visible = kv_positions[:, None, :] <= q_positions[:, :, None]
    if window is not None:
        visible &= kv_positions[:, None, :] > q_positions[:, :, None] - window
    scores = jnp.where(visible[:, None, None], scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    out = jnp.einsum("bkgst,btkd->bskgd", probs, v, preferred_element_type=jnp.float32)
    return out.reshape(b, s, h, d).astype(q.dtype)


def merge_splits(o: jax.Array, m: jax.Array, l: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Merge flash-decoding splits along axis 2: ``o [B, KVH, S, G, D]`` unnormalized, ``m, l
    [B, KVH, S, G]`` (each split's max score, natural log units, and sum of ``exp(s - m)``; an
    empty split has ``o = 0, m = -inf, l = 0``) to ``(out [B, KVH, G, D] normalized, m, l)``."""
    m_all = m.max(axis=2)
    safe = jnp.where(m_all == -jnp.inf, 0.0, m_all)
    w = jnp.where(m == -jnp.inf, 0.0, jnp.exp(m - safe[:, :, None]))
    num = (o * w[..., None]).sum(axis=2)
    den = (l * w).sum(axis=2)
    out = jnp.where(den[..., None] > 0, num / jnp.where(den > 0, den, 1.0)[..., None], 0.0)
    return out, m_all, den
