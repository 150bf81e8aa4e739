"""KV caches for :func:`jaxlp.generate`: formats by name, and the cache protocol."""

from jaxlp.kvcache.base import CacheFormat, KVCache, LayerCache
from jaxlp.kvcache.dense import Dense, DenseLayerCache

import jax.numpy as _jnp

_FORMATS = {
    "bf16": Dense(_jnp.bfloat16, "bf16"),
    "fp16": Dense(_jnp.float16, "fp16"),
    "fp32": Dense(_jnp.float32, "fp32"),
}


def get(name_or_format) -> CacheFormat:
    """A cache format from its name (``"bf16"``, ``"fp16"``, ``"fp32"``) or the format itself."""
    if isinstance(name_or_format, CacheFormat):
        return name_or_format
    if name_or_format not in _FORMATS:
        raise ValueError(f"unknown KV cache format {name_or_format!r}; known: {', '.join(sorted(_FORMATS))}")
    return _FORMATS[name_or_format]


def formats() -> tuple[str, ...]:
    return tuple(sorted(_FORMATS))


__all__ = ["CacheFormat", "Dense", "DenseLayerCache", "KVCache", "LayerCache", "formats", "get"]
