"""Dense (unquantized) KV cache: ``k, v [B, max_len, KVH, D]`` in BF16 by default."""

from __future__ import annotations

import dataclasses
import functools
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp

from jaxlp.attention import decode
from jaxlp.attention.reference import causal_attention
from jaxlp.kvcache.base import CacheFormat, KVCache, LayerCache, prompt_attention

if TYPE_CHECKING:
    from jaxlp.models.config import ModelConfig


@functools.partial(jax.tree_util.register_dataclass, data_fields=["k", "v"], meta_fields=["attention"])
@dataclasses.dataclass(frozen=True)
class DenseLayerCache(LayerCache):
    """``k, v [B, L, KVH, D]``; ``attention``: the decode-attention implementation (static,
    see :mod:`jaxlp.attention.decode`)."""

    k: jax.Array
    v: jax.Array
    attention: str = "auto"

    def attend(self, q, k, v, positions, *, scale, window, softcap, fresh=False):
        rows = jnp.arange(k.shape[0])[:, None]
        new = dataclasses.replace(
            self,
            k=self.k.at[rows, positions].set(k.astype(self.k.dtype), mode="drop"),
            v=self.v.at[rows, positions].set(v.astype(self.v.dtype), mode="drop"),
        )
        if q.shape[1] == 1 and decode.choose(q, new.k, self.attention) != "xla":
            p = positions[:, 0]
            lengths = jnp.minimum(p + 1, new.k.shape[1])
            starts = jnp.zeros_like(p) if window is None else jnp.maximum(p - window + 1, 0)
            out = decode.decode_attention(q[:, 0], new.k, new.v, lengths, starts, scale=scale, softcap=softcap,
                                          implementation=self.attention)
            return out[:, None], new
        if fresh:
            out = prompt_attention(q, k, v, positions, self.k.shape[1], scale=scale, window=window, softcap=softcap,
                                   attention=self.attention)
            if out is not None:
                return out, new
        slots = jnp.arange(self.k.shape[1])
        out = causal_attention(
            q, new.k.astype(q.dtype), new.v.astype(q.dtype), positions, slots,
            scale=scale, window=window, softcap=softcap,
        )
        return out, new


@dataclasses.dataclass(frozen=True)
class Dense(CacheFormat):
    """Keys and values stored as ``dtype`` (BF16 by default), one slot per position.

    ``attention``: how one-token (decode) steps attend, one of
    :data:`jaxlp.attention.decode.IMPLEMENTATIONS` (``"auto"``: the Pallas flash-decoding
    kernel on a GPU when q and the cache are BF16 or FP16, else the XLA reference).
    """

    dtype: type = jnp.bfloat16
    name: str = "bf16"
    attention: str = "auto"

    def __post_init__(self):
        decode.check_implementation(self.attention)
        if self.attention == "cuda":
            raise ValueError("the dense cache has no CUDA decode-attention kernel (only the quantized caches do); "
                             "use attention='auto', 'pallas' or 'xla'")

    def init(self, config: ModelConfig, batch_size: int, max_len: int) -> KVCache:
        shape = (batch_size, max_len, config.num_kv_heads, config.head_dim)
        return KVCache(tuple(
            DenseLayerCache(jnp.zeros(shape, self.dtype), jnp.zeros(shape, self.dtype), self.attention)
            for _ in range(config.num_layers)
        ))

    def bytes_per_token(self, config: ModelConfig) -> float:
        return 2 * config.num_kv_heads * config.head_dim * jnp.dtype(self.dtype).itemsize
