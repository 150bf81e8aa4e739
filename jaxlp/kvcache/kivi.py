"""KIVI baselines: keys per channel, values per token, a full-precision residual.

Keys: a residual of up to ``R = 128`` FP16 tokens; when it fills, its tokens are quantized
per channel in groups of ``G = 32`` tokens (asymmetric min-max, FP16 scale and min per
group and channel; codes channel-major, ``[D, R * bits / 8]`` per block). Values: the newest
``R = 128`` tokens in FP16; older tokens quantized per token in groups of ``G = 32``
channels (FP16 scale and min per group). Quantization rule: :mod:`jaxlp.kvcache.quant`.

Bit packing is planar (:mod:`jaxlp.kvcache.quant`): plane ``t`` of a key channel's bytes,
``(codes >> t * bits) & (2**bits - 1)``, holds the contiguous tokens ``[t R bits / 8,
(t + 1) R bits / 8)``: with 2 bits, plane ``t`` = tokens ``[32t, 32t + 32)`` = exactly scale
group ``t``; with 4 bits, plane ``t`` = tokens ``[64t, 64t + 64)`` = groups ``2t, 2t + 1``
(byte columns ``[0, 32)`` and ``[32, 64)``). Likewise plane ``u`` of a value token's bytes
holds channels ``[u D bits / 8, (u + 1) D bits / 8)``.

Variants (Kitty's tables): ``kivi-k2v2``, ``kivi-k4v4``; with a sink of the first 32 tokens
in FP16 (keys and values): ``kivi-k2v2*``, ``kivi-k2v4*``, ``kivi-k4v2*``.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar, TYPE_CHECKING

import jax
import jax.numpy as jnp

from jaxlp.kvcache.quant import minmax_dequantize, minmax_quantize, pack_bits, unpack_bits
from jaxlp.kvcache.quantized import Codec, QuantizedCacheFormat

if TYPE_CHECKING:
    from jaxlp.models.config import ModelConfig

GROUP = 32
RESIDUAL = 128


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KeyBlock:
    """``codes`` uint8 ``[..., D, R * bits / 8]`` (channel-major, planar over tokens), FP16
    ``scale, min [..., R / G, D]``."""

    codes: jax.Array
    scale: jax.Array
    min: jax.Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ValueTokens:
    """``codes`` uint8 ``[..., T, D * bits / 8]`` (planar over channels), FP16 ``scale, min [..., T, D / G]``."""

    codes: jax.Array
    scale: jax.Array
    min: jax.Array


def quantize_keys(k: jax.Array, bits: int, group: int = GROUP) -> KeyBlock:
    """Per-channel quantization of ``k [..., T, D]`` in groups of ``group`` tokens."""
    *lead, t, d = k.shape
    if t % group:
        raise ValueError(f"key block of {t} tokens is not a multiple of the group size {group}")
    codes, scale, lo = minmax_quantize(k.reshape(*lead, t // group, group, d), bits, axis=-2)
    codes = jnp.swapaxes(codes.reshape(*lead, t, d), -1, -2)  # [..., D, T]
    return KeyBlock(pack_bits(codes, bits), scale[..., 0, :], lo[..., 0, :])


def dequantize_keys(block: KeyBlock, bits: int) -> jax.Array:
    """``[..., T, D]`` float32."""
    codes = jnp.swapaxes(unpack_bits(block.codes, bits), -1, -2)  # [..., T, D]
    *lead, t, d = codes.shape
    g = block.scale.shape[-2]
    x = minmax_dequantize(codes.reshape(*lead, g, t // g, d), block.scale[..., None, :], block.min[..., None, :])
    return x.reshape(*lead, t, d)


def quantize_values(v: jax.Array, bits: int, group: int = GROUP) -> ValueTokens:
    """Per-token quantization of ``v [..., T, D]`` in groups of ``group`` channels."""
    *lead, t, d = v.shape
    if d % group:
        raise ValueError(f"head_dim {d} is not a multiple of the value group size {group}")
    codes, scale, lo = minmax_quantize(v.reshape(*lead, t, d // group, group), bits, axis=-1)
    return ValueTokens(pack_bits(codes.reshape(*lead, t, d), bits), scale[..., 0], lo[..., 0])


def dequantize_values(tokens: ValueTokens, bits: int) -> jax.Array:
    codes = unpack_bits(tokens.codes, bits)  # [..., T, D]
    *lead, t, d = codes.shape
    g = tokens.scale.shape[-1]
    x = minmax_dequantize(codes.reshape(*lead, t, g, d // g), tokens.scale[..., None], tokens.min[..., None])
    return x.reshape(*lead, t, d)


@dataclasses.dataclass(frozen=True)
class KeyCodec(Codec):
    layout: ClassVar[str] = "kivi_keys"
    bits: int
    group: int = GROUP
    unit: int = RESIDUAL

    def encode(self, x):
        return quantize_keys(x, self.bits, self.group)

    def decode(self, block):
        return dequantize_keys(block, self.bits)


@dataclasses.dataclass(frozen=True)
class ValueCodec(Codec):
    layout: ClassVar[str] = "kivi_values"
    bits: int
    group: int = GROUP
    unit: int = 1

    def encode(self, x):
        return quantize_values(x, self.bits, self.group)

    def decode(self, tokens):
        return dequantize_values(tokens, self.bits)


@dataclasses.dataclass(frozen=True)
class Kivi(QuantizedCacheFormat):
    """KIVI with ``key_bits`` / ``value_bits`` (2 or 4) and an optional FP16 sink.

    The value channel group is ``min(group, head_dim)``; head_dim must be a multiple of it.
    """

    key_bits: int = 2
    value_bits: int = 2
    group: int = GROUP
    residual: int = RESIDUAL
    name: str = "kivi-k2v2"
    sink: int = 0
    dtype: type = jnp.float16

    def __post_init__(self):
        super().__post_init__()
        for what, b in (("key_bits", self.key_bits), ("value_bits", self.value_bits)):
            if b not in (2, 4):
                raise ValueError(f"KIVI {what} must be 2 or 4, got {b}")
        if self.residual % self.group:
            raise ValueError(f"residual {self.residual} must be a multiple of the group size {self.group}")

    def streams(self, config: ModelConfig):
        d = config.head_dim
        vgroup = min(self.group, d)
        if d % vgroup or vgroup * self.value_bits % 8:
            raise ValueError(f"KIVI value groups of {vgroup} channels do not tile head_dim {d}")
        return (KeyCodec(self.key_bits, self.group, self.residual), 0), (ValueCodec(self.value_bits, vgroup), self.residual)
