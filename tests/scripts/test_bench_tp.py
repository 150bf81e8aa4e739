"""scripts/bench_tp.py on 4 simulated CPU devices (conftest): TP = 1 and 2 side by side, the token
check against TP = 1, and with ``--profile`` each run's kernel split (no GPU kernels here, but its
fields are there)."""

import json

import jax
import pytest

from conftest import load_script

pytestmark = pytest.mark.skipif(jax.device_count() < 2, reason="needs 2 (simulated) devices")


def test_tiny_run_writes_each_degree_with_its_token_check_and_profile(tmp_path):
    out = tmp_path / "tp.json"
    result = load_script("bench_tp").main(["--tiny", "--layers", "1", "--tp", "1,2", "--formats", "bf16", "--n1", "1",
                                           "--n2", "3", "--repeats", "1", "--profile", "--out", str(out)])
    runs = json.loads(out.read_text())["runs"]
    assert [(r["tp"], r["format"]) for r in runs] == [(1, "bf16"), (2, "bf16")]
    assert runs == result["runs"]
    for r in runs:
        assert (r["equal_token_fraction"] == 1.0) == r["same_tokens_as_tp1"]
        # BF16 weights: each device's partial product of a row-parallel layer is rounded to BF16
        # before the sum (5e-3 here); a wrong shard would be O(1).
        assert r["logits_rel_to_tp1"] <= (0.0 if r["tp"] == 1 else 1e-2)
        assert set(r["step_profile"]) == {"gpu_us_per_token", "launches_per_token", "by_kind_us", "top_kernels_us"}


def test_fused_projections_run_beside_unfused_ones_with_their_own_baseline(tmp_path):
    """``--projections unfused,fused``: every (degree, layout, format), each layout's TP = 2 run
    compared with its own TP = 1 run; the fused layout's rows are regrouped per degree."""
    result = load_script("bench_tp").main(["--tiny", "--layers", "1", "--tp", "1,2", "--formats", "w4a16",
                                           "--projections", "unfused,fused", "--n1", "1", "--n2", "3",
                                           "--repeats", "1"])
    runs = result["runs"]
    assert [(r["tp"], r["projections"], r["format"]) for r in runs] == [
        (t, p, "w4a16") for t in (1, 2) for p in ("unfused", "fused")]
    for r in runs:
        assert r["logits_rel_to_tp1"] <= (0.0 if r["tp"] == 1 else 1e-2), r


def test_host_weights_place_a_copy_per_run_and_give_the_same_logits(tmp_path):
    """--host-weights: the model is built in host memory and each run (TP = 1 on a mesh of one
    device) places its own copy (W4A16 quantized on the host first); TP = 2 gives TP = 1's logits."""
    hosted = load_script("bench_tp").main(["--tiny", "--layers", "1", "--tp", "1,2", "--formats", "bf16,w4a16",
                                           "--projections", "fused", "--n1", "1", "--n2", "2", "--repeats", "1",
                                           "--host-weights"])
    assert hosted["host_weights"] and "Qwen3-8B shape, 1 layers" in hosted["model"]
    assert [(r["tp"], r["format"]) for r in hosted["runs"]] == [(1, "bf16"), (1, "w4a16"), (2, "bf16"), (2, "w4a16")]
    for r in hosted["runs"]:
        assert r["logits_rel_to_tp1"] <= (0.0 if r["tp"] == 1 else 1e-2), r


def test_unknown_projections_are_refused():
    with pytest.raises(SystemExit):
        load_script("bench_tp").main(["--tiny", "--projections", "merged"])


def test_degrees_must_start_at_one():
    with pytest.raises(SystemExit):
        load_script("bench_tp").main(["--tiny", "--tp", "2"])
