"""Save and load quantized models: ``jaxlp_model.json`` + an Orbax checkpoint of the parameters.

Directory layout::

    jaxlp_model.json   format version, ModelConfig, dtype, recipe, per-layer quantization metadata
    params/            jaxlp.checkpoint of the model state (quantized arrays bit-exact)
    tokenizer.json ... copied from the source checkpoint when given

:func:`jaxlp.from_pretrained` recognises such a directory and calls :func:`load_quantized`.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from jaxlp import checkpoint
from jaxlp.errors import CheckpointFormatError
from jaxlp.formats.base import QuantizedArray
from jaxlp.models.config import ModelConfig, RopeConfig
from jaxlp.models.sharding import AXIS, param_shardings, shard_model, tp_mesh
from jaxlp.models.transformer import Transformer
from jaxlp.quantization.linear import QuantizedLinear
from jaxlp.quantization.model import QuantizationReport, quantized_layers

MARKER = "jaxlp_model.json"
FORMAT_VERSION = 1
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json")


def is_quantized_checkpoint(path: str | Path) -> bool:
    return (Path(path) / MARKER).is_file()


def _config_to_json(config: ModelConfig) -> dict:
    d = dataclasses.asdict(config)
    d["rope"] = [[name, dataclasses.asdict(r)] for name, r in config.rope]
    return d


def _config_from_json(d: dict) -> ModelConfig:
    d = dict(d)
    d["rope"] = tuple((name, RopeConfig(**r)) for name, r in d["rope"])
    for key in ("layer_types", "eos_token_ids"):
        d[key] = tuple(d[key])
    return ModelConfig(**d)


def _keys(tree, convert):
    """Map dict keys recursively (int layer indices <-> strings: checkpoints key by strings)."""
    if isinstance(tree, dict):
        return {convert(k): _keys(v, convert) for k, v in tree.items()}
    return tree


def _to_str(k):
    return str(k)


def _to_int(k):
    return int(k) if isinstance(k, str) and k.isdigit() else k


def _ancestor_file(path: Path) -> Path | None:
    """The first existing ancestor of ``path`` that is a file (a folder cannot be made under it)."""
    for parent in [path, *path.parents]:
        if parent.exists():
            return None if parent.is_dir() else parent
    return None


def check_output_dir(path: str | Path, *, overwrite: bool = False, source: str | Path | None = None) -> Path:
    """Refuse an output directory that cannot be (over)written safely; returns it resolved.

    A file where the directory (or one of its parents) should be; the ``source`` checkpoint
    itself or a directory holding it; an existing non-empty directory without ``overwrite``,
    or with it one that is not a jaxlp quantized checkpoint. Nothing is written.
    """
    path = Path(path).expanduser().resolve()
    blocker = _ancestor_file(path)
    if blocker == path:
        raise NotADirectoryError(f"{path} is a file: the output is a directory (pick a new path)")
    if blocker is not None:
        raise NotADirectoryError(f"{blocker} is a file, so {path} cannot be created under it")
    if source is not None:
        src = Path(source).expanduser().resolve()
        if path == src or path in src.parents:
            raise ValueError(f"the output {path} is the source checkpoint {src}"
                             f"{'' if path == src else ' or holds it'}: writing there would destroy it; pick another")
    if path.exists() and any(path.iterdir()):
        if not overwrite:
            raise FileExistsError(f"{path} exists and is not empty (pass overwrite=True / --overwrite)")
        if not is_quantized_checkpoint(path):
            raise FileExistsError(f"refusing to overwrite {path}: it is not a jaxlp quantized checkpoint "
                                  f"(no {MARKER}) or an empty directory")
    return path


def save_quantized(model, path: str | Path, *, tokenizer_from: str | Path | None = None, overwrite: bool = False):
    """Write a quantized model (from :func:`quantize_model`) to directory ``path``.

    Complete or absent: everything is written to a temporary sibling directory that is then
    renamed into place, so an error or an interrupt (Ctrl-C) leaves ``path`` as it was. With
    ``overwrite``, an existing jaxlp quantized checkpoint (or empty directory) is replaced;
    anything else, and the ``tokenizer_from`` source itself, is refused (:func:`check_output_dir`).
    """
    report = getattr(model, "quantization", None)
    if report is None:
        raise ValueError("save_quantized expects a model returned by jaxlp.quantize_model")
    path = check_output_dir(path, overwrite=overwrite, source=tokenizer_from)
    layers = {
        p: dict(activation=layer.activation, out_scale=layer.out_scale, mode=layer.mode,
                implementation=layer.implementation, has_amax=layer.act_amax is not None)
        for p, layer in quantized_layers(model)
    }
    meta = dict(
        format_version=FORMAT_VERSION, config=_config_to_json(model.config), dtype=jnp.dtype(model.dtype).name,
        recipe=report.recipe, layers=layers, kept=[list(k) for k in report.kept],
    )
    with checkpoint.replacing_directory(path) as tmp:
        checkpoint.save(tmp / "params", _keys(nnx.to_pure_dict(nnx.state(model)), _to_str))
        if tokenizer_from is not None:
            for name in TOKENIZER_FILES:
                if (Path(tokenizer_from) / name).is_file():
                    shutil.copy(Path(tokenizer_from) / name, tmp / name)
        (tmp / MARKER).write_text(json.dumps(meta, indent=1))  # written last: marks a complete save


def _lookup(tree: dict, dotted: str):
    node = tree
    for part in dotted.split("."):
        key = _to_int(part)
        if not isinstance(node, dict) or key not in node:
            raise CheckpointFormatError(f"quantized checkpoint lacks parameters of layer {dotted!r}")
        node = node[key]
    return node


def _read_marker(path: Path) -> tuple[dict, ModelConfig, object, dict]:
    marker = path / MARKER
    try:
        meta = json.loads(marker.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointFormatError(f"{path}: corrupt {MARKER} ({type(e).__name__}: {e})") from None
    if not isinstance(meta, dict):
        raise CheckpointFormatError(f"{path}: corrupt {MARKER} (expected a JSON object, got a {type(meta).__name__})")
    if meta.get("format_version") != FORMAT_VERSION:
        raise CheckpointFormatError(f"{path}: unsupported quantized-checkpoint version {meta.get('format_version')!r} "
                                    f"in {MARKER} (this jaxlp reads version {FORMAT_VERSION})")
    try:
        config = _config_from_json(meta["config"])
        dtype, layers = jnp.dtype(meta["dtype"]), meta["layers"]
        if not isinstance(layers, dict) or not all(isinstance(v, dict) for v in layers.values()):
            raise TypeError("'layers' must map layer paths to objects")
        if not isinstance(meta.get("recipe"), str) or not isinstance(meta.get("kept"), list):
            raise TypeError("'recipe' must be a string and 'kept' a list")
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise CheckpointFormatError(f"{path}: corrupt {MARKER} ({type(e).__name__}: {e})") from None
    return meta, config, dtype, layers


def _check_shapes(path: Path, expected: dict, params: dict) -> None:
    """Every parameter has the shape the config of the marker gives it (QuantizedArrays whole)."""
    is_leaf = lambda x: isinstance(x, QuantizedArray)  # noqa: E731
    want = dict(jax.tree_util.tree_flatten_with_path(expected, is_leaf=is_leaf)[0])
    for key, value in jax.tree_util.tree_flatten_with_path(params, is_leaf=is_leaf)[0]:
        if key in want and tuple(getattr(want[key], "shape", ())) != tuple(getattr(value, "shape", ())):
            name = ".".join(str(getattr(k, "key", k)) for k in key)
            raise CheckpointFormatError(
                f"{path}: parameter {name} has shape {tuple(value.shape)} but the config in {MARKER} gives "
                f"{tuple(want[key].shape)}"
            )


def load_quantized(path: str | Path, *, check_finite: bool = True, mesh: Mesh | None = None):
    """Load a directory written by :func:`save_quantized` (also reached via ``from_pretrained``).

    ``mesh`` (an axis ``"tp"``): tensor parallelism; every array is restored straight onto its
    target sharding (:func:`jaxlp.models.sharding.param_shardings`: each device reads its shard,
    no device ever holds a whole model), then :func:`~jaxlp.models.shard_model` gives the layers
    their roles (fused projections grouped for another device count are read into host memory and
    regrouped there first). Every problem (a corrupt or edited ``jaxlp_model.json``, missing, truncated or
    corrupt array data, parameters that do not fit) raises
    :class:`~jaxlp.errors.CheckpointFormatError` naming the file; ``check_finite`` also refuses
    floating parameters holding NaN or Inf (``NonFiniteWeightsError``; one reduction per array).
    """
    path = Path(path)
    meta, config, dtype, layers = _read_marker(path)
    sharding = None
    tp = 1 if mesh is None else tp_mesh(mesh).shape[AXIS]
    if mesh is not None and config.fused_projections and tp > 1 and config.fused_shards != tp:
        # Fused rows grouped for another device count: loaded into host memory, regrouped there by
        # shard_model, then placed (no device holds the whole model, as below).
        sharding = jax.sharding.SingleDeviceSharding(jax.devices("cpu")[0])
    elif mesh is not None:
        mesh = tp_mesh(mesh)
        stored = checkpoint.abstract(path / "params")
        try:
            sharding = param_shardings(stored, config, mesh)
        except ValueError as e:
            raise ValueError(f"{path}: cannot shard this model over {mesh.shape[AXIS]} devices: {e}") from None
    params = _keys(checkpoint.load(path / "params", sharding=sharding, check_finite=check_finite), _to_int)
    model = nnx.eval_shape(lambda: Transformer(config, dtype=dtype, rngs=nnx.Rngs(0)))
    for dotted, info in layers.items():
        entry = _lookup(params, dotted)
        parts = dotted.split(".")
        try:
            parent = model
            for part in parts[:-1]:
                parent = parent[int(part)] if part.isdigit() else getattr(parent, part)
            setattr(parent, parts[-1], QuantizedLinear(
                entry["weight"], entry.get("bias"), activation=info["activation"],
                act_amax=entry.get("act_amax") if info["has_amax"] else None, out_scale=info["out_scale"],
                implementation=info["implementation"], mode=info["mode"],
            ))
        except (KeyError, TypeError, ValueError, AttributeError, IndexError) as e:
            raise CheckpointFormatError(f"{path}: layer {dotted!r} of {MARKER} does not fit the parameters "
                                        f"({type(e).__name__}: {e})") from None
    state = nnx.state(model)
    _check_shapes(path, nnx.to_pure_dict(state), params)
    try:
        nnx.replace_by_pure_dict(state, params)
    except (KeyError, ValueError, TypeError) as e:
        raise CheckpointFormatError(f"{path}: parameters do not match the model in {MARKER} ({e})") from None
    nnx.update(model, state)
    model.quantization = QuantizationReport(meta["recipe"], tuple(layers), tuple(tuple(k) for k in meta["kept"]))
    return shard_model(model, mesh) if mesh is not None else model
