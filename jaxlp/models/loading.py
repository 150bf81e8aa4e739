"""Load Hugging Face checkpoints (``config.json`` + ``*.safetensors``) into a :class:`Transformer`.

Tensor names map one to one after dropping the ``model.`` prefix (``model.layers.0.mlp.
up_proj.weight`` -> ``layers.0.mlp.up_proj.weight``); ``lm_head.weight`` is skipped for tied
embeddings. A missing, unexpected or mis-shaped tensor is an error that names it.

With ``mesh=``, parameters are placed for tensor parallelism along the mesh axis ``"tp"``
(or the mesh's only axis): query/key/value projections split by output features (heads),
``o_proj`` by input features, MLP gate/up by columns and down by rows; embeddings and norms
are replicated. XLA's SPMD partitioner inserts the collectives.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxlp.errors import CheckpointFormatError
from jaxlp.models.config import ModelConfig, from_hf_config
from jaxlp.models.transformer import Transformer


def read_config(path: str | Path) -> ModelConfig:
    path = Path(path)
    if not path.is_dir():
        raise CheckpointFormatError(f"model directory {str(path)!r} does not exist")
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise CheckpointFormatError(f"{path}: no config.json")
    try:
        raw = json.loads(cfg_file.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointFormatError(f"{cfg_file}: corrupt JSON ({e})") from None
    gen_file = path / "generation_config.json"
    if gen_file.is_file():  # its EOS ids (e.g. Gemma's end-of-turn) also stop generation
        try:
            gen_eos = json.loads(gen_file.read_text()).get("eos_token_id")
        except json.JSONDecodeError as e:
            raise CheckpointFormatError(f"{gen_file}: corrupt JSON ({e})") from None
        as_list = lambda i: i if isinstance(i, list) else ([] if i is None else [i])  # noqa: E731
        merged = as_list(raw.get("eos_token_id")) + as_list(gen_eos)
        raw = {**raw, "eos_token_id": list(dict.fromkeys(merged))}
    return from_hf_config(raw)


def safetensors_files(path: Path) -> list[Path]:
    """The checkpoint's shard files: from ``model.safetensors.index.json`` when present."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (json.JSONDecodeError, KeyError) as e:
            raise CheckpointFormatError(f"{index}: corrupt index ({e})") from None
        files = [path / n for n in names]
        missing = [str(f.name) for f in files if not f.is_file()]
        if missing:
            raise CheckpointFormatError(f"{path}: shards named in the index are missing: {missing}")
        return files
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise CheckpointFormatError(f"{path}: no *.safetensors files")
    return files


def _read_tensors(files: list[Path]) -> dict[str, np.ndarray]:
    from safetensors import SafetensorError
    from safetensors.flax import load_file

    tensors: dict[str, np.ndarray] = {}
    for f in files:
        try:
            tensors.update(load_file(str(f)))
        except (SafetensorError, OSError, ValueError) as e:
            raise CheckpointFormatError(f"{f}: cannot read safetensors file ({e})") from None
    return tensors


def _hf_name(param_path: tuple) -> str:
    name = ".".join(str(p) for p in param_path)
    return name if name.startswith("lm_head.") else "model." + name


def tp_spec(name: str, shape: tuple[int, ...], config: ModelConfig, tp: int) -> P:
    """PartitionSpec of a parameter for tensor parallelism of degree ``tp``."""
    c = config

    def split(axis: int, heads: int | None = None) -> P:
        if (heads if heads is not None else shape[axis]) % tp:
            return P()  # not divisible: replicate (e.g. a single KV head)
        spec = [None] * len(shape)
        spec[axis] = "tp"
        return P(*spec)

    if re.search(r"self_attn\.q_proj\.(weight|bias)$", name):
        return split(0, c.num_heads)
    if re.search(r"self_attn\.[kv]_proj\.(weight|bias)$", name):
        return split(0, c.num_kv_heads)
    if name.endswith("self_attn.o_proj.weight"):
        return split(1, c.num_heads)
    if re.search(r"mlp\.(gate|up)_proj\.(weight|bias)$", name):
        return split(0)
    if name.endswith("mlp.down_proj.weight"):
        return split(1)
    return P()


def shard_model(model: Transformer, mesh: Mesh) -> Transformer:
    """Place the model's parameters for tensor parallelism over ``mesh`` (in place; returned)."""
    axis = "tp" if "tp" in mesh.axis_names else None
    if axis is None:
        if len(mesh.axis_names) != 1:
            raise ValueError(f"mesh needs an axis named 'tp' (axes: {mesh.axis_names})")
        mesh = Mesh(mesh.devices, ("tp",))
    tp = mesh.shape["tp"]
    if model.config.fused_projections and tp > 1:
        raise ValueError("shard_model splits q/k/v and gate/up by heads and rows: shard an unfused model "
                         "(fused qkv_proj / gate_up_proj rows cannot be split per device)")
    state = nnx.state(model)
    flat = nnx.to_flat_state(state)
    for path, var in flat:
        name = ".".join(str(p) for p in path)
        value = var.get_value()
        if not isinstance(value, jax.Array):
            raise ValueError(f"tensor parallelism of quantized layers is not supported yet ({name})")
        var.set_value(jax.device_put(value, NamedSharding(mesh, tp_spec(name, value.shape, model.config, tp))))
    nnx.update(model, nnx.from_flat_state(flat))
    return model


def load_hf(path: str | Path, *, dtype=jnp.bfloat16, mesh: Mesh | None = None) -> Transformer:
    """Load a Hugging Face checkpoint directory as a :class:`Transformer` with ``dtype`` params
    (:func:`jaxlp.from_pretrained` also loads quantized checkpoints)."""
    path = Path(path)
    config = read_config(path)
    tensors = _read_tensors(safetensors_files(path))
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
                f"{path}: tensor {name!r} has shape {tuple(t.shape)}, expected {tuple(var.shape)} from config.json"
            )
        var.set_value(jnp.asarray(t, dtype=dtype))
        seen.add(name)
    unexpected = sorted(set(tensors) - seen)
    if unexpected:
        shown = unexpected[:5] + (["..."] if len(unexpected) > 5 else [])
        raise CheckpointFormatError(f"{path}: unexpected tensors not used by {config.model_type}: {shown}")
    nnx.update(model, nnx.from_flat_state(flat))
    if mesh is not None:
        shard_model(model, mesh)
    return model
