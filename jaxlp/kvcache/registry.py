"""Cache formats by name: :func:`get` and :func:`formats`."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from jaxlp.kvcache.base import CacheFormat
from jaxlp.kvcache.dense import Dense
from jaxlp.kvcache.fireq import FireQInt4
from jaxlp.kvcache.kitty import Kitty
from jaxlp.kvcache.kivi import Kivi

_FORMATS = {
    "bf16": Dense(jnp.bfloat16, "bf16"),
    "fp16": Dense(jnp.float16, "fp16"),
    "fp32": Dense(jnp.float32, "fp32"),
    "kivi-k2v2": Kivi(key_bits=2, value_bits=2, name="kivi-k2v2"),
    "kivi-k4v4": Kivi(key_bits=4, value_bits=4, name="kivi-k4v4"),
    "kivi-k2v2*": Kivi(key_bits=2, value_bits=2, name="kivi-k2v2*", sink=32),
    "kivi-k2v4*": Kivi(key_bits=2, value_bits=4, name="kivi-k2v4*", sink=32),
    "kivi-k4v2*": Kivi(key_bits=4, value_bits=2, name="kivi-k4v2*", sink=32),
    "kitty": Kitty(boost=0.125, name="kitty"),
    "kitty-pro": Kitty(boost=0.25, name="kitty-pro"),
    "fireq-int4": FireQInt4(name="fireq-int4"),
}


def get(name_or_format, *, attention: str | None = None, kernel_options: dict | None = None) -> CacheFormat:
    """A cache format from its name (see :func:`formats`) or the format itself; ``attention``
    replaces its attention implementation (see :mod:`jaxlp.attention.decode`), ``kernel_options``
    a quantized format's CUDA kernel keywords (``QuantizedCacheFormat.kernel_options``)."""
    if isinstance(name_or_format, CacheFormat):
        fmt = name_or_format
    elif name_or_format in _FORMATS:
        fmt = _FORMATS[name_or_format]
    else:
        raise ValueError(f"unknown KV cache format {name_or_format!r}; known: {', '.join(sorted(_FORMATS))}")
    if kernel_options is not None:
        if not hasattr(fmt, "kernel_options"):
            raise ValueError(f"the {getattr(fmt, 'name', fmt)!r} cache has no CUDA kernel to take kernel_options")
        fmt = dataclasses.replace(fmt, kernel_options=kernel_options)
    return fmt if attention is None else dataclasses.replace(fmt, attention=attention)


def formats() -> tuple[str, ...]:
    return tuple(sorted(_FORMATS))
