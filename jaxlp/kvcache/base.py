"""KV-cache protocol used by the models and by :func:`jaxlp.generate`.

A cache *format* (a frozen, hashable dataclass such as :class:`jaxlp.kvcache.Dense`) makes
the cache state with ``init``. The state is a pytree: :class:`KVCache` holds one layer
cache per decoder layer, each with two methods:

    layer = layer.update(k, v, positions)          # k, v: [B, S, KVH, D] after RoPE
    out = layer.attend(q, positions, scale=..., window=..., softcap=...)   # q: [B, S, H, D]

``positions [B, S]`` are the absolute token positions of the new entries; a row's slots
beyond its own length hold stale data that the causal mask never shows (see
:mod:`jaxlp.models.attention`). Quantized caches implement the same two methods.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import dataclasses
from typing import Any

import jax


if TYPE_CHECKING:
    from jaxlp.models.config import ModelConfig


class LayerCache:
    """One layer's cache state (a registered dataclass pytree)."""

    def update(self, k: jax.Array, v: jax.Array, positions: jax.Array) -> "LayerCache":
        raise NotImplementedError

    def attend(self, q: jax.Array, positions: jax.Array, *, scale: float, window: int | None, softcap: float | None):
        raise NotImplementedError


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
    """The whole cache: one :class:`LayerCache` per decoder layer."""

    layers: tuple[Any, ...]

    @property
    def nbytes(self) -> int:
        return sum(leaf.nbytes for leaf in jax.tree.leaves(self))


class CacheFormat:
    """A cache format: ``init(config, batch_size, max_len) -> KVCache`` and its byte cost."""

    name: str = ""

    def init(self, config: ModelConfig, batch_size: int, max_len: int) -> KVCache:
        raise NotImplementedError

    def bytes_per_token(self, config: ModelConfig) -> float:
        """Bytes per cached token per layer, metadata included."""
        raise NotImplementedError
