"""Sizing a batch to a memory budget from a cache format's byte cost."""

from __future__ import annotations

from typing import TYPE_CHECKING

from jaxlp.kvcache.registry import get

if TYPE_CHECKING:
    from jaxlp.kvcache.base import CacheFormat
    from jaxlp.models.config import ModelConfig


def cache_bytes(cache_format: CacheFormat, config: ModelConfig, batch_size: int, max_len: int) -> int:
    """Bytes of the whole cache (every layer) that ``init(config, batch_size, max_len)`` allocates.

    Formats with ``bytes_for(config, num_tokens)`` (exact bytes of one row's layer) and
    ``fixed_bytes(config)`` (per layer, shared by the batch) are counted exactly; others as
    ``bytes_per_token(config) * max_len`` per row and layer.
    """
    if batch_size < 0 or max_len < 1:
        raise ValueError(f"need batch_size >= 0 and max_len >= 1, got {batch_size}, {max_len}")
    per_row, fixed = _row_and_fixed(cache_format, config, max_len)
    return config.num_layers * (batch_size * per_row + fixed)


def max_batch_size(cache_format: CacheFormat, config: ModelConfig, max_len: int, budget_bytes: int) -> int:
    """The largest batch whose cache for ``max_len`` positions fits in ``budget_bytes`` (0 if none)."""
    if max_len < 1:
        raise ValueError(f"max_len must be >= 1, got {max_len}")
    per_row, fixed = _row_and_fixed(cache_format, config, max_len)
    free = int(budget_bytes) - config.num_layers * fixed
    return max(0, free // (config.num_layers * per_row))


def _row_and_fixed(cache_format, config, max_len) -> tuple[int, int]:
    fmt = get(cache_format)
    if hasattr(fmt, "bytes_for"):
        return int(fmt.bytes_for(config, max_len)), int(getattr(fmt, "fixed_bytes", lambda c: 0)(config))
    return int(round(fmt.bytes_per_token(config) * max_len)), 0
