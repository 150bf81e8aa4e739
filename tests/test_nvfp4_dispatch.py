"""NVFP4 dispatch: the measured table, the XLA large-M path, registration (CPU)."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jaxlp.ffi import nvfp4 as ffi_nvfp4
from jaxlp.formats import nvfp4
from jaxlp.quantization import QuantizedLinear, implementations
from jaxlp.quantization import nvfp4_dispatch as dispatch
from jaxlp.pallas import nvfp4_matmul as pallas_nvfp4
from jaxlp.quantization.activations import fake_quantize

TABLE = {
    "shapes": [
        {"n": 4096, "k": 4096, "w4a16": [[8, {"rows_per_warp": 1, "k_split": 8}], [32, {"rows_per_warp": 2, "k_split": 4}],
                                         [128, "xla"]],
         "w4a4": [[4, {"rows_per_warp": 1, "k_split": 4}], [128, "xla"]]},
        {"n": 25600, "k": 5120, "w4a16": [[2, {"rows_per_warp": 2, "k_split": 8}], [128, "xla"]]},
    ],
}


def test_plan_follows_the_table():
    p = lambda m, n=4096, k=4096, mode="w4a16": dispatch.plan(m, n, k, mode, TABLE)  # noqa: E731
    assert p(1) == p(8) == ffi_nvfp4.GemvConfig(1, 8)
    assert p(9) == p(32) == ffi_nvfp4.GemvConfig(2, 4)  # the next larger benchmarked M decides
    assert p(33) is None and p(5000) is None
    assert p(4, mode="w4a4") == ffi_nvfp4.GemvConfig(1, 4) and p(5, mode="w4a4") is None
    assert p(2, 24000, 6000) == ffi_nvfp4.GemvConfig(2, 8) and p(3, 24000, 6000) is None  # nearest shape
    assert p(2, 24000, 6000, "w4a4") == ffi_nvfp4.GemvConfig(1, 4)  # nearest shape that has the mode
    with pytest.raises(ValueError, match="mode"):
        dispatch.plan(1, 16, 16, "w8a8", TABLE)


def test_shipped_table_is_valid():
    table = dispatch.load_table()
    for e in table["shapes"]:
        for mode in ("w4a16", "w4a4"):
            if mode in e:
                for m in (1, 2, 4, 8, 16, 32, 64, 128):
                    cfg = dispatch.plan(m, e["n"], e["k"], mode, table)
                    assert cfg is None or isinstance(cfg, (ffi_nvfp4.GemvConfig, pallas_nvfp4.MatmulConfig))
    assert dispatch.plan(1, 4096, 4096, "w4a16") is not None or table["shapes"]


def _weight(n, k, seed):
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((n, k)).astype(np.float32) * rng.uniform(0.05, 2, (n, 1)).astype(np.float32)
    return nvfp4.quantize(jnp.asarray(w))


@pytest.mark.parametrize("m,n,k,seed", [(1, 24, 48, 1), (64, 40, 272, 2), (130, 17, 128, 3)])
def test_dequantize_dot_w4a4_is_exact_emulation(m, n, k, seed):
    q = _weight(n, k, seed)
    x = jnp.asarray(np.random.default_rng(seed + 50).standard_normal((m, k)) * 3, jnp.float32)
    amax = jnp.float32(float(np.abs(np.asarray(x)).max()) * 0.5)  # saturating
    y = np.asarray(jax.jit(dispatch.dequantize_dot)(x, q, dispatch.act_tensor_scale(amax)), np.float64)
    ref = np.asarray(fake_quantize(x, "nvfp4", amax), np.float64) @ np.asarray(q.dequantize(), np.float64).T
    assert np.linalg.norm(y - ref) / np.linalg.norm(ref) < 1e-6
    # BF16 operands: the decoded values are exact in BF16, only the output is rounded.
    yb = np.asarray(dispatch.dequantize_dot(x.astype(jnp.bfloat16), q, dispatch.act_tensor_scale(amax)), np.float64)
    xb = np.asarray(fake_quantize(x.astype(jnp.bfloat16), "nvfp4", amax), np.float64)
    refb = (xb @ np.asarray(q.dequantize(), np.float64).T).astype(ml_dtypes.bfloat16).astype(np.float64)
    assert np.linalg.norm(yb - refb) / np.linalg.norm(refb) < 1e-3


def test_dequantize_dot_w4a16_matches_reference():
    q = _weight(48, 160, 7)
    x = jnp.asarray(np.random.default_rng(8).standard_normal((5, 160)), jnp.bfloat16)
    y = np.asarray(dispatch.dequantize_dot(x, q).astype(jnp.float32), np.float64)
    exact = np.asarray(x.astype(jnp.float32), np.float64) @ np.asarray(q.dequantize(), np.float64).T
    assert np.linalg.norm(y - exact) / np.linalg.norm(exact) < 4e-3  # BF16 output rounding only
    layer = QuantizedLinear(q)
    ref = np.asarray(layer.reference(x).astype(jnp.float32), np.float64)
    assert np.linalg.norm(y - ref) / np.linalg.norm(ref) < 1e-2


def test_registered_and_cpu_falls_back_to_reference():
    assert dispatch.IMPLEMENTATION in implementations()
    q = _weight(32, 64, 9)
    x = jnp.asarray(np.random.default_rng(10).standard_normal((3, 64)), jnp.float32)
    layer = QuantizedLinear(q, implementation="auto")
    if ffi_nvfp4.on_gpu():
        pytest.skip("checks the CPU fallback; this machine has a GPU")
    assert not dispatch.supports(layer, x)  # no GPU here
    np.testing.assert_array_equal(np.asarray(layer(x)), np.asarray(layer.reference(x)))
    forced = np.asarray(dispatch.nvfp4_matmul(layer, x, force="xla"))
    np.testing.assert_allclose(forced, np.asarray(layer.reference(x)), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("m,expect_call", [(1, True), (200, False)])
def test_lowering_for_cuda_follows_the_plan(m, expect_call):
    q = _weight(4096, 256, 11)
    amax = jnp.float32(3.0)
    layer = QuantizedLinear(q, activation="nvfp4", act_amax=amax)
    x = jnp.ones((m, 1, 256), jnp.bfloat16)
    f = jax.jit(lambda x: dispatch.nvfp4_matmul(layer, x))
    text = f.trace(x).lower(lowering_platforms=("cuda",)).as_text()
    assert (f"custom_call @{ffi_nvfp4.GEMV_TARGET}" in text) == expect_call
    assert f"tensor<{m}x1x4096xbf16>" in text


def test_large_m_cuda_activation_quantizer_lowers_to_one_custom_call():
    q = _weight(64, 256, 12)
    x = jnp.ones((300, 256), jnp.bfloat16)
    f = jax.jit(lambda x: dispatch.dequantize_dot(x, q, jnp.float32(0.01), act_quantizer="cuda"))
    text = f.trace(x).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count(f"custom_call @{ffi_nvfp4.QUANTIZE_TARGET}") == 1 and "tensor<300x128xui8>" in text
    with pytest.raises(ValueError, match="act_quantizer"):
        dispatch.dequantize_dot(x, q, jnp.float32(0.01), act_quantizer="triton")


DEVICE_TABLE = {
    "default": dispatch.DEFAULT_RULE,
    "fallback": "NVIDIA H200",
    "devices": {
        "NVIDIA H200": {"date": "2026-11-21", "shapes": [
            {"n": 4096, "k": 4096, "w4a16": [[8, {"rows_per_warp": 2, "k_split": 4}],
                                             [32, {"kernel": "pipe", "rows_per_warp": 2, "split": 2}],
                                             [128, "xla"]]}]},
        "NVIDIA H100 80GB HBM3": {"date": "2026-11-22", "shapes": [
            {"n": 4096, "k": 4096, "w4a16": [[8, {"kernel": "pipe16", "rows_per_warp": 1, "split": 2}]]}]},
    },
}


def test_device_keyed_table_picks_the_running_gpu_else_the_fallback():
    h100 = dispatch.device_table(DEVICE_TABLE, "NVIDIA H100 80GB HBM3")
    assert h100["device"] == "NVIDIA H100 80GB HBM3" and h100["default"] == dispatch.DEFAULT_RULE
    assert dispatch.plan(4, 4096, 4096, "w4a16", h100) == ffi_nvfp4.GemvConfig(1, kernel="pipe16", split=2)
    # Above the H100's benchmarked M: the fallback GPU's choice (not XLA by default).
    assert dispatch.plan(16, 4096, 4096, "w4a16", h100) == ffi_nvfp4.GemvConfig(2, kernel="pipe", split=2)
    assert dispatch.plan(100, 4096, 4096, "w4a16", h100) is None
    for kind in ("NVIDIA H200", "NVIDIA B200", None):
        t = dispatch.device_table(DEVICE_TABLE, kind)
        assert t["device"] == "NVIDIA H200"
        assert dispatch.plan(4, 4096, 4096, "w4a16", t) == ffi_nvfp4.GemvConfig(2, 4)
    assert dispatch.device_table(TABLE, "NVIDIA H100 80GB HBM3") is TABLE  # one-device form as it is
    with pytest.raises(ValueError, match="shapes"):
        dispatch.device_table({"devices": {"x": {}}}, "x")
    # The one-device form converts losslessly; the shipped file loads for either GPU.
    one = dispatch.split_by_device({"device": "NVIDIA H200", "date": "d", "shapes": TABLE["shapes"]})
    assert one["fallback"] == "NVIDIA H200" and dispatch.device_table(one, None)["shapes"] == TABLE["shapes"]
    for kind in ("NVIDIA H200", "NVIDIA H100 80GB HBM3"):
        assert dispatch.load_table(None, kind)["shapes"]


def test_pipe16_config_names_and_limits():
    cfg = ffi_nvfp4.GemvConfig(2, kernel="pipe16", split=4)
    assert cfg.name == "H2C4" and ffi_nvfp4.GemvConfig.from_name("H2C4") == cfg
    assert dispatch._choice_config(dispatch.config_choice(cfg)) == cfg
    assert cfg.unsupported(8, 4096, jnp.float32, False) is None  # FP32 W4A16 via the FP16 staging
    assert "multiple of 64" in cfg.unsupported(8, 4112, jnp.bfloat16, False)
    assert "1..32" in cfg.unsupported(33, 4096, jnp.bfloat16, True)


@pytest.mark.parametrize("w4a4", [False, True])
def test_pipe16_lowers_to_the_gemv_call(w4a4):
    q = _weight(300, 1024, 13)
    cfg = ffi_nvfp4.GemvConfig(1, kernel="pipe16", split=2)
    g = jnp.float32(0.01) if w4a4 else None
    f = jax.jit(lambda x: ffi_nvfp4.nvfp4_gemv(x, q, act_tensor_scale=g, config=cfg))
    text = f.trace(jnp.ones((5, 1024), jnp.bfloat16)).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count(f"custom_call @{ffi_nvfp4.GEMV_TARGET}") == 1
    assert "kernel = 3" in text and "split = 2" in text
    with pytest.raises(ValueError, match="multiple of 64"):
        ffi_nvfp4.nvfp4_gemv(jnp.ones((5, 1040), jnp.bfloat16), _weight(16, 1040, 14), config=cfg)


SMALL_M_VARIANTS = [
    ffi_nvfp4.GemvConfig(1, 8, blocks_per_sm=3),
    ffi_nvfp4.GemvConfig(1, 4, blocks_per_sm=3, accumulators=2),
    ffi_nvfp4.GemvConfig(2, 8, accumulators=2),
    ffi_nvfp4.GemvConfig(1, kernel="pipe16", stages=2),
    ffi_nvfp4.GemvConfig(2, kernel="pipe16", split=2, stages=2, accumulators=2),
    ffi_nvfp4.GemvConfig(1, kernel="pipe16", accumulators=2),
]


def test_small_m_variant_names_table_form_and_limits():
    names = [c.name for c in SMALL_M_VARIANTS]
    assert names == ["R1KS8B3", "R1KS4B3A2", "R2KS8A2", "H1C1S2", "H2C2S2A2", "H1C1A2"]
    for cfg in SMALL_M_VARIANTS:
        assert cfg.is_small_m_variant
        assert ffi_nvfp4.GemvConfig.from_name(cfg.name) == cfg
        assert dispatch._choice_config(dispatch.config_choice(cfg)) == cfg
        assert cfg.unsupported(8, 4096, jnp.bfloat16, True) is None
        assert "1..8" in cfg.unsupported(9, 4096, jnp.bfloat16, False)
    # Default configurations keep their old table form (no new keys), so older tables read the same.
    assert dispatch.config_choice(ffi_nvfp4.GemvConfig(1, 8)) == {"rows_per_warp": 1, "k_split": 8}
    assert dispatch.config_choice(SMALL_M_VARIANTS[0]) == {"rows_per_warp": 1, "k_split": 8, "blocks_per_sm": 3}
    assert not ffi_nvfp4.GemvConfig(1, kernel="pipe16").is_small_m_variant
    for bad, match in ((dict(blocks_per_sm=3, rows_per_warp=2), "rows_per_warp=1"),
                       (dict(blocks_per_sm=3, kernel="pipe16"), "regs"), (dict(blocks_per_sm=2), "0 .* or 3"),
                       (dict(accumulators=2, kernel="pipe"), "variant"), (dict(accumulators=3), "1 or 2"),
                       (dict(stages=2), "pipe16"), (dict(stages=3, kernel="pipe16"), "0 .* or 2")):
        with pytest.raises(ValueError, match=match):
            ffi_nvfp4.GemvConfig(**bad)


def test_small_m_variant_table_choice_and_fallback():
    table = {"shapes": [{"n": 4096, "k": 4096, "w4a16": [[1, {"rows_per_warp": 1, "k_split": 8, "blocks_per_sm": 3}],
                                                         [8, {"kernel": "pipe16", "rows_per_warp": 1, "split": 1,
                                                              "stages": 2, "accumulators": 2}],
                                                         [32, {"rows_per_warp": 2, "k_split": 4}]]}]}
    assert dispatch.plan(1, 4096, 4096, "w4a16", table) == SMALL_M_VARIANTS[0]
    assert dispatch.plan(5, 4096, 4096, "w4a16", table).name == "H1C1S2A2"
    assert dispatch.plan(9, 4096, 4096, "w4a16", table).name == "R2KS4"


@pytest.mark.parametrize("cfg", SMALL_M_VARIANTS[:1] + SMALL_M_VARIANTS[4:5])
def test_small_m_variant_lowers_with_its_attributes(cfg):
    q = _weight(300, 1024, 15)
    f = jax.jit(lambda x: ffi_nvfp4.nvfp4_gemv(x, q, config=cfg))
    text = f.trace(jnp.ones((5, 1024), jnp.bfloat16)).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count(f"custom_call @{ffi_nvfp4.GEMV_TARGET}") == 1
    for attr in ("blocks_per_sm", "accumulators", "stages"):
        assert f"{attr} = {getattr(cfg, attr)}" in text


PALLAS_CHOICE = {"kernel": "pallas", "tile_n": 64, "tile_m": 128, "tile_k": 128, "stages": 3}
PALLAS_TABLE = {
    "fallback": "NVIDIA H200",
    "devices": {
        "NVIDIA H200": {"shapes": [
            {"n": 4096, "k": 4096, "w4a16": [[8, {"rows_per_warp": 2, "k_split": 4}], [64, {"kernel": "gemm"}],
                                             [512, "xla"]]}]},
        "NVIDIA H100 80GB HBM3": {"shapes": [
            {"n": 4096, "k": 4096, "w4a16": [[8, {"rows_per_warp": 1, "k_split": 8}], [64, {"kernel": "gemm"}],
                                             [128, PALLAS_CHOICE], [512, "xla"], [2048, PALLAS_CHOICE]]}]},
    },
}


def test_pallas_choices():
    h100 = dispatch.device_table(PALLAS_TABLE, "NVIDIA H100 80GB HBM3")
    p = lambda m: dispatch.plan(m, 4096, 4096, "w4a16", h100)  # noqa: E731
    assert p(8) == ffi_nvfp4.GemvConfig(1, 8)
    assert p(9) == p(64) == ffi_nvfp4.GemvConfig(kernel="gemm")
    assert p(65) == p(128) == pallas_nvfp4.MatmulConfig(tile_n=64, tile_m=128, tile_k=128, stages=3)
    assert p(129) is None and p(512) is None
    assert isinstance(p(2048), pallas_nvfp4.MatmulConfig)
    assert p(4096) is None  # above this GPU's measurements: the fallback GPU's choice (XLA there)
    # Without a fallback GPU a tensor-core kernel is kept above the largest M.
    alone = {"shapes": PALLAS_TABLE["devices"]["NVIDIA H100 80GB HBM3"]["shapes"]}
    assert isinstance(dispatch.plan(100000, 4096, 4096, "w4a16", alone), pallas_nvfp4.MatmulConfig)
    # The table form round-trips.
    for cfg in (pallas_nvfp4.MatmulConfig(tile_n=64, tile_m=256, tile_k=64, stages=4),
                pallas_nvfp4.MatmulConfig(tile_m=8, tile_k=256, stages=8, split_k=4)):
        assert dispatch._choice_config(dispatch.config_choice(cfg)) == cfg
    with pytest.raises(ValueError, match="tile_k"):
        dispatch._choice_config({"kernel": "pallas", "tile_k": 96})


@pytest.mark.parametrize("w4a4", [False, True])
def test_pallas_choice_lowers_to_a_mosaic_kernel(w4a4, monkeypatch):
    """The hook runs the Pallas kernel where the table says so (W4A4 through the CUDA quantizer);
    FP32 activations go to XLA instead."""
    monkeypatch.setattr(dispatch, "plan", lambda *a, **k: pallas_nvfp4.MatmulConfig(tile_k=64))
    q = _weight(128, 256, 13)
    layer = QuantizedLinear(q, activation="nvfp4" if w4a4 else None, act_amax=jnp.float32(3.0) if w4a4 else None)
    x = jnp.ones((200, 256), jnp.bfloat16)
    text = jax.jit(lambda x: dispatch.nvfp4_matmul(layer, x)).trace(x).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text and "tensor<200x128xbf16>" in text
    assert (f"custom_call @{ffi_nvfp4.QUANTIZE_TARGET}" in text) == w4a4
    x32 = x.astype(jnp.float32)
    text = jax.jit(lambda x: dispatch.nvfp4_matmul(layer, x)).trace(x32).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" not in text
