"""Load Hugging Face checkpoints (``config.json`` + ``*.safetensors``) into a :class:`Transformer`.

Tensor names map one to one after dropping the ``model.`` prefix (``model.layers.0.mlp.
up_proj.weight`` -> ``layers.0.mlp.up_proj.weight``); ``lm_head.weight`` is skipped for tied
embeddings. A missing, unexpected or mis-shaped tensor is an error that names it.

With ``mesh=``, parameters are placed for tensor parallelism along the mesh axis ``"tp"``
(:mod:`jaxlp.models.sharding`).
"""

from __future__ import annotations

import json
from pathlib import Path

import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from jaxlp.errors import CheckpointFormatError, NonFiniteWeightsError, UnsupportedConfigError, one_line
from jaxlp.models.config import ModelConfig, from_hf_config
from jaxlp.models.sharding import shard_model
from jaxlp.models.transformer import Transformer


def check_model_dir(path: str | Path) -> Path:
    """``path`` as a Path if it is a directory; else a one-line error saying what it is."""
    path = Path(path)
    if not path.exists():
        raise CheckpointFormatError(f"model directory {str(path)!r} does not exist")
    if not path.is_dir():
        raise CheckpointFormatError(f"{str(path)!r} is a file, not a model directory (one holding config.json, "
                                    "*.safetensors and tokenizer.json)")
    return path


