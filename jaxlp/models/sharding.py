"""Tensor parallelism: where each parameter lives on a mesh axis ``"tp"`` of ``tp`` devices.

Megatron layout: query/key/value projections and MLP gate/up are *column-parallel* (output
features split: heads, MLP columns), ``o_proj`` and ``down_proj`` *row-parallel* (input features
split), the LM head *vocabulary-parallel* (column-parallel over the vocabulary: each device reads
its share of the largest matrix of a decode step; the sampler gathers the logits), embeddings
(also a tied LM head) and norms replicated. A projection whose heads do not divide ``tp`` (a single
KV head), or an LM head whose vocabulary does not, is replicated.

Quantized weights (:class:`jaxlp.formats.QuantizedArray` ``[N, K]``) split along their block
structure: column-parallel, every field with a leading axis of N rows (packed codes, block and
channel scales) splits its rows; row-parallel, every ``[N, K / b]`` field splits its last axis, so
``K / tp`` must be a multiple of the format's block (16 for NVFP4, 32 for MXFP4 and DialectFP4, 128
for FireQ groups; a :class:`ValueError` names the layer otherwise), and per-row or per-tensor
scales are replicated. Attention with a KV cache runs under ``shard_map`` on each device's heads
and its share of the cache (every cache format; ``LayerCache.head_specs``) when the query and KV
heads both divide ``tp``. Quantized linears learn their role
(:meth:`~jaxlp.quantization.linear.QuantizedLinear.set_parallel`): their GPU kernels then run on
each device's shard under ``shard_map`` (one all-reduce per row-parallel layer). XLA's SPMD
partitioner inserts the collectives everywhere else.

Fused projections (:func:`jaxlp.models.fuse_projections`) are column-parallel too: their rows are
grouped per device (``ModelConfig.fused_shards``: device ``d`` holds ``[q_d k_d v_d]`` of its own
heads, ``[gate_d up_d]`` of its own MLP columns), so each device runs one local product per group;
:func:`shard_model` regroups a fused model for its mesh (a permutation of rows, quantized ones
bit-exact) and refuses one whose heads or MLP columns do not divide over the devices.
"""

from __future__ import annotations

import re
from typing import Any

import jax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxlp.formats import QuantizedArray
from jaxlp.models.config import ModelConfig
from jaxlp.models.fused_layout import group_rows

AXIS = "tp"


def role(name: str, config: ModelConfig, tp: int) -> str | None:
    """``"column"``, ``"row"`` or ``None`` (replicated) for the layer (or parameter) at dotted
    path ``name`` (``layers.0.self_attn.q_proj`` or ``...q_proj.weight``)."""
    base = re.sub(r"\.(weight|bias|act_amax)$", "", name)
    heads = None
    if base.endswith("self_attn.q_proj") or base.endswith("self_attn.o_proj"):
        heads = config.num_heads
    elif base.endswith("self_attn.k_proj") or base.endswith("self_attn.v_proj"):
        heads = config.num_kv_heads
    if heads is not None and heads % tp:
        return None
    if base == "lm_head":
        return "column" if config.vocab_size % tp == 0 else None
    if base.endswith("self_attn.qkv_proj"):  # fused, rows grouped per device (ModelConfig.fused_shards)
        return None if config.num_heads % tp or config.num_kv_heads % tp else "column"
    if re.search(r"self_attn\.[qkv]_proj$|mlp\.(gate|up|gate_up)_proj$", base):
        return "column"
    if re.search(r"self_attn\.o_proj$|mlp\.down_proj$", base):
        return "row" if name.endswith(".weight") or name == base else None  # the bias is replicated
    return None


def tp_spec(name: str, shape: tuple[int, ...], config: ModelConfig, tp: int) -> P:
    """PartitionSpec of a dense parameter for tensor parallelism of degree ``tp``."""
    r = role(name, config, tp)
    if r is None or not shape:
        return P()
    axis = 0 if r == "column" else len(shape) - 1
    if shape[axis] % tp:
        return P()
    spec = [None] * len(shape)
    spec[axis] = AXIS
    return P(*spec)


def quantized_specs(w: QuantizedArray, parallel: str | None, tp: int, *, name: str = "weight") -> Any:
    """PartitionSpecs (a pytree like ``w``) of a quantized ``[N, K]`` weight's fields for role
    ``parallel`` (module doc); ValueError when a shard boundary would cut a block."""
    n, k = w.shape
    if parallel == "row":
        # The block: K over the fewest columns of a [N, K / b] field (16 for NVFP4's block scales).
        widths = [leaf.shape[-1] for leaf in jax.tree.leaves(w) if getattr(leaf, "ndim", 0) >= 2 and leaf.shape[0] == n]
        block = k // min(widths) if widths else 1
        if k % (tp * block):
            raise ValueError(f"{name}: {w.format} weight with K = {k} cannot be split over {tp} devices at "
                             f"{block}-element block boundaries (K / tp must be a multiple of {block})")
        if any(width % tp for width in widths):
            raise ValueError(f"{name}: {w.format} weight with K = {k} cannot be split over {tp} devices: its "
                             f"fields along K have {widths} columns")
    elif parallel == "column" and n % tp:
        raise ValueError(f"{name}: {w.format} weight with N = {n} rows cannot be split over {tp} devices")

    def spec(leaf):
        rowwise = getattr(leaf, "ndim", 0) >= 1 and leaf.shape[0] == n
        if parallel == "column" and rowwise:
            return P(AXIS, *([None] * (leaf.ndim - 1)))
        if parallel == "row" and rowwise and leaf.ndim >= 2:
            return P(*([None] * (leaf.ndim - 1)), AXIS)
        return P()

    return jax.tree.map(spec, w)


