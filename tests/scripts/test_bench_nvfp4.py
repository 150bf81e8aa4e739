"""scripts/bench_nvfp4.py: the shape list and the dispatch table it writes."""

import json

import pytest

from conftest import load_script


@pytest.fixture(scope="module")
def bn():
    return load_script("bench_nvfp4")


def test_shape_indices_stay_and_fused_pairs_follow(bn):
    shapes = bn.qwen3_shapes()
    assert shapes[0] == ("Qwen3-8B qkv", 6144, 4096) and shapes[11] == ("Qwen3-32B down", 5120, 25600)
    assert shapes[12:] == [("Qwen3-8B gate_up fused", 24576, 4096), ("Qwen3-14B gate_up fused", 34816, 5120),
                           ("Qwen3-32B gate_up fused", 51200, 5120)]


def test_merged_table_keeps_other_shapes_devices_and_the_note(bn, tmp_path):
    path = tmp_path / "t.json"
    a = {"n": 1, "k": 16, "name": "a", "w4a16": [[1, "xla"]]}
    b = {"n": 2, "k": 16, "name": "b", "w4a16": [[1, "xla"]]}
    bn.write_table(path, "GPU X", "2026-01-01", [a, b], merge=False)
    first = json.loads(path.read_text())
    path.write_text(json.dumps(dict(first, note=first["note"] + " Provenance of entry a.",
                                    devices=dict(first["devices"], **{"GPU Y": {"date": "d", "shapes": [a]}}))))
    b2 = dict(b, w4a16=[[1, {"rows_per_warp": 1, "k_split": 8}]])
    bn.write_table(path, "GPU X", "2026-01-02", [b2], merge=True)
    table = json.loads(path.read_text())
    assert table["note"].endswith("Provenance of entry a.")
    assert table["devices"]["GPU X"]["shapes"] == [a, b2] and table["devices"]["GPU Y"]["shapes"] == [a]
    bn.write_table(path, "GPU X", "2026-01-03", [a], merge=False)  # a fresh table: the standard note
    assert not json.loads(path.read_text())["note"].endswith("entry a.")
