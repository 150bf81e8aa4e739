"""scripts/bench_allreduce.py on simulated CPU devices: the chained all-reduces give the mean of
the devices' rows (checked by the script), one row per (dtype, size), and clear errors."""

import json

import jax
import numpy as np
import pytest
from jax.sharding import Mesh

from conftest import load_script

pytestmark = pytest.mark.skipif(jax.local_device_count() < 2, reason="needs 2 (simulated) devices")


def test_rows_per_dtype_and_size(tmp_path):
    out = tmp_path / "ar.json"
    result = load_script("bench_allreduce").main(["--devices", "2", "--sizes", "64,4096", "--dtypes", "bf16,f32",
                                                  "--steps", "1,3", "--repeats", "1", "--out", str(out)])
    assert json.loads(out.read_text())["rows"] == result["rows"]
    assert [(r["dtype"], r["bytes"]) for r in result["rows"]] == [
        ("bfloat16", 64), ("bfloat16", 4096), ("float32", 64), ("float32", 4096)]
    assert all(r["devices"] == 2 and set(r["call_us"]) == {"1", "3"} for r in result["rows"])
    assert "nccl_env" in result and "xla_flags_env" in result


def test_the_chain_sums_over_the_devices():
    """Three chained steps on 2 devices: each step replaces a row by the mean over the devices."""
    bench = load_script("bench_allreduce")
    mesh = Mesh(np.array(jax.local_devices()[:2]), ("tp",))
    x = np.array([[1.0, 2.0], [3.0, 6.0]], np.float32)
    got = np.asarray(bench.chained_allreduce(mesh, 3)(x))
    np.testing.assert_allclose(got, [[2.0, 4.0], [2.0, 4.0]])


@pytest.mark.parametrize("args", [["--devices", "1"], ["--dtypes", "f8"], ["--steps", "5,5"], ["--sizes", "x"]])
def test_bad_arguments(args):
    with pytest.raises(SystemExit):
        load_script("bench_allreduce").main(args)
