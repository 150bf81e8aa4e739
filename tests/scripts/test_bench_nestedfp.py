"""scripts/bench_nestedfp.py on a tiny model (CPU, fused projections): every variant is timed and written."""

import json

import pytest
from conftest import load_script


def test_tiny_run_times_every_variant_and_writes_json(tmp_path):
    bench = load_script("bench_nestedfp")
    out = tmp_path / "nestedfp.json"
    rows = bench.main(["--tiny", "--layers", "1", "--batches", "2", "--context", "64", "--n1", "1", "--n2", "2",
                       "--repeats", "1", "--prefill", "1x40", "--switch", "--generate", "threshold-fp8",
                       "--fused", "--out", str(out)])
    want = [(v, part, b) for v in ("fp16", "nestedfp-fp16", "nestedfp-fp8") for part, b in (("prefill", 1), ("decode", 2))]
    want += [(f"switch-{p}", "decode", 2) for p in ("fp16", "fp8", "alternate", "call-fp16", "call-fp8")]
    want += [("generate-threshold-fp8", "decode", 2)]
    assert [(r["variant"], r["part"], r["batch"]) for r in rows] == want
    saved = json.loads(out.read_text())
    assert saved["fused_projections"] is True
    assert [(r["variant"], r["part"], r["batch"]) for r in saved["rows"]] == want
    assert all(r["ms"] > 0 for r in saved["rows"] if r["part"] == "prefill")  # one timed call each
    assert all(r["ms"] == r["ms"] and r["x_fp16"] == r["x_fp16"] for r in saved["rows"])  # decode: a difference
    assert [r["context"] for r in saved["rows"]] == [40, 64] * 3 + [64] * 6
    assert [r["programs"] for r in saved["rows"][6:11]] == [1] * 5  # the flags are traced: one program per kind


def test_bad_options_are_refused_before_any_work():
    bench = load_script("bench_nestedfp")
    with pytest.raises(ValueError, match="unknown precision"):
        bench.main(["--tiny", "--layers", "1", "--batches", "1", "--generate", "fp4"])
    with pytest.raises(ValueError, match="--prefill must be BxS"):
        bench.main(["--tiny", "--layers", "1", "--batches", "1", "--prefill", "2048"])
