"""``quantize_model``: rewrite a model's linear layers into :class:`QuantizedLinear` by a recipe.

Calibration (for static activation scales) runs the model once per batch of offline token
ids under ``jax.jit`` with observers on the selected layers that keep the running amax of
their inputs. FireQ's CAS is folded into the preceding norms (and ``up_proj`` rows for
``down_proj``) before quantization, and PTS scales each weight by a power of two that the
layer's output scale undoes.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Iterable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from jaxlp import formats
from jaxlp.formats import int4_fp8, nestedfp
from jaxlp.models import fused_layout
from jaxlp.models.layers import Linear
from jaxlp.models.sharding import shard_model, tp_mesh_of
from jaxlp.quantization.activations import STATIC
from jaxlp.quantization.linear import QuantizedLinear
from jaxlp.quantization.recipes import LM_HEAD, Recipe, get_recipe

CAS_CONSTANTS = {"gate_up": 0.0096, "down": 0.015}  # FireQ's reference values for Llama-3-8B


@dataclasses.dataclass(frozen=True)
class QuantizationReport:
    """What ``quantize_model`` did: quantized layer paths, layers kept high precision and why."""

    recipe: str
    quantized: tuple[str, ...]
    kept: tuple[tuple[str, str], ...]  # (path, reason)


def _path_str(path) -> str:
    return ".".join(str(p) for p in path)


def linear_layers(model, recipe: Recipe) -> dict[str, tuple]:
    """``{path: (parent, attribute, Linear)}`` of the layers a recipe selects."""
    found = {}
    for path, module in nnx.iter_modules(model):
        if isinstance(module, Linear) and recipe.selects(_path_str(path)):
            parent = model
            for p in path[:-1]:
                parent = parent[p] if isinstance(p, int) else getattr(parent, p)
            found[_path_str(path)] = (parent, path[-1], module)
    return found


class _AmaxObserver(nnx.Module):
    def __init__(self, inner: Linear):
        self.inner = inner
        self.amax = nnx.Variable(jnp.zeros((), jnp.float32))

    def __call__(self, x):
        self.amax[...] = jnp.maximum(self.amax[...], jnp.max(jnp.abs(x.astype(jnp.float32))))
        return self.inner(x)


def _set(parent, attr, module):
    if isinstance(attr, int):
        parent[attr] = module
    else:
        setattr(parent, attr, module)


Progress = Callable[[str, int, int], None]  # (what, done, total)


def check_calibration(config, calibration) -> np.ndarray:
    """``calibration`` as token ids ``[N, S]`` with ``1 <= S <=`` the model's context length."""
    ids = np.asarray(calibration)
    if ids.ndim != 2 or ids.shape[0] == 0 or ids.shape[1] == 0:
        raise ValueError(f"calibration must be a non-empty [num_sequences, seq_len] array of token ids, got {ids.shape}")
    if not np.issubdtype(ids.dtype, np.integer):
        raise ValueError(f"calibration must hold integer token ids, got dtype {ids.dtype}")
    if ids.shape[1] > config.max_position_embeddings:
        raise ValueError(f"calibration sequences of {ids.shape[1]} tokens exceed the model's context length "
                         f"{config.max_position_embeddings}")
    if ids.min() < 0 or ids.max() >= config.vocab_size:
        raise ValueError("calibration holds token ids outside the model's vocabulary")
    return ids


def collect_activation_amax(model, layers: dict[str, tuple], calibration, *, batch_size: int = 4,
                            progress: Progress | None = None) -> dict[str, jax.Array]:
    """Max |input| of each layer over ``calibration`` token ids ``[N, S]`` (no padding), one jit.

    ``progress("calibrating", done, total)`` is called after each batch (sequences done)."""
    ids = check_calibration(model.config, calibration)
    if not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"calibration_batch_size must be an integer >= 1, got {batch_size!r}")
    observers = {}
    for path, (parent, attr, linear) in layers.items():
        observers[path] = _AmaxObserver(linear)
        _set(parent, attr, observers[path])

    @nnx.jit
    def run(m, batch):
        m.forward(batch)

    try:
        for start in range(0, len(ids), batch_size):
            run(model, jnp.asarray(ids[start : start + batch_size]))
            if progress is not None:
                progress("calibrating", min(start + batch_size, len(ids)), len(ids))
    finally:
        for path, (parent, attr, linear) in layers.items():
            _set(parent, attr, linear)
    return {path: obs.amax[...] for path, obs in observers.items()}


def _fold_norm(norm, s: jax.Array):
    """Divide an RMSNorm's gain by ``s`` (Gemma's ``1 + w`` gain included)."""
    w = norm.weight[...].astype(jnp.float32)
    new = (1.0 + w) / s - 1.0 if norm.offset else w / s
    norm.weight.set_value(new.astype(norm.weight[...].dtype))


