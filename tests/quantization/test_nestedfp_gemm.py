"""NestedFP's FP16 mode through the Pallas and CUTLASS GEMMs (``implementation="nestedfp_pallas"``,
``"nestedfp_cutlass"``): what they take and refuse on the CPU; on a GPU the layer's product against
float64 of the merged weights (the kernels themselves: tests/pallas/test_nestedfp_matmul.py,
tests/ffi/test_cutlass_gemm.py)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxlp.formats import fp8, nestedfp
from jaxlp.quantization import QuantizedLinear, nestedfp_gemm

ON_GPU = jax.default_backend() == "gpu"


def layer(w, mode="fp16", implementation="nestedfp_pallas", **kw):
    return QuantizedLinear(nestedfp.quantize(jnp.asarray(w, jnp.float16)), mode=mode, implementation=implementation,
                           **kw)


def test_why_not_names_what_it_does_not_compute():
    rng = np.random.default_rng(0)
    w = rng.uniform(-1, 1, (64, 128))
    x = jnp.ones((4, 128), jnp.float16)
    assert "mode 'fp8'" in nestedfp_gemm.why_not(layer(w, "fp8"), x)
    assert "float16 activations" in nestedfp_gemm.why_not(layer(w), x.astype(jnp.bfloat16))
    assert "no tokens" in nestedfp_gemm.why_not(layer(w), jnp.ones((0, 128), jnp.float16))
    w8 = QuantizedLinear(fp8.quantize(jnp.asarray(w, jnp.float32)), implementation="nestedfp_pallas")
    assert "format" in nestedfp_gemm.why_not(w8, x)
    if not ON_GPU:
        assert "needs a GPU" in nestedfp_gemm.why_not(layer(w), x)
        assert "needs a GPU" in nestedfp_gemm.why_not_cutlass(layer(w), x)
        with pytest.raises(ValueError, match="needs a GPU"):
            layer(w)(x)
    else:
        assert "N of 8" in nestedfp_gemm.why_not_cutlass(layer(w[:60]), x)


def test_auto_tries_them_after_the_small_m_kernel_and_before_xla_merge_then_dot():
    from jaxlp.quantization.linear import KERNELS

    names = list(KERNELS)
    assert names.index("nestedfp_cuda") < names.index("nestedfp_cutlass") < names.index("nestedfp_pallas")
    assert names.index("nestedfp_pallas") < names.index("xla_native")
    assert KERNELS["nestedfp_cutlass"].auto_declines is None  # CUTLASS for every token count it takes


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize("lead", [(1,), (2, 40), (300,), (2, 400)])
@pytest.mark.parametrize("impl", ["nestedfp_pallas", "nestedfp_cutlass"])
def test_gpu_layer_matches_float64(lead, impl):
    rng = np.random.default_rng(len(lead))
    w = rng.uniform(-1.75, 1.75, (320, 512)).astype(np.float16)
    lay = layer(w, out_scale=0.5, implementation=impl)
    x = rng.standard_normal(lead + (512,)).astype(np.float16)
    y = np.asarray(lay(jnp.asarray(x)), np.float64)
    want = 0.5 * (x.astype(np.float64) @ w.astype(np.float64).T)
    assert y.shape == lead + (320,)
    assert np.linalg.norm(y - want) / np.linalg.norm(want) <= 1e-3
    # "auto": CUTLASS past the small-M kernel
    if np.prod(lead) > 8 and impl == "nestedfp_cutlass":
        np.testing.assert_array_equal(np.asarray(layer(w, out_scale=0.5, implementation="auto")(jnp.asarray(x))),
                                      np.asarray(lay(jnp.asarray(x))))
