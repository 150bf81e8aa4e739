"""scripts/bench_fp8.py: a tiny CPU run of every variant (the times of a CPU are not checked)."""

import json

import pytest

from conftest import load_script


def test_tiny_run_of_every_variant(tmp_path):
    bench = load_script("bench_fp8")
    out, plot = tmp_path / "f.json", tmp_path / "f.png"
    result = bench.main(["--shapes", "64x128,40x256", "--m", "1,5", "--implementation", "xla_native", "--n1", "1",
                         "--n2", "2", "--repeats", "1", "--out", str(out), "--plot", str(plot)])
    rows = result["rows"]
    cpu_variants = [v for v in bench.VARIANTS if v not in bench.GPU_VARIANTS]  # the Pallas ones need a GPU
    assert {(r["n"], r["k"], r["m"], r["variant"]) for r in rows} == {
        (n, k, m, v) for n, k in ((64, 128), (40, 256)) for m in (1, 5) for v in cpu_variants}
    assert all(r["implementation"] == "xla_native" and r["x_fp16"] is not None for r in rows if r["variant"] != "bf16")
    assert json.loads(out.read_text())["rows"] == rows and plot.stat().st_size > 0
    with pytest.raises(SystemExit):
        bench.main(["--variants", "fp4"])
    with pytest.raises(SystemExit):
        bench.main(["--variants", "fp16,w8a8_pallas"])
