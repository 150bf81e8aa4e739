"""scripts/bench_nestedfp_gemm.py: its argument parsing, products and summary on the CPU (the timed
run needs a GPU: its kernels are Mosaic GPU ones)."""

import jax.numpy as jnp
import numpy as np
import pytest

from conftest import load_script
from jaxlp.formats import fp8, nestedfp


def test_configs_ms_and_shapes_parse():
    bench = load_script("bench_nestedfp_gemm")
    assert bench.parse_ms("32:128:32") == [32, 64, 96, 128] and bench.parse_ms("1,8") == [1, 8]
    assert len(bench.shapes_from("paper")) == 14 and bench.shapes_from("8x16") == (("custom", "8x16", 8, 16),)
    cfg = bench.parse_config("N64M128K64S4nm8s")
    assert (cfg.tile_m, cfg.stages, cfg.a_operand, cfg.merge) == (128, 4, "smem", "ptx")
    assert bench.parse_config("N64M256K64S3nm8-jnp").merge == "jnp"
    fp8_cfg = bench.parse_config("N64M128K128S5nm8p", "fp8")
    assert fp8_cfg.promote and not bench.parse_config("N64M256K128S3nm8", "w8a8").promote
    assert bench.parse_config("default") is None and bench.parse_config("xla") is None
    with pytest.raises(ValueError, match="MatmulConfig name"):
        bench.parse_config("big")
    assert bench.parse_config("gemv") == dict(design="gemv", unroll=None, splits=None)
    assert bench.parse_config("gemvU1S0", "fp8") == dict(design="gemv", unroll=1, splits=None)
    assert bench.parse_config("gemvU4S3") == dict(design="gemv", unroll=4, splits=3)
    assert bench.parse_config("gemvU2") == dict(design="gemv", unroll=2, splits=None)
    assert bench.parse_config("skinnyS4") == dict(design="skinny", unroll=None, splits=4)
    assert bench.parse_config("skinny") == dict(design="skinny", unroll=None, splits=None)
    with pytest.raises(ValueError, match="fp16 or fp8"):
        bench.parse_config("gemv", "w8a8")
    with pytest.raises(ValueError, match="MatmulConfig name"):
        bench.parse_config("gemvU3S1")
    # CUTLASS: NestedFP16 kernels in fp16 mode, FP8 kernels (and K per promoted sum) in the others
    assert bench.parse_config("cutlass:co128sk") == dict(config="co128sk")
    assert bench.parse_config("cutlass", "w8a8") == dict(config=None, promote_k=256)
    assert bench.parse_config("cutlass:co128p:512", "fp8") == dict(config="co128p", promote_k=512)
    assert bench.parse_config("cutlass-fp16") == dict(config="co128x256")
    with pytest.raises(ValueError, match="unknown CUTLASS config 'co128p' for --mode fp16"):
        bench.parse_config("cutlass:co128p")
    with pytest.raises(ValueError, match="no promote_k"):
        bench.parse_config("cutlass:co128:256")
    with pytest.raises(ValueError, match="takes --mode fp16"):
        bench.parse_config("cutlass-fp16", "fp8")


@pytest.mark.parametrize("mode", ["fp16", "fp8", "w8a8"])
def test_xla_products_are_the_layers(mode):
    bench = load_script("bench_nestedfp_gemm")
    rng = np.random.default_rng(0)
    w = rng.uniform(-1, 1, (48, 64)).astype(np.float32)
    x = jnp.asarray(rng.standard_normal((5, 64)), jnp.bfloat16 if mode == "w8a8" else jnp.float16)
    q = (fp8.quantize(jnp.asarray(w), granularity="channel") if mode == "w8a8"
         else nestedfp.quantize(jnp.asarray(w, jnp.float16)))
    y = np.asarray(bench.product(mode, "xla", None)(x, q), np.float64)
    ref = np.asarray(x, np.float64) @ np.asarray(w, np.float64).T
    assert y.shape == (5, 48) and np.linalg.norm(y - ref) / np.linalg.norm(ref) < (5e-2 if mode != "fp16" else 1e-3)


def test_summary_and_plot(tmp_path, capsys):
    bench = load_script("bench_nestedfp_gemm")
    rows = [dict(model="m", layer="o", n=64, k=128, m=m, base_us=2.0, best_us=b, ours_us={"default": b, "xla": 2.5},
                 ratio=2.0 / b, best_config="default") for m, b in ((32, 1.0), (64, 4.0))]
    result = dict(mode="fp8", device="cpu", date="today", rows=rows)
    bench.summary(result)
    text = capsys.readouterr().out
    assert "NestedFP8 (best config)" in text and "+100.0%" in text and "0.50-2.00x" in text
    bench.plot(result, str(tmp_path / "p.png"))
    assert (tmp_path / "p.png").stat().st_size > 0
