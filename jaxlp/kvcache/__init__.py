"""KV caches for :func:`jaxlp.generate`: formats by name, and the cache protocol."""

from jaxlp.kvcache.base import CacheFormat, KVCache, LayerCache
from jaxlp.kvcache.dense import Dense, DenseLayerCache
from jaxlp.kvcache.fireq import FireQInt4
from jaxlp.kvcache.kitty import Kitty
from jaxlp.kvcache.kivi import Kivi
from jaxlp.kvcache.quantized import QuantizedCacheFormat
from jaxlp.kvcache.sizing import cache_bytes, max_batch_size

import jax.numpy as _jnp

_FORMATS = {
    "bf16": Dense(_jnp.bfloat16, "bf16"),
    "fp16": Dense(_jnp.float16, "fp16"),
    "fp32": Dense(_jnp.float32, "fp32"),
    "kivi-k2v2": Kivi(key_bits=2, value_bits=2, name="kivi-k2v2"),
    "kivi-k4v4": Kivi(key_bits=4, value_bits=4, name="kivi-k4v4"),
    "kivi-k2v2*": Kivi(key_bits=2, value_bits=2, name="kivi-k2v2*", sink=32),
    "kivi-k2v4*": Kivi(key_bits=2, value_bits=4, name="kivi-k2v4*", sink=32),
    "kivi-k4v2*": Kivi(key_bits=4, value_bits=2, name="kivi-k4v2*", sink=32),
    "kitty": Kitty(boost=0.125, name="kitty"),
    "kitty-pro": Kitty(boost=0.25, name="kitty-pro"),
    "fireq-int4": FireQInt4(name="fireq-int4"),
}


def get(name_or_format) -> CacheFormat:
    """A cache format from its name (see :func:`formats`) or the format itself."""
    if isinstance(name_or_format, CacheFormat):
        return name_or_format
    if name_or_format not in _FORMATS:
        raise ValueError(f"unknown KV cache format {name_or_format!r}; known: {', '.join(sorted(_FORMATS))}")
    return _FORMATS[name_or_format]


def formats() -> tuple[str, ...]:
    return tuple(sorted(_FORMATS))


__all__ = [
    "CacheFormat", "Dense", "DenseLayerCache", "KVCache", "LayerCache", "formats", "get",
    "FireQInt4", "Kitty", "Kivi", "QuantizedCacheFormat", "cache_bytes", "max_batch_size",
]
