"""CPU tests of the Pallas NVFP4 matmul: the exact decode arithmetic against float64 NumPy, the
kernel's operand layouts, the FP32 reference, argument checks, and that the Mosaic GPU kernel
lowers (layout inference and the in-register decode run in Python) for several configurations.

The kernel itself cannot run on a CPU: the Mosaic GPU interpreter rejects its warp-specialized
pipeline ("run_scoped interpret rule does not support collective axes") and cannot execute
``inline_mgpu`` code; test_nvfp4_matmul_gpu.py runs it on a GPU.
"""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jaxlp.formats import nvfp4
from jaxlp.formats.nvfp4 import NVFP4Array
from jaxlp.pallas import nvfp4_matmul as nm

E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6], np.float64)
# E4M3 scales: the subnormal extremes, normals across the range, the maximum.
SCALE_SWEEP = np.array([2.0**-9, 3 * 2.0**-9, 7 * 2.0**-9, 2.0**-6, 1.125 * 2.0**-6, 0.5, 1.0, 1.875,
                        13.0, 96.0, 240.0, 416.0, 448.0])


def e2m1_f64(codes):
    codes = np.asarray(codes, np.int64) & 15
    return np.where(codes & 8, -1.0, 1.0) * E2M1[codes & 7]


def e4m3_f64(byte):
    """Float64 value of E4M3FN bits (no NaN inputs here)."""
    b = np.asarray(byte, np.int64)
    sign = np.where(b & 0x80, -1.0, 1.0)
    e, m = (b >> 3) & 15, b & 7
    return sign * np.where(e == 0, m * 2.0**-9, (1 + m / 8) * 2.0 ** (e - 7))


def e4m3_bytes(values):
    return np.asarray(values, np.float32).astype(ml_dtypes.float8_e4m3fn).view(np.uint8)


def test_decode_e2m1_bits_every_code():
    codes = np.arange(16)
    got = np.asarray(nm.decode_e2m1_bits(jnp.asarray(codes, jnp.int32)).astype(jnp.float32), np.float64)
    np.testing.assert_array_equal(got, e2m1_f64(codes) * 2.0**-126)
    # int4 codes (as the kernel reads them) give the same bits as their uint8 nibbles.
    as_int4 = jnp.asarray(np.where(codes >= 8, codes - 16, codes), jnp.int4)
    np.testing.assert_array_equal(np.asarray(nm.decode_e2m1_bits(as_int4).astype(jnp.float32)),
                                  got.astype(np.float32))


def test_scale_to_bf16_every_positive_e4m3():
    byte = np.arange(1, 0x7F, dtype=np.uint8)  # every positive finite E4M3 value
    s = jnp.asarray(byte).view(jnp.float8_e4m3fn)
    got = np.asarray(nm.scale_to_bf16(s).astype(jnp.float32), np.float64)
    np.testing.assert_array_equal(got, e4m3_f64(byte) * 2.0**119)


def test_decoded_product_every_code_times_scale_sweep_is_exact():
    """BF16(e2m1 bits) * BF16(scale * 2**119), rounded once to BF16 as mul.rn.bf16x2 does (with
    subnormal inputs: computed by ml_dtypes, not XLA:CPU, which flushes them), equals
    e2m1 * e4m3 * 2**-7 exactly."""
    codes = np.tile(np.arange(16), len(SCALE_SWEEP))
    sb = np.repeat(e4m3_bytes(SCALE_SWEEP), 16)
    a = np.asarray(nm.decode_e2m1_bits(jnp.asarray(codes))).astype(np.float32)
    b = np.asarray(nm.scale_to_bf16(jnp.asarray(sb).view(jnp.float8_e4m3fn))).astype(np.float32)
    prod = (a.astype(np.float64) * b).astype(np.float32).astype(ml_dtypes.bfloat16)
    expect = e2m1_f64(codes) * e4m3_f64(sb) * 2.0**-7
    np.testing.assert_array_equal(prod.astype(np.float64), expect)
    assert np.abs(expect[expect != 0]).min() >= 2.0**-17  # no product is a BF16 subnormal


