"""Fused projections: q/k/v as one ``qkv_proj`` and gate/up as one ``gate_up_proj`` per layer.

    model = jaxlp.models.fuse_projections(model)        # BF16: rows concatenated, exact
    qmodel = jaxlp.quantize_model(model, "w4a16-nvfp4")  # one NVFP4 tensor scale per fused linear

At decode time every linear is one kernel launch streaming its weight; one launch over the
concatenated rows instead of three (or two) saves the launch, ramp-up and tail of the small
ones (Qwen3-8B's k_proj and v_proj are 2.4 MB each in NVFP4). The outputs are the same: each
output row is the same dot product (XLA and the NVFP4 kernels may sum it in another order).

Fusing works on high-precision :class:`~jaxlp.models.layers.Linear` layers (rows concatenated)
and on quantized ones (:func:`jaxlp.formats.concatenate_rows`, bit-exact), which must then
share every per-tensor quantity: format, tensor scale, activation quantizer and its calibrated
amax, output scale. Quantizing a fused model gives that by construction (ModelOpt and
llm-compressor export NVFP4 checkpoints with shared q/k/v and gate/up tensor scales, for this
reason). ``save_pretrained`` writes fused models with the Hugging Face names (split again).
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxlp.models.fused_layout import fused_order, group_rows, part_sizes
from jaxlp.models.layers import Linear
from jaxlp.models.sharding import AXIS, shard_model, tp_mesh_of

QKV = ("q_proj", "k_proj", "v_proj")
GATE_UP = ("gate_proj", "up_proj")


def _concat_bias(parts, where: str):
    biases = [p.bias for p in parts]
    if all(b is None for b in biases):
        return None
    if any(b is None for b in biases):
        raise ValueError(f"{where}: cannot fuse linears of which only some have a bias")
    return jnp.concatenate([b[...] for b in biases], axis=0)


def _fuse_linears(parts: list, where: str):
    """One module computing the concatenated outputs of ``parts``: all :class:`Linear`, or all of
    one class with a ``concatenate_rows(parts, bias)`` classmethod (quantized linears)."""
    kind = type(parts[0])
    if not all(type(p) is kind for p in parts):
        kinds = sorted({type(p).__name__ for p in parts})
        raise ValueError(f"{where}: cannot fuse a mix of {kinds} (quantize all of them or none)")
    bias = _concat_bias(parts, where)
    if kind is Linear:
        w = jnp.concatenate([p.weight[...] for p in parts], axis=0)
        fused = nnx.eval_shape(lambda: Linear(w.shape[1], w.shape[0], bias=bias is not None,
                                              dtype=w.dtype, rngs=nnx.Rngs(0)))
        fused.weight = nnx.Param(w)
        fused.bias = None if bias is None else nnx.Param(bias)
        return fused
    if not hasattr(kind, "concatenate_rows"):
        raise ValueError(f"{where}: cannot fuse layers of type {kind.__name__}")
    try:
        return kind.concatenate_rows(parts, bias)
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None


def fuse_projections(model, *, inplace: bool = False, shards: int | None = None):
    """Return ``model`` (a copy unless ``inplace``) with fused q/k/v and gate/up projections.

    ``shards``: group the fused rows for that many tensor-parallel devices
    (``ModelConfig.fused_shards``; default: the devices of the mesh the model lies on, else 1),
    so that each device's row shard is one local product. A model that is already fused has its
    rows reordered if it was grouped for another count, else is returned as it is; a model on a
    mesh is placed on it again (:func:`jaxlp.models.shard_model`). Raises ValueError naming the
    layer when its projections cannot share one linear (see the module docstring).
    """
    mesh = tp_mesh_of(model)
    if shards is None:
        shards = mesh.shape[AXIS] if mesh is not None else model.config.fused_shards
    elif mesh is not None and shards != mesh.shape[AXIS]:
        raise ValueError(f"fuse_projections: the model lies on a mesh of {mesh.shape[AXIS]} devices, so its fused "
                         f"rows are grouped for {mesh.shape[AXIS]}, not shards={shards} (shard_model moves it to "
                         "another mesh)")
    if model.config.fused_projections and model.config.fused_shards == shards:
        return model
    if not inplace:
        model = nnx.clone(model)
    if model.config.fused_projections:
        group_rows(model, shards)
    else:
        _fuse(model)
        if shards != 1:
            group_rows(model, shards)
    return shard_model(model, mesh) if mesh is not None else model


def _fuse(model) -> None:
    """Fuse q/k/v and gate/up of every layer (rows concatenated whole), in place."""
    config = dataclasses.replace(model.config, fused_projections=True, fused_shards=1)
    fused = []
    for i, layer in enumerate(model.layers):  # build everything first: a failure leaves the model as it was
        attn, mlp = layer.self_attn, layer.mlp
        qkv = _fuse_linears([getattr(attn, n) for n in QKV], f"layers.{i}.self_attn")
        gate_up = _fuse_linears([getattr(mlp, n) for n in GATE_UP], f"layers.{i}.mlp")
        fused.append((qkv, gate_up))
    for layer, (qkv, gate_up) in zip(model.layers, fused):
        attn, mlp = layer.self_attn, layer.mlp
        for n in QKV:
            delattr(attn, n)
        for n in GATE_UP:
            delattr(mlp, n)
        attn.qkv_proj, attn.config = qkv, config
        mlp.gate_up_proj, mlp.fused = gate_up, True
    model.config = config
    report = getattr(model, "quantization", None)
    if report is not None:
        quantized = tuple(dict.fromkeys(fused_path(p) for p in report.quantized))
        kept = tuple({fused_path(p): (fused_path(p), why) for p, why in report.kept}.values())
        model.quantization = dataclasses.replace(report, quantized=quantized, kept=kept)


def fused_path(path: str) -> str:
    """A layer's path after fusion: ``...q_proj`` / ``k_proj`` / ``v_proj`` -> ``...qkv_proj``, likewise gate/up."""
    head, _, name = path.rpartition(".")
    if name in QKV:
        return f"{head}.qkv_proj"
    if name in GATE_UP:
        return f"{head}.gate_up_proj"
    return path


def split_fused(name: str, value, config) -> dict:
    """Hugging Face tensors of one parameter: ``...qkv_proj.weight`` -> q/k/v rows, likewise gate/up
    (rows grouped per device, ``fused_shards``, put back in order)."""
    module, _, leaf = name.rpartition(".")
    head, _, proj = module.rpartition(".")
    if proj not in ("qkv_proj", "gate_up_proj"):
        return {name: value}
    names = QKV if proj == "qkv_proj" else GATE_UP
    if config.fused_shards != 1:
        value = value[np.argsort(fused_order(config, proj))]
    bounds = [int(b) for b in np.cumsum(part_sizes(config, proj))[:-1]]
    return {f"{head}.{n}.{leaf}": part for n, part in zip(names, jnp.split(value, bounds, axis=0))}
