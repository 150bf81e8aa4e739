"""quantize_model: layer selection, calibration, the reference product, NestedFP modes, PTS/CAS."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxlp
from jaxlp.models import ModelConfig, Transformer
from jaxlp.models.layers import Linear
from jaxlp.quantization import RECIPES, QuantizedLinear, get_recipe, quantize_model, quantized_layers, set_mode
from jaxlp.quantization.activations import fake_quantize


def tiny(model_type="llama", **kw):
    cfg = ModelConfig(model_type=model_type, vocab_size=128, hidden_size=128, intermediate_size=256, num_layers=2,
                      num_heads=4, num_kv_heads=2, head_dim=32, **kw)
    return Transformer(cfg, dtype=jnp.float32, rngs=nnx.Rngs(0))


@pytest.fixture(scope="module")
def model():
    return tiny()


def ids(seed, shape=(2, 16)):
    return jnp.asarray(np.random.default_rng(seed).integers(0, 128, shape))


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_every_recipe_quantizes_decoder_linears_only(model, name):
    q = quantize_model(model, name, calibration=ids(1, (4, 32)))
    paths = {p for p, _ in quantized_layers(q)}
    assert paths == set(q.quantization.quantized) and len(paths) == 14  # 7 linears x 2 layers
    assert all(".self_attn." in p or ".mlp." in p for p in paths)
    assert isinstance(q.layers[0].self_attn.q_proj, QuantizedLinear)
    assert isinstance(model.layers[0].self_attn.q_proj, Linear)  # the original is untouched (a copy)
    out, ref = np.asarray(q(ids(0))), np.asarray(model(ids(0)))
    assert np.isfinite(out).all()
    rel = np.linalg.norm(out - ref) / np.linalg.norm(ref)
    assert 0 < rel < 0.35, rel  # changed by quantization, but still the same model


@jax.default_matmul_precision("highest")  # float32 dots on a GPU default to TF32
def test_reference_product_against_float64(model):
    rng = np.random.default_rng(3)
    for name in ["w4a4-nvfp4", "w8a8-fp8", "w4a8-fireq", "w4a4-dialect", "w4a4-mxfp4"]:
        recipe = get_recipe(name)
        w = jnp.asarray(rng.standard_normal((48, 128)) * 0.05, jnp.float32)
        x = jnp.asarray(rng.standard_normal((3, 5, 128)), jnp.float32)
        qw = jaxlp.formats.quantize(w, recipe.weight_format, **dict(recipe.weight_options))
        amax = jnp.float32(2.5)
        layer = QuantizedLinear(qw, jnp.arange(48.0), activation=recipe.activation, act_amax=amax)
        xq = np.asarray(fake_quantize(x, recipe.activation, amax), np.float64)
        expected = xq @ np.asarray(qw.dequantize(jnp.float32), np.float64).T + np.arange(48.0)
        np.testing.assert_allclose(np.asarray(layer(x)), expected, rtol=2e-5, atol=2e-5)


@jax.default_matmul_precision("highest")
@pytest.mark.parametrize("name", ["w4a16-nvfp4", "w4a4-nvfp4", "w4a8-fireq"])
def test_lm_head_option_quantizes_the_output_projection_weight_only(model, name):
    """``lm_head=True``: the output projection in the recipe's weight format, its input left alone
    (no activation quantizer, no calibration of it), the decoder layers as without the option; the
    logits are the float64 product with the dequantized weight (times FireQ's PTS output scale)."""
    q = quantize_model(model, get_recipe(name).replace(lm_head=True), calibration=ids(1, (4, 32)))
    assert "lm_head" in q.quantization.quantized and len(q.quantization.quantized) == 15
    head = q.lm_head
    assert isinstance(head, QuantizedLinear) and head.activation is None and head.act_amax is None
    assert head.weight.format == get_recipe(name).weight_format
    assert q.layers[0].mlp.down_proj.activation == get_recipe(name).activation
    hidden = jnp.asarray(np.random.default_rng(2).standard_normal((3, 128)), jnp.float32)
    expected = (np.asarray(hidden, np.float64) @ np.asarray(head.weight.dequantize(jnp.float32), np.float64).T
                * head.out_scale)
    np.testing.assert_allclose(np.asarray(q.logits(hidden)), expected, rtol=1e-5, atol=1e-5)
    assert isinstance(model.lm_head, Linear)  # the original is untouched
    rel = np.linalg.norm(np.asarray(q.logits(hidden)) - np.asarray(model.logits(hidden)))
    assert 0 < rel / np.linalg.norm(np.asarray(model.logits(hidden))) < 0.2  # quantized, the same projection


def test_lm_head_option_refuses_tied_and_excluded_heads(model):
    recipe = get_recipe("w4a16-nvfp4").replace(lm_head=True)
    with pytest.raises(ValueError, match="ties its output projection to the embeddings"):
        quantize_model(tiny(tie_word_embeddings=True), recipe)
    with pytest.raises(ValueError, match="exclude='lm_head' removes it"):
        quantize_model(model, recipe.replace(exclude="lm_head"))
    assert not get_recipe("w4a16-nvfp4").selects("lm_head") and recipe.selects("lm_head")


def test_nvfp4_activations_saturate_at_calibrated_amax():
    x = jnp.asarray([[0.5] * 15 + [100.0]], jnp.float32)
    xq = np.asarray(fake_quantize(x, "nvfp4", jnp.float32(1.0)))
    assert xq[0, -1] == pytest.approx(1.0, rel=1e-6)  # 448 * 6 * g = amax
    assert abs(xq[0, 0] - 0.5) < 0.1


def test_calibration_amax_is_the_max_input(model):
    calib = ids(5, (3, 24))
    q = quantize_model(model, "w4a4-nvfp4", calibration=calib, calibration_batch_size=2)
    x = model.embed_tokens(calib)
    expected = jnp.max(jnp.abs(model.layers[0].input_layernorm(x)))
    np.testing.assert_allclose(float(q.layers[0].self_attn.q_proj.act_amax[...]), float(expected), rtol=1e-6)
    np.testing.assert_allclose(float(q.layers[0].self_attn.v_proj.act_amax[...]), float(expected), rtol=1e-6)


def test_errors(model):
    with pytest.raises(ValueError, match="unknown recipe"):
        quantize_model(model, "w3a3")
    with pytest.raises(ValueError, match="calibration"):
        quantize_model(model, "w4a4-nvfp4")
    with pytest.raises(ValueError, match="selects no linear"):
        quantize_model(model, get_recipe("w4a16-nvfp4").replace(include="nothing"))
    with pytest.raises(ValueError, match="outside the model's vocabulary"):
        quantize_model(model, "w4a4-nvfp4", calibration=np.full((1, 4), 500))
    with pytest.raises(ValueError, match="unknown implementation"):
        quantize_model(model, "w4a16-nvfp4", implementation="cutlass")


def test_nestedfp_modes_share_bytes_and_fp16_is_exact(model):
    q = quantize_model(model, "nestedfp")
    half = nnx.clone(model)
    for path, layer in quantized_layers(q):
        lin = half
        for p in path.split("."):
            lin = lin[int(p)] if p.isdigit() else getattr(lin, p)
        lin.weight.set_value(lin.weight[...].astype(jnp.float16).astype(jnp.float32))
    np.testing.assert_allclose(np.asarray(q(ids(2))), np.asarray(half(ids(2))), rtol=1e-5, atol=1e-5)
    before = jax.tree.leaves(nnx.state(q))
    fp16_out = np.asarray(q(ids(2)))
    set_mode(q, "fp8")
    fp8_out = np.asarray(q(ids(2)))
    assert all(a is b for a, b in zip(before, jax.tree.leaves(nnx.state(q))))  # same stored arrays
    assert not np.allclose(fp8_out, fp16_out)
    assert np.linalg.norm(fp8_out - fp16_out) / np.linalg.norm(fp16_out) < 0.2


def test_nestedfp_exception_layer_stays_high_precision():
    m = tiny()
    m.layers[1].mlp.down_proj.weight.set_value(m.layers[1].mlp.down_proj.weight[...].at[0, 0].set(3.0))
    q = quantize_model(m, "nestedfp")
    assert isinstance(q.layers[1].mlp.down_proj, Linear)
    assert q.quantization.kept[0][0] == "layers.1.mlp.down_proj"


@jax.default_matmul_precision("highest")
def test_cas_folding_preserves_the_function():
    for model_type, extra in [("llama", {}), ("gemma3_text", dict(norm_offset=True, sandwich_norm=True))]:
        m = tiny(model_type, **extra)
        ref = np.asarray(m(ids(4)))
        # CAS with an identity-precision "format": fold, then write the scaled weights back.
        from jaxlp.quantization import model as qm

        clone = nnx.clone(m)
        layers = qm.linear_layers(clone, get_recipe("w4a8-fireq"))
        weights = {p: lin.weight[...] for p, (_, _, lin) in layers.items()}
        qm._apply_cas(clone, weights)
        for p, (_, _, lin) in layers.items():
            lin.weight.set_value(weights[p])
        assert not np.allclose(weights["layers.0.mlp.up_proj"], m.layers[0].mlp.up_proj.weight[...])
        np.testing.assert_allclose(np.asarray(clone(ids(4))), ref, rtol=1e-4, atol=1e-4 * np.abs(ref).max())


def test_pts_output_scale_undoes_weight_scaling(model):
    small = nnx.clone(model)
    for _, module in nnx.iter_modules(small):
        if isinstance(module, Linear):  # tiny weights: group scales would clamp at 2**-9
            module.weight.set_value(module.weight[...] * 0.01)
    q = quantize_model(small, get_recipe("w4a8-fireq").replace(cas=False))
    scales = [layer.out_scale for _, layer in quantized_layers(q)]
    assert all(s < 1.0 and np.log2(1 / s) == int(np.log2(1 / s)) for s in scales)
    no_pts = quantize_model(small, get_recipe("w4a8-fireq").replace(cas=False, pts=False))
    ref = np.asarray(small(ids(7)))
    err_pts = np.linalg.norm(np.asarray(q(ids(7))) - ref)
    err_plain = np.linalg.norm(np.asarray(no_pts(ids(7))) - ref)
    assert err_pts < 0.5 * err_plain


def test_quantized_model_generates(model):
    q = quantize_model(model, "w4a4-nvfp4", calibration=ids(6, (2, 16)))
    r = jaxlp.generate(q, [[1, 2, 3], [4, 5]], max_new_tokens=6, stop_tokens=())
    assert r.tokens.shape == (2, 6) and (r.num_tokens == 6).all()
