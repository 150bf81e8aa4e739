"""Row layout of fused projections (:func:`jaxlp.models.fuse_projections`): which rows of
``qkv_proj`` / ``gate_up_proj`` hold which projection, grouped per tensor-parallel device.

With ``ModelConfig.fused_shards = S`` the rows are ``[q_0 k_0 v_0 ... q_{S-1} k_{S-1} v_{S-1}]``
(``[gate_0 up_0 ...]``), part ``p_d`` being rows ``[d n / S, (d + 1) n / S)`` of projection ``p``:
device ``d``'s row shard holds its own heads' q, k, v and its own MLP columns' gate and up.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jaxlp.formats import QuantizedArray, take_rows
from jaxlp.models.config import ModelConfig


def qkv_sizes(config: ModelConfig) -> tuple[int, int, int]:
    """Output features of q_proj, k_proj, v_proj (the row split of a fused qkv_proj)."""
    kv = config.num_kv_heads * config.head_dim
    return config.num_heads * config.head_dim, kv, kv


def fused_parts(y: jax.Array, sizes: tuple[int, ...], shards: int = 1) -> list[jax.Array]:
    """The outputs of the projections fused into ``y [..., sum(sizes)]`` (q, k, v or gate, up),
    whose features are grouped per device for ``shards`` devices (``ModelConfig.fused_shards``):
    device ``d``'s rows ``[d * N / shards, (d + 1) * N / shards)`` hold its share of every part in
    turn. A reshape and slices, local to each device under tensor parallelism."""
    lead = y.shape[:-1]
    bounds = np.cumsum([n // shards for n in sizes])[:-1].tolist()
    parts = jnp.split(y.reshape(*lead, shards, -1), bounds, axis=-1)
    return [p.reshape(*lead, n) for p, n in zip(parts, sizes)]


def part_sizes(config: ModelConfig, proj: str) -> tuple[int, ...]:
    """Output features of the projections fused into ``proj`` (``"qkv_proj"`` or ``"gate_up_proj"``)."""
    if proj == "qkv_proj":
        return qkv_sizes(config)
    if proj == "gate_up_proj":
        return (config.intermediate_size,) * 2
    raise ValueError(f"unknown fused projection {proj!r} (qkv_proj, gate_up_proj)")


def fused_order(config: ModelConfig, proj: str, shards: int | None = None) -> np.ndarray:
    """Row ``i`` of fused projection ``proj`` laid out for ``shards`` devices (default: the config's
    ``fused_shards``) is row ``fused_order(...)[i]`` of the parts concatenated whole (``[q k v]``,
    ``[gate up]``): device ``d``'s block holds slice ``d`` of every part in turn."""
    shards = config.fused_shards if shards is None else shards
    sizes = part_sizes(config, proj)
    if any(n % shards for n in sizes):
        raise ValueError(f"{proj}: parts of {sizes} rows do not split over {shards} devices")
    starts = np.cumsum((0,) + sizes[:-1])
    return np.concatenate([start + np.arange(d * n // shards, (d + 1) * n // shards)
                           for d in range(shards) for start, n in zip(starts, sizes)])


def part_rows(config: ModelConfig, proj: str, part: int) -> np.ndarray:
    """The rows of ``proj`` (in the config's layout) that hold part ``part`` (q, k, v = 0, 1, 2;
    gate, up = 0, 1), in the part's own order."""
    sizes = part_sizes(config, proj)
    start = sum(sizes[:part])
    order = fused_order(config, proj)
    rows = np.nonzero((order >= start) & (order < start + sizes[part]))[0]
    return rows[np.argsort(order[rows])]


def group_rows(model, shards: int) -> None:
    """Reorder the fused projections' rows of ``model`` (in place) for ``shards`` devices
    (``ModelConfig.fused_shards``); placement is left to the caller."""
    old = model.config
    config = dataclasses.replace(old, fused_shards=shards)  # checks that the parts divide
    for layer in model.layers:
        for module, proj in ((layer.self_attn, "qkv_proj"), (layer.mlp, "gate_up_proj")):
            rows = np.argsort(fused_order(old, proj))[fused_order(config, proj)]
            _take_rows(getattr(module, proj), rows)
        layer.self_attn.config, layer.mlp.shards = config, shards
    model.config = config


def _take_rows(linear, rows: np.ndarray) -> None:
    """Keep rows ``rows`` of a (quantized or high-precision) linear's weight and bias, in place."""
    w = linear.weight.get_value()
    linear.weight.set_value(take_rows(w, rows) if isinstance(w, QuantizedArray) else w[rows])
    if linear.bias is not None:
        linear.bias.set_value(linear.bias[...][rows])
