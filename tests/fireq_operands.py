"""FireQ test operands shared by the kernel and layer tests (``tests/ffi/test_fireq_cuda.py``,
``tests/quantization/test_fireq_kernels.py``)."""

import numpy as np


def rel(y, ref) -> float:
    y, ref = np.asarray(y, np.float64), np.asarray(ref, np.float64)
    return float(np.linalg.norm(y - ref) / max(np.linalg.norm(ref), 1e-30))


def weights(rng, n, k):
    w = rng.standard_normal((n, k)).astype(np.float32) * 0.05
    w[1] = 0.0  # an all-zero output channel: the scale floor
    w[2, :128] = np.linspace(-3136, 3136, 128)  # scale 448, codes -8..7: saturated products
    w[3, -128:] *= 1e-4  # a group near the scale floor
    return w
