"""The Pallas FP8 x FP8 matmul with scales in its epilogue: its reference against float64 NumPy and
its checks on the CPU; on a GPU the kernel against float64 of the E4M3 values (skipped without a
CUDA GPU: no Pallas GPU interpreter path for it)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fp8_operands import float64_product, operands

from jaxlp.pallas import fp8_matmul as fm
from jaxlp.pallas.wgmma_tiles import SMEM_LIMIT

ON_GPU = jax.devices()[0].platform == "gpu"


@pytest.mark.parametrize("out_dtype", [jnp.bfloat16, jnp.float16])
def test_reference_is_the_float64_product_rounded_once(out_dtype):
    rng = np.random.default_rng(3)
    x, w, ts, cs = operands(rng, 6, 96, 160)  # the last token all zero
    got = np.asarray(fm.reference(jnp.asarray(x), jnp.asarray(w), jnp.asarray(ts), jnp.asarray(cs), out_dtype),
                     np.float64)
    want = float64_product(x, w, ts, cs).astype(out_dtype).astype(np.float64)
    eps = float(jnp.finfo(out_dtype).eps)
    np.testing.assert_allclose(got, want, rtol=eps, atol=1e-30)
    np.testing.assert_array_equal(got[-1], 0.0)


def test_config_and_operands_are_checked():
    with pytest.raises(ValueError, match="tile_m"):
        fm.MatmulConfig(tile_m=300)
    with pytest.raises(ValueError, match="tile_k must be 64, 128 or 256"):
        fm.MatmulConfig(tile_k=512)
    with pytest.raises(ValueError, match="needs promote"):
        fm.MatmulConfig(tile_k=256, tile_m=64, promote=False)
    with pytest.raises(ValueError, match="promote"):
        fm.MatmulConfig(tile_m=256)
    x8 = jnp.zeros((8, 128), jnp.float8_e4m3fn)
    w8 = jnp.zeros((64, 128), jnp.float8_e4m3fn)
    ts, cs = jnp.ones(8), jnp.ones(64)
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        fm.fp8_matmul(x8.astype(jnp.bfloat16), w8, ts, cs)
    with pytest.raises(ValueError, match="K mismatch"):
        fm.fp8_matmul(x8[:, :64], w8, ts, cs)
    with pytest.raises(ValueError, match="token_scale"):
        fm.fp8_matmul(x8, w8, ts[:4], cs)
    with pytest.raises(ValueError, match="out_dtype"):
        fm.fp8_matmul(x8, w8, ts, cs, out_dtype=jnp.float32)
    with pytest.raises(ValueError, match="shared memory"):
        fm._check(x8, w8, ts, cs, jnp.bfloat16, fm.MatmulConfig(tile_n=256, tile_m=128, stages=8))
    assert fm.MatmulConfig(tile_n=64, tile_m=16, tile_k=128).padded_shape(20, 200, 300) == (32, 256, 384)


K256 = fm.MatmulConfig(tile_n=64, tile_m=128, tile_k=256, stages=3)


@pytest.mark.parametrize("m, n, k, config", [
    (1, 256, 512, None), (8, 320, 640, None), (33, 4096, 1024, None), (256, 1024, 4096, None),
    (300, 640, 4160, fm.MatmulConfig(tile_n=64, tile_m=64, tile_k=64, stages=3, wg_split="m")),
    (2048, 4096, 4096, None), (200, 576, 1024, fm.MatmulConfig(tile_n=128, tile_m=64, stages=3)),
    (512, 1024, 1024, fm.MatmulConfig(tile_m=256, stages=3, promote=False)),
    # two 128-wide WGMMAs per promoted step: K padded to 256 (4160), one step (256), many (4096)
    (300, 640, 4160, K256), (8, 320, 256, K256), (2048, 4096, 4096, K256)])
@pytest.mark.parametrize("out_dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
def test_gpu_matches_float64_of_the_e4m3_values(m, n, k, config, out_dtype):
    rng = np.random.default_rng(m + n + k)
    x, w, ts, cs = operands(rng, m, n, k)
    y = np.asarray(fm.fp8_matmul(jnp.asarray(x), jnp.asarray(w), jnp.asarray(ts), jnp.asarray(cs),
                                 out_dtype=out_dtype, config=config), np.float64)
    want = float64_product(x, w, ts, cs)
    assert y.shape == (m, n) and np.isfinite(y).all()
    # the one rounding to the output (RMS relative error under its epsilon; FP16: <= 1e-3), with
    # the step sums promoted to FP32 (without: ~1.3e-3 at K = 4096, the tensor cores' FP8 sums)
    assert np.linalg.norm(y - want) / np.linalg.norm(want) <= float(jnp.finfo(out_dtype).eps)
    if m > 1:
        np.testing.assert_array_equal(y[-1], 0.0)


def test_default_config_promotes_and_fits_shared_memory():
    """Every default tiling is valid (promoted ones within the two-accumulator tile_m bound) and
    fits shared memory; 129..256 promoted tokens take 256 K per step sum, unpromoted never do."""
    for m in (1, 8, 64, 65, 128, 129, 256, 257, 1024, 1025, 4096):
        for promote in (True, False):
            for n in (None, 1024, 4096, 28672):
                cfg = fm.default_config(m, n, promote=promote)
                assert cfg.promote == promote and cfg.smem_bytes() <= SMEM_LIMIT
                assert cfg.tile_k == (256 if promote and 128 < m <= 256 else 128)
