"""Dense (unquantized) KV cache: ``k, v [B, max_len, KVH, D]`` in BF16 by default."""

from __future__ import annotations

from typing import TYPE_CHECKING

import dataclasses

import jax
import jax.numpy as jnp

from jaxlp.kvcache.base import CacheFormat, KVCache, LayerCache
from jaxlp.models.attention import causal_attention

if TYPE_CHECKING:
    from jaxlp.models.config import ModelConfig


#: How one-token (decode) steps attend: "auto" runs :mod:`jaxlp.pallas.decode_attention` on a GPU
#: when the cache holds q's dtype (BF16 or FP16), else the reference; "xla" always the reference
#: (``causal_attention``); "interpret" the Pallas kernel in interpret mode (CPU tests).
ATTENTION = "auto"
ATTENTION_CHOICES = ("auto", "xla", "interpret")


def _decode_kernel(q, cache_k) -> bool:
    if ATTENTION not in ATTENTION_CHOICES:
        raise ValueError(f"jaxlp.kvcache.dense.ATTENTION must be one of {ATTENTION_CHOICES}, got {ATTENTION!r}")
    if ATTENTION == "xla" or q.shape[1] != 1:
        return False
    if ATTENTION == "interpret":
        return True
    return (jax.default_backend() == "gpu" and q.dtype == cache_k.dtype
            and jnp.dtype(q.dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DenseLayerCache(LayerCache):
    k: jax.Array  # [B, L, KVH, D]
    v: jax.Array

    def attend(self, q, k, v, positions, *, scale, window, softcap):
        rows = jnp.arange(k.shape[0])[:, None]
        new = DenseLayerCache(
            self.k.at[rows, positions].set(k.astype(self.k.dtype), mode="drop"),
            self.v.at[rows, positions].set(v.astype(self.v.dtype), mode="drop"),
        )
        if _decode_kernel(q, new.k):
            from jaxlp.pallas import decode_attention

            p = positions[:, 0]
            lengths = jnp.minimum(p + 1, new.k.shape[1])
            starts = jnp.zeros_like(p) if window is None else jnp.maximum(p - window + 1, 0)
            out = decode_attention.decode_attention(q[:, 0], new.k, new.v, lengths, starts, scale=scale,
                                                    softcap=softcap, interpret=ATTENTION == "interpret")
            return out[:, None], new
        slots = jnp.arange(self.k.shape[1])
        out = causal_attention(
            q, new.k.astype(q.dtype), new.v.astype(q.dtype), positions, slots,
            scale=scale, window=window, softcap=softcap,
        )
        return out, new


@dataclasses.dataclass(frozen=True)
class Dense(CacheFormat):
    """Keys and values stored as ``dtype`` (BF16 by default), one slot per position."""

    dtype: type = jnp.bfloat16
    name: str = "bf16"

    def init(self, config: ModelConfig, batch_size: int, max_len: int) -> KVCache:
        shape = (batch_size, max_len, config.num_kv_heads, config.head_dim)
        return KVCache(tuple(
            DenseLayerCache(jnp.zeros(shape, self.dtype), jnp.zeros(shape, self.dtype))
            for _ in range(config.num_layers)
        ))

    def bytes_per_token(self, config: ModelConfig) -> float:
        return 2 * config.num_kv_heads * config.head_dim * jnp.dtype(self.dtype).itemsize
