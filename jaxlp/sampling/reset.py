"""ReSET: reasoning-step entropy-based temperature scaling, as a batched on-device sampler.

Per row, over generated tokens only (prompt tokens are never seen), at every decode position:

1. Step boundary on the tokens already generated: the last token's text contains "\\n\\n"
   (``double_newline_ids``), or the last two tokens are each exactly "\\n" (``newline_ids``).
   A boundary clears the current step only.
2. ``H`` = entropy (nats) of softmax(raw logits), float32, full vocabulary.
3. Step estimate, excluding the current token: if ``len(step) < window`` the mean of the
   last ``window`` entropies ``sw`` (crossing step boundaries; ``H`` when ``sw`` is empty),
   else the mean of ``step``.
4. ``Hbar`` = mean of all generated entropies, or the step estimate when there are none.
5. Uncertain step iff step estimate > ``Hbar`` (strict).
6. Confident: ``T = t_high if H >= tau0 else t_low``;
   uncertain: ``T = t_high if H >= step_estimate else t_low``.
7. Push ``H`` into ``step``, ``sw`` and the running mean.
8. Sample from softmax(logits / T) restricted by top-p (applied after T); ``T <= 1e-6``
   means argmax. No other temperature is applied.

The whole update is a pure function of a per-row state pytree (:class:`ReSETState`), so the
sampler runs under ``jit`` / ``lax.while_loop`` with no host sync, any batch size, rows
independent. :func:`reset_temperatures` replays the same update over a recorded trace.

Numerics: entropies and thresholds are float32. Sums use Kahan compensation, so the running
mean over a 32k-token generation stays at float32 rounding. Means are compared as fractions
by cross-multiplication (``a/b > c/d`` iff ``a*d > c*b``), never through a division, and
means of the same set of tokens are built from the same sums (the window mean *is* the
running mean while at most ``window`` tokens exist; the step sum equals the running sum
while no boundary has occurred). So the exact ties of the algorithm (e.g. every one of the
first ``window`` tokens is in a confident step) resolve exactly on CPU and GPU alike.

The ablation baselines of the paper (fixed threshold, other step estimators, uniform
``t_low``) are subclasses of :class:`EntropyTemperatureSampler`; see ``baselines.py``.
"""

from __future__ import annotations

import dataclasses
import numbers
from typing import Any, ClassVar, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxlp.ffi import sampling as kernels
from jaxlp.errors import is_number
from jaxlp.sampling import noise
from jaxlp.sampling.boundaries import boundary_ids
from jaxlp.sampling.base import (
    GREEDY_TEMPERATURE,
    SampleOutput,
    Sampler,
    check_implementation,
    check_sampler_settings,
    entropy_and_max,
    register,
    sample_with_temperature,
    static_field,
    token_entropy,
    use_kernels,
)

NO_TOKEN = -1  # last_tokens entry before that many tokens were generated


class ReSETState(NamedTuple):
    """Per-row sampler state; every field has leading dimension B."""

    window: jax.Array  # f32 [B, w]: ring buffer of the last w entropies; slot count % w is next
    count: jax.Array  # int32 [B]: entropies recorded = tokens generated so far
    step_sum: jax.Array  # f32 [B]: Kahan sum of the current step's entropies
    step_comp: jax.Array  # f32 [B]: its Kahan compensation
    step_len: jax.Array  # int32 [B]: tokens in the current step
    total_sum: jax.Array  # f32 [B]: Kahan sum of all generated entropies
    total_comp: jax.Array  # f32 [B]: its Kahan compensation
    ema: jax.Array  # f32 [B]: exponential moving average (EMA baseline only; else 0)
    last_tokens: jax.Array  # int32 [B, 2]: [:, 1] last generated token, [:, 0] the one before


class ReSETStats(NamedTuple):
    """What one position's decision was based on (arrays of shape [B], or [T] for a trace)."""

    temperature: jax.Array  # f32: temperature used (0 means argmax)
    entropy: jax.Array  # f32: H of the raw logits
    step_estimate: jax.Array  # f32: step-entropy estimate (excludes the current token)
    running_mean: jax.Array  # f32: Hbar
    uncertain: jax.Array  # bool: step estimate > Hbar


def _kahan_add(total: jax.Array, comp: jax.Array, x: jax.Array) -> tuple[jax.Array, jax.Array]:
    y = x - comp
    t = total + y
    return t, (t - total) - y


