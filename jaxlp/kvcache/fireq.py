"""FireQ KV cache: INT4 keys and values per token with FP8 (E4M3) scales, FP8 queries.

Storage per token and KV head: ``codes`` uint8 ``[D/2]`` (two's-complement nibbles, planar:
channel ``i`` in the low nibble of byte ``i``, channel ``i + D/2`` -- its rotate-half RoPE
partner -- in the high nibble) and one FP8 E4M3 scale ``max|x| / 7`` (symmetric, codes in
[-8, 7]; see :mod:`jaxlp.kvcache.quant`). Every stored token is quantized; the tokens of the
current call (the prompt at prefill, the newest token at decode) are attended in full
precision. Queries go through FP8 E4M3 with a float32 scale per token and head
(``max|q| / 448``).

Outlier smoothing (offline calibration, Section 3.2 of the FireQ paper, as in
``shared/notes/kvcache.md``):

* RPN, pre-RoPE: per KV head and rotate-half pair ``(i, i + D/2)``, ``m = max_tokens
  ||(k_i, k_j)||``; keys times ``alpha / m`` (folded into ``k_proj`` rows), queries times
  ``m / alpha`` (into ``q_proj``): :func:`rpn_factors`, :func:`fold_rpn`. A common factor on
  both channels of a pair commutes with the RoPE rotation, so scores are unchanged.
* CRS, post-RoPE, online: ``k`` pairs per head with the largest channel absmax; each of their
  channels is scaled by ``beta / absmax`` in K and the inverse in Q, inside the cache
  (:func:`crs_channels`, ``FireQInt4.calibrated``). RPN leaves those pairs alone.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import ClassVar, TYPE_CHECKING, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from jaxlp.kvcache.base import KVCache, LayerCache
from jaxlp.kvcache.quant import absmax_int4_quantize, pack_int4, unpack_int4
from jaxlp.kvcache.quantized import Codec, QuantizedCacheFormat, QuantizedLayerCache, QueryScaling

if TYPE_CHECKING:
    from jaxlp.models.config import ModelConfig


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Int4Tokens:
    """``codes`` uint8 ``[..., T, D/2]`` (byte ``i``: channel ``i`` low nibble, ``i + D/2`` high),
    ``scale`` float8_e4m3fn ``[..., T]``."""

    codes: jax.Array
    scale: jax.Array


def quantize_tokens(x: jax.Array) -> Int4Tokens:
    """Symmetric INT4 per token of ``x [..., T, D]`` (D even) with FP8 scales."""
    if x.shape[-1] % 2:
        raise ValueError(f"head_dim {x.shape[-1]} must be even for INT4 packing")
    codes, scale = absmax_int4_quantize(x, axis=-1)
    return Int4Tokens(pack_int4(codes), scale[..., 0])


def dequantize_tokens(tokens: Int4Tokens) -> jax.Array:
    """``[..., T, D]`` float32."""
    return unpack_int4(tokens.codes).astype(jnp.float32) * tokens.scale.astype(jnp.float32)[..., None]


@dataclasses.dataclass(frozen=True)
class TokenCodec(Codec):
    layout: ClassVar[str] = "int4_tokens"
    unit: int = 1

    def encode(self, x):
        return quantize_tokens(x)

    def decode(self, tokens):
        return dequantize_tokens(tokens)


@functools.partial(jax.tree_util.register_dataclass, data_fields=["inner", "k_scale"], meta_fields=["fp8_queries"])
@dataclasses.dataclass(frozen=True)
class FireQLayerCache(LayerCache):
    """A quantized layer (no sink, no ring) plus the CRS key scales ``k_scale [KVH, D]``
    (one per layer, shared by the batch): ``k * k_scale`` is stored, ``q / k_scale`` attends."""

    inner: QuantizedLayerCache
    k_scale: jax.Array
    fp8_queries: bool

    @property
    def query_scaling(self) -> QueryScaling:
        """The queries' transform: divided by the CRS scales, through FP8 if ``fp8_queries``."""
        return QueryScaling(self.k_scale, self.fp8_queries)

    def attend(self, q, k, v, positions, *, scale, window, softcap, fresh=False):
        out, inner = self.inner.attend(
            q, k.astype(jnp.float32) * self.k_scale, v, positions,
            scale=scale, window=window, softcap=softcap, fresh=fresh, query_scaling=self.query_scaling,
        )
        return out.astype(q.dtype), dataclasses.replace(self, inner=inner)

    def head_specs(self, axis: str):
        """The quantized layer's, and the CRS scales ``[KVH, D]`` split by head."""
        return dataclasses.replace(self, inner=self.inner.head_specs(axis), k_scale=P(axis, None))


