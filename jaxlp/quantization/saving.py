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

import jax.numpy as jnp
from flax import nnx

from jaxlp import checkpoint
from jaxlp.models.config import ModelConfig, RopeConfig
from jaxlp.errors import CheckpointFormatError
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


def save_quantized(model, path: str | Path, *, tokenizer_from: str | Path | None = None, overwrite: bool = False):
    """Write a quantized model (from :func:`quantize_model`) to ``path``."""
    path = Path(path)
    report = getattr(model, "quantization", None)
    if report is None:
        raise ValueError("save_quantized expects a model returned by jaxlp.quantize_model")
    if path.exists() and any(path.iterdir()) and not overwrite:
        raise FileExistsError(f"{path} exists and is not empty (pass overwrite=True)")
    path.mkdir(parents=True, exist_ok=True)
    layers = {
        p: dict(activation=layer.activation, out_scale=layer.out_scale, mode=layer.mode,
                implementation=layer.implementation, has_amax=layer.act_amax is not None)
        for p, layer in quantized_layers(model)
    }
    meta = dict(
        format_version=FORMAT_VERSION, config=_config_to_json(model.config), dtype=jnp.dtype(model.dtype).name,
        recipe=report.recipe, layers=layers, kept=[list(k) for k in report.kept],
    )
    checkpoint.save(path / "params", _keys(nnx.to_pure_dict(nnx.state(model)), _to_str), overwrite=overwrite)
    if tokenizer_from is not None:
        for name in TOKENIZER_FILES:
            if (Path(tokenizer_from) / name).is_file():
                shutil.copy(Path(tokenizer_from) / name, path / name)
    (path / MARKER).write_text(json.dumps(meta, indent=1))  # written last: marks a complete save


def _lookup(tree: dict, dotted: str):
    node = tree
    for part in dotted.split("."):
        key = _to_int(part)
        if key not in node:
            raise CheckpointFormatError(f"quantized checkpoint lacks parameters of layer {dotted!r}")
        node = node[key]
    return node


def load_quantized(path: str | Path):
    """Load a directory written by :func:`save_quantized` (also reached via ``from_pretrained``)."""
    path = Path(path)
    try:
        meta = json.loads((path / MARKER).read_text())
        if meta.get("format_version") != FORMAT_VERSION:
            raise CheckpointFormatError(f"{path}: unsupported quantized-checkpoint version {meta.get('format_version')}")
        config = _config_from_json(meta["config"])
        dtype, layers = jnp.dtype(meta["dtype"]), meta["layers"]
    except (OSError, json.JSONDecodeError, KeyError, TypeError) as e:
        raise CheckpointFormatError(f"{path}: corrupt {MARKER} ({type(e).__name__}: {e})") from None
    params = _keys(checkpoint.load(path / "params"), _to_int)
    model = nnx.eval_shape(lambda: Transformer(config, dtype=dtype, rngs=nnx.Rngs(0)))
    for dotted, info in layers.items():
        entry = _lookup(params, dotted)
        parts = dotted.split(".")
        parent = model
        for part in parts[:-1]:
            parent = parent[int(part)] if part.isdigit() else getattr(parent, part)
        setattr(parent, parts[-1], QuantizedLinear(
            entry["weight"], entry.get("bias"), activation=info["activation"],
            act_amax=entry.get("act_amax") if info["has_amax"] else None, out_scale=info["out_scale"],
            implementation=info["implementation"], mode=info["mode"],
        ))
    state = nnx.state(model)
    try:
        nnx.replace_by_pure_dict(state, params)
    except (KeyError, ValueError) as e:
        raise CheckpointFormatError(f"{path}: parameters do not match the model in {MARKER} ({e})") from None
    nnx.update(model, state)
    model.quantization = QuantizationReport(meta["recipe"], tuple(layers), tuple(tuple(k) for k in meta["kept"]))
    return model
