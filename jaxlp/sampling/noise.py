"""Counter-based Gumbel noise, shared bit for bit by the XLA path and the CUDA sampling kernel.

Per step a JAX PRNG key gives two uint32 words ``(w0, w1)`` (:func:`key_words`); row b's key
pair is ``k0 = mix(w0 ^ mix(b * 0x9e3779b9 + 0x7f4a7c15))``, ``k1 = mix(w1 + mix(b ^ 0x85ebca6b))``
(:func:`row_keys`); per token i, with ``mix`` the "lowbias32" integer hash (x ^= x >> 16;
x *= 0x7feb352d; x ^= x >> 15; x *= 0x846ca68b; x ^= x >> 16, all mod 2^32):

    bits = mix(mix(i + k0) ^ k1)
    u    = ((bits >> 9) + 1/2) * 2^-23       exactly representable, in [2^-24, 1 - 2^-24]
    g    = -log(-log(u))                      so g in [-2.8115, 16.6355]

A kernel can generate any token's noise from the two key words alone (no [B, V] array of random
numbers, no per-row key derivation by XLA), and both paths draw the same token from the same
key; a row's draw depends neither on the batch size nor on the other rows.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

MIX_MULTIPLIERS = (0x7FEB352D, 0x846CA68B)
GUMBEL_MIN = float(-np.log(-np.log(np.float64(2.0**-24))))  # -2.8115
GUMBEL_MAX = float(-np.log(-np.log1p(-np.float64(2.0**-24))))  # 16.6355


def mix32(x: jax.Array) -> jax.Array:
    """The lowbias32 hash of uint32 ``x`` (a bijection of 32-bit words)."""
    x = x ^ (x >> 16)
    x = x * jnp.uint32(MIX_MULTIPLIERS[0])
    x = x ^ (x >> 15)
    x = x * jnp.uint32(MIX_MULTIPLIERS[1])
    return x ^ (x >> 16)


ROW_CONSTANTS = (0x9E3779B9, 0x7F4A7C15, 0x85EBCA6B)


def key_words(key: jax.Array) -> jax.Array:
    """uint32 [2]: the two words of a JAX PRNG key (typed or raw uint32); keys of another size
    (e.g. "rbg", 4 words) are folded to two by the hash."""
    data = jax.random.key_data(key) if jnp.issubdtype(key.dtype, jax.dtypes.prng_key) else key
    words = jnp.asarray(data).astype(jnp.uint32).reshape(-1)
    if words.shape[0] == 2:
        return words
    acc = [jnp.uint32(0), jnp.uint32(ROW_CONSTANTS[0])]
    for j in range(words.shape[0]):
        acc[j % 2] = mix32(acc[j % 2] ^ words[j])
    return jnp.stack(acc)


def row_keys(words: jax.Array, rows: int) -> jax.Array:
    """uint32 [rows, 2]: the key pairs of rows 0 .. rows - 1 from the words ``[2]`` of a step key."""
    words = jnp.asarray(words, jnp.uint32)
    b = jnp.arange(rows, dtype=jnp.uint32)
    k0 = mix32(words[0] ^ mix32(b * jnp.uint32(ROW_CONSTANTS[0]) + jnp.uint32(ROW_CONSTANTS[1])))
    k1 = mix32(words[1] + mix32(b ^ jnp.uint32(ROW_CONSTANTS[2])))
    return jnp.stack([k0, k1], axis=-1)


def gumbel(keys: jax.Array, vocab: int) -> jax.Array:
    """float32 [B, vocab] Gumbel noise for the rows of ``keys [B, 2]`` (see the module docstring)."""
    keys = jnp.asarray(keys, jnp.uint32)
    i = jnp.arange(vocab, dtype=jnp.uint32)[None, :]
    bits = mix32(mix32(i + keys[:, :1]) ^ keys[:, 1:])
    u = ((bits >> 9).astype(jnp.float32) + 0.5) * jnp.float32(2.0**-23)
    return -jnp.log(-jnp.log(u))