# Means are carried as fractions (num, den) and compared by cross-multiplying, so every
# decision uses only correctly rounded float32 products: XLA's float32 division on GPU is not
# correctly rounded, which would break exact ties (e.g. two means of equal value).
Fraction = tuple[jax.Array, jax.Array]


def _select(cond: jax.Array, a: Fraction, b: Fraction) -> Fraction:
    return jnp.where(cond, a[0], b[0]), jnp.where(cond, a[1], b[1])


def _greater(a: Fraction, b: Fraction) -> jax.Array:
    """a > b for positive denominators."""
    return a[0] * b[1] > b[0] * a[1]


def _value(a: Fraction) -> jax.Array:
    return a[0] / a[1]


def _is_member(tokens: jax.Array, ids: tuple[int, ...]) -> jax.Array:
    if not ids:
        return jnp.zeros(tokens.shape, bool)
    return jnp.any(tokens[..., None] == jnp.asarray(ids, jnp.int32), axis=-1)


def _normalize_ids(name: str, ids: Any) -> tuple[int, ...]:
    """A sorted tuple of distinct non-negative ints (hashable, so usable as a static field)."""
    if isinstance(ids, tuple) and all(type(i) is int for i in ids):  # fast path (unflattening)
        if all(0 <= a < b for a, b in zip(ids, ids[1:])) and (not ids or ids[0] >= 0):
            return ids
    try:
        values = list(np.asarray(ids).reshape(-1)) if not isinstance(ids, (str, bytes)) else None
    except (TypeError, ValueError):
        values = None
    if values is None or not all(isinstance(i, (numbers.Integral, np.integer)) for i in values):
        raise ValueError(f"{name} must be a sequence of integer token ids, got {ids!r}")
    if any(i < 0 for i in values):
        raise ValueError(f"{name} must be non-negative token ids, got {ids!r}")
    return tuple(sorted({int(i) for i in values}))


def _is_number(x: Any) -> bool:
    return is_number(x)


