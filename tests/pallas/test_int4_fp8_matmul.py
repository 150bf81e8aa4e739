"""The Pallas FireQ INT4 x FP8 matmul: its in-register decode (as array ops) against the format's
own dequantization on every code and scale, its reference against float64 NumPy, its checks and its
lowering on the CPU; on a GPU the kernel against float64 of the exactly decoded operands (skipped
without a CUDA GPU: no Pallas GPU interpreter path for it)."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from fireq_operands import rel
from jaxlp.formats import int4_fp8
from jaxlp.pallas import int4_fp8_matmul as im
from jaxlp.pallas.wgmma_tiles import SMEM_LIMIT

ON_GPU = jax.devices()[0].platform == "gpu"
E4M3 = ml_dtypes.float8_e4m3fn


def test_decode_words_is_the_formats_dequantization_for_every_code_and_scale():
    """Every positive finite E4M3 scale (subnormals, 448) times every code in every nibble position
    of a word, against ``Int4FP8Array.fp8_values`` (``e4m3(clip(q * s))``) byte for byte."""
    scale_bytes = np.arange(1, 0x7F, dtype=np.uint8)  # 2**-9 .. 448
    rows = len(scale_bytes)
    q = (np.arange(128)[None, :] * 3 + np.arange(rows)[:, None]) % 16 - 8  # each code at each position
    arr = int4_fp8.Int4FP8Array(codes=int4_fp8.pack_int4(jnp.asarray(q, jnp.int8)),
                                scales=jnp.asarray(scale_bytes[:, None].view(E4M3)), shape=(rows, 128))
    words = np.asarray(arr.codes).view(np.uint32)  # [rows, 16]: 8 codes each
    got = im.decode_words(jnp.asarray(words), jnp.asarray(np.broadcast_to(scale_bytes[:, None], words.shape)))
    got_bytes = np.asarray(got).view(np.uint8).reshape(rows, 128)
    want = np.asarray(arr.fp8_values()).view(np.uint8)
    np.testing.assert_array_equal(got_bytes, want)
    assert (want == 0x7E).any() and (want == 0xFE).any()  # +-448 reached (8 * 448 saturates)


def test_reference_is_the_float64_product_rounded_once():
    rng = np.random.default_rng(3)
    w = int4_fp8.quantize(jnp.asarray(rng.standard_normal((96, 256)), jnp.float32))
    x8 = jnp.asarray((rng.standard_normal((6, 256)) * 40).clip(-448, 448).astype(E4M3))
    ts = jnp.asarray(rng.uniform(0.5, 2, 6).astype(np.float32) * 2.0**-8)
    got = np.asarray(im.reference(x8, w, ts, jnp.float16), np.float64)
    w64 = np.asarray(w.fp8_values()).astype(np.float64)
    want = (np.asarray(x8).astype(np.float64) @ w64.T) * np.asarray(ts, np.float64)[:, None]
    np.testing.assert_allclose(got, want.astype(np.float16).astype(np.float64), rtol=1e-3, atol=1e-30)


def test_config_and_operands_are_checked():
    with pytest.raises(ValueError, match="tile_k must be the scale group"):
        im.MatmulConfig(tile_k=64)
    with pytest.raises(ValueError, match="promote"):
        im.MatmulConfig(tile_m=256)
    with pytest.raises(ValueError, match="tile_m"):
        im.MatmulConfig(tile_m=12)
    with pytest.raises(ValueError, match="multiple of 128"):
        im.MatmulConfig(tile_n=64, tile_m=64, wg_split="m")
    w = int4_fp8.quantize(jnp.ones((64, 256)))
    x8 = jnp.zeros((8, 256), jnp.float8_e4m3fn)
    ts = jnp.ones(8)
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        im.int4_fp8_matmul(x8.astype(jnp.bfloat16), w, ts)
    with pytest.raises(ValueError, match="K mismatch"):
        im.int4_fp8_matmul(x8[:, :128], w, ts)
    with pytest.raises(ValueError, match="token_scale"):
        im.int4_fp8_matmul(x8, w, ts[:4])
    with pytest.raises(ValueError, match="Int4FP8Array"):
        im.int4_fp8_matmul(x8, jnp.ones((64, 256)), ts)
    with pytest.raises(ValueError, match="groups of 128"):
        im.int4_fp8_matmul(x8, int4_fp8.quantize(jnp.ones((64, 256)), group_size=64), ts)
    with pytest.raises(ValueError, match="out_dtype"):
        im.int4_fp8_matmul(x8, w, ts, out_dtype=jnp.float32)
    with pytest.raises(ValueError, match="shared memory"):
        im._check(x8, w, ts, jnp.bfloat16, im.MatmulConfig(tile_n=256, tile_m=128, stages=8))


@pytest.mark.parametrize("m", [1, 16, 64, 100, 128, 129, 256, 1000, 2048, 8192])
@pytest.mark.parametrize("n", [64, 4096, 28672])
def test_default_config_fits_shared_memory(m, n):
    cfg = im.default_config(m, n)
    assert cfg.smem_bytes() <= SMEM_LIMIT and cfg.promote


def test_lowers_for_cuda_on_any_machine():
    """The kernel's Mosaic GPU lowering (the decode's layouts and PTX included) runs without a GPU."""
    w = int4_fp8.quantize(jnp.asarray(np.random.default_rng(0).standard_normal((200, 512)), jnp.float32))
    x8 = jnp.zeros((40, 512), jnp.float8_e4m3fn)
    for cfg in (None, im.MatmulConfig(tile_n=64, tile_m=64, stages=3, promote=False)):
        f = jax.jit(lambda x8, w: im.int4_fp8_matmul(x8, w, jnp.ones(40), config=cfg, num_sms=132))
        text = f.trace(x8, w).lower(lowering_platforms=("cuda",)).as_text()
        assert "mosaic_gpu" in text


def operands(rng, m, n, k):
    """FireQ weights with the format's edges (a zero row: the scale floor; a saturating group: scale
    448, codes -8) and E4M3 activations over their range with a zero token."""
    w = rng.standard_normal((n, k)).astype(np.float32) * 0.05
    w[1] = 0.0
    w[2, :128] = np.linspace(-3136, 3136, 128)  # absmax / 7 = 448
    if n > 3:
        w[3, 128 * (k // 256):] *= 1e-4  # tiny groups near the scale floor
    x8 = (rng.standard_normal((m, k)) * 60).clip(-448, 448).astype(E4M3)
    if m > 1:
        x8[-1] = 0
    ts = rng.uniform(0.5, 2.0, m).astype(np.float32) * 2.0**-6
    return int4_fp8.quantize(jnp.asarray(w)), x8, ts


def float64_product(w, x8, ts):
    w64 = np.asarray(w.fp8_values()).astype(np.float64)
    return (x8.astype(np.float64) @ w64.T) * ts[:, None].astype(np.float64)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a GPU")
@pytest.mark.parametrize("m, n, k, config", [
    (1, 256, 512, None), (17, 320, 640, None), (33, 4096, 1024, None), (256, 1024, 4096, None),
    (300, 640, 4224, im.MatmulConfig(tile_n=128, tile_m=64, stages=3, wg_split="m")),
    (2048, 4096, 4096, None), (200, 576, 128, im.MatmulConfig(tile_n=128, tile_m=64, stages=3)),
    (512, 1024, 1024, im.MatmulConfig(tile_m=256, stages=3, promote=False)),
])
@pytest.mark.parametrize("out_dtype", [jnp.bfloat16, jnp.float16])
def test_gpu_matches_float64_of_the_decoded_operands(m, n, k, config, out_dtype):
    rng = np.random.default_rng(m + n + k)
    w, x8, ts = operands(rng, m, n, k)
    y = im.int4_fp8_matmul(jnp.asarray(x8), w, jnp.asarray(ts), out_dtype=out_dtype, config=config)
    want = float64_product(w, x8, ts)
    assert y.shape == (m, n) and y.dtype == out_dtype
    # the one rounding to the output (RMS relative error: FP16 <= 1e-3, BF16 under half its
    # epsilon); unpromoted, the tensor cores' FP8 sums add ~1.3e-3 at K = 4096
    tol = 1e-3 if out_dtype == jnp.float16 else float(jnp.finfo(jnp.bfloat16).eps) / 2
    assert rel(np.asarray(y, np.float32), want) <= (tol if config is None or config.promote else 2 * tol)
    if m > 1:
        assert not np.asarray(y[-1], np.float32).any()
