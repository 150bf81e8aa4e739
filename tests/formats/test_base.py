"""Format-independent operations on quantized arrays (jaxlp.formats.base)."""

import jax.numpy as jnp
import numpy as np
import pytest

from jaxlp import formats


@pytest.mark.parametrize("fmt", formats.formats())
def test_take_rows_is_exact_for_every_format(fmt):
    rng = np.random.default_rng(7)
    q = formats.quantize(jnp.asarray(0.3 * rng.standard_normal((24, 256)), jnp.float32), fmt)  # NestedFP: |w| < 1.75
    rows = rng.permutation(24)[:17]
    t = formats.take_rows(q, rows)
    assert t.shape == (17, 256) and t.format == q.format
    np.testing.assert_array_equal(np.asarray(formats.dequantize(t)), np.asarray(formats.dequantize(q))[rows])
    for bad in ([24], [-1], [[0, 1]], [0.5]):
        with pytest.raises(ValueError, match="row indices in"):
            formats.take_rows(q, np.asarray(bad))