@dataclasses.dataclass(frozen=True)
class EntropyTemperatureSampler(Sampler):
    """Entropy-driven two-temperature sampler; the subclass picks the step estimator and rule.

    Fields (float hyper-parameters are pytree leaves, so sweeping them does not recompile;
    ``window`` and the id sets fix shapes and are static):

    - ``t_low``, ``t_high``: the two temperatures, finite and >= 0 (0, or any ``T <= 1e-6``, means argmax).
    - ``tau0``: global entropy threshold (nats, finite, >= 0), required.
    - ``window``: sliding-window length w.
    - ``double_newline_ids``: ids whose text contains "\\n\\n"; ``newline_ids``: ids whose text
      is exactly "\\n" (see :func:`jaxlp.sampling.boundaries.boundary_ids`).
    - ``top_p``: nucleus filter applied after the temperature, in (0, 1] (None: no filter).
    - ``implementation``: "auto", "xla" or "cuda" (:mod:`jaxlp.sampling.base`); static.

    Class attributes chosen by subclasses: ``step_estimator`` in {"hybrid" (ReSET), "window",
    "causal", "ema", "none"} and ``confident_rule`` in {"threshold", "uniform_low"}.
    """

    t_low: float
    t_high: float = 1.0
    tau0: float | None = None
    window: int = static_field(default=32)
    double_newline_ids: tuple[int, ...] = static_field(default=())
    newline_ids: tuple[int, ...] = static_field(default=())
    top_p: float | None = 0.95
    implementation: str = static_field(default="auto")

    step_estimator: ClassVar[str] = "hybrid"
    confident_rule: ClassVar[str] = "threshold"

    def __post_init__(self):
        # Runs on every construction, including pytree unflattening with tracers or other
        # placeholders as leaves: only concrete Python/NumPy numbers are checked.
        name = type(self).__name__
        if type(self) is EntropyTemperatureSampler:
            raise ValueError("EntropyTemperatureSampler is abstract: use ReSETConfig or a baseline")
        if self.tau0 is None and _is_number(self.t_low):
            raise ValueError(f"{name}: tau0 (the global entropy threshold) is required")
        # None stands for a placeholder leaf here (tau0's absence is caught above).
        check_sampler_settings(name, **{f: getattr(self, f) for f in ("t_low", "t_high", "tau0")
                                        if getattr(self, f) is not None})
        check_sampler_settings(name, top_p=self.top_p)
        if not isinstance(self.window, numbers.Integral) or isinstance(self.window, bool) or self.window < 1:
            raise ValueError(f"{name}: window must be an int >= 1, got {self.window!r}")
        object.__setattr__(self, "window", int(self.window))
        for field in ("double_newline_ids", "newline_ids"):
            object.__setattr__(self, field, _normalize_ids(f"{name}.{field}", getattr(self, field)))
        if self.step_estimator not in ("hybrid", "window", "causal", "ema", "none"):
            raise ValueError(f"{name}: unknown step_estimator {self.step_estimator!r}")
        if self.confident_rule not in ("threshold", "uniform_low"):
            raise ValueError(f"{name}: unknown confident_rule {self.confident_rule!r}")
        check_implementation(self.implementation)

    @classmethod
    def from_tokenizer(cls, tokenizer, t_low: float, tau0: float, **kwargs):
        """Build with the step-boundary id sets derived from ``tokenizer`` (see boundaries.py)."""
        ids = boundary_ids(tokenizer)
        return cls(
            t_low=t_low,
            tau0=tau0,
            double_newline_ids=ids.double_newline_ids,
            newline_ids=ids.newline_ids,
            **kwargs,
        )

    def init(self, batch_size: int) -> ReSETState:
        if not isinstance(batch_size, numbers.Integral) or batch_size < 1:
            raise ValueError(f"batch_size must be an int >= 1, got {batch_size!r}")
        zeros = jnp.zeros((batch_size,), jnp.float32)
        count = jnp.zeros((batch_size,), jnp.int32)
        return ReSETState(
            window=jnp.zeros((batch_size, self.window), jnp.float32),
            count=count,
            step_sum=zeros,
            step_comp=zeros,
            step_len=count,
            total_sum=zeros,
            total_comp=zeros,
            ema=zeros,
            last_tokens=jnp.full((batch_size, 2), NO_TOKEN, jnp.int32),
        )

    def _check_state(self, state: ReSETState, batch_size: int | None = None) -> None:
        if not isinstance(state, ReSETState):
            raise ValueError(f"state must be a ReSETState (from init), got {type(state).__name__}")
        if state.window.ndim != 2 or state.window.shape[1] != self.window:
            raise ValueError(
                f"state window buffer has shape {state.window.shape}, expected [B, {self.window}]"
            )
        if batch_size is not None and state.count.shape != (batch_size,):
            raise ValueError(
                f"state is for batch size {state.count.shape[0]}, logits have batch size {batch_size}"
            )

    def is_boundary(self, last_tokens: jax.Array) -> jax.Array:
        """bool [B]: do the generated tokens ``last_tokens [B, 2]`` end a reasoning step?"""
        last, before = last_tokens[..., 1], last_tokens[..., 0]
        pair = _is_member(last, self.newline_ids) & _is_member(before, self.newline_ids)
        return _is_member(last, self.double_newline_ids) | pair

    def step(self, state: ReSETState, entropy: jax.Array) -> tuple[jax.Array, ReSETState, ReSETStats]:
        """Steps 1-7 for one position: temperature f32 [B] (raw, not zeroed), new state, stats.

        ``entropy [B]`` is H of the raw logits of this position. The token sampled here must
        then be passed to :meth:`record`.
        """
        self._check_state(state, entropy.shape[0] if entropy.ndim == 1 else None)
        if entropy.ndim != 1:
            raise ValueError(f"entropy must have shape [B], got {entropy.shape}")
        h = entropy.astype(jnp.float32)
        w = self.window

        # 1. A boundary clears the current step only.
        boundary = self.is_boundary(state.last_tokens)
        step_sum = jnp.where(boundary, 0.0, state.step_sum)
        step_comp = jnp.where(boundary, 0.0, state.step_comp)
        step_len = jnp.where(boundary, 0, state.step_len)

        # 3. Step estimate over tokens before this one, kept as a fraction num / den (den >= 1).
        count = state.count
        recorded = count > 0
        ones = jnp.ones_like(h)
        total = (state.total_sum, jnp.maximum(count, 1).astype(jnp.float32))
        # While count <= w the window holds every generated token: its mean is the running mean.
        window_mean = _select(count <= w, total, (jnp.sum(state.window, axis=-1), jnp.full_like(h, w)))
        step_mean = (step_sum, jnp.maximum(step_len, 1).astype(jnp.float32))
        current = (h, ones)
        if self.step_estimator == "hybrid":
            estimate = _select(step_len < w, _select(recorded, window_mean, current), step_mean)
        elif self.step_estimator == "window":
            estimate = _select(recorded, window_mean, current)
        elif self.step_estimator == "causal":
            estimate = _select(step_len > 0, step_mean, current)
        elif self.step_estimator == "ema":
            estimate = _select(recorded, (state.ema, ones), current)
        else:  # "none": the estimate is Hbar itself, so every step is confident.
            estimate = _select(recorded, total, current)

        # 4-6. Step type and temperature.
        running_mean = _select(recorded, total, estimate)
        uncertain = _greater(estimate, running_mean)
        t_low = jnp.asarray(self.t_low, jnp.float32)
        t_high = jnp.asarray(self.t_high, jnp.float32)
        tau0 = jnp.asarray(self.tau0, jnp.float32)
        if self.confident_rule == "threshold":
            high = jnp.where(uncertain, ~_greater(estimate, current), h >= tau0)
        else:  # "uniform_low": every token of a confident step gets t_low.
            high = uncertain & ~_greater(estimate, current)
        temperature = jnp.broadcast_to(jnp.where(high, t_high, t_low), h.shape)

        # 7. Push H.
        slot = jnp.arange(w, dtype=jnp.int32) == (count % w)[:, None]
        window = jnp.where(slot, h[:, None], state.window)
        step_sum, step_comp = _kahan_add(step_sum, step_comp, h)
        total_sum, total_comp = _kahan_add(state.total_sum, state.total_comp, h)
        ema = self._update_ema(state.ema, h, recorded)
        new_state = ReSETState(
            window=window,
            count=count + 1,
            step_sum=step_sum,
            step_comp=step_comp,
            step_len=step_len + 1,
            total_sum=total_sum,
            total_comp=total_comp,
            ema=ema,
            last_tokens=state.last_tokens,
        )
        used = jnp.where(temperature <= GREEDY_TEMPERATURE, 0.0, temperature)
        stats = ReSETStats(used, h, _value(estimate), _value(running_mean), uncertain)
        return temperature, new_state, stats

    def _update_ema(self, ema: jax.Array, h: jax.Array, recorded: jax.Array) -> jax.Array:
        del h, recorded
        return ema

    def record(self, state: ReSETState, tokens: jax.Array) -> ReSETState:
        """Append the tokens ``[B]`` sampled at this position to the last-two-tokens memory."""
        tokens = jnp.asarray(tokens, jnp.int32)
        last_tokens = jnp.stack([state.last_tokens[:, 1], tokens], axis=-1)
        return state._replace(last_tokens=last_tokens)

    def sample(self, state: ReSETState, logits: jax.Array, key: jax.Array) -> SampleOutput:
        if logits.ndim != 2:
            raise ValueError(f"logits must have shape [B, V], got {logits.shape}")
        self._check_state(state, logits.shape[0])
        if use_kernels(logits.shape[1], self.implementation):
            # One kernel reads the row once: H, and the tokens at t_low and at t_high (same noise);
            # the state update then picks the one of the temperature it chose.
            pair = jnp.stack([jnp.asarray(self.t_low, jnp.float32), jnp.asarray(self.t_high, jnp.float32)])
            both, entropy, _ = kernels.entropy_sample(logits, pair, noise.key_words(key), top_p=self.top_p)
            temperature, state, stats = self.step(state, entropy)
            tokens = jnp.where(temperature == pair[1], both[:, 1], both[:, 0])
        else:
            # One pass gives H and the row max; the max is reused by the top-p stage.
            entropy, row_max = entropy_and_max(logits, self.implementation)
            temperature, state, stats = self.step(state, entropy)
            tokens = sample_with_temperature(logits, temperature, key, top_p=self.top_p, row_max=row_max,
                                             implementation=self.implementation)
        return SampleOutput(tokens, stats.temperature, self.record(state, tokens), stats.entropy)