def tp_mesh(mesh: Mesh) -> Mesh:
    """``mesh`` with its axis named ``"tp"`` (a mesh of one axis of another name is renamed)."""
    if AXIS in mesh.axis_names:
        return mesh
    if len(mesh.axis_names) != 1:
        raise ValueError(f"mesh needs an axis named 'tp' (axes: {mesh.axis_names})")
    return Mesh(mesh.devices, (AXIS,))


def _check_fused_divides(config: ModelConfig, tp: int) -> None:
    uneven = config.uneven_for(tp)
    if config.fused_projections and tp > 1 and uneven:
        raise ValueError(f"fused q/k/v and gate/up projections split over {tp} devices need {', '.join(uneven)} to "
                         f"divide by {tp}: shard an unfused model")


def _check_splits(config: ModelConfig, tp: int) -> None:
    _check_fused_divides(config, tp)
    if config.fused_projections and tp > 1 and config.fused_shards != tp:
        raise ValueError(f"the fused projections' rows are grouped for {config.fused_shards} device(s), not {tp}: "
                         f"jaxlp.models.fuse_projections(model, shards={tp}) regroups them (shard_model does)")


def tp_mesh_of(model) -> Mesh | None:
    """The mesh of the model's first parameter when it has a ``"tp"`` axis of more than one device."""
    leaf = jax.tree.leaves(nnx.state(model))[0]
    mesh = getattr(getattr(leaf, "sharding", None), "mesh", None)
    return mesh if isinstance(mesh, Mesh) and mesh.shape.get(AXIS, 1) > 1 else None


def parameter_sharding(name: str, value: Any, config: ModelConfig, mesh: Mesh) -> Any:
    """Where parameter ``name`` (dotted path, e.g. ``layers.0.mlp.down_proj.weight``) lives on
    ``mesh``: a NamedSharding, or for a QuantizedArray a pytree like it of NamedShardings (arrays
    or ``jax.ShapeDtypeStruct`` leaves both do)."""
    tp = mesh.shape[AXIS]
    if isinstance(value, QuantizedArray):
        specs = quantized_specs(value, role(name, config, tp), tp, name=name)
        return jax.tree.map(lambda s: NamedSharding(mesh, s), specs)
    if not hasattr(value, "shape"):
        raise ValueError(f"parameter {name} is a {type(value).__name__}, not an array")
    return NamedSharding(mesh, tp_spec(name, tuple(value.shape), config, tp))


def param_shardings(params: Any, config: ModelConfig, mesh: Mesh) -> Any:
    """The tree of :func:`parameter_sharding` for a model's parameters as a nested dict (``nnx``'s
    pure dict, or a checkpoint's :func:`jaxlp.checkpoint.abstract`): what a loader restores onto."""
    mesh = tp_mesh(mesh)
    _check_splits(config, mesh.shape[AXIS])
    is_leaf = lambda x: isinstance(x, QuantizedArray)  # noqa: E731

    def place(path, value):
        name = ".".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)
        return parameter_sharding(name, value, config, mesh)

    return jax.tree_util.tree_map_with_path(place, params, is_leaf=is_leaf)


def shard_model(model, mesh: Mesh):
    """Place the model's parameters for tensor parallelism over ``mesh`` (in place; returned).
    Layers with a ``set_parallel(mesh, role)`` method (quantized linears) are told their role, and
    those with ``set_mesh(mesh)`` (attention) the mesh when the heads split, so that their kernels
    run on local shards; the model (``set_logits_mesh``) gathers the logits of a vocabulary-parallel
    LM head. Parameters already on their target shardings stay where they are. Fused projections
    have their rows regrouped for the mesh's devices first (``ModelConfig.fused_shards``)."""
    mesh = tp_mesh(mesh)
    tp = mesh.shape[AXIS]
    if model.config.fused_projections and tp > 1 and model.config.fused_shards != tp:
        _check_fused_divides(model.config, tp)
        group_rows(model, tp)
    c = model.config
    _check_splits(c, tp)
    local_heads = tp > 1 and not (c.num_heads % tp or c.num_kv_heads % tp)
    for path, layer in nnx.iter_modules(model):
        if hasattr(layer, "set_parallel"):  # quantized linears
            name = ".".join(str(p) for p in path)
            layer.set_parallel(mesh, role(name, c, tp) if tp > 1 else None)
        if hasattr(layer, "set_mesh"):  # attention with a cache: on the local heads
            layer.set_mesh(mesh if local_heads else None)
        if hasattr(layer, "set_logits_mesh"):  # the model: whole logits after a vocabulary-parallel head
            split = tp > 1 and getattr(layer, "lm_head", None) is not None and role("lm_head", c, tp) == "column"
            layer.set_logits_mesh(mesh if split else None)
    flat = nnx.to_flat_state(nnx.state(model))
    for path, var in flat:
        name = ".".join(str(p) for p in path)
        value = var.get_value()
        if not isinstance(value, (QuantizedArray, jax.Array)):
            raise ValueError(f"shard_model: parameter {name} is a {type(value).__name__}, not an array")
        var.set_value(jax.tree.map(jax.device_put, value, parameter_sharding(name, value, c, mesh)))
    nnx.update(model, nnx.from_flat_state(flat))
    return model
