"""The MXFP4 / DialectFP4 dispatch (jaxlp.quantization.block_fp4_dispatch) off a GPU: its choices, its
reasons and the fallback of ``"auto"``. On a GPU: tests/ffi/test_block_fp4_gpu.py."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxlp.ffi import block_fp4
from jaxlp.formats import dialect_fp4, mxfp4, nvfp4
from jaxlp.quantization import QuantizedLinear
from jaxlp.quantization import block_fp4_dispatch as dispatch
from jaxlp.quantization.linear import KERNELS

OFF_GPU = jax.default_backend() != "gpu"


def test_default_config_by_tokens():
    for tokens in (1, 8, 16):
        assert dispatch.default_config(tokens, 4096, 4096).name == "P2C1"
    assert dispatch.default_config(17, 4096, 12288).name == "G64x64S2"
    assert dispatch.default_config(64, 12288, 4096).name == "G128x64S2"
    assert dispatch.default_config(65, 12288, 4096) is None
    for tokens in (1, 16, 17, 64):
        cfg = dispatch.default_config(tokens, 4096, 4096)
        assert block_fp4.why_not(mxfp4.quantize(jnp.ones((64, 256))), tokens, jnp.bfloat16, cfg) is None


def test_listed_for_auto():
    assert dispatch.IMPLEMENTATION in KERNELS


def test_reasons_name_the_problem():
    x = jnp.ones((2, 256), jnp.bfloat16)
    assert "'nvfp4'" in dispatch.why_not(QuantizedLinear(nvfp4.quantize(jnp.ones((64, 256)))), x)
    layer = QuantizedLinear(mxfp4.quantize(jnp.ones((64, 256))), activation="fp8_token")
    assert "'fp8_token'" in dispatch.why_not(layer, x)
    layer = QuantizedLinear(mxfp4.quantize(jnp.ones((64, 256)), block_size=16))
    assert "blocks of 16" in dispatch.why_not(layer, x)
    layer = QuantizedLinear(dialect_fp4.quantize(jnp.ones((64, 256))))
    assert "float32" in dispatch.why_not(layer, x.astype(jnp.float32))


@pytest.mark.skipif(not OFF_GPU, reason="checks the reasons off a GPU")
@pytest.mark.parametrize("fmt", ["mxfp4", "dialect_fp4"])
def test_off_a_gpu_auto_is_the_reference_and_the_kernel_says_why(fmt):
    q = (mxfp4 if fmt == "mxfp4" else dialect_fp4).quantize(jnp.asarray(np.random.default_rng(0).standard_normal(
        (64, 256)), jnp.float32))
    x = jnp.asarray(np.random.default_rng(1).standard_normal((3, 256)), jnp.bfloat16)
    layer = QuantizedLinear(q, activation=fmt, implementation="auto")
    np.testing.assert_array_equal(np.asarray(layer(x), np.float32), np.asarray(layer.reference(x), np.float32))
    assert "not available" in dispatch.why_not(layer, x)
    assert "GPU" in dispatch.why_not(layer, jnp.ones((100, 256), jnp.bfloat16))
    layer.set_implementation(dispatch.IMPLEMENTATION)
    with pytest.raises(ValueError, match="block_fp4_cuda"):
        layer(x)