@register
class ReSETConfig(EntropyTemperatureSampler):
    """The ReSET sampler (hybrid step estimator, step-aware threshold); see module docstring.

    ``ReSETConfig(t_low, t_high=1.0, tau0=..., window=32, double_newline_ids=(),
    newline_ids=(), top_p=0.95)``; ``from_tokenizer`` / ``from_preset`` fill the id sets.
    """

    @classmethod
    def from_preset(cls, model_name: str, tokenizer, **kwargs) -> "ReSETConfig":
        """The paper's (t_low, tau0) for ``model_name`` (see RESET_PRESETS), ids from tokenizer."""
        preset = reset_preset(model_name)
        return cls.from_tokenizer(tokenizer, preset.t_low, preset.tau0, **kwargs)


class ReSETPreset(NamedTuple):
    t_low: float
    tau0: float


# The paper's per-model settings (Table 8 for tau0, T_high = 1.0, w = 32, top-p 0.95).
RESET_PRESETS: dict[str, ReSETPreset] = {
    "Qwen3-8B": ReSETPreset(0.1, 0.5505),
    "Qwen3-14B": ReSETPreset(0.3, 0.4863),
    "Qwen3-32B": ReSETPreset(0.1, 0.5363),
    "DeepSeek-R1-Distill-Qwen-7B": ReSETPreset(0.4, 0.6446),
    "DeepSeek-R1-Distill-Qwen-14B": ReSETPreset(0.3, 0.6488),
}


