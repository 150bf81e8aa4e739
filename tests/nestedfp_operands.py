"""FP16 weights for the NestedFP GEMM tests (``tests/pallas/test_nestedfp_matmul.py``,
``tests/ffi/test_cutlass_gemm.py``)."""

import numpy as np


def weights(rng, n, k):
    """FP16 weights over NestedFP's range: random, +-1.75, subnormals, zero rows."""
    w = rng.uniform(-1.75, 1.75, (n, k)).astype(np.float16)
    w[0, :] = 1.75
    w[1, :] = -1.75
    w[2, : k // 2] = np.float16(2.0**-20)  # FP16 subnormals
    w[3, :] = 0
    return w
