"""jaxlp.evals.harness: timing of a tiny jitted function, run metadata, standard JSON, the plot helper."""

import json
import math
import platform
import sys

import jax
import numpy as np
import jax.numpy as jnp
import pytest

from jaxlp.evals import harness


def test_time_call_of_a_jitted_function():
    f = jax.jit(lambda x: jnp.sin(x) @ x.T)
    x = jnp.ones((64, 64), jnp.float32)
    calls = []
    timing = harness.time_call(lambda x: calls.append(1) or f(x), x, warmup=2, repeats=4, number=3)
    assert len(calls) == 2 + 4 * 3
    assert timing.median_us > 0 and 0 < timing.min_us <= timing.median_us and timing.spread_us >= 0
    assert timing.min_us + timing.spread_us >= timing.median_us and timing.repeats == 4
    assert timing.output.shape == (64, 64)  # the last call's result, ready
    single = harness.time_call(f, x, warmup=0, repeats=1)
    assert single.median_us == single.min_us > 0 and single.spread_us == 0.0
    for bad in (dict(repeats=0), dict(number=0), dict(warmup=-1)):
        with pytest.raises(ValueError, match="time_call needs"):
            harness.time_call(f, x, **bad)


def test_run_metadata_and_json(tmp_path):
    import jaxlib

    meta = harness.run_metadata(["--out", "x.json"])
    device = jax.devices()[0]
    assert meta["device"] == device.device_kind and meta["platform"] == device.platform
    assert meta["jax"] == jax.__version__ and meta["jaxlib"] == jaxlib.__version__
    assert meta["python"] == platform.python_version() and len(meta["date"]) == 10
    assert meta["command"] == f"python {sys.argv[0]} --out x.json"
    assert harness.run_metadata()["command"] == "python " + " ".join(sys.argv)
    path = harness.write_json(tmp_path / "new" / "r.json", {**meta, "rows": [{"us": math.inf, "x": (1.5, math.nan)}]})
    data = json.loads(path.read_text())  # standard JSON: no Infinity / NaN literals
    assert data["rows"] == [{"us": None, "x": [1.5, None]}] and data["device"] == meta["device"]


def test_plot_lines(tmp_path):
    pytest.importorskip("matplotlib")
    path = harness.plot_lines(tmp_path / "p" / "t.png", [1, 8, 32], {"a": [3.0, 2.0, None], "b": [1, 1, 1]},
                              xlabel="M", ylabel="us", logx=True, logy=True)
    assert path.stat().st_size > 1000
    with pytest.raises(ValueError, match="series 'c' has 2 values for 3 x values"):
        harness.plot_lines(tmp_path / "u.png", [1, 2, 3], {"c": [1, 2]}, xlabel="x", ylabel="y")


def test_relative_error_against_float64():
    a, b = np.array([[1.0, 2.0], [3.0, 4.0]], np.float32), np.array([[1.0, 2.0], [3.0, 5.0]], np.float32)
    assert harness.relative_error(a, b) == pytest.approx(1.0 / np.sqrt(39.0), rel=1e-12)
    assert harness.relative_error(b, b) == 0.0
    assert harness.relative_error(np.zeros(3), np.zeros(3)) == 0.0  # 0 / 0: no NaN
