"""NVFP4 dispatch across the three CUDA kernels (CPU: the table, fallbacks, lowering)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxlp.ffi import nvfp4 as ffi_nvfp4
from jaxlp.formats import nvfp4
from jaxlp.quantization import QuantizedLinear
from jaxlp.quantization import nvfp4_dispatch as dispatch

PIPE = {"kernel": "pipe", "rows_per_warp": 2, "split": 2}
GEMM = {"kernel": "gemm", "block_m": 64, "block_n": 128, "split": 2}
TABLE = {
    "shapes": [
        {"n": 4096, "k": 4096, "w4a16": [[1, {"rows_per_warp": 1, "k_split": 8}], [8, PIPE], [64, GEMM], [512, "xla"]],
         "w4a4": [[8, PIPE], [128, GEMM]]},
    ],
}


def _weight(n, k, seed):
    w = np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32)
    return nvfp4.quantize(jnp.asarray(w))


def test_plan_picks_each_kernel_family():
    p = lambda m, mode="w4a16": dispatch.plan(m, 4096, 4096, mode, TABLE)  # noqa: E731
    assert p(1) == ffi_nvfp4.GemvConfig(1, 8)
    assert p(2) == p(8) == ffi_nvfp4.GemvConfig(2, kernel="pipe", split=2)
    assert p(9) == p(64) == ffi_nvfp4.GemvConfig(kernel="gemm", block_m=64, block_n=128, split=2)
    assert p(65) is None and p(5000) is None  # XLA won at the largest M
    # Above the largest benchmarked M the GEMM is kept when it won there.
    assert p(129, "w4a4") == p(8000, "w4a4") == ffi_nvfp4.GemvConfig(kernel="gemm", block_m=64, split=2)


def test_config_choice_round_trip():
    for cfg in (ffi_nvfp4.GemvConfig(2, 4), ffi_nvfp4.GemvConfig(1, kernel="pipe", split=4),
                ffi_nvfp4.GemvConfig(kernel="gemm", block_m=128, block_n=64, split=4)):
        assert dispatch._choice_config(dispatch.config_choice(cfg)) == cfg
        assert ffi_nvfp4.GemvConfig.from_name(cfg.name) == cfg
    assert dispatch.config_choice(None) == dispatch.XLA


def test_unsupported_reasons():
    pipe, gemm = ffi_nvfp4.GemvConfig(kernel="pipe"), ffi_nvfp4.GemvConfig(kernel="gemm", split=4)
    assert pipe.unsupported(8, 4096, jnp.bfloat16, False) is None
    assert "multiple of 64" in pipe.unsupported(8, 4112, jnp.bfloat16, False)
    assert "bfloat16" in pipe.unsupported(8, 4096, jnp.float32, False)
    assert pipe.unsupported(8, 4096, jnp.float32, True) is None  # W4A4 stages FP32 activations
    assert "1..32" in pipe.unsupported(33, 4096, jnp.bfloat16, False)
    assert gemm.unsupported(5000, 4096, jnp.bfloat16, False) is None
    assert "split" in gemm.unsupported(64, 192, jnp.bfloat16, False)
    assert "bfloat16 or float32" in ffi_nvfp4.GemvConfig().unsupported(1, 64, jnp.float16, False)
    with pytest.raises(ValueError, match="kernel"):
        ffi_nvfp4.GemvConfig(kernel="wgmma")
    with pytest.raises(ValueError, match="block_n"):
        ffi_nvfp4.GemvConfig(block_n=32)
    with pytest.raises(ValueError, match="configuration name"):
        ffi_nvfp4.GemvConfig.from_name("G64")


def _lowered(layer, x, config=None):
    f = jax.jit(lambda x: dispatch.nvfp4_matmul(layer, x, config=config))
    return f.trace(x).lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize("k,dtype,target", [
    (1024, jnp.bfloat16, ffi_nvfp4.MATMUL_TARGET),  # the pipe kernel takes it
    (1040, jnp.bfloat16, ffi_nvfp4.GEMV_TARGET),    # K % 64 != 0: the regs GEMV
    (1024, jnp.float32, ffi_nvfp4.GEMV_TARGET),     # FP32 W4A16: the regs GEMV
])
def test_unsupported_choice_falls_back_to_regs(k, dtype, target):
    layer = QuantizedLinear(_weight(64, k, 1))
    text = _lowered(layer, jnp.ones((4, k), dtype), ffi_nvfp4.GemvConfig(kernel="pipe"))
    assert f"custom_call @{target}(" in text
    other = ({ffi_nvfp4.MATMUL_TARGET, ffi_nvfp4.GEMV_TARGET} - {target}).pop()
    assert f"custom_call @{other}(" not in text


def test_gemm_unsupported_at_large_m_falls_back_to_xla():
    layer = QuantizedLinear(_weight(64, 1040, 2))
    text = _lowered(layer, jnp.ones((100, 1040), jnp.bfloat16), ffi_nvfp4.GemvConfig(kernel="gemm"))
    assert "custom_call @jaxlp_nvfp4_" not in text and "dot_general" in text


def test_w4a4_passes_the_amax_to_the_kernel():
    """No XLA op derives g_x on the kernel path: the amax goes to the custom call (xg_amax = 1)."""
    layer = QuantizedLinear(_weight(64, 1024, 3), activation="nvfp4", act_amax=jnp.float32(5.0))
    for cfg in (ffi_nvfp4.GemvConfig(), ffi_nvfp4.GemvConfig(kernel="pipe"), ffi_nvfp4.GemvConfig(kernel="gemm")):
        text = _lowered(layer, jnp.ones((8, 1024), jnp.bfloat16), cfg)
        assert "xg_amax = 1 : i64" in text and "mode = 1 : i64" in text
        assert "stablehlo.divide" not in text
    with pytest.raises(ValueError, match="not both"):
        ffi_nvfp4.nvfp4_gemv(jnp.ones((1, 1024), jnp.bfloat16), layer.weight.get_value(),
                             act_tensor_scale=jnp.float32(1.0), act_amax=jnp.float32(1.0))
