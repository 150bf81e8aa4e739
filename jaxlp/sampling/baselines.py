"""The paper's baseline decoding policies, as samplers comparable with ReSET.

Each entropy policy is a variant of :class:`~jaxlp.sampling.reset.ReSETConfig`: same fields
(``t_low, t_high=1.0, tau0, window=32, double_newline_ids=(), newline_ids=(), top_p=0.95``;
fields a policy does not use are ignored), same state, same per-position order (the step
estimate excludes the current token and is ``H`` itself when it has no token to average),
and each works with :func:`~jaxlp.sampling.reset.reset_temperatures`. Only the step
estimator (Appendix Eq. 4) or the confident-step rule differs:

- :class:`FixedThreshold` (Eq. 1, Table 2): ``T = t_high if H >= tau0 else t_low`` at every
  token; no step awareness.
- :class:`SlidingWindowEstimate` (Table 2 "Sliding Window", Fig. 4b): step-aware threshold
  with the step estimate = mean of the last ``window`` entropies, ignoring step boundaries.
- :class:`WithinStepMeanEstimate` (Fig. 4b "causal"): the mean of the current step's
  entropies; at a step's first token (empty step) the estimate is ``H``, which is the
  paper's inclusive Eq. 4 at ``t = t0`` (so such a token is uncertain iff ``H > Hbar``, and
  then gets ``t_high``).
- :class:`EMAEstimate` (Fig. 4b, Eq. 4, ``alpha = 0.1``): an exponential moving average of
  all previous entropies, ignoring step boundaries (the paper: "ignores the step boundary");
  it starts at the first entropy: ``ema_0 = H_0``, ``ema_t = ema_{t-1} + alpha (H_t - ema_{t-1})``.
- :class:`UniformConfidentLow` (Table 6): ReSET, except every token of a confident step gets
  ``t_low`` (uncertain steps unchanged).

Truncation baselines (Table 5) are plain :class:`~jaxlp.sampling.base.Categorical` samplers:
:func:`truncation_sweep` lists them.
"""

from __future__ import annotations

from typing import ClassVar

import jax
import jax.numpy as jnp

from jaxlp.sampling.base import Categorical, register
from jaxlp.errors import check_number
from jaxlp.sampling.reset import EntropyTemperatureSampler

BASE_TEMPERATURE = 0.6  # the models' default decoding temperature (the NVFP4 baseline)
BASE_TOP_P = 0.95


@register
class FixedThreshold(EntropyTemperatureSampler):
    """Eq. 1: ``T = t_high if H >= tau0 else t_low`` (window and id sets are ignored)."""

    step_estimator: ClassVar[str] = "none"


@register
class SlidingWindowEstimate(EntropyTemperatureSampler):
    """Step-aware threshold with the sliding-window step estimate only (no boundaries)."""

    step_estimator: ClassVar[str] = "window"


@register
class WithinStepMeanEstimate(EntropyTemperatureSampler):
    """Step-aware threshold with the within-step causal mean only (``H`` on a fresh step)."""

    step_estimator: ClassVar[str] = "causal"


@register
class EMAEstimate(EntropyTemperatureSampler):
    """Step-aware threshold with an EMA step estimate (decay ``alpha``, boundaries ignored)."""

    alpha: float = 0.1

    step_estimator: ClassVar[str] = "ema"

    def __post_init__(self):
        super().__post_init__()
        if self.alpha is not None:
            check_number("EMAEstimate", "alpha", self.alpha, low=0.0, high=1.0, low_open=True)

    def _update_ema(self, ema: jax.Array, h: jax.Array, recorded: jax.Array) -> jax.Array:
        alpha = jnp.asarray(self.alpha, jnp.float32)
        return jnp.where(recorded, ema + alpha * (h - ema), h)


@register
class UniformConfidentLow(EntropyTemperatureSampler):
    """Table 6 ablation: ReSET with ``t_low`` for every token of a confident step."""

    confident_rule: ClassVar[str] = "uniform_low"


ENTROPY_BASELINES: dict[str, type[EntropyTemperatureSampler]] = {
    "fixed_threshold": FixedThreshold,
    "sliding_window": SlidingWindowEstimate,
    "within_step_mean": WithinStepMeanEstimate,
    "ema": EMAEstimate,
    "uniform_confident_low": UniformConfidentLow,
}


def truncation_sweep(temperature: float = BASE_TEMPERATURE) -> dict[str, Categorical]:
    """Table 5: top-p in {0.80, 0.85, 0.90, 0.95 (baseline), 0.99, 1.0} without min-p, and
    min-p in {0.01, 0.03, 0.05, 0.10} with top-p 0.95, all at the base temperature.

    The keys are ``"top_p=0.8"``-style names; top-p 1.0 is built as no top-p filter (a float
    cumulative sum can reach 1.0 before the last tokens and would drop them).
    """
    sweep = {}
    for p in (0.80, 0.85, 0.90, 0.95, 0.99, 1.0):
        sweep[f"top_p={p:g}"] = Categorical(temperature=temperature, top_p=None if p == 1.0 else p)
    for m in (0.01, 0.03, 0.05, 0.10):
        sweep[f"top_p={BASE_TOP_P:g},min_p={m:g}"] = Categorical(
            temperature=temperature, top_p=BASE_TOP_P, min_p=m
        )
    return sweep


def base_decoding() -> Categorical:
    """The models' default decoding, the NVFP4 baseline of every table: T = 0.6, top-p 0.95."""
    return Categorical(temperature=BASE_TEMPERATURE, top_p=BASE_TOP_P)


__all__ = [
    "BASE_TEMPERATURE",
    "BASE_TOP_P",
    "EMAEstimate",
    "ENTROPY_BASELINES",
    "FixedThreshold",
    "SlidingWindowEstimate",
    "UniformConfidentLow",
    "WithinStepMeanEstimate",
    "base_decoding",
    "truncation_sweep",
]
