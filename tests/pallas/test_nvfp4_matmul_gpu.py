"""The Pallas NVFP4 matmul on a GPU against float64 NumPy (skipped without a CUDA GPU)."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jaxlp.formats import nvfp4
from jaxlp.formats.nvfp4 import NVFP4Array
from jaxlp.pallas import nvfp4_matmul as nm

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(jax.devices()[0].platform != "gpu", reason="needs a CUDA GPU"),
]

E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6], np.float64)
EXTREME_SCALES = np.array([2.0**-9, 5 * 2.0**-9, 2.0**-6, 0.75, 1.0, 27.0, 448.0], np.float32)


def weight_f64(w: NVFP4Array) -> np.ndarray:
    data = np.asarray(w.data).astype(np.int64)
    codes = np.stack([data & 15, data >> 4], axis=-1).reshape(w.shape)
    vals = np.where(codes & 8, -1.0, 1.0) * E2M1[codes & 7]
    s = np.asarray(w.block_scale).astype(np.float64)
    return vals * np.repeat(s, 16, axis=1) * float(w.tensor_scale)


def rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def random_weight(rng, n, k, *, extreme=False, zero_blocks=6):
    if extreme:  # random codes, scales from the E4M3 extremes (incl. the subnormal 2**-9 and 448)
        data = rng.integers(0, 256, (n, k // 2), dtype=np.uint8)
        sb = rng.choice(EXTREME_SCALES, (n, k // 16)).astype(ml_dtypes.float8_e4m3fn)
        for r, c in zip(rng.integers(0, n, zero_blocks), rng.integers(0, k // 16, zero_blocks)):
            data[r, 8 * c: 8 * c + 8] = 0  # all-zero blocks
        return NVFP4Array(data=jnp.asarray(data), block_scale=jnp.asarray(sb),
                          tensor_scale=jnp.float32(0.37), shape=(n, k))
    w = rng.standard_normal((n, k)).astype(np.float32) * np.exp(rng.uniform(-4, 4, (n, 1))).astype(np.float32)
    for r, c in zip(rng.integers(0, n, zero_blocks), rng.integers(0, k // 16, zero_blocks)):
        w[r, 16 * c: 16 * c + 16] = 0.0
    return nvfp4.quantize(jnp.asarray(w))


def check(x, w, config):
    y = jax.jit(lambda x, w: nm.nvfp4_matmul(x, w, config=config))(x, w)
    assert y.dtype == jnp.bfloat16 and y.shape == (x.shape[0], w.shape[0])
    ref = np.asarray(x, np.float64) @ weight_f64(w).T
    y = np.asarray(y.astype(jnp.float32), np.float64)
    assert np.isfinite(y).all()
    err = rel(y, ref.astype(ml_dtypes.bfloat16).astype(np.float64))
    assert err <= 2e-3, (config.name, x.shape, w.shape, err)
    return err


def code_sweep_weight(n: int, k: int) -> NVFP4Array:
    """Every code in every position of each 16-row group, scales from 2**-9 to 448 (g = 2: exact)."""
    codes = (np.arange(n)[:, None] * 7 + np.arange(k)[None, :]) % 16
    data = (codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint8)
    sweep = np.array([2.0**-9, 3 * 2.0**-9, 2.0**-7, 2.0**-6, 0.5, 1.0, 1.125, 15.0, 240.0, 448.0], np.float32)
    sb = sweep[(np.arange(n)[:, None] + 3 * np.arange(k // 16)[None, :]) % len(sweep)]
    return NVFP4Array(data=jnp.asarray(data), block_scale=jnp.asarray(sb.astype(ml_dtypes.float8_e4m3fn)),
                      tensor_scale=jnp.float32(2.0), shape=(n, k))


def test_every_code_and_scale_is_decoded_exactly():
    """x = I reads the decoded weights back: y[m, n] = w[n, m] * g exactly (one nonzero term, g a
    power of two), for every code in every position of a 64-k tile and scales from 2**-9 to 448."""
    w = code_sweep_weight(256, 128)
    k = w.shape[1]
    x = jnp.eye(k, dtype=jnp.bfloat16)
    for config in (nm.MatmulConfig(), nm.MatmulConfig(tile_n=128, tile_k=128, wg_split="m", tile_m=64)):
        y = np.asarray(nm.nvfp4_matmul(x, w, config=config).astype(jnp.float32), np.float64)
        np.testing.assert_array_equal(y, weight_f64(w).T, err_msg=config.name)


CASES = [  # (M, N, K, config): M, N, K multiples of the tiles and not (padded)
    (128, 256, 512, nm.MatmulConfig()),
    (256, 512, 1024, nm.MatmulConfig(tile_n=128, tile_m=128)),
    (512, 256, 2048, nm.MatmulConfig(tile_m=256)),
    (256, 256, 1024, nm.MatmulConfig(wg_split="m", grid_minor="n", grid_tile_width=2)),
    (384, 384, 1024, nm.MatmulConfig(tile_k=128, stages=3)),
    (200, 320, 1040, nm.MatmulConfig()),  # M, N, K not multiples of the tile (K % 64 != 0)
    (1, 128, 64, nm.MatmulConfig()),
    (37, 1000, 4112, nm.MatmulConfig(tile_n=128, tile_m=64, tile_k=128)),
    (1024, 2048, 4096, nm.MatmulConfig(tile_n=64, tile_m=256, stages=4)),
]


@pytest.mark.parametrize("m, n, k, config", CASES, ids=[f"{m}x{n}x{k}-{c.name}" for m, n, k, c in CASES])
def test_matches_float64(m, n, k, config):
    rng = np.random.default_rng(m * 7 + n + k)
    x = rng.standard_normal((m, k)) * np.exp(rng.uniform(-2, 2, (m, 1)))
    x[rng.integers(0, m), : min(k, 48)] = 0.0
    check(jnp.asarray(x, jnp.bfloat16), random_weight(rng, n, k), config)


@pytest.mark.parametrize("config", [nm.MatmulConfig(), nm.MatmulConfig(tile_k=128, tile_n=128, tile_m=64)],
                         ids=lambda c: c.name)
def test_extreme_scales_and_zero_blocks(config):
    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.standard_normal((256, 1024)), jnp.bfloat16)
    check(x, random_weight(rng, 512, 1024, extreme=True), config)


def test_all_zero_weight_gives_zeros():
    w = nvfp4.quantize(jnp.zeros((256, 512)))
    y = nm.nvfp4_matmul(jnp.ones((128, 512), jnp.bfloat16), w)
    assert (np.asarray(y.astype(jnp.float32)) == 0).all()


def test_w4a4_exact_activations():
    rng = np.random.default_rng(4)
    x = rng.standard_normal((128, 512)).astype(np.float32)
    xq = nvfp4.quantize(jnp.asarray(x))
    unit = NVFP4Array(data=xq.data, block_scale=xq.block_scale, tensor_scale=jnp.float32(1.0), shape=xq.shape)
    x_dq = unit.dequantize(jnp.bfloat16)  # e2m1 * e4m3: exact in BF16
    w = random_weight(rng, 256, 512)
    y = nm.nvfp4_matmul(x_dq, w, act_tensor_scale=xq.tensor_scale)
    ref = np.asarray(xq.dequantize(jnp.float32), np.float64) @ weight_f64(w).T
    assert rel(np.asarray(y.astype(jnp.float32)), ref.astype(ml_dtypes.bfloat16).astype(np.float64)) < 1e-3


@pytest.mark.parametrize("w4a4", [False, True])
def test_dispatch_runs_the_pallas_choice_exactly(w4a4, monkeypatch):
    """QuantizedLinear through the dispatch hook with the table's choice forced to the Pallas kernel:
    W4A16 and W4A4 (CUDA quantizer, exact BF16 decode, g_x in the epilogue) against float64."""
    from jaxlp.quantization import QuantizedLinear
    from jaxlp.quantization import nvfp4_dispatch as dispatch
    from jaxlp.quantization.activations import fake_quantize

    monkeypatch.setattr(dispatch, "plan", lambda *a, **k: nm.MatmulConfig(tile_k=128, stages=3))
    rng = np.random.default_rng(11)
    w = random_weight(rng, 384, 1024)
    x = jnp.asarray(rng.standard_normal((160, 1024)) * 2, jnp.bfloat16)
    amax = jnp.float32(np.abs(np.asarray(x, np.float32)).max() * 0.7) if w4a4 else None  # some saturate
    layer = QuantizedLinear(w, activation="nvfp4" if w4a4 else None, act_amax=amax)
    y = np.asarray(jax.jit(lambda x: dispatch.nvfp4_matmul(layer, x))(x).astype(jnp.float32), np.float64)
    xq = np.asarray(fake_quantize(x, "nvfp4", amax) if w4a4 else x.astype(jnp.float32), np.float64)
    ref = xq @ weight_f64(w).T
    assert rel(y, ref.astype(ml_dtypes.bfloat16).astype(np.float64)) < 1e-3


# --- Small M (GEMV): tile_m = 8, 16, 32, deeper pipelines, split-K with FP32 partials. ---------

SMALL = [
    nm.MatmulConfig(tile_m=8),
    nm.MatmulConfig(tile_m=8, tile_k=256, stages=6),
    nm.MatmulConfig(tile_m=8, tile_k=256, stages=8, split_k=2),
    nm.MatmulConfig(tile_m=8, tile_k=128, stages=6, split_k=4),
    nm.MatmulConfig(tile_m=16, tile_k=128, stages=4, split_k=2),
    nm.MatmulConfig(tile_n=128, tile_m=32, tile_k=128, stages=4),
]
SMALL_CASES = [(m, n, k, c) for c in SMALL for m, n, k in ((1, 256, 2048), (3, 384, 1024), (8, 512, 4096))]
SMALL_CASES += [(5, 1000, 4112, SMALL[2]), (1, 320, 1040, SMALL[3])]  # N, K padded (K to tile_k * split_k)


@pytest.mark.parametrize("m, n, k, config", SMALL_CASES, ids=[f"{m}x{n}x{k}-{c.name}" for m, n, k, c in SMALL_CASES])
def test_small_m_matches_float64(m, n, k, config):
    rng = np.random.default_rng(m * 13 + n + k)
    x = rng.standard_normal((m, k)) * np.exp(rng.uniform(-2, 2, (m, 1)))
    check(jnp.asarray(x, jnp.bfloat16), random_weight(rng, n, k), config)


@pytest.mark.parametrize("config", [SMALL[0], SMALL[2]], ids=lambda c: c.name)
def test_small_m_extreme_scales_and_prepared_operands(config):
    rng = np.random.default_rng(5)
    x = jnp.asarray(rng.standard_normal((8, 2048)), jnp.bfloat16)
    w = random_weight(rng, 512, 2048, extreme=True)
    err = check(x, w, config)
    ops = nm.kernel_operands(w, *nm.padded_shape(config, 8, 512, 2048)[1:])
    y = jax.jit(lambda x, w, o: nm.nvfp4_matmul(x, w, config=config, operands=o))(x, w, ops)
    ref = np.asarray(x, np.float64) @ weight_f64(w).T
    assert rel(np.asarray(y.astype(jnp.float32)), ref.astype(ml_dtypes.bfloat16).astype(np.float64)) == pytest.approx(err)


@pytest.mark.parametrize("config", [SMALL[0], SMALL[2], SMALL[4]], ids=lambda c: c.name)
def test_small_m_reads_back_every_code_exactly(config):
    """x = 8 rows of the identity reads 8 weight columns back exactly (one nonzero term; with
    split-K the other partials are exact zeros), for every column of two 256-k tiles."""
    w = code_sweep_weight(256, 512)
    k = w.shape[1]
    f = jax.jit(lambda x, w: nm.nvfp4_matmul(x, w, config=config))
    eye = np.eye(k, dtype=np.float32)
    wt = weight_f64(w).T
    for j in range(0, k, 8):
        y = np.asarray(f(jnp.asarray(eye[j:j + 8], jnp.bfloat16), w).astype(jnp.float32), np.float64)
        np.testing.assert_array_equal(y, wt[j:j + 8], err_msg=f"{config.name} columns {j}..{j + 7}")
