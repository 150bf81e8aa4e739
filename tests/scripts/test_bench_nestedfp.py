"""scripts/bench_nestedfp.py on a tiny model (CPU): every variant is timed and written."""

import json

from conftest import load_script


def test_tiny_run_times_every_variant_and_writes_json(tmp_path):
    bench = load_script("bench_nestedfp")
    out = tmp_path / "nestedfp.json"
    rows = bench.main(["--tiny", "--layers", "1", "--batches", "2", "--context", "64", "--n1", "1", "--n2", "2",
                       "--repeats", "1", "--out", str(out)])
    want = [(v, 2) for v in ("fp16", "nestedfp-fp16", "nestedfp-fp8")]
    assert [(r["variant"], r["batch"]) for r in rows] == want
    saved = json.loads(out.read_text())
    assert [(r["variant"], r["batch"]) for r in saved["rows"]] == want
    assert all(r["ms_per_token"] == r["ms_per_token"] and r["context"] == 64 for r in saved["rows"])
