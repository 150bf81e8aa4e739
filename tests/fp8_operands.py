"""E4M3 operands of the FP8 GEMM tests (``tests/pallas/test_fp8_matmul.py``,
``tests/ffi/test_cutlass_gemm.py``) and their float64 product."""

import ml_dtypes
import numpy as np

E4M3 = ml_dtypes.float8_e4m3fn


def operands(rng, m, n, k):
    """E4M3 operands over the format's range: random, +-448 (saturation), subnormals, a zero row."""
    x = (rng.standard_normal((m, k)) * 40).clip(-448, 448).astype(E4M3)
    w = (rng.standard_normal((n, k)) * 40).clip(-448, 448).astype(E4M3)
    w[0, :] = 448
    w[1, : k // 2] = -448
    w[2, :] = np.float32(2.0**-8)  # an E4M3 subnormal
    if m > 1:
        x[-1] = 0  # an all-zero token
    ts = rng.uniform(0.5, 2.0, m).astype(np.float32) * 2.0**-10
    cs = rng.uniform(0.5, 2.0, n).astype(np.float32) * 2.0**-8
    return x, w, ts, cs


def float64_product(x, w, ts, cs):
    return (x.astype(np.float64) @ w.astype(np.float64).T) * ts[:, None].astype(np.float64) * cs[None, :]
