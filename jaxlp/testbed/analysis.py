"""Pure NumPy helpers for the entropy analysis of reasoning traces (ReSET Figures 2, 3 and 8).

- Token classes, from a token's decoded text (``classify_token``, ``class_table``):
  ``"testbed"`` scheme (the character tokenizer of :mod:`jaxlp.testbed`): ``digit`` (0-9),
  ``operator`` (``+ - * =``), ``letter`` (the carry marker ``c``, ``Answer``, ``Q``),
  ``boundary`` (``"\\n"`` and special tokens such as ``<eos>``), ``format`` (anything else:
  space, ``:``, parentheses). ``"text"`` scheme (any tokenizer), on the text with surrounding
  whitespace stripped: ``number`` (digits, optionally one ``.``/``,`` between digits),
  ``operator`` (one or two characters of ``+-*/=<>^%``; longer runs such as ``----`` rules
  are punctuation), ``punctuation`` (no letter or digit),
  ``word`` (letters only), ``whitespace`` (nothing left after stripping), ``other`` (mixed,
  e.g. ``x2``, ``__init``, ``'s``). The "symbolic" classes (locally constrained decisions in
  the paper's sense) are digits/numbers and operators.
- Reasoning steps (``step_starts``, ``step_index``, ``step_statistics``): ReSET's boundary
  rule on a token sequence treated as generated text: a new step starts at position ``t``
  when token ``t-1`` contains "\\n\\n" or tokens ``t-2`` and ``t-1`` are each exactly "\\n".
  The step entropy is the mean token entropy of the step (the paper's offline
  ``H_step``); a step is *uncertain* when its entropy is strictly above the running mean
  of all token entropies up to the end of that step (so the first step is always confident,
  as in the online sampler).
- Entropy bins (``log_bin_edges``, ``bin_index``, ``bin_labels``): log-spaced edges
  ``e_0 < ... < e_{n-1}``; bin 0 is ``[0, e_0)`` (zero entropies included), bin ``i`` is
  ``[e_{i-1}, e_i)``, bin ``n`` is ``[e_{n-1}, inf)``.
- ``group_summary``: count, mean and quantiles of values per group (NaN for empty groups).
- ``checkpoint_spec``: the :class:`ProblemSpec` a reasoner checkpoint was trained on.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import NamedTuple

import numpy as np

from jaxlp.testbed.problems import ProblemSpec

TESTBED_CLASSES = ("digit", "operator", "letter", "boundary", "format")
TEXT_CLASSES = ("number", "operator", "punctuation", "word", "whitespace", "other")
SCHEMES = {"testbed": TESTBED_CLASSES, "text": TEXT_CLASSES}
SYMBOLIC_CLASSES = {"testbed": ("digit", "operator"), "text": ("number", "operator")}

TESTBED_OPERATORS = frozenset("+-*=")
TEXT_OPERATORS = frozenset("+-*/=<>^%")
_NUMBER = re.compile(r"^[0-9]+(?:[.,][0-9]+)?$")
_SPECIAL = re.compile(r"^<[^<>\s]+>$")  # <eos>, <bos>, <pad>, <unk>, <end_of_turn>, ...


def classify_token(text: str, scheme: str) -> str:
    """The class name of one token, given its decoded text (see the module docstring)."""
    if not isinstance(text, str):
        raise ValueError(f"token text must be a str, got {type(text).__name__}")
    if scheme == "testbed":
        if text == "\n" or _SPECIAL.match(text):
            return "boundary"
        if len(text) == 1 and text.isdigit():
            return "digit"
        if text in TESTBED_OPERATORS:
            return "operator"
        if text.isalpha():
            return "letter"
        return "format"
    if scheme == "text":
        s = text.strip()
        if not s:
            return "whitespace"
        if _NUMBER.match(s):
            return "number"
        if len(s) <= 2 and all(c in TEXT_OPERATORS for c in s):
            return "operator"
        if not any(c.isalnum() for c in s):
            return "punctuation"
        if s.isalpha():
            return "word"
        return "other"
    raise ValueError(f"unknown token class scheme {scheme!r}; known: {sorted(SCHEMES)}")


def class_table(texts: dict[int, str], scheme: str) -> dict[int, int]:
    """``{token id: class index into SCHEMES[scheme]}`` for every id of ``texts`` (id -> decoded text)."""
    if scheme not in SCHEMES:
        raise ValueError(f"unknown token class scheme {scheme!r}; known: {sorted(SCHEMES)}")
    names = SCHEMES[scheme]
    return {int(i): names.index(classify_token(t, scheme)) for i, t in texts.items()}


def _token_array(tokens) -> np.ndarray:
    tokens = np.asarray(tokens)
    if tokens.ndim != 1:
        raise ValueError(f"tokens must have shape [T], got {tokens.shape}")
    if tokens.size and not np.issubdtype(tokens.dtype, np.integer):
        raise ValueError(f"tokens must be integer ids, got dtype {tokens.dtype}")
    return tokens.astype(np.int64)


def step_starts(tokens, double_newline_ids=(), newline_ids=()) -> np.ndarray:
    """bool ``[T]``: True where a reasoning step starts (position 0 always, then ReSET's rule).

    ``double_newline_ids``: ids whose text contains "\\n\\n"; ``newline_ids``: ids whose text
    is exactly "\\n" (:func:`jaxlp.sampling.boundary_ids` gives both).
    """
    tokens = _token_array(tokens)
    starts = np.zeros(tokens.shape, bool)
    if tokens.size == 0:
        return starts
    double = np.isin(tokens, np.asarray(list(double_newline_ids), np.int64))
    single = np.isin(tokens, np.asarray(list(newline_ids), np.int64))
    starts[0] = True
    starts[1:] |= double[:-1]
    starts[2:] |= single[:-2] & single[1:-1]
    return starts


def step_index(starts) -> np.ndarray:
    """int ``[T]``: the step number (0, 1, ...) of each position, from :func:`step_starts`."""
    starts = np.asarray(starts)
    if starts.ndim != 1 or starts.dtype != bool:
        raise ValueError(f"starts must be a bool array of shape [T], got {starts.dtype} {starts.shape}")
    if starts.size and not starts[0]:
        raise ValueError("starts[0] must be True (the first position opens the first step)")
    return np.cumsum(starts) - 1


class StepStatistics(NamedTuple):
    """Per step (arrays of shape [K]): mean entropy, token count, running mean, uncertainty."""

    mean: np.ndarray  # float64: mean token entropy of the step (H_step)
    length: np.ndarray  # int64: tokens in the step
    running_mean: np.ndarray  # float64: mean of all token entropies from position 0 to the step's end
    uncertain: np.ndarray  # bool: mean > running_mean (strict)


def step_statistics(values, steps) -> StepStatistics:
    """Step entropies of one sequence: ``values [T]`` token entropies, ``steps [T]`` from :func:`step_index`."""
    values = np.asarray(values, np.float64)
    steps = np.asarray(steps)
    if values.ndim != 1 or steps.shape != values.shape:
        raise ValueError(f"values and steps must both have shape [T], got {values.shape} and {steps.shape}")
    if not np.isfinite(values).all():
        raise ValueError("values must be finite")
    if values.size == 0:
        empty = np.zeros(0)
        return StepStatistics(empty, np.zeros(0, np.int64), empty, np.zeros(0, bool))
    if steps[0] != 0 or np.any(np.diff(steps) < 0) or np.any(np.diff(steps) > 1):
        raise ValueError("steps must start at 0 and increase by 0 or 1 between positions")
    length = np.bincount(steps).astype(np.int64)
    total = np.bincount(steps, weights=values)
    mean = total / length
    running = np.cumsum(total) / np.cumsum(length)
    return StepStatistics(mean, length, running, mean > running)


def log_bin_edges(lo: float = 1e-4, hi: float = 10.0, per_decade: int = 2) -> np.ndarray:
    """Edges ``lo * 10**(i / per_decade)``, ``i = 0..n``, with ``n`` the fewest reaching ``hi``."""
    if not (0 < lo < hi and np.isfinite(hi)):
        raise ValueError(f"need 0 < lo < hi < inf, got lo={lo}, hi={hi}")
    if not isinstance(per_decade, int) or per_decade < 1:
        raise ValueError(f"per_decade must be an int >= 1, got {per_decade!r}")
    n = int(np.ceil(round(np.log10(hi / lo) * per_decade, 9)))
    return lo * 10.0 ** (np.arange(n + 1) / per_decade)


def bin_index(values, edges) -> np.ndarray:
    """int ``[...]``: bin of each value; 0 below ``edges[0]``, ``len(edges)`` at or above ``edges[-1]``."""
    values = np.asarray(values, np.float64)
    edges = np.asarray(edges, np.float64)
    if edges.ndim != 1 or edges.size < 1 or np.any(np.diff(edges) <= 0) or not np.isfinite(edges).all():
        raise ValueError("edges must be a non-empty, finite, strictly increasing 1-D array")
    if np.isnan(values).any():
        raise ValueError("values contain NaN")
    return np.searchsorted(edges, values, side="right")


def bin_labels(edges) -> list[str]:
    """Human-readable names of the ``len(edges) + 1`` bins of :func:`bin_index`."""
    e = [f"{x:.2g}" for x in np.asarray(edges, np.float64)]
    return [f"<{e[0]}"] + [f"[{a},{b})" for a, b in zip(e, e[1:])] + [f">={e[-1]}"]


def group_summary(values, groups, num_groups: int, quantiles=(0.1, 0.5, 0.9)) -> dict[str, np.ndarray]:
    """Per group ``g in [0, num_groups)``: ``count``, ``mean`` and ``q{100*q:g}`` of ``values``.

    Means and quantiles of empty groups are NaN. Quantiles use NumPy's default (linear) rule.
    """
    values = np.asarray(values, np.float64)
    groups = np.asarray(groups)
    if values.shape != groups.shape:
        raise ValueError(f"values and groups must have the same shape, got {values.shape} and {groups.shape}")
    if groups.size and (groups.min() < 0 or groups.max() >= num_groups):
        raise ValueError(f"groups must lie in [0, {num_groups}), got [{groups.min()}, {groups.max()}]")
    values, groups = values.reshape(-1), groups.reshape(-1).astype(np.int64)
    count = np.bincount(groups, minlength=num_groups).astype(np.int64)
    with np.errstate(invalid="ignore", divide="ignore"):
        mean = np.bincount(groups, weights=values, minlength=num_groups) / count
    out = {"count": count, "mean": np.where(count > 0, mean, np.nan)}
    order = np.argsort(groups, kind="stable")
    sorted_values, bounds = values[order], np.concatenate([[0], np.cumsum(count)])
    for q in quantiles:
        out[f"q{100 * q:g}"] = np.array([
            np.quantile(sorted_values[bounds[g]:bounds[g + 1]], q) if count[g] else np.nan for g in range(num_groups)
        ])
    return out


def checkpoint_spec(model_dir) -> ProblemSpec:
    """The ``spec`` recorded in ``model_dir/training_log.json`` (as ``scripts/train_reasoner.py``
    writes it), or the default :class:`ProblemSpec` when the directory has no training log."""
    log = Path(model_dir) / "training_log.json"
    if not log.is_file():
        return ProblemSpec()
    spec = json.loads(log.read_text()).get("spec")
    if not isinstance(spec, dict):
        raise ValueError(f"{log} has no 'spec' object")
    return ProblemSpec(**spec)
