"""The row layout of fused projections grouped per tensor-parallel device (jaxlp.models.fused_layout)."""

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

from jaxlp.models import ModelConfig
from jaxlp.models.fused_layout import fused_order, fused_parts, part_rows

CONFIG = ModelConfig(model_type="qwen3", vocab_size=128, hidden_size=128, intermediate_size=256, num_layers=2,
                     num_heads=4, num_kv_heads=2, head_dim=32, qk_norm=True)


def test_fused_order_and_part_rows():
    c = dataclasses.replace(CONFIG, fused_projections=True, fused_shards=2)  # q 128, k 64, v 64 rows
    order = fused_order(c, "qkv_proj")
    np.testing.assert_array_equal(order, np.concatenate([np.arange(0, 64), np.arange(128, 160), np.arange(192, 224),
                                                         np.arange(64, 128), np.arange(160, 192), np.arange(224, 256)]))
    np.testing.assert_array_equal(np.sort(order), np.arange(256))
    np.testing.assert_array_equal(fused_order(c, "gate_up_proj")[part_rows(c, "gate_up_proj", 1)], np.arange(256, 512))
    np.testing.assert_array_equal(part_rows(c, "qkv_proj", 1), np.concatenate([np.arange(64, 96), np.arange(192, 224)]))
    with pytest.raises(ValueError, match="unknown fused projection"):
        fused_order(c, "o_proj")


@pytest.mark.parametrize("shards", [1, 2, 4])
def test_fused_parts_inverts_the_grouping(shards):
    """Outputs laid out by fused_order come apart into the parts, each in its own order."""
    sizes = (8, 4, 4)
    c = dataclasses.replace(CONFIG, num_heads=8, num_kv_heads=4, head_dim=1, intermediate_size=8,
                            fused_projections=True, fused_shards=shards)
    whole = np.random.default_rng(shards).standard_normal((2, 3, sum(sizes))).astype(np.float32)
    grouped = whole[..., fused_order(c, "qkv_proj")]
    parts = fused_parts(jnp.asarray(grouped), sizes, shards)
    for got, want in zip(parts, np.split(whole, np.cumsum(sizes)[:-1], axis=-1)):
        np.testing.assert_array_equal(np.asarray(got), want)
