"""scripts/bench_serving.py: the workload (arrival times, lengths) and a tiny CPU sweep of two KV
cache formats x two rates at a fixed cache memory (JSON, plot, no compilation after warm-up)."""

import json
import math

import numpy as np
import pytest

from conftest import load_script


@pytest.fixture(scope="module")
def bs():
    return load_script("bench_serving")


def test_arrivals_and_lengths(bs):
    assert not bs.arrival_times(5, math.inf, 1.0, 0).any()
    t = bs.arrival_times(4000, 8.0, 1.0, 0)
    assert t[0] == 0 and np.all(np.diff(t) >= 0)
    assert np.mean(np.diff(t)) == pytest.approx(1 / 8, rel=0.08)  # Poisson at 8 req/s
    assert np.array_equal(t, bs.arrival_times(4000, 8.0, 1.0, 0))  # the same schedule for every configuration
    assert bs.parse_len("100", 0.25) == (75, 125) and bs.parse_len("100", 0.0) == (100, 100)
    assert bs.parse_len("3:9", 0.5) == (3, 9)
    with pytest.raises(SystemExit, match="bad length"):
        bs.parse_len("9:3", 0.0)
    reqs = bs.make_requests(50, (3, 9), (4, 4), 100, seed=7)
    assert all(3 <= len(r["prompt"]) <= 9 and r["max_tokens"] == 4 for r in reqs)
    assert [r["seed"] for r in reqs] == list(range(7, 57))
    assert bs.rate_label(math.inf) == "inf" and bs.rate_label(2.0) == 2.0


def test_tiny_sweep(bs, tmp_path):
    out = tmp_path / "serving.json"
    result = bs.main(["--tiny", "--kv-caches", "bf16,kitty-pro", "--rates", "8,inf", "--cache-gib", "0.0001",
                      "--max-slots", "4", "--out", str(out)])
    saved = json.loads(out.read_text())
    assert saved["runs"] == json.loads(json.dumps(result["runs"]))  # inf is stored as the string "inf"
    runs = {(r["kv_cache"], r["rate"]): r for r in saved["runs"]}
    assert set(runs) == {(c, rate) for c in ("bf16", "kitty-pro") for rate in (8.0, "inf")}
    for key, r in runs.items():
        assert "error" not in r, (key, r.get("error"))
        assert r["completed"] == r["num_requests"] == 6 and r["finish_reasons"] == {"length": 6}
        assert r["output_tokens"] == r["generated_tokens_counted"] == 6 * 8  # EOS ignored: every token generated
        assert r["output_tokens_per_s"] > 0 and r["requests_per_s"] > 0 and r["duration_s"] > 0
        assert r["compilations_after_warmup"] == 0
        assert 1 <= r["slots"] <= 4 and 0 < r["cache_bytes"] <= 0.0001 * 2**30
        assert 1 <= r["running_max"] <= r["slots"]
        for metric in ("ttft", "tpot", "itl"):
            p50, p99 = r[f"{metric}_p50_ms"], r[f"{metric}_p99_ms"]
            assert p50 is not None and math.isfinite(p50) and p50 > 0, (key, metric, p50)
            assert p99 >= p50, (key, metric)
        assert r["step_mean_ms"] > 0 and r["decode_calls"] > 0
    # All at t=0 fills every slot; at 8 req/s the tiny model is idle between arrivals.
    assert runs[("bf16", "inf")]["running_max"] == runs[("bf16", "inf")]["slots"]
    assert runs[("bf16", 8.0)]["duration_s"] > runs[("bf16", "inf")]["duration_s"]
    # Saturated throughput: only the steps with every slot busy (6 requests of 8 tokens on fewer
    # slots: the first wave fills them all); at most the run's own time and tokens.
    full = runs[("bf16", "inf")]
    assert full["slots"] < 6 and 0 < full["saturated_s"] < full["duration_s"]
    assert full["saturated_tokens_per_s"] > 0
    assert full["saturated_tokens_per_s"] * full["saturated_s"] <= full["output_tokens"]
    assert (tmp_path / "serving.png").is_file() and saved["plot"] == str(tmp_path / "serving.png")


def test_generate_baseline_row(bs, tmp_path):
    """``--generate-baseline``: a row per engine with jaxlp.generate's decode step at the engine's
    slot count and the engine's own step against it."""
    out = tmp_path / "serving.json"
    result = bs.main(["--tiny", "--kv-caches", "bf16", "--rates", "inf", "--slots", "3", "--generate-baseline",
                      "--out", str(out)])
    rows = [r for r in result["runs"] if r["rate"] == "generate"]
    assert len(rows) == 1
    row, run = rows[0], [r for r in result["runs"] if r["rate"] == "inf"][0]
    assert row["slots"] == run["slots"] == 3 and row["generate_steps"] == [1, 8]
    # The tiny model's steps drown in the CPU's timing noise (the difference may even be negative):
    # the plumbing is what is checked here, the GPU runs give the numbers.
    assert math.isfinite(row["generate_step_ms"]) and row["engine_step_ms"] == run["step_mean_ms"]
    assert row["engine_over_generate"] == row["engine_step_ms"] / row["generate_step_ms"]
    assert json.loads(out.read_text())["runs"][-1]["rate"] == "generate"


def test_precision_policies_are_engines_of_their_own(bs, tmp_path):
    """``--precision``: an engine per NestedFP policy; an SLO no step meets runs FP8 from the
    third decode call on (the engine overlaps calls: the second is dispatched before the first
    is read), fixed FP16 never; a model without NestedFP layers skips the policy."""
    result = bs.main(["--tiny", "--recipes", "bf16,nestedfp", "--kv-caches", "bf16", "--precision", "fp16,slo:0.001",
                      "--rates", "inf", "--out", str(tmp_path / "p.json")])
    runs = {(r["recipe"], r["precision"]): r for r in result["runs"]}
    assert "no NestedFP layers" in runs[("bf16", "fp16")]["skipped"]
    fixed, slo = runs[("nestedfp", "fp16")], runs[("nestedfp", "slo:0.001")]
    # NestedFP on an FP16 model (its FP16-mode kernels take FP16 activations only), the rest BF16.
    assert fixed["model_dtype"] == slo["model_dtype"] == "float16"
    assert runs[("bf16", "fp16")]["model_dtype"] == "bfloat16"
    assert fixed["fp8_decode_calls"] == 0 and fixed["completed"] == 6
    assert slo["fp8_decode_calls"] == slo["decode_calls"] - 2 > 0 and slo["completed"] == 6
    assert slo["compilations_after_warmup"] == 0
    assert bs.run_label(slo) == "nestedfp@slo:0.001" and bs.run_label(dict(recipe="bf16")) == "bf16"
    with pytest.raises(SystemExit, match="slo:MS"):
        bs.parse_precision("fast")
    with pytest.raises(SystemExit, match="target_ms must be > 0"):
        bs.parse_precision("slo:0")
