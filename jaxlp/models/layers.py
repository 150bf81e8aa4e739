"""Building blocks: Linear (weight ``[out, in]``), Embedding, RMSNorm, rotary embedding.

Weights keep the Hugging Face layout ``[out_features, in_features]`` = ``[N, K]``: the
reduction axis K is last, which is the axis quantization blocks run along.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxlp.models.config import RopeConfig


def _normal(rngs: nnx.Rngs, shape, dtype, std=0.02):
    return (std * jax.random.normal(rngs.params(), shape, jnp.float32)).astype(dtype)


class Linear(nnx.Module):
    """``y = x @ weight.T + bias`` with ``weight [out_features, in_features]``."""

    def __init__(self, in_features: int, out_features: int, *, bias: bool = False, dtype=jnp.float32, rngs: nnx.Rngs):
        self.in_features, self.out_features = in_features, out_features
        self.weight = nnx.Param(_normal(rngs, (out_features, in_features), dtype))
        self.bias = nnx.Param(jnp.zeros((out_features,), dtype)) if bias else None

    def __call__(self, x: jax.Array) -> jax.Array:
        w = self.weight[...]
        y = jnp.einsum("...k,nk->...n", x.astype(w.dtype), w)
        if self.bias is not None:
            y = y + self.bias[...]
        return y


class Embedding(nnx.Module):
    """Token embedding ``weight [vocab, hidden]``; ``attend`` is the tied output projection."""

    def __init__(self, vocab_size: int, hidden_size: int, *, dtype=jnp.float32, rngs: nnx.Rngs):
        self.weight = nnx.Param(_normal(rngs, (vocab_size, hidden_size), dtype))

    def __call__(self, ids: jax.Array) -> jax.Array:
        return jnp.take(self.weight[...], ids, axis=0)

    def attend(self, x: jax.Array) -> jax.Array:
        return jnp.einsum("...k,vk->...v", x, self.weight[...], preferred_element_type=jnp.float32)


class RMSNorm(nnx.Module):
    """``x / sqrt(mean(x^2) + eps) * g`` in float32, where ``g = w`` or ``1 + w`` (Gemma).

    Rounding follows transformers: Llama-style casts the normalised x to the input dtype
    before the gain; Gemma-style multiplies in float32 and casts last.
    """

    def __init__(self, dim: int, *, eps: float, offset: bool, dtype=jnp.float32):
        self.eps, self.offset = eps, offset
        self.weight = nnx.Param(jnp.zeros((dim,), dtype) if offset else jnp.ones((dim,), dtype))

    def __call__(self, x: jax.Array) -> jax.Array:
        xf = x.astype(jnp.float32)
        normed = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
        w = self.weight[...]
        if self.offset:
            return (normed * (1.0 + w.astype(jnp.float32))).astype(x.dtype)
        return w * normed.astype(x.dtype)


def rope_cos_sin(positions: jax.Array, rope: RopeConfig, head_dim: int, dtype) -> tuple[jax.Array, jax.Array]:
    """cos and sin ``[..., head_dim]`` (halves repeated) for integer ``positions [...]``."""
    inv_freq = jnp.asarray(rope.inv_freq(head_dim).astype(np.float32))
    freqs = positions.astype(jnp.float32)[..., None] * inv_freq
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(emb).astype(dtype), jnp.sin(emb).astype(dtype)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate-half RoPE on ``x [B, S, heads, D]`` with ``cos, sin [B, S, D]``."""
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos[:, :, None, :] + rotated * sin[:, :, None, :]
