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
