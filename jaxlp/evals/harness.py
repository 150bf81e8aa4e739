"""The benchmark harness: wall-clock timing, run metadata, JSON results, a plot helper and the
relative error that benchmark checks report.

``time_call`` runs ``fn(*args)`` ``warmup`` times (compilation, caches), then ``repeats`` times
``number`` back-to-back calls, waiting for the last result (``jax.block_until_ready``) before
stopping the clock; a repeat's time per call is its elapsed time / ``number``. The result holds
the median, the minimum and the spread (max - min) of those per-call times, in microseconds.
"""

from __future__ import annotations

import datetime
import json
import math
import platform
import sys
import time
from pathlib import Path
from typing import Any, Callable, Mapping, NamedTuple, Sequence

import jax
import numpy as np


class Timing(NamedTuple):
    """Per-call wall time over ``repeats`` repeats, in microseconds."""

    median_us: float
    min_us: float
    spread_us: float  # max - min over the repeats
    repeats: int
    output: Any = None  # the result of the last call (ready), so reading it needs no extra call


def time_call(fn: Callable, *args, warmup: int = 1, repeats: int = 5, number: int = 1) -> Timing:
    """Time ``fn(*args)``: ``warmup`` untimed calls, then ``repeats`` x ``number`` timed calls.

    Each repeat dispatches ``number`` calls back to back and blocks on the last result; its
    time per call is the elapsed wall time / ``number``.
    """
    if warmup < 0 or repeats < 1 or number < 1:
        raise ValueError(f"time_call needs warmup >= 0, repeats >= 1 and number >= 1; got warmup={warmup}, "
                         f"repeats={repeats}, number={number}")
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    times, out = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(number):
            out = fn(*args)
        jax.block_until_ready(out)
        times.append((time.perf_counter() - start) / number)
    us = np.asarray(times) * 1e6
    return Timing(float(np.median(us)), float(us.min()), float(us.max() - us.min()), repeats, out)


def relative_error(a, b) -> float:
    """``||a - b|| / ||b||`` in float64 (Frobenius norms; 0 / 0 counts as 0)."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def command_line(argv: Sequence[str] | None = None) -> str:
    """``python <script> <arguments>``: the process's own arguments, or ``argv`` when given."""
    return "python " + " ".join([sys.argv[0]] + list(sys.argv[1:] if argv is None else argv))


def run_metadata(argv: Sequence[str] | None = None) -> dict:
    """What identifies a benchmark run: device kind and platform, jax, jaxlib and Python
    versions, the date (ISO, local) and the command line."""
    import jaxlib

    device = jax.devices()[0]
    return {"device": getattr(device, "device_kind", str(device)), "platform": device.platform,
            "jax": jax.__version__, "jaxlib": jaxlib.__version__, "python": platform.python_version(),
            "date": datetime.date.today().isoformat(), "command": command_line(argv)}


def finite_json(obj):
    """``obj`` with every non-finite float (a value not measured) as None, so that the JSON is standard."""
    if isinstance(obj, Mapping):
        return {k: finite_json(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [finite_json(v) for v in obj]
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    return obj


def write_json(path: str | Path, result: Mapping, indent: int | None = 1) -> Path:
    """Write ``result`` as standard JSON (non-finite floats as null), creating the parent directory."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(finite_json(result), indent=indent))
    return path


def pyplot():
    """``matplotlib.pyplot`` on the file-only Agg backend (matplotlib is imported here, on first use)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_lines(path: str | Path, x: Sequence[float], series: Mapping[str, Sequence[float | None]], *,
               xlabel: str, ylabel: str, title: str = "", logx: bool = False, logy: bool = False) -> Path:
    """One line per entry of ``series`` (None: no point) against ``x``, saved as PNG at ``path``."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for label, ys in series.items():
        if len(ys) != len(x):
            raise ValueError(f"series {label!r} has {len(ys)} values for {len(x)} x values")
        ax.plot(x, [np.nan if y is None else y for y in ys], marker="o", ms=3, label=label)
    ax.set(xlabel=xlabel, ylabel=ylabel, title=title, xscale="log" if logx else "linear",
           yscale="log" if logy else "linear")
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