def _read_json_object(file: Path) -> dict:
    try:
        raw = json.loads(file.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointFormatError(f"{file}: corrupt JSON ({e})") from None
    except OSError as e:
        raise CheckpointFormatError(f"{file}: cannot read ({e.strerror or e})") from None
    if not isinstance(raw, dict):
        raise CheckpointFormatError(f"{file}: expected a JSON object, got a {type(raw).__name__}")
    return raw


def read_config(path: str | Path) -> ModelConfig:
    path = check_model_dir(path)
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise CheckpointFormatError(f"{path}: no config.json")
    raw = _read_json_object(cfg_file)
    gen_file = path / "generation_config.json"
    if gen_file.is_file():  # its EOS ids (e.g. Gemma's end-of-turn) also stop generation
        gen_eos = _read_json_object(gen_file).get("eos_token_id")
        as_list = lambda i: i if isinstance(i, list) else ([] if i is None else [i])  # noqa: E731
        merged = as_list(raw.get("eos_token_id")) + as_list(gen_eos)
        try:
            raw = {**raw, "eos_token_id": list(dict.fromkeys(merged))}
        except TypeError:  # unhashable ids (lists in the list)
            raise CheckpointFormatError(f"{path}: eos_token_id must be an integer or a list of integers, "
                                        f"got {raw.get('eos_token_id')!r} / {gen_eos!r}") from None
    try:
        return from_hf_config(raw)
    except (UnsupportedConfigError, CheckpointFormatError) as e:
        raise type(e)(f"{cfg_file}: {e}") from None
    except ValueError as e:  # a setting out of range, named by the check
        raise CheckpointFormatError(f"{cfg_file}: {e}") from None
    except (TypeError, KeyError, AttributeError) as e:
        raise CheckpointFormatError(f"{cfg_file}: invalid config ({type(e).__name__}: {e})") from None


def safetensors_files(path: Path) -> list[Path]:
    """The checkpoint's shard files: from ``model.safetensors.index.json`` when present."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = _read_json_object(index).get("weight_map")
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise CheckpointFormatError(f"{index}: corrupt index (no 'weight_map' object of tensor -> file names)")
        names = sorted(set(weight_map.values()))
        files = [path / n for n in names]
        missing = [str(f.name) for f in files if not f.is_file()]
        if missing:
            raise CheckpointFormatError(f"{path}: shards named in the index are missing: {missing}")
        return files
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise CheckpointFormatError(f"{path}: no *.safetensors files")
    return files


def describe_safetensors_error(f: Path, e: BaseException) -> str:
    """One line for a safetensors read failure: truncated, bad header, or unreadable."""
    text = str(e)
    if any(w in text for w in ("MetadataIncompleteBuffer", "incomplete", "out of bounds", "InvalidOffset",
                               "too small", "unexpected end")):
        what = "truncated or incomplete"
    elif any(w in text for w in ("HeaderTooLarge", "InvalidHeader", "header")):
        what = "not a safetensors file (bad header)"
    else:
        what = "unreadable"
    return f"{f}: cannot read safetensors file, it is {what} ({one_line(text, 200)})"


def _read_tensors(files: list[Path]) -> tuple[dict[str, np.ndarray], dict[str, Path]]:
    """Every tensor of the shard files, and the file each came from."""
    from safetensors import SafetensorError
    from safetensors.flax import load_file

    tensors: dict[str, np.ndarray] = {}
    where: dict[str, Path] = {}
    for f in files:
        try:
            part = load_file(str(f))
        except (SafetensorError, OSError, ValueError, RuntimeError, TypeError) as e:
            raise CheckpointFormatError(describe_safetensors_error(f, e)) from None
        tensors.update(part)
        where.update(dict.fromkeys(part, f))
    return tensors, where


def _hf_name(param_path: tuple) -> str:
    name = ".".join(str(p) for p in param_path)
    return name if name.startswith("lm_head.") else "model." + name


def _check_tensor_finite(name: str, file: Path, source, value, dtype) -> None:
    """Refuse a parameter holding NaN or Inf after the cast to ``dtype`` (naming why)."""
    if bool(jnp.all(jnp.isfinite(value))):
        return
    src = jnp.asarray(source)
    if jnp.issubdtype(src.dtype, jnp.floating) and bool(jnp.all(jnp.isfinite(src))):
        raise NonFiniteWeightsError(
            f"{file}: tensor {name!r} overflows {jnp.dtype(dtype).name} (its largest magnitude is "
            f"{float(jnp.max(jnp.abs(src.astype(jnp.float32)))):.4g}); load it in bfloat16 or float32"
        )
    nans, infs = int(jnp.sum(jnp.isnan(src))), int(jnp.sum(jnp.isinf(src)))
    raise NonFiniteWeightsError(
        f"{file}: tensor {name!r} holds {nans:,} NaN and {infs:,} Inf values (of {src.size:,}): the checkpoint is "
        "damaged (check_finite=False / --no-check loads it anyway)"
    )


def load_hf(path: str | Path, *, dtype=jnp.bfloat16, mesh: Mesh | None = None, check_finite: bool = True) -> Transformer:
    """Load a Hugging Face checkpoint directory as a :class:`Transformer` with ``dtype`` params
    (:func:`jaxlp.from_pretrained` also loads quantized checkpoints).

    Every tensor must be floating, of the shape config.json implies, and (``check_finite``,
    one reduction per tensor at load) free of NaN and Inf in ``dtype``; else
    :class:`~jaxlp.errors.CheckpointFormatError` (``NonFiniteWeightsError``) names the tensor and the file.
    """
    path = Path(path)
    config = read_config(path)
    tensors, files = _read_tensors(safetensors_files(path))
    if config.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)
    model = nnx.eval_shape(lambda: Transformer(config, dtype=dtype, rngs=nnx.Rngs(0)))
    flat = nnx.to_flat_state(nnx.state(model))
    seen = set()
    for param_path, var in flat:
        name = _hf_name(param_path)
        if name not in tensors:
            raise CheckpointFormatError(f"{path}: tensor {name!r} is missing from the checkpoint")
        t = tensors[name]
        if tuple(t.shape) != tuple(var.shape):
            raise CheckpointFormatError(
                f"{files[name]}: tensor {name!r} has shape {tuple(t.shape)}, expected {tuple(var.shape)} from config.json"
            )
        if not jnp.issubdtype(t.dtype, jnp.floating):
            raise CheckpointFormatError(
                f"{files[name]}: tensor {name!r} has dtype {jnp.dtype(t.dtype).name}, expected a floating-point dtype"
            )
        value = jnp.asarray(t, dtype=dtype)
        if check_finite:
            _check_tensor_finite(name, files[name], t, value, dtype)
        var.set_value(value)
        seen.add(name)
    unexpected = sorted(set(tensors) - seen)
    if unexpected:
        shown = unexpected[:5] + (["..."] if len(unexpected) > 5 else [])
        raise CheckpointFormatError(f"{path}: unexpected tensors not used by {config.model_type}: {shown}")
    nnx.update(model, nnx.from_flat_state(flat))
    if mesh is not None:
        shard_model(model, mesh)
    return model