@dataclasses.dataclass(frozen=True)
class FireQInt4(QuantizedCacheFormat):
    """FireQ INT4 K/V cache. ``channel_scales``: per layer, ``[KVH][D]`` CRS key scales (or
    None for ones); build it with :meth:`calibrated`."""

    channel_scales: tuple | None = None
    fp8_queries: bool = True
    name: str = "fireq-int4"
    sink: int = 0
    dtype: type = jnp.float16

    @classmethod
    def calibrated(cls, scales: Sequence, **kwargs) -> "FireQInt4":
        """A format whose layer ``i`` scales keys by ``scales[i]`` (``[KVH, D]``; None: ones)."""
        table = tuple(None if s is None else tuple(map(tuple, np.asarray(s, np.float64).tolist())) for s in scales)
        return cls(channel_scales=table, **kwargs)

    def streams(self, config: ModelConfig):
        if config.head_dim % 2:
            raise ValueError(f"FireQ needs an even head_dim, got {config.head_dim}")
        return (TokenCodec(), 0), (TokenCodec(), 0)

    def _k_scale(self, config: ModelConfig, layer: int) -> jax.Array:
        shape = (config.num_kv_heads, config.head_dim)
        if self.channel_scales is None or self.channel_scales[layer] is None:
            return jnp.ones(shape, jnp.float32)
        s = jnp.asarray(self.channel_scales[layer], jnp.float32)
        if s.shape != shape:
            raise ValueError(f"channel_scales[{layer}] has shape {s.shape}, expected {shape}")
        return s

    def init(self, config: ModelConfig, batch_size: int, max_len: int) -> KVCache:
        if self.channel_scales is not None and len(self.channel_scales) != config.num_layers:
            raise ValueError(f"channel_scales has {len(self.channel_scales)} layers, the model {config.num_layers}")
        return KVCache(tuple(
            FireQLayerCache(self.init_layer(config, batch_size, max_len), self._k_scale(config, i), self.fp8_queries)
            for i in range(config.num_layers)
        ))

    def fixed_bytes(self, config: ModelConfig) -> int:
        """The float32 CRS scales ``[KVH, D]`` of a layer."""
        return 4 * config.num_kv_heads * config.head_dim


def _pairs(keys, what: str) -> tuple[np.ndarray, np.ndarray]:
    k = np.asarray(keys, np.float64)
    if k.ndim < 3 or k.shape[-1] % 2:
        raise ValueError(f"{what} must be [..., tokens, num_kv_heads, head_dim] with an even head_dim, got {k.shape}")
    k = k.reshape(-1, k.shape[-2], k.shape[-1])
    half = k.shape[-1] // 2
    return k[..., :half], k[..., half:]


def rpn_factors(keys_pre_rope, alpha: float = 8.0, exclude=None) -> np.ndarray:
    """RPN key factors ``[KVH, D]`` (float32) from calibration keys ``[..., N, KVH, D]`` before RoPE.

    Pair ``(i, i + D/2)`` of a head gets ``alpha / max_tokens ||(k_i, k_j)||`` on both
    channels (1 where that max is 0, or where ``exclude [KVH, D]`` marks either channel).
    """
    if alpha <= 0:
        raise ValueError(f"alpha must be > 0, got {alpha}")
    a, b = _pairs(keys_pre_rope, "keys_pre_rope")
    m = np.sqrt(a * a + b * b).max(axis=0)  # [KVH, D/2]
    f = np.where(m > 0, alpha / np.where(m > 0, m, 1.0), 1.0)
    if exclude is not None:
        ex = np.asarray(exclude, bool)
        if ex.shape != (m.shape[0], 2 * m.shape[1]):
            raise ValueError(f"exclude must be [KVH, D] = {(m.shape[0], 2 * m.shape[1])}, got {ex.shape}")
        f = np.where(ex[:, : m.shape[1]] | ex[:, m.shape[1]:], 1.0, f)
    return np.concatenate([f, f], axis=-1).astype(np.float32)


def crs_channels(keys_post_rope, k: int = 8, beta: float = 8.0) -> tuple[np.ndarray, np.ndarray]:
    """CRS: ``(scales [KVH, D] float32, channels [KVH, D] bool)`` from post-RoPE calibration keys.

    Per head, the ``k`` rotate-half pairs whose larger channel absmax is greatest (ties to
    the lower pair) are outlier pairs; each of their channels gets ``beta / absmax`` (1 if
    its absmax is 0), every other channel 1.
    """
    if beta <= 0:
        raise ValueError(f"beta must be > 0, got {beta}")
    a, b = _pairs(keys_post_rope, "keys_post_rope")
    half = a.shape[-1]
    if not 0 <= k <= half:
        raise ValueError(f"k must be in [0, head_dim / 2 = {half}], got {k}")
    absmax = np.concatenate([np.abs(a).max(axis=0), np.abs(b).max(axis=0)], axis=-1)  # [KVH, D]
    pair = np.maximum(absmax[:, :half], absmax[:, half:])
    top = np.argsort(-pair, axis=-1, kind="stable")[:, :k]
    chosen = np.zeros_like(pair, bool)
    np.put_along_axis(chosen, top, True, axis=-1)
    channels = np.concatenate([chosen, chosen], axis=-1)
    scales = np.where(channels & (absmax > 0), beta / np.where(absmax > 0, absmax, 1.0), 1.0)
    return scales.astype(np.float32), channels