def test_kernel_operands_layout():
    rng = np.random.default_rng(0)
    n, k = 128, 192
    data = rng.integers(0, 256, (n, k // 2), dtype=np.uint8)
    sb = rng.integers(0x08, 0x7F, (n, k // 16), dtype=np.uint8)
    w = NVFP4Array(data=jnp.asarray(data), block_scale=jnp.asarray(sb).view(jnp.float8_e4m3fn),
                   tensor_scale=jnp.float32(1.0), shape=(n, k))
    codes, s = nm.kernel_operands(w, n, k)
    assert codes.dtype == jnp.int4 and codes.shape == (n, k)
    nib = np.stack([data & 15, data >> 4], axis=-1).reshape(n, k)
    np.testing.assert_array_equal(np.asarray(codes.astype(jnp.int32)) & 15, nib)
    s = np.asarray(s)
    assert s.shape == (k // 64, n // 64, 256)
    for kt, slab, warp, lane_group, block, half in np.ndindex(k // 64, n // 64, 4, 8, 4, 2):
        row = 64 * slab + 16 * warp + lane_group + 8 * half
        offset = 8 * (8 * warp + lane_group) + 2 * block + half
        assert s[kt, slab, offset] == sb[row, 4 * kt + block]


def test_kernel_operands_padding_contributes_zero():
    w = nvfp4.quantize(jax.random.normal(jax.random.key(1), (70, 48)))
    codes, s = nm.kernel_operands(w, 128, 64)
    assert codes.shape == (128, 64) and s.shape == (1, 2, 256)
    c = np.asarray(codes.astype(jnp.int32))
    assert (c[70:] == 0).all() and (c[:, 48:] == 0).all()


def test_reference_matches_float64():
    rng = np.random.default_rng(2)
    m, n, k = 5, 40, 96
    wf = rng.standard_normal((n, k)).astype(np.float32)
    wf[3, 16:32] = 0.0  # an all-zero block
    w = nvfp4.quantize(jnp.asarray(wf))
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
    data = np.asarray(w.data)
    codes = np.stack([data & 15, data >> 4], axis=-1).reshape(n, k)
    wd = e2m1_f64(codes) * np.repeat(e4m3_f64(np.asarray(w.block_scale).view(np.uint8)), 16, axis=1)
    ref = np.asarray(x, np.float64) @ (wd * float(w.tensor_scale)).T
    y = nm.reference(x, w)
    assert y.dtype == jnp.bfloat16 and y.shape == (m, n)
    np.testing.assert_allclose(np.asarray(y, np.float64), ref, rtol=8e-3, atol=1e-6 * np.abs(ref).max())


@pytest.mark.parametrize("kwargs, match", [
    (dict(tile_n=96), "tile_n"), (dict(tile_m=24), "tile_m"), (dict(tile_m=48), "tile_m"),
    (dict(tile_k=32), "tile_k"), (dict(split_k=0), "split_k"),
    (dict(stages=1), "stages"), (dict(wg_split="k"), "wg_split"), (dict(grid_minor="x"), "grid_minor"),
    (dict(grid_tile_width=0), "grid_tile_width"),
])
def test_config_rejects_bad_values(kwargs, match):
    with pytest.raises(ValueError, match=match):
        nm.MatmulConfig(**kwargs)


def test_rejects_bad_inputs():
    w = nvfp4.quantize(jnp.ones((64, 64)))
    with pytest.raises(ValueError, match="bfloat16"):
        nm.nvfp4_matmul(jnp.ones((4, 64), jnp.float32), w)
    with pytest.raises(ValueError, match="K mismatch"):
        nm.nvfp4_matmul(jnp.ones((4, 32), jnp.bfloat16), w)
    with pytest.raises(ValueError, match="2-D"):
        nm.nvfp4_matmul(jnp.ones((2, 4, 64), jnp.bfloat16), w)
    with pytest.raises(ValueError, match="NVFP4Array"):
        nm.nvfp4_matmul(jnp.ones((4, 64), jnp.bfloat16), jnp.ones((64, 64)))
    with pytest.raises(ValueError, match="shared memory"):
        nm.nvfp4_matmul(jnp.ones((4, 64), jnp.bfloat16), w,
                        config=nm.MatmulConfig(tile_n=128, tile_m=256, tile_k=128, stages=4))


@pytest.mark.parametrize("config", [
    nm.MatmulConfig(),
    nm.MatmulConfig(tile_n=128, tile_m=64, tile_k=128, stages=3, wg_split="m"),
    nm.MatmulConfig(tile_n=64, tile_m=256, grid_minor="n"),
    nm.MatmulConfig(tile_m=8),  # small M (GEMV): WGMMA N = 8, 16, 32
    nm.MatmulConfig(tile_m=8, tile_k=256, stages=8, split_k=2),  # FP32 partials [2, N, M]
    nm.MatmulConfig(tile_m=16, tile_k=128, stages=6, split_k=4),
    nm.MatmulConfig(tile_n=128, tile_m=32, tile_k=256, stages=3, split_k=2),
    nm.MatmulConfig(tile_n=128, tile_m=8, wg_split="m", split_k=2),
], ids=lambda c: c.name)
def test_kernel_lowers_for_cuda(config):
    """Tracing and lowering for a CUDA target runs Mosaic GPU's layout inference and our
    in-register decode (inline_mgpu) on the CPU: shape errors and unsupported layouts show here."""
    import jax._src.pallas.mosaic_gpu.pallas_call_registration  # noqa: F401 - registers the lowering

    x = jax.ShapeDtypeStruct((200, 1040), jnp.bfloat16)  # M, K not multiples of the tile: padded
    w = jax.eval_shape(nvfp4.quantize, jax.ShapeDtypeStruct((320, 1040), jnp.float32))
    f = jax.jit(lambda x, w: nm.nvfp4_matmul(x, w, config=config, num_sms=132))
    text = f.trace(x, w).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text


def test_small_m_config_properties():
    c = nm.MatmulConfig(tile_n=64, tile_m=8, tile_k=256, stages=8, split_k=4)
    assert c.name == "N64M8K256S8nm8x4" and nm.MatmulConfig(tile_m=8).name == "N64M8K64S4nm8"
    assert (c.cta_tile_n, c.cta_tile_m) == (128, 8)
    # 8 stages of (128 x 256 codes, scales, 8 x 256 BF16 tokens) + the FP32 output tile.
    assert c.smem_bytes() == 8 * (128 * 128 + 128 * 16 + 8 * 256 * 2) + 8 * 128 * 4 <= nm.SMEM_LIMIT
    assert nm.padded_shape(c, 1, 12288, 4096) == (8, 12288, 4096)
    assert nm.padded_shape(c, 3, 100, 1040) == (8, 128, 2048)  # K to tile_k * split_k


def test_operands_argument_is_checked():
    w = jax.eval_shape(nvfp4.quantize, jax.ShapeDtypeStruct((128, 256), jnp.float32))
    x = jax.ShapeDtypeStruct((1, 256), jnp.bfloat16)
    bad = (jax.ShapeDtypeStruct((128, 128), jnp.int4), jax.ShapeDtypeStruct((2, 2, 256), jnp.uint8))
    with pytest.raises(ValueError, match="kernel_operands"):
        jax.eval_shape(lambda x, w, o: nm.nvfp4_matmul(x, w, config=nm.MatmulConfig(tile_m=8), operands=o),
                       x, w, bad)


def test_small_m_lowers_with_prepared_operands():
    """M = 1 with operands prepared ahead (the weights in the kernel layout): no int4 view or scale
    permutation in the lowered module."""
    import jax._src.pallas.mosaic_gpu.pallas_call_registration  # noqa: F401

    cfg = nm.MatmulConfig(tile_m=8, tile_k=256, stages=8, split_k=2)
    w = jax.eval_shape(nvfp4.quantize, jax.ShapeDtypeStruct((256, 1024), jnp.float32))
    ops = jax.eval_shape(lambda w: nm.kernel_operands(w, 256, 1024), w)
    f = jax.jit(lambda x, w, o: nm.nvfp4_matmul(x, w, config=cfg, operands=o, num_sms=132))
    text = f.trace(jax.ShapeDtypeStruct((1, 1024), jnp.bfloat16), w, ops).lower(
        lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text and "transpose" not in text.split("mosaic_gpu")[0]


def test_gemv_config_balances_the_persistent_loop():
    """split_k minimises rounds * (K steps per item + overhead), rounds = ceil(tiles * split / SMs)."""
    # 12288 rows = 96 CTA tiles of 128, 16 steps of 256 k: split 1 costs 1 * 18, 4 costs 3 * 6 (a tie:
    # the smaller split), 2 costs 2 * 10; with an overhead of 0.5 steps split 4 (3 * 4.5) wins.
    assert nm.gemv_config(12288, 4096).split_k == 1
    assert nm.gemv_config(12288, 4096, item_overhead_steps=0.5).split_k == 4
    # 4096 rows = 32 tiles, 48 steps: split 4 (1 round of 12 + 2) beats 1 (50) and 8 (2 * 8).
    c = nm.gemv_config(4096, 12288)
    assert c.split_k == 4 and (c.tile_m, c.tile_k, c.stages) == (8, 256, 8)
