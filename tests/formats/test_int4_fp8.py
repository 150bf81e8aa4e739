"""FireQ INT4-FP8: exact agreement with a float64 NumPy + ml_dtypes reference."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jaxlp.formats import base
from jaxlp.formats import int4_fp8
from jaxlp.formats.int4_fp8 import Int4FP8Array, cas_scales, pts_factor, quantize, quantize_activation_fp8

F8 = ml_dtypes.float8_e4m3fn


def reference_quantize(w: np.ndarray, group_size: int = 128):
    """float64 reference: (q int8 [..., K], scales float8 [..., G], dequantized float64 [..., K])."""
    w64 = np.asarray(w, np.float64)
    groups = w64.reshape(*w64.shape[:-1], -1, group_size)
    absmax = np.abs(groups).max(-1)
    s = (np.maximum(absmax, 1e-5) / 7).astype(F8).astype(np.float64)
    s = np.maximum(s, 2.0**-9)
    q = np.clip(np.round(groups / s[..., None]), -8, 7)
    deq = (q * s[..., None]).astype(F8).astype(np.float64)
    return q.reshape(w64.shape).astype(np.int8), s.astype(F8), deq.reshape(w64.shape)


def reference_pack(q: np.ndarray) -> np.ndarray:
    nib = q.astype(np.int64) % 16
    return (nib[..., 0::2] + 16 * nib[..., 1::2]).astype(np.uint8)


def check_against_reference(x, group_size=128):
    qa = quantize(jnp.asarray(x), group_size=group_size)
    q_ref, s_ref, deq_ref = reference_quantize(np.asarray(jnp.asarray(x).astype(jnp.float32)), group_size)
    np.testing.assert_array_equal(np.asarray(qa.int4_values()), q_ref)
    np.testing.assert_array_equal(np.asarray(qa.codes), reference_pack(q_ref))
    np.testing.assert_array_equal(np.asarray(qa.scales).view(np.uint8), s_ref.view(np.uint8))
    np.testing.assert_array_equal(np.asarray(qa.dequantize(jnp.float32)), deq_ref.astype(np.float32))
    return qa, q_ref, s_ref


def test_normal_weights():
    rng = np.random.default_rng(201)
    x = (rng.standard_normal((16, 512)) * 0.02).astype(np.float32)
    qa, q_ref, _ = check_against_reference(x)
    assert qa.codes.shape == (16, 256) and qa.scales.shape == (16, 4) and qa.scales.dtype == jnp.float8_e4m3fn
    assert qa.nbytes == 16 * (256 + 4) and qa.bits_per_element == 4 + 8 / 128
    # The table emulation matters: fp8(q * s) differs from q * s somewhere.
    assert np.any(np.asarray(qa.dequantize()) != q_ref * np.asarray(qa.scales).astype(np.float32).repeat(128, -1))


def test_heavy_tailed_bf16_weights():
    rng = np.random.default_rng(202)
    x = jnp.asarray(rng.standard_t(2, (4, 3, 256)) * 0.05, jnp.bfloat16)
    qa, _, _ = check_against_reference(x)
    assert qa.shape == (4, 3, 256)
    assert qa.dequantize(jnp.bfloat16).dtype == jnp.bfloat16


def test_zero_and_tiny_groups_hit_the_scale_clamp():
    rng = np.random.default_rng(203)
    x = (rng.standard_normal((6, 256)) * 0.03).astype(np.float32)
    x[0, :128] = 0.0  # zero group
    x[1, 128:] = rng.standard_normal(128) * 1e-4  # absmax / 7 rounds to 0 -> 2**-9
    x[2, :128] = rng.uniform(-1, 1, 128) * 6e-3  # absmax / 7 ~ 2**-10 .. 2**-9
    x[3, :128] = rng.uniform(-1, 1, 128) * 0.05  # subnormal scales
    x[4, 128:] = np.linspace(-1e-2, 1e-2, 128)
    qa, q_ref, s_ref = check_against_reference(x)
    scales = s_ref.astype(np.float64)
    assert scales[0, 0] == 2.0**-9 and scales[1, 1] == 2.0**-9
    assert np.all(q_ref[0, :128] == 0)
    assert q_ref.min() == -8 and q_ref.max() == 7  # tiny scales make the clip bite


def test_exact_ties_round_half_to_even():
    # Groups whose absmax is 7 s for an E4M3 scale s (so the scale is exactly s), filled with
    # (n + 1/2) s: every quotient is an exact tie, which a reciprocal multiply would misround.
    f8 = np.arange(256, dtype=np.uint8).view(F8).astype(np.float64)
    scales = np.unique(np.abs(f8[np.isfinite(f8)]))
    scales = scales[(scales >= 2.0**-6) & (scales <= 8)]
    halves = np.tile(np.arange(-7, 7) + 0.5, 10)[:127]  # |.| <= 6.5 < 7
    exact = np.concatenate([np.full((len(scales), 1), 7.0), halves[None].repeat(len(scales), 0)], 1) * scales[:, None]
    x = exact.astype(np.float32)
    assert np.all(x.astype(np.float64) == exact)
    qa, q_ref, s_ref = check_against_reference(x)
    np.testing.assert_array_equal(s_ref.astype(np.float64)[:, 0], scales)
    assert np.all(q_ref[:, 1:] % 2 == 0)  # ties went to even
    # Near-ties one ulp either side round away from the tie.
    up = np.nextafter(x, np.float32(np.inf))
    up[:, 0] = x[:, 0]
    check_against_reference(up)


def test_other_group_sizes_and_errors():
    rng = np.random.default_rng(204)
    check_against_reference((rng.standard_normal((3, 64)) * 0.1).astype(np.float32), group_size=32)
    with pytest.raises(ValueError, match="multiple of the block size"):
        quantize(jnp.zeros((2, 200)))
    with pytest.raises(ValueError, match="NaN or Inf"):
        quantize(jnp.full((1, 128), jnp.nan))
    with pytest.raises(ValueError, match="group_size"):
        quantize(jnp.zeros((1, 128)), group_size=3)
    with pytest.raises(ValueError, match="floating-point"):
        quantize(jnp.zeros((1, 128), jnp.int32))


def test_saturation_instead_of_nan():
    x = np.zeros((1, 128), np.float32)
    x[0, :3] = [5000.0, -3000.0, 400.0]  # absmax / 7 > 448
    qa = quantize(jnp.asarray(x))
    deq = np.asarray(qa.dequantize())
    assert np.all(np.isfinite(deq)) and float(np.asarray(qa.scales).astype(np.float32)[0, 0]) == 448.0
    assert deq[0, 0] == 448.0 and deq[0, 1] == -448.0


def test_table_holds_every_code_times_its_groups_scale():
    """table(): e4m3(q * s) for q = -8 .. 7 per group (the kernels' pre-scaled lookup), against
    float64 products rounded by ml_dtypes (saturating at 448 as the format does), on normal, tiny
    (scale floor) and saturating groups."""
    rng = np.random.default_rng(3)
    x = rng.standard_normal((3, 384)).astype(np.float32)
    x[1, :128] *= 1e-6
    x[2, 128:256] *= 1e4
    qa = quantize(jnp.asarray(x))
    table = np.asarray(qa.table())
    assert table.shape == (3, 3, 16) and table.dtype == F8
    s = np.asarray(qa.scales).astype(np.float64)
    want = np.clip(s[..., None] * np.arange(-8, 8), -448, 448).astype(F8)
    np.testing.assert_array_equal(table.view(np.uint8), want.view(np.uint8))
    q = np.asarray(qa.int4_values()).reshape(3, 3, 128) + 8
    np.testing.assert_array_equal(np.take_along_axis(table, q, axis=-1).reshape(3, 384).astype(np.float32),
                                  np.asarray(qa.dequantize(jnp.float32)))


def test_jit_registry_and_pytree():
    rng = np.random.default_rng(205)
    x = jnp.asarray(rng.standard_t(3, (8, 256)) * 0.02, jnp.bfloat16)  # bf16: many exact ties
    eager = quantize(x)
    jitted = jax.jit(quantize)(x)
    np.testing.assert_array_equal(np.asarray(jitted.codes), np.asarray(eager.codes))
    np.testing.assert_array_equal(np.asarray(jitted.scales).view(np.uint8), np.asarray(eager.scales).view(np.uint8))
    np.testing.assert_array_equal(np.asarray(jax.jit(lambda q: q.dequantize())(eager)), np.asarray(eager.dequantize()))
    check_against_reference(x)
    x_act = jnp.asarray(rng.standard_normal((4, 96)), jnp.bfloat16)
    for eager_out, jit_out in zip(quantize_activation_fp8(x_act), jax.jit(quantize_activation_fp8)(x_act)):
        np.testing.assert_array_equal(np.asarray(jit_out, np.float32), np.asarray(eager_out, np.float32))
    via_registry = base.quantize(x, "int4_fp8")
    assert isinstance(via_registry, Int4FP8Array)
    assert via_registry.static_fields() == {"shape": (8, 256), "group_size": 128}
    np.testing.assert_array_equal(np.asarray(base.dequantize(via_registry)), np.asarray(eager.dequantize()))


def test_activation_fp8_matches_numpy():
    rng = np.random.default_rng(206)
    x = (rng.standard_normal((5, 7, 96)) * np.exp(rng.uniform(-4, 4, (5, 7, 1)))).astype(np.float32)
    x[0, 0] = 0.0  # a zero row
    x_fp8, scale = quantize_activation_fp8(jnp.asarray(x))
    assert x_fp8.dtype == jnp.float8_e4m3fn and scale.dtype == jnp.bfloat16 and scale.shape == (5, 7, 1)
    s32 = np.abs(x).max(-1, keepdims=True) / np.float32(448)
    safe = np.where(s32 > 0, s32, np.float32(1))
    ref = np.clip(x / safe, -448, 448).astype(F8)
    np.testing.assert_array_equal(np.asarray(x_fp8).view(np.uint8), ref.view(np.uint8))
    np.testing.assert_array_equal(np.asarray(scale).view(np.uint16), s32.astype(ml_dtypes.bfloat16).view(np.uint16))
    assert np.all(np.asarray(x_fp8)[0, 0].astype(np.float32) == 0) and float(scale[0, 0, 0]) == 0.0
    back = np.asarray(int4_fp8.dequantize_activation_fp8(x_fp8, scale))
    assert np.all(back[0, 0] == 0)
    # Each row's max maps to +-448 (up to fp32 rounding of the division).
    assert np.allclose(np.abs(np.asarray(x_fp8).astype(np.float32)).max(-1)[1:], 448)
    np.testing.assert_allclose(back, x, rtol=2**-3, atol=0)  # E4M3 relative step plus the BF16 scale
    with pytest.raises(ValueError, match="NaN or Inf"):
        quantize_activation_fp8(jnp.array([[1.0, np.inf]]))


def test_activation_fp8_exact_ties():
    # Rows with scale c (absmax 448 c) holding c * (E4M3 midpoints): x / c is an exact tie.
    f8 = np.arange(256, dtype=np.uint8).view(F8).astype(np.float64)
    grid = np.unique(f8[np.isfinite(f8) & (f8 >= 0)])
    mids = ((grid[1:] + grid[:-1]) / 2)[-64:]
    c = np.array([1.125, 1.25, 1.375, 0.75, 0.625, 3.5 * 2.0**-8])
    x = np.concatenate([np.full((len(c), 1), 448.0), np.tile(mids, (len(c), 1))], 1) * c[:, None]
    x[:, 1::2] *= -1
    x = x.astype(np.float32)
    x_fp8, scale = quantize_activation_fp8(jnp.asarray(x))
    np.testing.assert_array_equal(np.asarray(scale, np.float64)[:, 0], c)
    ref = (x.astype(np.float64) / c[:, None]).astype(F8)  # exact quotients, RNE ties to even
    np.testing.assert_array_equal(np.asarray(x_fp8).view(np.uint8), ref.view(np.uint8))


def brute_force_pts(w: np.ndarray, group_size: int = 128) -> float:
    w64 = np.asarray(w, np.float64)
    best_p, best_score = 1.0, None
    for i in range(15):
        p = 2.0**i
        absmax = np.abs((w64 * p).reshape(-1, group_size)).max(-1)
        if np.any(absmax > 448):
            break
        score = np.sum(np.maximum(0.0, 7 * 2.0**-9 - absmax)) / (7 * 2.0**-9)
        if best_score is None or score < best_score:
            best_p, best_score = p, score
    return best_p


def test_pts_hand_cases():
    w = np.zeros((2, 128), np.float32)
    w[0, 5] = 1.0  # allows p <= 256
    w[1, 9] = 2.0**-9  # score at p: max(0, 1 - p/7) -> zero from p = 8 on
    assert float(pts_factor(jnp.asarray(w))) == 8.0
    w[1, 9] = 2.0**-20  # still underflows at p = 256: the largest valid p wins
    assert float(pts_factor(jnp.asarray(w))) == 256.0
    w[0, 5] = 500.0  # already overflows at p = 1
    assert float(pts_factor(jnp.asarray(w))) == 1.0
    w[0, 5] = 0.01  # no overflow up to p = 2**14 = 16384 * 0.01 = 163.84
    w[1, 9] = 0.0  # a zero group scores 1 at every p: tie -> smallest p
    assert float(pts_factor(jnp.asarray(w))) == 2.0  # 0.01 * 2 >= 7 * 2**-9 ~= 0.0137


def test_pts_matches_brute_force():
    rng = np.random.default_rng(207)
    for trial in range(6):
        scale = 10.0 ** rng.uniform(-5, 0)
        w = (rng.standard_normal((8, 384)) * scale).astype(np.float32)
        w[rng.integers(0, 8), :128] *= 10.0 ** rng.uniform(-4, 3)
        assert float(pts_factor(jnp.asarray(w))) == brute_force_pts(w), trial
    w = (rng.standard_normal((4, 256)) * 1e-4).astype(np.float32)
    assert float(jax.jit(pts_factor)(jnp.asarray(w))) == brute_force_pts(w)


def test_cas_matches_numpy():
    rng = np.random.default_rng(208)
    gate = (rng.standard_normal((48, 64)) * rng.uniform(0.01, 1, 64)).astype(np.float32)
    up = (rng.standard_normal((32, 64)) * 0.1).astype(np.float32)
    gate[:, 3] = 0.0
    up[:, 3] = 0.0
    s = np.asarray(cas_scales([jnp.asarray(gate), jnp.asarray(up)], 0.0096))
    with np.errstate(divide="ignore"):
        ref = 0.0096 / np.abs(np.concatenate([gate, up]).astype(np.float64)).mean(0)
    ref[3] = 1.0
    np.testing.assert_allclose(s, ref, rtol=1e-6)
    s_one = np.asarray(cas_scales([jnp.asarray(up)], 0.015))
    live = np.arange(64) != 3
    np.testing.assert_allclose(s_one[live], 0.015 / np.abs(up[:, live].astype(np.float64)).mean(0), rtol=1e-6)
    assert s_one[3] == 1.0
    with pytest.raises(ValueError, match="disagree on K"):
        cas_scales([jnp.zeros((2, 4)), jnp.zeros((2, 5))], 0.01)
    with pytest.raises(ValueError, match="non-empty list"):
        cas_scales([], 0.01)
    with pytest.raises(ValueError, match=r"\[N, K\]"):
        cas_scales([jnp.zeros(4)], 0.01)
    with pytest.raises(ValueError, match="positive"):
        cas_scales([jnp.ones((2, 4))], 0.0)


def test_check_and_checkpoint_round_trip(tmp_path):
    from jaxlp import checkpoint

    x = jnp.asarray(np.random.default_rng(209).standard_normal((4, 256)) * 0.02, jnp.float32)
    q = quantize(x)
    q.check()
    checkpoint.save(tmp_path / "ckpt", {"w": q})
    back = checkpoint.load(tmp_path / "ckpt")["w"]
    assert isinstance(back, Int4FP8Array) and back.static_fields() == q.static_fields()
    np.testing.assert_array_equal(np.asarray(back.dequantize()), np.asarray(q.dequantize()))
    with pytest.raises(ValueError, match="scales"):
        Int4FP8Array(codes=q.codes, scales=q.scales.astype(jnp.float32), shape=q.shape).check()
    with pytest.raises(ValueError, match="codes"):
        Int4FP8Array(codes=q.codes[:, :64], scales=q.scales, shape=q.shape).check()
    with pytest.raises(ValueError, match="multiple of the block size"):
        Int4FP8Array(codes=q.codes, scales=q.scales, shape=(4, 200)).check()
