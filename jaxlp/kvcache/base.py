"""KV-cache protocol used by the models and by :func:`jaxlp.generate`.

A cache *format* (a frozen, hashable dataclass such as :class:`jaxlp.kvcache.Dense`) makes
the cache state with ``init``. The state is a pytree: :class:`KVCache` holds one layer
cache per decoder layer, each with one method that stores the new entries and attends:

    out, layer = layer.attend(q, k, v, positions, scale=..., window=..., softcap=..., fresh=False)
    # q: [B, S, H, D]; k, v: [B, S, KVH, D] after RoPE; positions: [B, S] absolute

``S`` is the prompt bucket at prefill and 1 at decode. At prefill, a row's padding carries
a position ``>= max_len``: caches neither store nor attend such entries. A row's slots
beyond its own length hold stale data that the causal mask never shows (see
:mod:`jaxlp.attention.reference`). The
order of storing and attending is the cache's own: a quantized cache may attend the new
tokens in full precision and quantize them afterwards.

``fresh=True`` (static) promises a prompt call on empty rows: row ``b`` holds positions
``0 .. n_b - 1`` then padding, and nothing before. Attention then needs only the call's own keys
(:func:`prompt_attention`: blockwise flash attention, so memory follows the cache, not S^2).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxlp.attention import prefill

if TYPE_CHECKING:
    from jaxlp.models.config import ModelConfig


class LayerCache:
    """One layer's cache state (a registered dataclass pytree)."""

    def attend(self, q, k, v, positions, *, scale: float, window: int | None, softcap: float | None,
               fresh: bool = False):
        """Store ``k, v`` at ``positions`` and attend ``q``: returns ``(out [B, S, H, D], new layer)``."""
        raise NotImplementedError

    def head_specs(self, axis: str):
        """PartitionSpecs (a pytree like this layer) that split its KV heads over mesh ``axis``
        (tensor parallelism): arrays ``[B, T, KVH, ...]`` split axis 2, the rest are replicated."""
        return jax.tree.map(lambda x: P(None, None, axis) if x.ndim >= 3 else P(), self)


def prompt_attention(q, k, v, positions, max_len: int, *, scale, window, softcap, attention: str):
    """Attention of a fresh prompt call (see module doc) over its own ``k, v``, or None where the
    caller's reference path serves: ``attention`` "auto", "pallas" or "cuda" takes cuDNN's flash
    attention on a GPU when it applies, else the blockwise XLA flash attention of
    :mod:`jaxlp.attention.prefill` on a GPU; "interpret" takes the blockwise one (CPU tests); the
    CPU with "auto", and "xla", keep the reference."""
    if q.shape[1] == 1 or attention == "xla":
        return None
    if attention != "interpret" and jax.default_backend() != "gpu":
        return None
    lengths = jnp.sum((positions >= 0) & (positions < max_len), axis=1).astype(jnp.int32)
    impl = "auto" if attention in ("auto", "pallas", "cuda") else "xla"
    return prefill.prefill_attention(q, k.astype(q.dtype), v.astype(q.dtype), lengths, scale=scale, window=window,
                                     softcap=softcap, implementation=impl)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
    """The whole cache: one :class:`LayerCache` per decoder layer."""

    layers: tuple[Any, ...]

    @property
    def nbytes(self) -> int:
        return sum(leaf.nbytes for leaf in jax.tree.leaves(self))

    def write_rows(self, rows: KVCache, slots: jax.Array, batched: tuple[bool, ...]) -> KVCache:
        """This cache with the rows of ``rows`` (a cache of the same format and length with
        batch ``n``) written at batch indices ``slots [n]``: a row's whole state moves, so the
        slot then holds exactly what ``rows`` held. ``batched`` (from
        :meth:`CacheFormat.batched_leaves`) marks the leaves with a leading batch axis; the others
        (state shared by every row, such as FireQ's channel scales) stay this cache's."""
        leaves, tree = jax.tree.flatten(self)
        small, small_tree = jax.tree.flatten(rows)
        if tree != small_tree or len(batched) != len(leaves):
            raise ValueError("write_rows needs a cache of the same format and length (and its batched_leaves)")
        out = [big.at[slots].set(row.astype(big.dtype)) if b else big for big, row, b in zip(leaves, small, batched)]
        return jax.tree.unflatten(tree, out)


class CacheFormat:
    """A cache format: ``init(config, batch_size, max_len) -> KVCache`` and its byte cost."""

    name: str = ""

    def init(self, config: ModelConfig, batch_size: int, max_len: int) -> KVCache:
        raise NotImplementedError

    def bytes_per_token(self, config: ModelConfig) -> float:
        """Bytes per cached token per layer, metadata included."""
        raise NotImplementedError

    def batched_leaves(self, config: ModelConfig, max_len: int) -> tuple[bool, ...]:
        """Per leaf of ``init(config, B, max_len)`` (flattened order): whether it has a leading
        batch axis (its shape follows B), for :meth:`KVCache.write_rows`."""
        one, two = (jax.tree.leaves(jax.eval_shape(lambda b=b: self.init(config, b, max_len))) for b in (1, 2))
        return tuple(a.shape != b.shape for a, b in zip(one, two))
