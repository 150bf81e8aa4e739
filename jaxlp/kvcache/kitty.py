"""Kitty: 2-bit KV cache with dynamic channel-wise precision boost for keys.

Keys: pages of ``G = 128`` tokens per (row, KV head); per channel asymmetric min-max over
the page; the ``n_boost`` channels of largest mean ``|k|`` over the page are stored at INT4,
the others at INT2. Packed layout of a key page (one head, ``D = head_dim``):

* ``low``   uint8 ``[D, G/4]``: low 2 bits of every channel's codes, 4 tokens per byte,
  planar (:mod:`jaxlp.kvcache.quant`): byte ``i`` of a channel row holds tokens
  ``i, i + 32, i + 64, i + 96`` at bits ``0, 2, 4, 6``, so plane ``t`` of the row,
  ``(low >> 2t) & 3``, is the 32 contiguous tokens ``[32t, 32t + 32)``;
* ``high``  uint8 ``[n_boost, G/4]``: high 2 bits of the boosted channels, same planar
  layout, row ``r`` = the channel ranked ``r`` (ranks by score, ties to the lower channel);
* ``boost_idx`` uint8 ``[D]``: each channel's rank, ``n_boost`` (sentinel) if not boosted;
* ``scale``, ``min`` FP16 ``[D]``: ``scale = max((max - min) / (15 or 3), 1e-6)``.

Values: per-token asymmetric INT2 over the whole head, token-major (``codes [G, D/4]``,
FP16 ``scale, min [G]``); planar along the head: plane ``u`` of a token's bytes is channels
``[u D/4, (u + 1) D/4)``.

Cache (see :mod:`jaxlp.kvcache.quantized`): sink of 32 tokens FP16; key Q-buffer of up to
128 FP16 tokens packed into a page as it fills (after that step's attention); a value local
window of the newest 128 tokens, the tokens leaving it collected in a value Q-buffer that is
packed into a value page once it holds 128 tokens. ``"kitty"`` boosts 12.5% of the key
channels, ``"kitty-pro"`` 25%.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar, TYPE_CHECKING

import jax
import jax.numpy as jnp

from jaxlp.kvcache.quant import minmax_dequantize, minmax_quantize, minmax_quantize_levels, pack_bits, unpack_bits
from jaxlp.kvcache.quantized import Codec, QuantizedCacheFormat

if TYPE_CHECKING:
    from jaxlp.models.config import ModelConfig

PAGE = 128
SINK = 32
LOCAL = 128


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KeyPage:
    """A packed key page (leading batch dims allowed): see module doc."""

    low: jax.Array  # uint8 [..., D, G/4]
    high: jax.Array  # uint8 [..., n_boost, G/4]
    boost_idx: jax.Array  # uint8 [..., D]
    scale: jax.Array  # float16 [..., D]
    min: jax.Array  # float16 [..., D]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ValuePage:
    """A packed value page: ``codes`` uint8 ``[..., G, D/4]``, FP16 ``scale, min [..., G]``."""

    codes: jax.Array
    scale: jax.Array
    min: jax.Array


def _check_page(x: jax.Array, what: str) -> None:
    if x.ndim < 2:
        raise ValueError(f"{what} page must be [..., tokens, head_dim], got shape {x.shape}")
    if x.shape[-2] % 4:
        raise ValueError(f"{what} page length {x.shape[-2]} must be a multiple of 4 (4 codes per byte)")


def quantize_key_page(k: jax.Array, n_boost: int) -> KeyPage:
    """Pack a key page ``k [..., G, D]`` (G = 128 in the cache) boosting ``n_boost`` channels to INT4."""
    _check_page(k, "key")
    d = k.shape[-1]
    if not 0 <= n_boost <= min(d, 255):
        raise ValueError(f"n_boost must be in [0, min(head_dim, 255)] = [0, {min(d, 255)}], got {n_boost}")
    x = k.astype(jnp.float32)
    score = jnp.mean(jnp.abs(x), axis=-2)  # [..., D]
    order = jnp.argsort(-score, axis=-1, stable=True)  # channels by decreasing score
    rank = jnp.argsort(order, axis=-1, stable=True)
    boosted = rank < n_boost
    levels = jnp.where(boosted, 15, 3)[..., None, :]
    codes, scale, lo = minmax_quantize_levels(x, levels, axis=-2)  # codes [..., G, D]
    codes = jnp.swapaxes(codes, -1, -2)  # [..., D, G]
    high = jnp.take_along_axis(codes >> 2, order[..., :n_boost, None], axis=-2)
    return KeyPage(
        low=pack_bits(codes & 3, 2),
        high=pack_bits(high, 2),
        boost_idx=jnp.where(boosted, rank, n_boost).astype(jnp.uint8),
        scale=scale[..., 0, :],
        min=lo[..., 0, :],
    )


def key_page_codes(page: KeyPage) -> jax.Array:
    """Integer codes ``[..., D, G]`` (uint8) of a key page: low bits | high bits << 2."""
    low = unpack_bits(page.low, 2)
    high = unpack_bits(page.high, 2)  # [..., n_boost, G]
    zero = jnp.zeros(high.shape[:-2] + (1, high.shape[-1]), high.dtype)
    high = jnp.take_along_axis(jnp.concatenate([high, zero], axis=-2), page.boost_idx[..., None].astype(jnp.int32), axis=-2)
    return low | (high << 2)


def dequantize_key_page(page: KeyPage) -> jax.Array:
    """A key page back to ``[..., G, D]`` float32."""
    x = minmax_dequantize(key_page_codes(page), page.scale[..., None], page.min[..., None])
    return jnp.swapaxes(x, -1, -2)


def quantize_value_page(v: jax.Array) -> ValuePage:
    """Pack a value page ``v [..., G, D]``: per-token INT2 over the head."""
    _check_page(v, "value")
    if v.shape[-1] % 4:
        raise ValueError(f"head_dim {v.shape[-1]} must be a multiple of 4 for 2-bit value codes")
    codes, scale, lo = minmax_quantize(v, 2, axis=-1)
    return ValuePage(codes=pack_bits(codes, 2), scale=scale[..., 0], min=lo[..., 0])


def dequantize_value_page(page: ValuePage) -> jax.Array:
    """A value page back to ``[..., G, D]`` float32."""
    return minmax_dequantize(unpack_bits(page.codes, 2), page.scale[..., None], page.min[..., None])


@dataclasses.dataclass(frozen=True)
class KeyCodec(Codec):
    layout: ClassVar[str] = "kitty_keys"
    n_boost: int
    unit: int = PAGE

    def encode(self, x):
        return quantize_key_page(x, self.n_boost)

    def decode(self, page):
        return dequantize_key_page(page)


@dataclasses.dataclass(frozen=True)
class ValueCodec(Codec):
    layout: ClassVar[str] = "kitty_values"
    unit: int = PAGE

    def encode(self, x):
        return quantize_value_page(x)

    def decode(self, page):
        return dequantize_value_page(page)


@dataclasses.dataclass(frozen=True)
class Kitty(QuantizedCacheFormat):
    """Kitty cache; ``boost`` is the fraction of key channels at INT4 (``head_dim * boost`` rounded)."""

    boost: float = 0.125
    name: str = "kitty"
    sink: int = SINK
    dtype: type = jnp.float16

    def n_boost(self, head_dim: int) -> int:
        return int(round(head_dim * self.boost))

    def streams(self, config: ModelConfig):
        d = config.head_dim
        if d % 4:
            raise ValueError(f"Kitty needs head_dim divisible by 4 (2-bit packing), got {d}")
        return (KeyCodec(self.n_boost(d)), 0), (ValueCodec(), LOCAL)
