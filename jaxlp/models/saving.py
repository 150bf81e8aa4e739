"""Write a :class:`Transformer` as a Hugging Face checkpoint directory.

Files: ``config.json`` in transformers' format for the model's family (llama, mistral,
qwen2, qwen3, gemma3_text), ``generation_config.json`` (BOS/EOS/PAD ids),
``model.safetensors`` -- or ``model-0000i-of-0000n.safetensors`` shards plus
``model.safetensors.index.json`` when ``max_shard_bytes`` is given -- with the HF tensor
names (``model.layers.0.self_attn.q_proj.weight``; no ``lm_head.weight`` when embeddings
are tied), and with a tokenizer ``tokenizer.json`` + ``tokenizer_config.json``. Both
:func:`jaxlp.from_pretrained` and transformers' ``AutoModelForCausalLM.from_pretrained``
load the result.

The config is checked by reading it back with :func:`from_hf_config`: a model whose
architecture the family's config.json cannot express (e.g. o_proj bias on Qwen2) raises
ValueError naming the fields.
"""

from __future__ import annotations

import dataclasses
import json
import math
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
from flax import nnx

from jaxlp import checkpoint
from jaxlp.models.config import FULL, SLIDING, ModelConfig, from_hf_config
from jaxlp.models.fusion import split_fused
from jaxlp.models.loading import _hf_name

_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
}
_DTYPE_NAMES = {jnp.dtype(jnp.float32): "float32", jnp.dtype(jnp.bfloat16): "bfloat16", jnp.dtype(jnp.float16): "float16"}


def _rope_json(rope) -> dict:
    d = {"rope_type": rope.kind, "rope_theta": float(rope.theta)}
    if rope.kind == "linear":
        d["factor"] = float(rope.factor)
    elif rope.kind == "llama3":
        d.update(factor=float(rope.factor), low_freq_factor=float(rope.low_freq_factor),
                 high_freq_factor=float(rope.high_freq_factor),
                 original_max_position_embeddings=int(rope.original_max_position_embeddings))
    return d


def _clean_float(x: float) -> float | int:
    """``x`` rounded away from float noise (24.000000000000004 -> 24)."""
    r = round(x)
    return int(r) if math.isclose(x, r, rel_tol=1e-9) else float(x)


def hf_config_dict(config: ModelConfig, dtype=jnp.float32) -> dict:
    """transformers ``config.json`` contents for ``config`` (weights stored as ``dtype``).

    Raises ValueError when the family's config cannot express ``config`` exactly.
    """
    c = config
    if c.model_type not in _ARCHITECTURES:
        raise ValueError(
            f"cannot write a config.json for model_type {c.model_type!r} (supported: {sorted(_ARCHITECTURES)})"
        )
    eos = list(c.eos_token_ids)
    d = {
        "architectures": [_ARCHITECTURES[c.model_type]],
        "model_type": c.model_type,
        "vocab_size": c.vocab_size,
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_hidden_layers": c.num_layers,
        "num_attention_heads": c.num_heads,
        "num_key_value_heads": c.num_kv_heads,
        "head_dim": c.head_dim,
        "rms_norm_eps": c.rms_norm_eps,
        "max_position_embeddings": c.max_position_embeddings,
        "tie_word_embeddings": c.tie_word_embeddings,
        "bos_token_id": c.bos_token_id,
        "eos_token_id": eos[0] if len(eos) == 1 else (eos or None),
        "pad_token_id": c.pad_token_id,
        "dtype": _DTYPE_NAMES.get(jnp.dtype(dtype), str(jnp.dtype(dtype))),
        "use_cache": True,
    }
    rope = dict(c.rope)
    sliding = SLIDING in c.layer_types
    if c.model_type == "gemma3_text":
        d.update(
            hidden_activation=c.hidden_act,
            query_pre_attn_scalar=_clean_float(c.query_scale**-2),
            final_logit_softcapping=c.final_logit_softcap,
            attn_logit_softcapping=None,
            layer_types=list(c.layer_types),
            sliding_window=c.sliding_window,
            rope_parameters={t: _rope_json(c.rope_for(t)) for t in (FULL, SLIDING)},
        )
    else:
        d["hidden_act"] = c.hidden_act
        d["rope_parameters"] = _rope_json(rope.get(FULL, next(iter(rope.values()))))
        d["attention_bias"] = c.qkv_bias
        if c.model_type == "llama":
            d["mlp_bias"] = c.mlp_bias
        if c.model_type == "mistral":
            d["sliding_window"] = c.sliding_window
        if c.model_type in ("qwen2", "qwen3"):
            # transformers reads the per-layer pattern from layer_types (and writes these too).
            first = c.layer_types.index(SLIDING) if sliding else c.num_layers
            d.update(use_sliding_window=sliding, sliding_window=c.sliding_window,
                     max_window_layers=first, layer_types=list(c.layer_types))
    back = from_hf_config(d)
    # fused projections are a layout, not in config.json
    diff = _differences(dataclasses.replace(c, fused_projections=False, fused_shards=1), back)
    if diff:
        raise ValueError(f"a {c.model_type} config.json cannot express this model: {', '.join(diff)} would change")
    return d


def _differences(a: ModelConfig, b: ModelConfig) -> list[str]:
    out = []
    for f in dataclasses.fields(ModelConfig):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if isinstance(x, float) and isinstance(y, float):
            same = math.isclose(x, y, rel_tol=1e-9)
        else:
            same = x == y
        if not same:
            out.append(f"{f.name} ({x!r} -> {y!r})")
    return out


