"""NestedFP precision chosen per step inside one compiled program.

A NestedFP model holds one copy of the weights and two models: FP16 (exact) and FP8 (the upper
bytes). A layer's mode is static (part of the NNX graph definition), so :func:`variants`
splits a model once into the graph definitions of both modes over the same parameter state,
and :func:`run` calls one of them on a traced boolean (``lax.cond``: both are compiled into the
program, so switching between steps or calls compiles nothing).

Policies say when to use FP8:

- ``"fp16"`` / ``"fp8"``: always that mode (one graph definition, no conditional).
- :class:`LoadThreshold`, the NestedFP reference's rule: FP8 in a step whose scheduled tokens
  exceed ``fraction`` of ``max_tokens`` (``generate``: the rows still running per decode step,
  the prompt tokens for the prefill; ``max_tokens`` defaults to the batch size). Its fields
  are traced: changing them does not recompile.
- :class:`LatencyTarget`, for a loop that times its steps (a server): FP8 once the FP16 mode's
  predicted time per step (its decode step at the current load plus the mean prefill stall)
  misses ``target_ms``, back to FP16 once it is under ``recover`` times it.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from jaxlp.errors import check_choice
from jaxlp.quantization.linear import NESTEDFP_MODES
from jaxlp.quantization.model import quantized_layers

FIXED = NESTEDFP_MODES  # ("fp16", "fp8")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LoadThreshold:
    """FP8 when ``scheduled_tokens > fraction * max_tokens`` (None: the caller's batch size)."""

    fraction: float = 0.5
    max_tokens: int | None = None

    def __post_init__(self):
        if isinstance(self.fraction, (int, float)) and not 0.0 <= float(self.fraction) <= 1.0:
            raise ValueError(f"LoadThreshold: fraction must be in [0, 1], got {self.fraction}")
        if isinstance(self.max_tokens, int) and self.max_tokens < 1:
            raise ValueError(f"LoadThreshold: max_tokens must be >= 1, got {self.max_tokens}")

    def use_fp8(self, scheduled_tokens: jax.Array) -> jax.Array:
        """Traced boolean: whether a step scheduling ``scheduled_tokens`` runs the FP8 model."""
        if self.max_tokens is None:
            raise ValueError("LoadThreshold.max_tokens is unset (generate sets it to the batch size)")
        return jnp.asarray(scheduled_tokens, jnp.float32) > jnp.asarray(self.fraction, jnp.float32) * self.max_tokens


@dataclasses.dataclass
class LatencyTarget:
    """Host-side SLO rule on the time per output token: FP8 once the FP16 mode's predicted time
    per step exceeds ``target_ms``; FP16 again once it is under ``recover * target_ms``.

    The prediction is the FP16 decode step at the current load plus the mean stall per step:
    - the decode step: a decode-only FP16 step's own time; a decode-only FP8 step's time x the
      ratio of the two modes' mean decode-only steps (exponential averages, the newest weighted
      ``smoothing``; ratio 1 before any FP16 step was measured); after a step that waited for a
      prefill (``update(..., prefill=True)``), its mode's mean;
    - the stall: an exponential average, over every step, of how far a step that waited for a
      prefill ran over its mode's mean (0 for decode-only steps). TPOT includes those stalls.
    History (docs/perf.md sessions 32-33): back to FP16 after any FP8 step under 0.6 x target
    alternated the modes call by call; mean step times with the prefill stalls mixed in made the
    ratio swing with whichever mode met the prefills (at 128 requests at once, FP8 in 56 to 153
    of 157 calls from one run to the next)."""

    target_ms: float
    recover: float = 0.9
    smoothing: float = 0.2
    fp8: bool = False
    mean_ms: dict = dataclasses.field(default_factory=dict)  # {"fp16": ms, "fp8": ms}: decode-only steps
    stall_ms: float = 0.0  # prefill stall per step

    def __post_init__(self):
        if not self.target_ms > 0:
            raise ValueError(f"LatencyTarget: target_ms must be > 0, got {self.target_ms}")
        if not 0.0 < self.recover <= 1.0:
            raise ValueError(f"LatencyTarget: recover must be in (0, 1], got {self.recover}")
        if not 0.0 < self.smoothing <= 1.0:
            raise ValueError(f"LatencyTarget: smoothing must be in (0, 1], got {self.smoothing}")

    def reset(self) -> None:
        """Forget the measurements: FP16 next, no averages."""
        self.fp8 = False
        self.mean_ms.clear()
        self.stall_ms = 0.0

    def update(self, step_ms: float, fp8: bool | None = None, *, prefill: bool = False) -> bool:
        """Record a step's time (``fp8``: the mode it ran in; None: the policy's current mode,
        right for a loop that measures each step before choosing the next; ``prefill``: the
        step waited for a prefill); returns whether the next step runs FP8."""
        mode = "fp8" if (self.fp8 if fp8 is None else fp8) else "fp16"
        mean = self.mean_ms.get(mode)
        stall = 0.0
        if not prefill:
            decode = step_ms
            self.mean_ms[mode] = step_ms if mean is None else mean + self.smoothing * (step_ms - mean)
        elif mean is None:  # nothing to tell the stall from the step: the whole time stands
            decode = step_ms
        else:
            decode, stall = mean, max(step_ms - mean, 0.0)
        self.stall_ms += self.smoothing * (stall - self.stall_ms)
        if mode == "fp8" and "fp16" in self.mean_ms:
            decode *= self.mean_ms["fp16"] / self.mean_ms["fp8"]
        predicted = decode + self.stall_ms
        self.fp8 = predicted > self.target_ms if mode == "fp16" else predicted >= self.recover * self.target_ms
        return self.fp8


def check_policy(policy, *, host_side: bool = False) -> None:
    """ValueError unless ``policy`` is None, ``"fp16"``, ``"fp8"``, a :class:`LoadThreshold`, or
    (``host_side``: a loop that times its steps) a :class:`LatencyTarget`."""
    if policy is None or isinstance(policy, LoadThreshold) or (host_side and isinstance(policy, LatencyTarget)):
        return
    if isinstance(policy, str):
        check_choice("precision", "precision", policy, FIXED)
        return
    allowed = "'fp16', 'fp8', a LoadThreshold" + (" or a LatencyTarget" if host_side else "")
    raise ValueError(f"precision must be {allowed}, got {type(policy).__name__}")


def has_nestedfp(model) -> bool:
    return any(layer.format == "nestedfp" for _, layer in quantized_layers(model))


def variants(model) -> tuple[nnx.GraphDef, nnx.GraphDef, nnx.State]:
    """``(graphdef_fp16, graphdef_fp8, state)`` of a NestedFP model: the same state under both
    modes (the model's own modes are restored)."""
    layers = [layer for _, layer in quantized_layers(model) if layer.format == "nestedfp"]
    if not layers:
        raise ValueError("a precision policy needs NestedFP layers (quantize with the 'nestedfp' recipe); "
                         "this model has none")
    modes = [layer.mode for layer in layers]
    try:
        for layer in layers:
            layer.set_mode("fp16")
        graphdef_fp16, state = nnx.split(model)
        for layer in layers:
            layer.set_mode("fp8")
        graphdef_fp8 = nnx.graphdef(model)
    finally:
        for layer, mode in zip(layers, modes):
            layer.set_mode(mode)
    return graphdef_fp16, graphdef_fp8, state


def run(fn: Callable, graphdef_fp16, graphdef_fp8, state, use_fp8: jax.Array):
    """``fn(model)`` with the FP8 model where ``use_fp8`` (a traced boolean), else the FP16 one;
    with ``graphdef_fp8`` None, ``fn`` of ``graphdef_fp16``'s model (no conditional). ``fn``
    returns arrays (pytrees of them) of the same structure either way."""
    if graphdef_fp8 is None:
        return fn(nnx.merge(graphdef_fp16, state))
    return jax.lax.cond(use_fp8, lambda s: fn(nnx.merge(graphdef_fp8, s)),
                        lambda s: fn(nnx.merge(graphdef_fp16, s)), state)
