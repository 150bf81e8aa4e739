"""Quantized models round-trip through save_quantized / from_pretrained bit-exactly."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxlp
from jaxlp.formats import QuantizedArray
from jaxlp.errors import CheckpointFormatError
from jaxlp.models import ModelConfig, Transformer
from jaxlp.quantization import quantize_model, save_quantized, set_mode


@pytest.fixture(scope="module")
def model():
    cfg = ModelConfig(model_type="qwen3", vocab_size=128, hidden_size=128, intermediate_size=256, num_layers=2,
                      num_heads=4, num_kv_heads=2, head_dim=32, qk_norm=True, qkv_bias=True)
    return Transformer(cfg, dtype=jnp.bfloat16, rngs=nnx.Rngs(1))


@pytest.mark.parametrize("recipe", ["w4a4-nvfp4", "w4a8-fireq", "nestedfp", "w4a4-dialect", "w8a8-fp8"])
def test_round_trip_is_bit_exact(model, tmp_path, recipe):
    q = quantize_model(model, recipe, calibration=np.arange(64).reshape(2, 32))
    save_quantized(q, tmp_path / "q")
    loaded = jaxlp.from_pretrained(tmp_path / "q")
    is_q = lambda x: isinstance(x, QuantizedArray)  # noqa: E731
    a = jax.tree.leaves(nnx.state(q), is_leaf=is_q)
    b = jax.tree.leaves(nnx.state(loaded), is_leaf=is_q)
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert type(x) is type(y)
        for u, v in zip(jax.tree.leaves(x), jax.tree.leaves(y)):
            assert u.dtype == v.dtype and np.array_equal(np.atleast_1d(np.asarray(u)).view(np.uint8), np.atleast_1d(np.asarray(v)).view(np.uint8))
        if is_q(x):
            assert x.static_fields() == y.static_fields()
    ids = jnp.asarray([[3, 4, 5, 6, 7]])
    np.testing.assert_array_equal(np.asarray(loaded(ids)), np.asarray(q(ids)))
    assert loaded.quantization.quantized == q.quantization.quantized
    if recipe == "nestedfp":  # the FP8 mode is reachable from the loaded bytes too
        np.testing.assert_array_equal(np.asarray(set_mode(loaded, "fp8")(ids)), np.asarray(set_mode(q, "fp8")(ids)))


def test_corrupt_and_partial_checkpoints(model, tmp_path):
    q = quantize_model(model, "w4a16-nvfp4")
    save_quantized(q, tmp_path / "q")
    with pytest.raises(FileExistsError):
        save_quantized(q, tmp_path / "q")
    meta = tmp_path / "q" / "jaxlp_model.json"
    good = meta.read_text()
    meta.write_text(good[:50])
    with pytest.raises(CheckpointFormatError, match="corrupt jaxlp_model.json"):
        jaxlp.from_pretrained(tmp_path / "q")
    broken = json.loads(good)
    broken["layers"]["layers.7.mlp.up_proj"] = broken["layers"]["layers.0.mlp.up_proj"]
    meta.write_text(json.dumps(broken))
    with pytest.raises(CheckpointFormatError, match="layers.7.mlp.up_proj"):
        jaxlp.from_pretrained(tmp_path / "q")
    with pytest.raises(ValueError, match="quantize_model"):
        save_quantized(model, tmp_path / "plain")


def test_round_trip_with_a_quantized_lm_head(model, tmp_path):
    """``lm_head=True``: the quantized output projection (weight-only, under a W4A4 recipe) is saved
    and loaded like the decoder layers, bit-exactly."""
    from jaxlp.quantization import QuantizedLinear, get_recipe

    q = quantize_model(model, get_recipe("w4a4-nvfp4").replace(lm_head=True), calibration=np.arange(64).reshape(2, 32))
    save_quantized(q, tmp_path / "q")
    loaded = jaxlp.from_pretrained(tmp_path / "q")
    assert isinstance(loaded.lm_head, QuantizedLinear) and loaded.lm_head.activation is None
    assert "lm_head" in loaded.quantization.quantized
    for u, v in zip(jax.tree.leaves(q.lm_head.weight), jax.tree.leaves(loaded.lm_head.weight)):
        assert u.dtype == v.dtype and np.array_equal(np.atleast_1d(np.asarray(u)).view(np.uint8),
                                                     np.atleast_1d(np.asarray(v)).view(np.uint8))
    ids = jnp.asarray([[3, 4, 5, 6, 7]])
    np.testing.assert_array_equal(np.asarray(loaded(ids)), np.asarray(q(ids)))
