"""Sampler protocol and the plain samplers (greedy, temperature, top-k, top-p, min-p).

A sampler is a registered dataclass pytree: its hyper-parameters (temperature, p, ...)
are array leaves, so sweeping them does not recompile; anything that fixes a shape
(``top_k``) is static. Its per-row state is a pytree made by ``init`` and carried by the
decode loop of :func:`jaxlp.generate`:

    state = sampler.init(batch_size)
    out = sampler.sample(state, logits, key)     # logits: float32 [B, V], raw
    out.tokens, out.temperature, out.state

``logits`` are the raw model logits of the position being decoded; the sampler owns every
transformation (temperature, filtering). A temperature <= ``GREEDY_TEMPERATURE`` means argmax.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

GREEDY_TEMPERATURE = 1e-6


class SampleOutput(NamedTuple):
    tokens: jax.Array  # int32 [B]
    temperature: jax.Array  # float32 [B], the temperature actually used (0 for argmax)
    state: Any  # the sampler's new state
    entropy: jax.Array | None = None  # float32 [B] raw-logit entropy, if the sampler computed it


def token_entropy(logits: jax.Array) -> jax.Array:
    """Shannon entropy in nats of softmax(logits) over the last axis, computed in float32."""
    logits = logits.astype(jnp.float32)
    logp = jax.nn.log_softmax(logits, axis=-1)
    p = jnp.exp(logp)
    return -jnp.sum(jnp.where(p > 0, p * logp, 0.0), axis=-1)


def filter_logits(
    logits: jax.Array,
    *,
    top_k: int | None = None,
    top_p: jax.Array | float | None = None,
    min_p: jax.Array | float | None = None,
) -> jax.Array:
    """Mask (to -inf) the tokens that top-k / top-p / min-p exclude; rows along the last axis.

    top-p keeps the smallest set of most likely tokens whose probability mass reaches ``p``
    (the token that crosses ``p`` is kept, as in transformers). min-p keeps tokens with
    probability >= ``min_p * max_prob``. The most likely token is always kept.
    """
    neg_inf = jnp.asarray(-jnp.inf, logits.dtype)
    if top_k is not None:
        kth = jax.lax.top_k(logits, top_k)[0][..., -1:]
        logits = jnp.where(logits < kth, neg_inf, logits)
    if min_p is not None:
        logp = jax.nn.log_softmax(logits, axis=-1)
        threshold = jnp.max(logp, axis=-1, keepdims=True) + jnp.log(jnp.asarray(min_p, jnp.float32))[..., None]
        logits = jnp.where(logp < threshold, neg_inf, logits)
    if top_p is not None:
        logits = jnp.where(logits < _top_p_threshold(logits, top_p), neg_inf, logits)
    return logits


TOP_P_CANDIDATES = 256


def _top_p_threshold(logits: jax.Array, top_p) -> jax.Array:
    """Smallest logit kept by top-p (``[..., 1]``); ties with it are kept too.

    Fast path: when the ``TOP_P_CANDIDATES`` largest logits of every row already hold mass
    ``>= p``, the nucleus lies among them and ``lax.top_k`` replaces the full sort (the
    common case for the peaked distributions of decoding); otherwise a full sort.
    Probabilities are ``exp(logit - logsumexp(row))`` in both paths.
    """
    p = jnp.asarray(top_p, jnp.float32)[..., None]
    lse = jax.nn.logsumexp(logits, axis=-1, keepdims=True)

    def threshold(sorted_logits):
        probs = jnp.exp(sorted_logits - lse)
        drop = (jnp.cumsum(probs, axis=-1) - probs) >= p
        drop = drop.at[..., 0].set(False)
        return jnp.min(jnp.where(drop, jnp.inf, sorted_logits), axis=-1, keepdims=True)

    k = min(TOP_P_CANDIDATES, logits.shape[-1])
    candidates = jax.lax.top_k(logits, k)[0]
    covered = jnp.all(jnp.sum(jnp.exp(candidates - lse), axis=-1, keepdims=True) >= p)
    if k == logits.shape[-1]:
        return threshold(candidates)
    return jax.lax.cond(covered, lambda: threshold(candidates),
                        lambda: threshold(-jnp.sort(-logits, axis=-1)))


def sample_with_temperature(
    logits: jax.Array,
    temperature: jax.Array,
    key: jax.Array,
    *,
    top_k: int | None = None,
    top_p: jax.Array | float | None = None,
    min_p: jax.Array | float | None = None,
) -> jax.Array:
    """Divide ``logits [B, V]`` by a per-row ``temperature [B]``, filter, sample one token per row.

    Rows whose temperature is <= GREEDY_TEMPERATURE take the argmax of the raw logits.
    """
    logits = logits.astype(jnp.float32)
    temperature = jnp.broadcast_to(jnp.asarray(temperature, jnp.float32), logits.shape[:-1])
    greedy = temperature <= GREEDY_TEMPERATURE
    scaled = logits / jnp.where(greedy, 1.0, temperature)[..., None]
    filtered = filter_logits(scaled, top_k=top_k, top_p=top_p, min_p=min_p)
    # One key per row (folded with the row index) so that a row's draw does not depend on
    # the batch size or on the other rows.
    row_keys = jax.vmap(lambda i: jax.random.fold_in(key, i))(jnp.arange(filtered.shape[0]))
    sampled = jax.vmap(lambda k, row: jax.random.categorical(k, row))(row_keys, filtered)
    return jnp.where(greedy, jnp.argmax(logits, axis=-1), sampled).astype(jnp.int32)


class Sampler:
    """Base class; subclasses are registered dataclasses (see module docstring)."""

    def init(self, batch_size: int) -> Any:
        del batch_size
        return ()

    def sample(self, state: Any, logits: jax.Array, key: jax.Array) -> SampleOutput:
        raise NotImplementedError


def register(cls):
    """Make a sampler dataclass a pytree: fields with metadata static=True are static."""
    cls = dataclasses.dataclass(frozen=True)(cls)
    return jax.tree_util.register_dataclass(cls)


def static_field(**kwargs):
    return dataclasses.field(metadata=dict(static=True), **kwargs)


@register
class Greedy(Sampler):
    """Argmax of the raw logits."""

    def sample(self, state, logits, key):
        del key
        tokens = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        return SampleOutput(tokens, jnp.zeros(tokens.shape, jnp.float32), state)


@register
class Categorical(Sampler):
    """softmax(logits / temperature), optionally restricted by top-k, top-p and min-p.

    ``temperature`` <= 1e-6 means argmax. Filters are applied after the temperature.
    """

    temperature: float = 1.0
    top_p: float | None = None
    min_p: float | None = None
    top_k: int | None = static_field(default=None)

    def sample(self, state, logits, key):
        temperature = jnp.full(logits.shape[:-1], self.temperature, jnp.float32)
        tokens = sample_with_temperature(
            logits, temperature, key, top_k=self.top_k, top_p=self.top_p, min_p=self.min_p
        )
        used = jnp.where(temperature <= GREEDY_TEMPERATURE, 0.0, temperature)
        return SampleOutput(tokens, used, state)
