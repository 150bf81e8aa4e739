"""Calibration of ReSET's global entropy threshold tau0.

tau0 is the 80th percentile of the token entropies of the generated tokens of a few
calibration generations (the paper: 5 NuminaMath-1.5 problems; model-default decoding,
T = 0.6, top-p 0.95). The percentile is NumPy's default (linear interpolation between
order statistics, as ``torch.quantile``).

Which entropy: here, the entropy of softmax of the *raw* logits (T = 1), the quantity the
sampler compares with tau0 at run time (:func:`jaxlp.sampling.base.token_entropy`). The
reference implementation measured calibration entropies on scores already divided by
T = 0.6, which are systematically lower than the raw-logit entropies the sampler thresholds;
its tau0 values (the presets in reset.py, kept as published) therefore select fewer tokens
than the intended top 20%. Measuring both sides the same way keeps "tau0 = top 20% of
entropies" true at run time, so we calibrate on raw logits.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

TAU0_PERCENTILE = 80.0


def calibrate_tau0(entropies, percentile: float = TAU0_PERCENTILE) -> float:
    """tau0 = the ``percentile``-th percentile of ``entropies`` (nats, raw-logit entropies).

    ``entropies`` is an array of any shape, or an iterable of arrays (e.g. one per
    generation, of different lengths); all values are pooled. Pass only generated tokens'
    entropies (no prompt or padding positions).
    """
    if hasattr(entropies, "__array__") or np.isscalar(entropies):  # NumPy / JAX arrays
        pooled = np.asarray(entropies, np.float64).reshape(-1)
    elif isinstance(entropies, Iterable):
        parts = [np.asarray(e, np.float64).reshape(-1) for e in entropies]
        pooled = np.concatenate(parts) if parts else np.zeros((0,), np.float64)
    else:
        pooled = np.asarray(entropies, np.float64).reshape(-1)
    if pooled.size == 0:
        raise ValueError("calibrate_tau0: no entropies given")
    if not np.all(np.isfinite(pooled)):
        raise ValueError("calibrate_tau0: entropies contain NaN or Inf")
    if not 0.0 <= percentile <= 100.0:
        raise ValueError(f"calibrate_tau0: percentile must be in [0, 100], got {percentile!r}")
    return float(np.percentile(pooled, percentile))