def reset_preset(model_name: str) -> ReSETPreset:
    """Preset by model name: case-insensitive, an "org/" prefix and a "DeepSeek-" prefix optional."""
    base = model_name.rsplit("/", 1)[-1].lower()
    for name, preset in RESET_PRESETS.items():
        key = name.lower()
        if base == key or (key.startswith("deepseek-") and base == key[len("deepseek-"):]):
            return preset
    raise ValueError(f"no ReSET preset for model {model_name!r}; known: {sorted(RESET_PRESETS)}")


@jax.jit
def _trace(config: EntropyTemperatureSampler, entropies: jax.Array, tokens: jax.Array) -> ReSETStats:
    def body(state, xs):
        h, token = xs
        _, state, stats = config.step(state, h[None])
        state = config.record(state, token[None])
        return state, jax.tree.map(lambda x: x[0], stats)

    _, stats = jax.lax.scan(body, config.init(1), (entropies, tokens))
    return stats


def reset_temperatures_from_entropies(
    entropies: jax.Array,
    tokens: jax.Array,
    config: EntropyTemperatureSampler,
    return_stats: bool = False,
):
    """:func:`reset_temperatures` given the raw-logit entropies ``[T]`` instead of the logits."""
    if not isinstance(config, EntropyTemperatureSampler):
        raise ValueError(f"config must be a ReSETConfig or a baseline of it, got {type(config).__name__}")
    entropies = jnp.asarray(entropies, jnp.float32)
    tokens = jnp.asarray(tokens)
    if entropies.ndim != 1 or tokens.shape != entropies.shape:
        raise ValueError(
            f"entropies and tokens must both have shape [T], got {entropies.shape} and {tokens.shape}"
        )
    if not jnp.issubdtype(tokens.dtype, jnp.integer):
        raise ValueError(f"tokens must be integer ids, got dtype {tokens.dtype}")
    stats = _trace(config, entropies, tokens.astype(jnp.int32))
    return stats if return_stats else stats.temperature


def reset_temperatures(
    logits: jax.Array,
    tokens: jax.Array,
    config: EntropyTemperatureSampler,
    return_stats: bool = False,
):
    """Replay the sampler over one recorded sequence.

    ``logits [T, V]`` are the raw logits of the T generated positions and ``tokens [T]`` the
    tokens sampled there; position t uses the logits at t and the tokens before t. Returns the
    temperatures f32 [T] the sampler uses (0 means argmax), or with ``return_stats`` a
    :class:`ReSETStats` of [T] arrays (temperature, entropy, step_estimate, running_mean,
    uncertain). It scans :meth:`EntropyTemperatureSampler.step`, the sampler's own update.
    """
    logits = jnp.asarray(logits)
    if logits.ndim != 2:
        raise ValueError(f"logits must have shape [T, V], got {logits.shape}")
    return reset_temperatures_from_entropies(token_entropy(logits), tokens, config, return_stats)
