"""scripts/bench_block_fp4.py on the CPU: its products, bytes, table and plot (the timed run needs the
GPU kernels)."""

import jax.numpy as jnp
import numpy as np
import pytest

from conftest import load_script
from jaxlp.formats import dialect_fp4, mxfp4


def test_products_and_bytes():
    bench = load_script("bench_block_fp4")
    rng = np.random.default_rng(0)
    w = rng.standard_normal((64, 256)).astype(np.float32)
    x = jnp.asarray(rng.standard_normal((3, 256)), jnp.bfloat16)
    for fmt, mod in (("mxfp4", mxfp4), ("dialect", dialect_fp4)):
        q = mod.quantize(jnp.asarray(w))
        ref = np.asarray(x, np.float64) @ np.asarray(q.dequantize(jnp.float32), np.float64).T
        for method in (f"{fmt}-xla", f"{fmt}-dot"):
            y = np.asarray(bench.product(method)(x, q), np.float64)
            assert y.shape == (3, 64) and np.linalg.norm(y - ref) / np.linalg.norm(ref) < 4e-3
        y = np.asarray(bench.product(f"{fmt}-a4-xla")(x, q), np.float64)
        assert np.linalg.norm(y - ref) / np.linalg.norm(ref) < 0.3  # activations in 4 bits
    assert bench.stored_bytes("mxfp4", 64, 256) == 64 * 128 + 64 * 8
    assert bench.stored_bytes("dialect", 64, 256) == 64 * 128 + 64 * 8 + 64 * 4
    with pytest.raises(ValueError, match="not a block_fp4 launch"):
        bench.product("mxfp4:R1")


def test_table_and_plot(tmp_path, capsys):
    bench = load_script("bench_block_fp4")
    rows = [dict(shape="s", n=64, k=256, m=m, method=meth, us=us, floor_us=1.0, x_bf16=2.0 / us if us else None,
                 copy_pct=100.0 / us) for m in (1, 8) for meth, us in (("bf16", 2.0), ("mxfp4", 1.0))]
    result = dict(device="cpu", date="today", rows=rows)
    bench.print_table(result, ["bf16", "mxfp4"], [1, 8])
    text = capsys.readouterr().out
    assert "| s | 1 | 2.0 | 1.0 (2.00x, 100%) |" in text
    bench.plot(result, str(tmp_path / "p.png"))
    assert (tmp_path / "p.png").stat().st_size > 0
