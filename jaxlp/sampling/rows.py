"""Per-row sampling: each row of a batch with its own sampler settings, seed and step.

The serving engine's slots hold unrelated requests. :class:`RowSettings` carries, per row, the
settings of the samplers a request may ask for (:class:`~jaxlp.sampling.Greedy`,
:class:`~jaxlp.sampling.Categorical` without top-k, :class:`~jaxlp.sampling.ReSETConfig`) as
``[B]`` arrays, and the row's seed; :meth:`RowSampler.row` converts one sampler and seed into one
row. :meth:`RowSampler.sample` draws row ``b``'s token exactly as :func:`jaxlp.generate` draws
it for that request alone (row 0 of a batch of one) with that sampler and seed at the row's own
step: the step key is ``fold_in(key(seed), step)``, the noise that of row 0 of that key
(:mod:`jaxlp.sampling.noise`), ``top_p`` 1 / ``min_p`` 0 keep every token as None does, and a
ReSET row's temperature follows :meth:`ReSETConfig.step` over that row's own state.

Tokens are drawn by the XLA path (:func:`~jaxlp.sampling.base.sample_with_row_keys`); the CUDA
sampling kernels take one step key per call. The entropy of the ReSET rule goes through
``implementation`` (the kernels on a GPU with "auto", as ``generate`` does).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxlp.sampling import noise
from jaxlp.sampling.base import (
    GREEDY_TEMPERATURE,
    Categorical,
    Greedy,
    SampleOutput,
    check_implementation,
    entropy_and_max,
    sample_with_row_keys,
)
from jaxlp.sampling.reset import ReSETConfig, ReSETState


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class RowSettings:
    """Per-row sampler settings; every field has leading dimension B.

    ``temperature`` (0: greedy), ``top_p`` (1: off), ``min_p`` (0: off) as in
    :class:`~jaxlp.sampling.Categorical`; ``entropy_rule`` rows take their temperature from the
    ReSET rule with ``t_low``, ``t_high``, ``tau0`` instead; ``key`` uint32 [B, 2] is the key
    data of ``jax.random.key(seed)``.
    """

    temperature: jax.Array
    top_p: jax.Array
    min_p: jax.Array
    entropy_rule: jax.Array
    t_low: jax.Array
    t_high: jax.Array
    tau0: jax.Array
    key: jax.Array


def seed_key(seed: int) -> np.ndarray:
    """uint32 [2]: the key data of ``jax.random.key(seed)`` (the key :func:`jaxlp.generate` uses)."""
    return np.asarray(jax.random.key_data(jax.random.key(seed)), np.uint32).reshape(2)


@dataclasses.dataclass(frozen=True)
class RowSampler:
    """Samples rows with their own settings (see module doc). Static: the ReSET rule's
    ``window`` and boundary id sets (one tokenizer per engine), and ``implementation`` of the
    entropy ("auto", "xla", "cuda")."""

    window: int = 32
    double_newline_ids: tuple[int, ...] = ()
    newline_ids: tuple[int, ...] = ()
    implementation: str = "auto"

    def __post_init__(self):
        check_implementation(self.implementation)
        object.__setattr__(self, "double_newline_ids", tuple(int(i) for i in self.double_newline_ids))
        object.__setattr__(self, "newline_ids", tuple(int(i) for i in self.newline_ids))

    def _rule(self, settings: RowSettings | None = None) -> ReSETConfig:
        values = (0.0, 1.0, 0.0) if settings is None else (settings.t_low, settings.t_high, settings.tau0)
        return ReSETConfig(t_low=values[0], t_high=values[1], tau0=values[2], window=self.window,
                           double_newline_ids=self.double_newline_ids, newline_ids=self.newline_ids, top_p=None,
                           implementation="xla")

    def init(self, batch_size: int) -> ReSETState:
        """Per-row state (the ReSET state; plain rows carry it unused)."""
        return self._rule().init(batch_size)

    def row(self, sampler: Any, seed: int) -> dict[str, np.ndarray]:
        """One row of :class:`RowSettings` (NumPy scalars, ``key`` [2]) for ``sampler`` and ``seed``.

        Takes Greedy, Categorical without ``top_k`` and ReSETConfig whose window and id sets
        are this sampler's; anything else is a ValueError naming what is not supported."""
        row = dict(temperature=0.0, top_p=1.0, min_p=0.0, entropy_rule=False, t_low=0.0, t_high=1.0, tau0=0.0)
        if isinstance(sampler, Greedy):
            pass
        elif isinstance(sampler, Categorical):
            if sampler.top_k is not None:
                raise ValueError("per-request sampling does not support top_k (it fixes a shape); use top_p or min_p")
            row.update(temperature=float(sampler.temperature),
                       top_p=1.0 if sampler.top_p is None else float(sampler.top_p),
                       min_p=0.0 if sampler.min_p is None else float(sampler.min_p))
        elif type(sampler) is ReSETConfig:
            if sampler.window != self.window:
                raise ValueError(f"ReSET window {sampler.window} differs from the engine's {self.window}")
            if (sampler.double_newline_ids, sampler.newline_ids) != (self.double_newline_ids, self.newline_ids):
                raise ValueError("ReSET boundary ids differ from the engine's (built from another tokenizer?)")
            row.update(entropy_rule=True, t_low=float(sampler.t_low), t_high=float(sampler.t_high),
                       tau0=float(sampler.tau0), top_p=1.0 if sampler.top_p is None else float(sampler.top_p))
        else:
            raise ValueError(f"per-request sampling serves Greedy, Categorical and ReSETConfig, not "
                             f"{type(sampler).__name__}")
        out = {k: np.asarray(v, bool if k == "entropy_rule" else np.float32) for k, v in row.items()}
        out["key"] = seed_key(seed)
        return out

    @staticmethod
    def is_greedy(sampler: Any) -> bool:
        """Whether ``sampler`` (one :meth:`row` takes) always picks the argmax: Greedy, or
        Categorical at a temperature that :func:`sample_with_row_keys` treats as greedy."""
        return isinstance(sampler, Greedy) or (type(sampler) is Categorical and
                                               float(sampler.temperature) <= GREEDY_TEMPERATURE)

    def sample(self, settings: RowSettings, state: ReSETState, logits: jax.Array, steps: jax.Array, *,
               greedy: bool = False) -> SampleOutput:
        """Tokens int32 [B] of rows at their ``steps [B]`` (tokens generated so far), the
        temperature used (0 for argmax), the new state and the raw-logit entropy.

        ``greedy`` (static; the caller knows every row :meth:`is_greedy`): the argmax alone, the
        tokens the full draw gives such rows, without its passes over the logits (entropy,
        nucleus, noise); the ReSET rule is not stepped (no row uses it) and the entropy is NaN."""
        if greedy:
            tokens = jnp.argmax(logits, axis=-1).astype(jnp.int32)
            zeros = jnp.zeros(tokens.shape, jnp.float32)
            return SampleOutput(tokens, zeros, self._rule(settings).record(state, tokens), zeros + jnp.nan)
        entropy, row_max = entropy_and_max(logits, self.implementation)
        rule_temperature, state, _ = self._rule(settings).step(state, entropy)
        temperature = jnp.where(settings.entropy_rule, rule_temperature, settings.temperature)
        keys = jax.vmap(_row_key)(settings.key, steps)
        tokens = sample_with_row_keys(logits, temperature, keys, top_p=settings.top_p, min_p=settings.min_p,
                                      row_max=row_max)
        used = jnp.where(temperature <= GREEDY_TEMPERATURE, 0.0, temperature)
        return SampleOutput(tokens, used, self._rule(settings).record(state, tokens), entropy)


def _row_key(key_data: jax.Array, step: jax.Array) -> jax.Array:
    """uint32 [2]: the noise key pair of row 0 of ``fold_in(key, step)`` (as ``generate``)."""
    words = noise.key_words(jax.random.fold_in(jax.random.wrap_key_data(key_data), step))
    return noise.row_keys(words, 1)[0]
