"""KV caches for :func:`jaxlp.generate`: formats by name, and the cache protocol."""

from jaxlp.kvcache.base import CacheFormat, KVCache, LayerCache
from jaxlp.kvcache.dense import Dense, DenseLayerCache
from jaxlp.kvcache.fireq import FireQInt4
from jaxlp.kvcache.kitty import Kitty
from jaxlp.kvcache.kivi import Kivi
from jaxlp.kvcache.quantized import QuantizedCacheFormat
from jaxlp.kvcache.registry import formats, get
from jaxlp.kvcache.sizing import cache_bytes, max_batch_size

__all__ = [
    "CacheFormat", "Dense", "DenseLayerCache", "KVCache", "LayerCache", "formats", "get",
    "FireQInt4", "Kitty", "Kivi", "QuantizedCacheFormat", "cache_bytes", "max_batch_size",
]
