"""Model configuration: one frozen dataclass for every supported decoder-only family.

:func:`from_hf_config` reads a Hugging Face ``config.json`` dict (Llama 2/3.x, Mistral,
Qwen2, Qwen3, Gemma 3 text) and fails loudly on options that change the math and are not
implemented, naming them.
"""

from __future__ import annotations

import dataclasses
import json
import math
import numbers
from pathlib import Path
from typing import Any

from jaxlp.errors import UnsupportedConfigError

FULL = "full_attention"
SLIDING = "sliding_attention"


@dataclasses.dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding of one layer type (rotate-half convention, as transformers).

    ``kind``: "default", "linear" (positions / factor) or "llama3" (Llama 3.1 frequency
    smoothing with ``factor``, ``low_freq_factor``, ``high_freq_factor``,
    ``original_max_position_embeddings``).
    """

    theta: float = 10000.0
    kind: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def inv_freq(self, head_dim: int):
        """Inverse frequencies ``[head_dim // 2]`` as float64 NumPy (cast at use)."""
        import numpy as np

        inv = 1.0 / (self.theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
        if self.kind == "linear":
            inv = inv / self.factor
        elif self.kind == "llama3":
            low_wavelen = self.original_max_position_embeddings / self.low_freq_factor
            high_wavelen = self.original_max_position_embeddings / self.high_freq_factor
            wavelen = 2 * math.pi / inv
            scaled = np.where(wavelen > low_wavelen, inv / self.factor, inv)
            smooth = (self.original_max_position_embeddings / wavelen - self.low_freq_factor) / (
                self.high_freq_factor - self.low_freq_factor
            )
            smoothed = (1 - smooth) * scaled / self.factor + smooth * scaled
            medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
            inv = np.where(medium, smoothed, scaled)
        return inv


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Architecture of a decoder-only transformer.

    Attributes that differ between families:
      norm_offset: RMSNorm gain is ``1 + w`` (Gemma) instead of ``w``.
      qk_norm: RMSNorm over head_dim on queries and keys before RoPE (Qwen3, Gemma 3).
      sandwich_norm: extra post-attention / pre- and post-MLP norms (Gemma 3).
      embed_scale: embeddings multiplied by this (Gemma: sqrt(hidden)), or 1.0.
      query_scale: attention scores are ``q . k * query_scale``.
      layer_types: per layer ``"full_attention"`` or ``"sliding_attention"``.
      rope: per layer type, its :class:`RopeConfig` (a tuple of pairs, to stay hashable).

    Layout (not architecture): ``fused_projections`` holds q/k/v as one ``qkv_proj`` and
    gate/up as one ``gate_up_proj`` linear (rows concatenated; see
    :func:`jaxlp.models.fuse_projections`). Hugging Face checkpoints always hold them apart.
    ``fused_shards``: the fused rows are grouped per tensor-parallel device, ``[q_0 k_0 v_0 q_1 k_1
    v_1 ...]`` (``gate_0 up_0 gate_1 up_1 ...``) for that many devices (1: ``[q k v]``), so that
    each device's row shard holds its own heads' q, k, v (MLP columns' gate, up).
    """

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    hidden_act: str = "silu"
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    norm_offset: bool = False
    sandwich_norm: bool = False
    embed_scale: float = 1.0
    query_scale: float | None = None
    tie_word_embeddings: bool = False
    layer_types: tuple[str, ...] = ()
    sliding_window: int | None = None
    rope: tuple[tuple[str, RopeConfig], ...] = ((FULL, RopeConfig()),)
    final_logit_softcap: float | None = None
    attn_logit_softcap: float | None = None
    max_position_embeddings: int = 8192
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int | None = None
    fused_projections: bool = False
    fused_shards: int = 1

    def __post_init__(self):
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads",
                     "head_dim", "max_position_embeddings"):
            value = getattr(self, name)
            if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < 1:
                raise ValueError(f"ModelConfig: {name} must be an integer >= 1, got {value!r}")
        if not self.layer_types:
            object.__setattr__(self, "layer_types", (FULL,) * self.num_layers)
        if self.query_scale is None:
            object.__setattr__(self, "query_scale", self.head_dim**-0.5)
        if len(self.layer_types) != self.num_layers:
            raise ValueError(f"layer_types has {len(self.layer_types)} entries for {self.num_layers} layers")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}")
        if SLIDING in self.layer_types and not self.sliding_window:
            raise ValueError("sliding_attention layers need a sliding_window")
        shards = self.fused_shards
        if not isinstance(shards, numbers.Integral) or isinstance(shards, bool) or shards < 1:
            raise ValueError(f"ModelConfig: fused_shards must be an integer >= 1, got {shards!r}")
        if shards > 1 and not self.fused_projections:
            raise ValueError(f"ModelConfig: fused_shards = {shards} needs fused_projections")
        uneven = self.uneven_for(shards)
        if uneven:
            raise ValueError(f"ModelConfig: fused projections grouped for {shards} devices need {', '.join(uneven)} "
                             f"to divide by {shards}")

    def uneven_for(self, devices: int) -> list[str]:
        """What a per-device split of the fused projections over ``devices`` would cut: the head
        counts and the MLP width that do not divide (``"num_kv_heads 2"``), or nothing."""
        return [f"{name} {getattr(self, name)}" for name in ("num_heads", "num_kv_heads", "intermediate_size")
                if getattr(self, name) % devices]

    def rope_for(self, layer_type: str) -> RopeConfig:
        table = dict(self.rope)
        return table.get(layer_type, table.get(FULL))

    def window_for(self, layer: int) -> int | None:
        return self.sliding_window if self.layer_types[layer] == SLIDING else None

    @property
    def num_params(self) -> int:
        """Parameter count (tied embeddings counted once)."""
        h, d = self.hidden_size, self.head_dim
        attn = h * d * (2 * self.num_heads + 2 * self.num_kv_heads)
        if self.qkv_bias:
            attn += d * (self.num_heads + 2 * self.num_kv_heads)
        if self.o_bias:
            attn += h
        if self.qk_norm:
            attn += 2 * d
        mlp = 3 * h * self.intermediate_size + (2 * self.intermediate_size + h if self.mlp_bias else 0)
        norms = (4 if self.sandwich_norm else 2) * h
        layer = attn + mlp + norms
        embed = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * layer + embed + h

    @classmethod
    def from_json(cls, path: str | Path) -> "ModelConfig":
        return from_hf_config(json.loads(Path(path).read_text()))


# Keys that never change the math (bookkeeping, training-only, tokenizer ids read elsewhere).
_BENIGN_KEYS = {
    "_name_or_path", "architectures", "model_type", "transformers_version", "torch_dtype", "dtype",
    "use_cache", "initializer_range", "attention_dropout", "pretraining_tp", "bos_token_id",
    "eos_token_id", "pad_token_id", "max_position_embeddings", "tie_word_embeddings",
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "rms_norm_eps", "hidden_act", "rope_theta", "rope_scaling",
    "rope_parameters", "layer_types", "sliding_window", "output_attentions", "output_hidden_states",
    "return_dict", "id2label", "label2id", "problem_type", "chunk_size_feed_forward", "is_encoder_decoder",
    "tokenizer_class", "prefix", "sep_token_id", "decoder_start_token_id", "task_specific_params",
    "finetuning_task", "cross_attention_hidden_size", "add_cross_attention", "tie_encoder_decoder",
    "is_decoder", "pruned_heads", "max_window_layers", "use_sliding_window", "attention_bias",
    "mlp_bias", "query_pre_attn_scalar", "final_logit_softcapping", "attn_logit_softcapping",
    "rope_local_base_freq", "sliding_window_pattern", "hidden_activation", "use_bidirectional_attention",
    "cache_implementation", "embedding_dropout", "quantization_config",  # a non-empty one is rejected below
    "resid_pdrop", "torchscript", "use_return_dict", "partial_rotary_factor",
}

_FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma3_text")


def _rope_from(params: dict[str, Any] | None, default_theta: float, where: str) -> RopeConfig:
    params = dict(params or {})
    kind = params.pop("rope_type", params.pop("type", "default"))
    theta = float(params.pop("rope_theta", default_theta))
    if params.pop("partial_rotary_factor", 1.0) != 1.0:
        raise UnsupportedConfigError(f"{where}: partial_rotary_factor != 1 is not supported")
    if kind == "default":
        return RopeConfig(theta=theta)
    if kind == "linear":
        return RopeConfig(theta=theta, kind="linear", factor=float(params["factor"]))
    if kind == "llama3":
        return RopeConfig(
            theta=theta,
            kind="llama3",
            factor=float(params["factor"]),
            low_freq_factor=float(params["low_freq_factor"]),
            high_freq_factor=float(params["high_freq_factor"]),
            original_max_position_embeddings=int(params["original_max_position_embeddings"]),
        )
    raise UnsupportedConfigError(f"{where}: RoPE type {kind!r} is not supported (supported: default, linear, llama3)")


def from_hf_config(cfg: dict[str, Any]) -> ModelConfig:
    """Build a :class:`ModelConfig` from a transformers ``config.json`` dict."""
    cfg = dict(cfg)
    model_type = cfg.get("model_type")
    if model_type == "gemma3":  # a multimodal wrapper: only its text part is supported
        raise UnsupportedConfigError(
            "model_type 'gemma3' (multimodal) is not supported; use a Gemma 3 text checkpoint (model_type 'gemma3_text')"
        )
    if model_type not in _FAMILIES:
        raise UnsupportedConfigError(
            f"unsupported architecture: model_type {model_type!r} (supported: {', '.join(_FAMILIES)})"
        )
    if cfg.get("quantization_config"):
        raise UnsupportedConfigError(
            "config has a quantization_config: pre-quantized HF checkpoints are not loaded; "
            "load the high-precision checkpoint and use jaxlp.quantize_model"
        )
    unknown = sorted(
        k for k in cfg if k not in _BENIGN_KEYS and not k.startswith("_") and not k.endswith("_token_id")
    )
    if unknown:
        raise UnsupportedConfigError(f"{model_type}: unsupported config key(s) {unknown}")

    def need(key):
        if key not in cfg:
            raise ValueError(f"{model_type}: config.json lacks required key {key!r}")
        return cfg[key]

    def as_int(key, value, minimum=1):
        """``value`` of config key ``key`` as an int (integral floats too), >= minimum; else a named error."""
        ok = isinstance(value, int) and not isinstance(value, bool)
        if isinstance(value, float) and value.is_integer():
            value, ok = int(value), True
        if not ok or value < minimum:
            raise ValueError(f"{key} must be an integer >= {minimum}, got {value!r}")
        return value

    def as_float(key, value):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ValueError(f"{key} must be a finite number, got {value!r}")
        return float(value)

    def need_int(key):
        return as_int(key, need(key))

    def get_int(key, default, minimum=1):
        value = cfg.get(key)
        return default if value is None else as_int(key, value, minimum)

    hidden, heads = need_int("hidden_size"), need_int("num_attention_heads")
    num_layers = need_int("num_hidden_layers")
    head_dim = get_int("head_dim", None) or hidden // heads
    gemma = model_type == "gemma3_text"
    act = cfg.get("hidden_activation" if gemma else "hidden_act") or cfg.get("hidden_act", "silu")
    if act not in ("silu", "gelu_pytorch_tanh"):
        raise UnsupportedConfigError(f"{model_type}: activation {act!r} is not supported (silu, gelu_pytorch_tanh)")
    if gemma and cfg.get("attn_logit_softcapping") is not None:
        # transformers' Gemma 3 stores this key but never applies it; real checkpoints set null.
        raise UnsupportedConfigError(
            f"{model_type}: attn_logit_softcapping={cfg['attn_logit_softcapping']} is not supported "
            "(transformers' Gemma 3 ignores it; Gemma 3 checkpoints set it to null)"
        )
    if cfg.get("partial_rotary_factor", 1.0) != 1.0:
        raise UnsupportedConfigError(f"{model_type}: partial_rotary_factor != 1 is not supported")
    if cfg.get("use_bidirectional_attention"):
        raise UnsupportedConfigError(f"{model_type}: use_bidirectional_attention is not supported")

    # Layer types and sliding windows.
    layer_types = cfg.get("layer_types")
    # transformers' Mistral defaults to a 4096 window when config.json names none.
    sliding_window = cfg.get("sliding_window", 4096 if model_type == "mistral" else None)
    if layer_types is None:
        if gemma:
            pattern = get_int("sliding_window_pattern", 6)
            layer_types = [SLIDING if (i + 1) % pattern else FULL for i in range(num_layers)]
        elif model_type in ("qwen2", "qwen3"):
            use_sw = bool(cfg.get("use_sliding_window", False)) and sliding_window
            max_window_layers = get_int("max_window_layers", num_layers, minimum=0)
            layer_types = [SLIDING if use_sw and i >= max_window_layers else FULL for i in range(num_layers)]
        else:  # llama has none; mistral slides on every layer when sliding_window is set
            layer_types = [SLIDING if (model_type == "mistral" and sliding_window) else FULL] * num_layers
    layer_types = tuple(layer_types)
    bad = sorted(set(layer_types) - {FULL, SLIDING})
    if bad:
        raise UnsupportedConfigError(f"{model_type}: layer types {bad} are not supported")
    if SLIDING not in layer_types:
        sliding_window = None

    # RoPE, per layer type.
    for key in ("rope_parameters", "rope_scaling"):
        if cfg.get(key) is not None and not isinstance(cfg[key], dict):
            raise ValueError(f"{key} must be an object (or null), got {cfg[key]!r}")
    rope_params = cfg.get("rope_parameters")
    if rope_params is None and cfg.get("rope_scaling") is not None:
        rope_params = dict(cfg["rope_scaling"])
    if gemma:
        per_type = rope_params if rope_params and set(rope_params) & {FULL, SLIDING} else None
        full = dict((per_type or {}).get(FULL) or (rope_params if not per_type else {}) or {})
        local = dict((per_type or {}).get(SLIDING) or {})
        full.setdefault("rope_theta", cfg.get("rope_theta", 1_000_000.0))
        local.setdefault("rope_theta", cfg.get("rope_local_base_freq", 10_000.0))
        rope = ((FULL, _rope_from(full, 1e6, model_type)), (SLIDING, _rope_from(local, 1e4, model_type)))
    else:
        if rope_params and set(rope_params) & {FULL, SLIDING}:
            rope = tuple(
                (t, _rope_from(rope_params[t], cfg.get("rope_theta", 10000.0), model_type)) for t in sorted(set(layer_types))
            )
        else:
            rope_params = dict(rope_params or {})
            rope_params.setdefault("rope_theta", cfg.get("rope_theta", 10000.0))
            rope = ((FULL, _rope_from(rope_params, 10000.0, model_type)),)

    eos = cfg.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else ((eos,) if eos is not None else ())
    tie_default = gemma  # Gemma ties by default; the others store lm_head unless told
    qkv_bias = bool(cfg.get("attention_bias", model_type == "qwen2"))
    if model_type == "qwen2":
        qkv_bias = True  # Qwen2 always has q/k/v biases (and none on o_proj)
    return ModelConfig(
        model_type=model_type,
        vocab_size=need_int("vocab_size"),
        hidden_size=hidden,
        intermediate_size=need_int("intermediate_size"),
        num_layers=num_layers,
        num_heads=heads,
        num_kv_heads=get_int("num_key_value_heads", heads),
        head_dim=head_dim,
        rms_norm_eps=as_float("rms_norm_eps", cfg.get("rms_norm_eps", 1e-6)),
        hidden_act=act,
        qkv_bias=qkv_bias,
        o_bias=bool(cfg.get("attention_bias", False)) and model_type != "qwen2",
        mlp_bias=bool(cfg.get("mlp_bias", False)),
        qk_norm=model_type in ("qwen3", "gemma3_text"),
        norm_offset=gemma,
        sandwich_norm=gemma,
        embed_scale=math.sqrt(hidden) if gemma else 1.0,
        query_scale=float(cfg.get("query_pre_attn_scalar", 256)) ** -0.5 if gemma else head_dim**-0.5,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", tie_default)),
        layer_types=layer_types,
        sliding_window=as_int("sliding_window", sliding_window) if sliding_window else None,
        rope=rope,
        final_logit_softcap=cfg.get("final_logit_softcapping"),
        attn_logit_softcap=cfg.get("attn_logit_softcapping"),
        max_position_embeddings=get_int("max_position_embeddings", 8192),
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=eos_ids,
        pad_token_id=cfg.get("pad_token_id"),
    )