def _apply_cas(model, weights: dict[str, jax.Array]) -> None:
    """FireQ CAS on the MLPs: scale gate/up columns and down columns; fold the inverses.

    With fused projections the up rows are ``gate_up_proj``'s second part (:func:`fused_layout.part_rows`)."""
    for i, layer in enumerate(model.layers):
        mlp = f"layers.{i}.mlp"
        down = f"{mlp}.down_proj"
        if layer.mlp.fused:  # one weight; up is its second part of rows
            gate_up = [f"{mlp}.gate_up_proj"]
            up, up_module = gate_up[0], layer.mlp.gate_up_proj
            up_rows = fused_layout.part_rows(model.config, "gate_up_proj", 1)
        else:
            gate_up = [f"{mlp}.gate_proj", f"{mlp}.up_proj"]
            up, up_rows, up_module = gate_up[1], slice(None), layer.mlp.up_proj
        if all(p in weights for p in gate_up):
            s = int4_fp8.cas_scales([weights[p] for p in gate_up], CAS_CONSTANTS["gate_up"])
            for p in gate_up:
                weights[p] = weights[p] * s
            _fold_norm(layer.pre_feedforward_layernorm if layer.sandwich else layer.post_attention_layernorm, s)
        if down in weights and up in weights:
            s = int4_fp8.cas_scales([weights[down]], CAS_CONSTANTS["down"])
            weights[down] = weights[down] * s
            weights[up] = weights[up].at[up_rows].divide(s[:, None])
            if up_module.bias is not None:
                b = up_module.bias[...]
                up_module.bias.set_value(b.at[up_rows].set((b[up_rows].astype(jnp.float32) / s).astype(b.dtype)))


def quantize_model(
    model,
    recipe: str | Recipe,
    *,
    calibration=None,
    calibration_batch_size: int = 4,
    implementation: str = "xla",
    inplace: bool = False,
    progress: Progress | None = None,
    mesh: Mesh | None = None,
):
    """Return a copy of ``model`` (unless ``inplace``) whose selected linears compute in the recipe's format.

    ``calibration``: token ids ``[N, S]`` for recipes with static activation scales (NVFP4
    W4A4), ``S`` at most the model's context length. The result has ``model.quantization``, a
    :class:`QuantizationReport`. ``progress(what, done, total)``, if given, is called as the
    calibration batches (``"calibrating"``) and the layers (``"quantizing"``) are done.
    ``mesh``: place the result for tensor parallelism (:func:`jaxlp.models.shard_model`); a model
    whose parameters already lie on a mesh with a ``"tp"`` axis is placed on that mesh again.
    """
    recipe = get_recipe(recipe)
    mesh = mesh if mesh is not None else tp_mesh_of(model)
    if calibration is not None:
        check_calibration(model.config, calibration)
    if not inplace:
        model = nnx.clone(model)
    layers = linear_layers(model, recipe)
    if recipe.lm_head and LM_HEAD not in layers:
        why = ("the model ties its output projection to the embeddings (tie_word_embeddings)"
               if getattr(model, "lm_head", None) is None else f"exclude={recipe.exclude!r} removes it")
        raise ValueError(f"recipe {recipe.name!r} asks for the lm_head (lm_head=True), but {why}")
    if not layers:
        raise ValueError(f"recipe {recipe.name!r} selects no linear layer (include={recipe.include!r})")
    amax = {}
    if recipe.activation in STATIC:
        if calibration is None:
            raise ValueError(f"recipe {recipe.name!r} quantizes activations with a static scale: pass calibration=")
        observed = {p: entry for p, entry in layers.items() if p != LM_HEAD}  # the lm_head is weight-only
        amax = collect_activation_amax(model, observed, calibration, batch_size=calibration_batch_size,
                                       progress=progress)

    weights = {p: lin.weight[...].astype(jnp.float32) for p, (_, _, lin) in layers.items()}
    if recipe.cas:
        _apply_cas(model, weights)
    options = dict(recipe.weight_options)
    quantized, kept = [], []
    for path, (parent, attr, linear) in layers.items():
        w = weights[path]
        if recipe.weight_format == "nestedfp":
            threshold = options.get("threshold", nestedfp.DEFAULT_THRESHOLD)
            if not nestedfp.is_eligible(w.astype(jnp.float16), threshold):
                kept.append((path, f"NestedFP exception layer: max |w| > {threshold}"))
                if progress is not None:
                    progress("quantizing", len(quantized) + len(kept), len(layers))
                continue
        p = int4_fp8.pts_factor(w) if recipe.pts else jnp.float32(1.0)
        q = formats.quantize(w * p, recipe.weight_format, **options)
        bias = None if linear.bias is None else linear.bias[...]
        _set(parent, attr, QuantizedLinear(
            q, bias, activation=None if path == LM_HEAD else recipe.activation, act_amax=amax.get(path),
            out_scale=float(1.0 / p), implementation=implementation,
        ))
        quantized.append(path)
        if progress is not None:
            progress("quantizing", len(quantized) + len(kept), len(layers))
    model.quantization = QuantizationReport(recipe.name, tuple(quantized), tuple(kept))
    return shard_model(model, mesh) if mesh is not None else model


def quantized_layers(model) -> Iterable[tuple[str, QuantizedLinear]]:
    for path, module in nnx.iter_modules(model):
        if isinstance(module, QuantizedLinear):
            yield _path_str(path), module


def set_mode(model, mode: str):
    """Switch every NestedFP layer between ``"fp16"`` and ``"fp8"`` (same stored bytes); returns model."""
    for _, layer in quantized_layers(model):
        if layer.format == "nestedfp":
            layer.set_mode(mode)
    return model


def set_implementation(model, implementation: str):
    """Select the matmul implementation of every quantized layer; returns model."""
    for _, layer in quantized_layers(model):
        layer.set_implementation(implementation)
    return model
