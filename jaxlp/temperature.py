"""Sampling-temperature conventions shared by the sampler reference and the sampling kernels.

A temperature ``T <= GREEDY_TEMPERATURE`` means argmax (greedy). Both implementations scale the
logits by :func:`inverse_temperature`, computed here once so that they are bit-identical.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

GREEDY_TEMPERATURE = 1e-6


def inverse_temperature(temperature: jax.Array) -> jax.Array:
    """``1 / T`` per row, 1 for greedy rows (``T <= GREEDY_TEMPERATURE``)."""
    greedy = temperature <= GREEDY_TEMPERATURE
    return jnp.where(greedy, 1.0, 1.0 / jnp.where(greedy, 1.0, temperature))
