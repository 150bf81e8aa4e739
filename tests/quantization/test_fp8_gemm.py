"""NestedFP's FP8 mode and W8A8-FP8 through the FP8 GEMMs (``implementation="fp8_pallas"`` and
``"fp8_cutlass"``): what they take and refuse on the CPU; on a GPU the layer's product against
float64 of the quantized operands (the kernels themselves: tests/pallas/test_fp8_matmul.py,
tests/ffi/test_cutlass_gemm.py)."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jaxlp.formats import fp8, nestedfp
from jaxlp.quantization import QuantizedLinear, fp8_gemm

ON_GPU = jax.default_backend() == "gpu"
E4M3 = ml_dtypes.float8_e4m3fn


def rel(y, ref) -> float:
    y, ref = np.asarray(y, np.float64), np.asarray(ref, np.float64)
    return float(np.linalg.norm(y - ref) / max(np.linalg.norm(ref), 1e-30))


def test_why_not_names_what_it_does_not_compute():
    rng = np.random.default_rng(0)
    w = rng.uniform(-1, 1, (64, 128)).astype(np.float32)
    x = jnp.ones((4, 128), jnp.bfloat16)
    nested = nestedfp.quantize(jnp.asarray(w, jnp.float16))
    assert "FP8 mode" in fp8_gemm.why_not(QuantizedLinear(nested, mode="fp16"), x)
    w8 = fp8.quantize(jnp.asarray(w), granularity="channel")
    assert "fp8_token" in fp8_gemm.why_not(QuantizedLinear(w8), x)
    layer = QuantizedLinear(w8, activation="fp8_token")
    assert "bfloat16 or float16" in fp8_gemm.why_not(layer, x.astype(jnp.float32))
    assert "no tokens" in fp8_gemm.why_not(layer, jnp.ones((0, 128), jnp.bfloat16))
    if not ON_GPU:
        assert "needs a GPU" in fp8_gemm.why_not(layer, x)
        assert "needs a GPU" in fp8_gemm.why_not_cutlass(layer, x)
    else:
        odd = QuantizedLinear(fp8.quantize(jnp.asarray(w[:60]), granularity="channel"), activation="fp8_token")
        assert "N of 8" in fp8_gemm.why_not_cutlass(odd, x)


def test_auto_tries_them_after_the_small_m_kernel_and_before_xla_native():
    from jaxlp.quantization.linear import KERNELS

    names = list(KERNELS)
    assert names.index("nestedfp_cuda") < names.index("fp8_cutlass") < names.index("fp8_pallas")
    assert names.index("fp8_pallas") < names.index("xla_native")
    for fast in ("fp8_pallas_fast", "fp8_cutlass_fast"):  # explicit only
        assert names.index(fast) > names.index("xla_native")
    decline = KERNELS["fp8_cutlass"].auto_declines
    layer = QuantizedLinear(fp8.quantize(jnp.ones((64, 128)), granularity="channel"), activation="fp8_token")
    assert "Pallas kernel is as fast" in decline(layer, jnp.ones((2, 32, 128), jnp.bfloat16))  # 64 tokens
    assert decline(layer, jnp.ones((65, 128), jnp.bfloat16)) is None


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize("lead", [(1,), (2, 40), (300,)])
@pytest.mark.parametrize("impl", ["fp8_pallas", "fp8_cutlass"])
def test_gpu_layers_match_float64_of_the_quantized_operands(lead, impl):
    rng = np.random.default_rng(len(lead))
    k, n = 1040, 1000  # N not a multiple of the tile, K not of tile_k
    w = np.clip(rng.standard_normal((n, k)).astype(np.float32) * 0.3, -1.75, 1.75)
    x = rng.standard_normal(lead + (k,)).astype(np.float32) * np.exp(rng.uniform(-3, 3, lead + (1,)))
    x.reshape(-1, k)[0] = 0.0
    # NestedFP FP8 mode, FP16 model
    nested = nestedfp.quantize(jnp.asarray(w, jnp.float16))
    x16 = jnp.asarray(x, jnp.float16)
    xf = np.asarray(x16, np.float32)
    s = np.clip(np.float32(0.7 * 448.0) / np.maximum(np.abs(xf).max(-1, keepdims=True), np.float32(1e-5)),
                np.float32(0.1), np.float32(50.0))
    x8 = np.clip(xf * s, -448, 448).astype(E4M3).astype(np.float64) / s
    upper = np.asarray(nested.upper).view(E4M3).astype(np.float64) * 2.0**-8
    y8 = QuantizedLinear(nested, mode="fp8", implementation=impl, out_scale=0.5)(x16)
    assert y8.dtype == jnp.float16 and y8.shape == lead + (n,)
    assert rel(y8, 0.5 * x8 @ upper.T) <= 1e-3
    # W8A8, BF16 model: against XLA's native dots (same quantized operands)
    w8 = fp8.quantize(jnp.asarray(w), granularity="channel")
    xb = jnp.asarray(x, jnp.bfloat16)
    ours = QuantizedLinear(w8, activation="fp8_token", implementation=impl)(xb)
    native = QuantizedLinear(w8, activation="fp8_token", implementation="xla_native")(xb)
    assert ours.dtype == jnp.bfloat16 and rel(ours, native) <= 8e-3
    assert np.all(np.asarray(ours, np.float32).reshape(-1, n)[0] == 0)
    fast = QuantizedLinear(w8, activation="fp8_token", implementation=impl + "_fast")(xb)
    assert rel(fast, native) <= 8e-3  # K = 1040: the unpromoted FP8 sums stay near BF16 rounding
    # "auto": past NestedFP's small-M kernel, Pallas up to 64 tokens, CUTLASS past them
    if np.prod(lead) > 8 and (impl == "fp8_cutlass") == (np.prod(lead) > fp8_gemm.CUTLASS_MIN_TOKENS):
        auto = QuantizedLinear(nested, mode="fp8", implementation="auto", out_scale=0.5)(x16)
        np.testing.assert_array_equal(np.asarray(auto), np.asarray(y8))
