"""scripts/bench_fireq.py: its products, floor, table and plot on the CPU (the timed run needs a GPU:
its kernels are CUDA and Mosaic GPU ones)."""

import jax.numpy as jnp
import numpy as np
import pytest

from conftest import load_script
from jaxlp.formats import int4_fp8


def test_xla_products_are_the_layers():
    """``bf16`` is the BF16 dot; ``xla_fp8`` the FireQ layer's own math (its pure-JAX reference)."""
    from jaxlp.quantization import QuantizedLinear

    bench = load_script("bench_fireq")
    rng = np.random.default_rng(0)
    w = rng.standard_normal((48, 256)).astype(np.float32) * 0.05
    x = jnp.asarray(rng.standard_normal((5, 256)), jnp.bfloat16)
    y = np.asarray(bench.product("bf16")(x, jnp.asarray(w, jnp.bfloat16)), np.float64)
    want = np.asarray(x, np.float64) @ np.asarray(jnp.asarray(w, jnp.bfloat16), np.float64).T
    assert np.linalg.norm(y - want) / np.linalg.norm(want) < 1e-2
    q = int4_fp8.quantize(jnp.asarray(w))
    y = np.asarray(bench.product("xla_fp8")(x, q), np.float64)
    want = np.asarray(QuantizedLinear(q, activation="fireq_fp8")(x), np.float64)
    assert y.shape == (5, 48) and np.linalg.norm(y - want) / np.linalg.norm(want) < 1e-2
    with pytest.raises(KeyError):
        bench.product("fireq_triton")


def test_cutlass_variants_take_a_config():
    bench = load_script("bench_fireq")
    assert bench.known_variant("fireq_cutlass") and bench.known_variant("fireq_cutlass_tables:co128p1")
    assert not bench.known_variant("fireq_cutlass:co256") and not bench.known_variant("auto:co128")
    with pytest.raises(SystemExit):
        bench.main(["--variants", "bf16,fireq_cutlass:co256"])


def test_floor_is_bytes_or_flops():
    bench = load_script("bench_fireq")
    n, k = 28672, 4096
    bytes_one = n * k // 2 + n * k // 128 + 2 * (k + n)  # codes, scales, 16-bit activations in and out
    assert bench.floor_us(1, n, k, 3.0, 1000.0) == pytest.approx(bytes_one / 3e12 * 1e6)
    assert bench.floor_us(8192, n, k, 3.0, 1000.0) == pytest.approx(2 * 8192 * n * k / 2e15 * 1e6)


def test_table_and_plot(tmp_path, capsys):
    bench = load_script("bench_fireq")
    rows = [dict(layer="ffn", m=m, floor_us=10.0, us=dict(bf16=100.0, xla_fp8=400.0, auto=a)) for m, a in ((1, 50.0),
                                                                                                     (16, 80.0))]
    result = dict(device="cpu", rows=rows)
    bench.table(result)
    text = capsys.readouterr().out
    assert "| ffn | 1 | 10.0 | 100.0 | 400.0 |" in text and "| 2.00 | 8.00 |" in text and "| 1.25 | 5.00 |" in text
    bench.plot(result, str(tmp_path / "p.png"))
    assert (tmp_path / "p.png").stat().st_size > 0


def test_end_to_end_on_a_tiny_model(tmp_path):
    """``--e2e``: BF16 then W4A8-FireQ rows for each prefill and decode point, JSON written."""
    bench = load_script("bench_fireq")
    out = tmp_path / "e2e.json"
    rows = bench.main(["--e2e", "--tiny", "--layers", "1", "--prefill", "2x32", "--decode-batches", "1",
                       "--context", "32", "--reps", "1", "--out", str(out)])
    assert [(r["variant"], r["part"]) for r in rows] == [("bf16", "prefill"), ("bf16", "decode"),
                                                          ("w4a8-fireq", "prefill"), ("w4a8-fireq", "decode")]
    # decode ms is a difference of two timings: finite, not necessarily positive on a busy CPU
    assert all(np.isfinite(r["ms"]) for r in rows) and rows[0]["x_bf16"] == 1.0
    assert all(r["ms"] > 0 for r in rows if r["part"] == "prefill")
    assert out.stat().st_size > 0
    with pytest.raises(ValueError, match="BxS"):
        bench.main(["--e2e", "--prefill", "16-1024"])
