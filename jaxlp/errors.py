"""Errors jaxlp raises for bad user input, each naming the file or option at fault, and the
checks that raise them.

Every user-facing setting (sampler, generation, quantization, cache, command line) is checked
where it is made, with the helpers below, so that the Python API and the command line refuse
the same value with the same message: the setting, the value and the allowed range, e.g.
``Categorical: top_p must be a number in (0, 1], got 1.5``. ``docs/errors.md`` lists what each
bad input gets.

Samplers are pytrees whose float fields may be tracers (or other placeholders) when a
compiled function rebuilds them, so range checks only look at concrete Python / NumPy
numbers (:func:`is_number`); anything else passes through unchecked.
"""

from __future__ import annotations

import math
import numbers
from typing import Any


class CheckpointFormatError(ValueError):
    """A model directory that is missing files or holds tensors that do not fit the config."""


class UnsupportedConfigError(ValueError):
    """A config.json option that changes the math and that jaxlp does not implement."""


class NonFiniteWeightsError(CheckpointFormatError):
    """A checkpoint tensor holds NaN or Inf values (checked once at load; ``check_finite=False``
    or ``--no-check`` skips the check)."""


class NonFiniteLogitsError(ValueError):
    """The model produced a NaN or Inf logit while generating.

    ``step``: the first decode step (0 = the token right after the prompt) at which a row's
    logits held a non-finite value; ``row``: the first such row (prompt index) at that step.
    """

    def __init__(self, message: str, *, step: int, row: int):
        super().__init__(message)
        self.step = step
        self.row = row


# ----------------------------------------------------------------------------- checks


def is_number(x: Any) -> bool:
    """A concrete Python or NumPy real number (not a bool, not a tracer or an array)."""
    if isinstance(x, bool):
        return False
    return isinstance(x, numbers.Real)  # NumPy registers its scalar types; jax arrays and tracers are not


def _owner(owner: str | None) -> str:
    return f"{owner}: " if owner else ""


def _interval(low, high, low_open: bool, high_open: bool) -> str:
    if high is None:
        return f"> {low:g}" if low_open else f">= {low:g}"
    if low is None:
        return f"< {high:g}" if high_open else f"<= {high:g}"
    return f"in {'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"


def check_number(owner: str | None, name: str, value: Any, *, low: float | None = None, high: float | None = None,
                 low_open: bool = False, high_open: bool = False, optional: bool = False, note: str = "") -> None:
    """Refuse ``value`` unless it is a finite real number in the given range.

    Only concrete numbers are checked (see module docstring); ``None`` passes when
    ``optional``; strings, bools and NaN / Inf are refused. ``note`` is appended to the range
    (e.g. "0 means greedy").
    """
    if value is None and optional:
        return
    bounds = _interval(low, high, low_open, high_open) if (low is not None or high is not None) else ""
    want = f"{name} must be a finite number" + (f" {bounds}" if bounds else "") + (f" ({note})" if note else "")
    if isinstance(value, (str, bytes, bool)) or value is None:
        raise ValueError(f"{_owner(owner)}{want}, got {value!r}")
    if not is_number(value):
        return  # a tracer, an array or another placeholder: checked by whoever made it
    v = float(value)
    ok = math.isfinite(v)
    if ok and low is not None:
        ok = v > low if low_open else v >= low
    if ok and high is not None:
        ok = v < high if high_open else v <= high
    if not ok:
        raise ValueError(f"{_owner(owner)}{want}, got {_show(value)}")


def check_int(owner: str | None, name: str, value: Any, *, low: int | None = 1, high: int | None = None,
              optional: bool = False, note: str = "") -> int | None:
    """Refuse ``value`` unless it is an integer (not a bool) in ``[low, high]``; returns it as an int."""
    if value is None and optional:
        return None
    if low is not None and high is not None:
        bounds = f"in [{low}, {high}]"
    elif low is not None:
        bounds = f">= {low}"
    elif high is not None:
        bounds = f"<= {high}"
    else:
        bounds = ""
    want = f"{name} must be an integer" + (f" {bounds}" if bounds else "") + (f" ({note})" if note else "")
    integral = isinstance(value, numbers.Integral) and not isinstance(value, bool)
    if not integral:
        raise ValueError(f"{_owner(owner)}{want}, got {value!r}")
    v = int(value)
    if (low is not None and v < low) or (high is not None and v > high):
        raise ValueError(f"{_owner(owner)}{want}, got {v}")
    return v


def check_choice(owner: str | None, name: str, value: Any, choices) -> None:
    if value not in choices:
        raise ValueError(f"{_owner(owner)}{name} must be one of {', '.join(map(str, choices))}; got {value!r}")


def _show(value: Any) -> str:
    v = float(value)
    if math.isnan(v):
        return "nan"
    if math.isinf(v):
        return "inf" if v > 0 else "-inf"
    return repr(value) if isinstance(value, (int, float)) else f"{v:g}"


def one_line(message: Any, limit: int = 400) -> str:
    """``message`` (an exception or text) as one line of at most ``limit`` characters."""
    text = " ".join(str(message).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."