def _tensors(model, dtype) -> dict[str, jax.Array]:
    if getattr(model, "quantization", None) is not None:
        raise ValueError("save_pretrained writes high-precision models; use jaxlp.quantization.save_quantized")
    out = {}
    for path, var in nnx.to_flat_state(nnx.state(model)):
        value = var.get_value()
        name = _hf_name(path)
        if not isinstance(value, jax.Array) or not jnp.issubdtype(value.dtype, jnp.floating):
            raise ValueError(f"parameter {name} is not a floating-point array (a quantized layer?)")
        for hf_name, part in split_fused(name, value, model.config).items():
            out[hf_name] = jnp.asarray(part, dtype if dtype is not None else part.dtype)
    return out


def _shards(tensors: dict[str, jax.Array], max_bytes: int | None) -> list[dict[str, jax.Array]]:
    if max_bytes is None:
        return [tensors]
    shards, current, size = [], {}, 0
    for name, t in tensors.items():
        if current and size + t.nbytes > max_bytes:
            shards.append(current)
            current, size = {}, 0
        current[name] = t
        size += t.nbytes
    shards.append(current)
    return shards


def save_pretrained(
    model,
    path: str | Path,
    tokenizer=None,
    *,
    dtype=None,
    max_shard_bytes: int | None = None,
    overwrite: bool = False,
) -> Path:
    """Write ``model`` (a :class:`Transformer`) to the directory ``path`` as an HF checkpoint.

    ``dtype``: storage dtype of the tensors (default: the parameters' own). ``tokenizer``:
    a ``tokenizers.Tokenizer`` (or a transformers fast tokenizer) saved as tokenizer.json,
    or a directory whose tokenizer files are copied. ``max_shard_bytes``: split the weights
    into shards of at most this many bytes (a tensor larger than that gets its own shard).
    An existing non-empty directory needs ``overwrite=True``; its old weight files are removed.

    Complete or absent: the checkpoint is written to a temporary sibling directory (holding
    the old directory's other files when overwriting) and renamed into place, so an error or
    an interrupt leaves ``path`` as it was.
    """
    path = Path(path)
    if max_shard_bytes is not None and max_shard_bytes < 1:
        raise ValueError(f"max_shard_bytes must be >= 1, got {max_shard_bytes}")
    if path.exists() and not path.is_dir():
        raise ValueError(f"{path} exists and is not a directory")
    if path.is_dir() and any(path.iterdir()) and not overwrite:
        raise FileExistsError(f"{path} exists and is not empty (pass overwrite=True)")
    path = path.resolve()
    with checkpoint.replacing_directory(path) as tmp:
        if path.is_dir():  # keep the old directory's other files (its weights are replaced)
            for old in path.iterdir():
                if old.name.endswith(".safetensors") or old.name == "model.safetensors.index.json":
                    continue
                (shutil.copytree if old.is_dir() else shutil.copy2)(old, tmp / old.name)
        _write_pretrained(model, tmp, tokenizer, dtype=dtype, max_shard_bytes=max_shard_bytes)
    return path


def _write_pretrained(model, path: Path, tokenizer, *, dtype, max_shard_bytes) -> None:
    from safetensors.flax import save_file

    config = model.config
    tensors = _tensors(model, dtype)
    if config.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)
    store_dtype = next(iter(tensors.values())).dtype
    hf = hf_config_dict(config, store_dtype)
    (path / "config.json").write_text(json.dumps(hf, indent=2) + "\n")
    gen = {k: hf[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if hf[k] is not None}
    (path / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")

    def write(shard, name):
        save_file(shard, str(path / name), metadata={"format": "pt"})
        (path / name).chmod(0o644)  # safetensors creates files readable by the owner only

    shards = _shards(tensors, max_shard_bytes)
    if len(shards) == 1:
        write(shards[0], "model.safetensors")
    else:
        weight_map = {}
        for i, shard in enumerate(shards):
            name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            write(shard, name)
            weight_map.update({k: name for k in shard})
        index = {"metadata": {"total_size": int(sum(t.nbytes for t in tensors.values()))}, "weight_map": weight_map}
        (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")

    if tokenizer is not None:
        _save_tokenizer(tokenizer, path, config)


def _save_tokenizer(tokenizer, path: Path, config: ModelConfig) -> None:
    if isinstance(tokenizer, (str, Path)):
        src = Path(tokenizer)
        files = [f for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json") if (src / f).is_file()]
        if "tokenizer.json" not in files:
            raise ValueError(f"{src} holds no tokenizer.json")
        for f in files:
            shutil.copyfile(src / f, path / f)
        return
    backend = getattr(tokenizer, "backend_tokenizer", tokenizer)
    if not callable(getattr(backend, "save", None)) or not callable(getattr(backend, "id_to_token", None)):
        raise ValueError(f"expected a tokenizers.Tokenizer or a directory, got {type(tokenizer).__name__}")
    backend.save(str(path / "tokenizer.json"))
    tok_cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": config.max_position_embeddings}
    for key, ident in (("bos_token", config.bos_token_id), ("pad_token", config.pad_token_id),
                       ("eos_token", config.eos_token_ids[0] if config.eos_token_ids else None)):
        token = backend.id_to_token(ident) if ident is not None else None
        if token is not None:
            tok_cfg[key] = token
    (path / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2) + "\n")
