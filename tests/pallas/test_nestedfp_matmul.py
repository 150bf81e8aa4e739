"""The Pallas NestedFP16 matmul: its register arithmetic (:func:`merge_words`) exhaustively against
the format's merge, its checks on the CPU; on a GPU the kernel against float64 NumPy of the merged
FP16 weights (skipped without a CUDA GPU: Pallas' GPU interpreter does not take a register WGMMA
operand)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from nestedfp_operands import weights

from jaxlp.formats import nestedfp
from jaxlp.pallas import nestedfp_matmul as nm

ON_GPU = jax.devices()[0].platform == "gpu"


def test_merge_words_rebuilds_every_byte_pair_as_the_format_does():
    u, low = np.meshgrid(np.arange(256, dtype=np.uint8), np.arange(256, dtype=np.uint8), indexing="ij")
    got = np.asarray(nm.merge_words(jnp.asarray(u), jnp.asarray(low))).view(np.uint16)
    want = np.asarray(nestedfp.merge(jnp.asarray(u), jnp.asarray(low))).view(np.uint16)
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("lane", range(4))
def test_merge_packed_words_rebuilds_every_byte_pair_in_every_lane(lane):
    """The kernel's 32-bit merge (one PTX block per pair of weights): all 65,536 byte pairs in each
    of a word's 4 byte positions, the other positions random (a lane's borrow must not reach its
    neighbour)."""
    rng = np.random.default_rng(lane)
    u, low = (a.ravel() for a in np.meshgrid(np.arange(256, dtype=np.uint8), np.arange(256, dtype=np.uint8),
                                               indexing="ij"))
    planes = []
    for plane in (u, low):
        b = rng.integers(0, 256, (plane.size, 4), dtype=np.uint8)
        b[:, lane] = plane
        planes.append(b.view("<u4")[:, 0])
    words = np.asarray(nm.merge_packed_words(jnp.asarray(planes[0]), jnp.asarray(planes[1])))
    got = words.astype("<u4").view(np.uint16).reshape(-1, 4)[:, lane]
    want = np.asarray(nestedfp.merge(jnp.asarray(u), jnp.asarray(low))).view(np.uint16)
    np.testing.assert_array_equal(got, want)


def test_reference_is_the_float64_product_of_the_merged_weights_rounded_once():
    rng = np.random.default_rng(7)
    w16 = weights(rng, 96, 192)
    x = rng.standard_normal((5, 192)).astype(np.float16)
    got = np.asarray(nm.reference(jnp.asarray(x), nestedfp.quantize(jnp.asarray(w16))), np.float64)
    want = (x.astype(np.float64) @ w16.astype(np.float64).T).astype(np.float16).astype(np.float64)
    np.testing.assert_allclose(got, want, rtol=2.0**-10, atol=2.0**-24)


def test_config_and_operands_are_checked():
    with pytest.raises(ValueError, match="tile_n"):
        nm.MatmulConfig(tile_n=96)
    with pytest.raises(ValueError, match="tile_m"):
        nm.MatmulConfig(tile_m=12)
    with pytest.raises(ValueError, match="tile_k"):
        nm.MatmulConfig(tile_k=32)
    with pytest.raises(ValueError, match="a_operand"):
        nm.MatmulConfig(a_operand="tmem")
    with pytest.raises(ValueError, match="merge"):
        nm.MatmulConfig(merge="cuda")
    with pytest.raises(ValueError, match="shared memory"):
        nm._check(jnp.zeros((8, 64), jnp.float16), nestedfp.quantize(jnp.zeros((64, 64))),
                  nm.MatmulConfig(tile_n=256, tile_m=256, tile_k=128, stages=8))
    w = nestedfp.quantize(jnp.zeros((64, 128)))
    with pytest.raises(ValueError, match="float16"):
        nm.nestedfp_matmul(jnp.zeros((8, 128), jnp.bfloat16), w)
    with pytest.raises(ValueError, match="K mismatch"):
        nm.nestedfp_matmul(jnp.zeros((8, 64), jnp.float16), w)
    with pytest.raises(ValueError, match="NestedFPArray"):
        nm.nestedfp_matmul(jnp.zeros((8, 128), jnp.float16), jnp.zeros((64, 128), jnp.float16))
    assert nm.MatmulConfig(tile_n=64, tile_m=16, tile_k=128).padded_shape(20, 200, 300) == (32, 256, 384)


@pytest.mark.parametrize("m, n, k, config", [
    (1, 256, 512, None), (8, 320, 640, None), (33, 4096, 1024, None), (256, 1024, 4096, None),
    (300, 640, 4160, nm.MatmulConfig(tile_n=64, tile_m=64, tile_k=64, stages=3, wg_split="m")),
    (2048, 4096, 4096, None), (200, 576, 1024, nm.MatmulConfig(tile_m=128, merge="jnp")),
    (128, 1024, 2048, nm.MatmulConfig(tile_n=128, tile_m=64, tile_k=64, stages=3, a_operand="smem")),
    (96, 640, 1024, nm.MatmulConfig(tile_m=64, tile_k=128, stages=3)),
    (512, 1024, 1024, nm.MatmulConfig(tile_m=256, tile_k=64, stages=3, a_operand="smem"))])
@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
def test_gpu_matches_float64_of_the_merged_weights(m, n, k, config):
    rng = np.random.default_rng(m + n + k)
    w16 = weights(rng, n, k)
    w = nestedfp.quantize(jnp.asarray(w16))
    x = rng.standard_normal((m, k)).astype(np.float16)
    if m > 1:
        x[-1] = 0  # an all-zero row
    y = np.asarray(nm.nestedfp_matmul(jnp.asarray(x), w, config=config), np.float64)
    want = x.astype(np.float64) @ w16.astype(np.float64).T
    assert y.shape == (m, n) and np.isfinite(y).all()
    assert np.linalg.norm(y - want) / np.linalg.norm(want) <= 1e-3
    if m > 1:
        np.testing.assert_array_equal(y[-1], 0.0)
