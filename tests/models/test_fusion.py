"""fuse_projections: one qkv_proj and one gate_up_proj per layer, the same model function."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxlp
from jaxlp import formats
from jaxlp.formats import nvfp4
from jaxlp.models import ModelConfig, Transformer, fuse_projections
from jaxlp.models.fused_layout import fused_order, group_rows
from jaxlp.quantization import quantize_model, save_quantized
from jaxlp.quantization.recipes import get_recipe

CONFIGS = {
    "qwen3": ModelConfig(model_type="qwen3", vocab_size=128, hidden_size=128, intermediate_size=256, num_layers=2,
                         num_heads=4, num_kv_heads=2, head_dim=32, qk_norm=True),
    "qwen2_bias": ModelConfig(model_type="qwen2", vocab_size=128, hidden_size=128, intermediate_size=256,
                              num_layers=2, num_heads=4, num_kv_heads=1, head_dim=32, qkv_bias=True, mlp_bias=True),
    "qwen2_bias_kv2": ModelConfig(model_type="qwen2", vocab_size=128, hidden_size=128, intermediate_size=256,
                                  num_layers=2, num_heads=4, num_kv_heads=2, head_dim=32, qkv_bias=True,
                                  mlp_bias=True),
    "gemma3": ModelConfig(model_type="gemma3_text", vocab_size=128, hidden_size=128, intermediate_size=256,
                          num_layers=2, num_heads=4, num_kv_heads=1, head_dim=32, qk_norm=True, norm_offset=True,
                          sandwich_norm=True, hidden_act="gelu_pytorch_tanh", embed_scale=128**0.5),
}


def _random(config, seed, dtype=jnp.float32):
    """Every parameter random (biases too), so a row put in the wrong place cannot go unnoticed."""
    model = Transformer(config, dtype=dtype, rngs=nnx.Rngs(seed))
    rng = np.random.default_rng(seed)
    flat = nnx.to_flat_state(nnx.state(model))
    for _, var in flat:
        v = var.get_value()
        var.set_value(jnp.asarray(0.5 + 0.1 * rng.standard_normal(v.shape) if v.ndim == 1 else
                                  0.1 * rng.standard_normal(v.shape), dtype))
    nnx.update(model, nnx.from_flat_state(flat))
    return model


def _ids(seed, shape=(2, 9)):
    return jnp.asarray(np.random.default_rng(seed).integers(0, 128, shape))


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_fused_model_computes_the_same_logits(name):
    model = _random(CONFIGS[name], seed=3)
    fused = fuse_projections(model)
    assert fused.config.fused_projections and not model.config.fused_projections  # a copy by default
    attn, mlp = fused.layers[0].self_attn, fused.layers[0].mlp
    assert not hasattr(attn, "q_proj") and not hasattr(mlp, "gate_proj")
    nq, nkv = CONFIGS[name].num_heads * 32, CONFIGS[name].num_kv_heads * 32
    assert attn.qkv_proj.weight.shape == (nq + 2 * nkv, 128) and mlp.gate_up_proj.weight.shape == (512, 128)
    np.testing.assert_array_equal(np.asarray(attn.qkv_proj.weight[...][nq : nq + nkv]),
                                  np.asarray(model.layers[0].self_attn.k_proj.weight[...]))
    ids = _ids(1)
    np.testing.assert_allclose(np.asarray(fused(ids)), np.asarray(model(ids)), rtol=1e-5, atol=1e-5)
    assert fuse_projections(fused) is fused


def test_fused_generation_gives_the_same_tokens():
    model = _random(CONFIGS["qwen3"], seed=5, dtype=jnp.bfloat16)
    prompts = [[3, 4, 5, 6], [7, 8]]
    a = jaxlp.generate(model, prompts, max_new_tokens=6, stop_tokens=[])
    b = jaxlp.generate(fuse_projections(model), prompts, max_new_tokens=6, stop_tokens=[])
    assert [list(t) for t in a.tokens] == [list(t) for t in b.tokens]


def test_quantizing_a_fused_model_shares_the_nvfp4_tensor_scale():
    """Fuse then quantize == quantize q, k, v with one tensor scale (amax over the three), as ModelOpt exports."""
    model = _random(CONFIGS["qwen3"], seed=7)
    q = quantize_model(fuse_projections(model), "w4a16-nvfp4")
    assert "layers.1.self_attn.qkv_proj" in q.quantization.quantized
    attn = model.layers[1].self_attn
    parts = [attn.q_proj.weight[...], attn.k_proj.weight[...], attn.v_proj.weight[...]]
    amax = max(float(jnp.max(jnp.abs(w))) for w in parts)
    expected = formats.concatenate_rows([nvfp4.quantize(w, amax=amax) for w in parts])
    got = q.layers[1].self_attn.qkv_proj.weight.get_value()
    for field in ("data", "block_scale", "tensor_scale"):
        np.testing.assert_array_equal(np.atleast_1d(np.asarray(getattr(got, field))).view(np.uint8),
                                      np.atleast_1d(np.asarray(getattr(expected, field))).view(np.uint8))


@pytest.mark.parametrize("recipe", ["w4a16-mxfp4", "w8a16-fp8", "w4a4-dialect"])
def test_fusing_a_quantized_model_is_exact(recipe):
    """Formats without a tensor scale fuse after quantization: the same codes, the same logits."""
    model = _random(CONFIGS["qwen2_bias"], seed=11)
    q = quantize_model(model, recipe, calibration=np.arange(32).reshape(2, 16))
    fused = fuse_projections(q)
    expected = {f"layers.{i}.{p}" for i in range(2)
                for p in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")}
    assert set(fused.quantization.quantized) == expected and len(fused.quantization.quantized) == 8
    w = fused.layers[0].mlp.gate_up_proj.weight.get_value()
    ref = jnp.concatenate([q.layers[0].mlp.gate_proj.weight.get_value().dequantize(),
                           q.layers[0].mlp.up_proj.weight.get_value().dequantize()])
    np.testing.assert_array_equal(np.asarray(w.dequantize()), np.asarray(ref))
    ids = _ids(2)
    np.testing.assert_allclose(np.asarray(fused(ids)), np.asarray(q(ids)), rtol=1e-5, atol=1e-5)


def test_fusing_refuses_what_cannot_share_one_linear():
    model = _random(CONFIGS["qwen3"], seed=13)
    q = quantize_model(model, "w4a16-nvfp4")  # q, k, v quantized apart: three tensor scales
    with pytest.raises(ValueError, match=r"layers\.0\.self_attn: nvfp4: field 'tensor_scale' is per tensor"):
        fuse_projections(q)
    assert hasattr(q.layers[0].self_attn, "q_proj")  # left as it was
    mixed = quantize_model(model, get_recipe("w4a16-mxfp4").replace(exclude=r".*\.k_proj"))
    with pytest.raises(ValueError, match=r"layers\.0\.self_attn: cannot fuse a mix"):
        fuse_projections(mixed)


# --- rows grouped per tensor-parallel device (ModelConfig.fused_shards) ---------------------------


@pytest.mark.parametrize("name", ["qwen3", "qwen2_bias_kv2"])
def test_rows_grouped_per_device_hold_each_devices_heads_and_columns(name):
    """Device d's block of qkv_proj is [q_d k_d v_d] (its query and KV heads), of gate_up_proj
    [gate_d up_d]; the model computes the same function (biases go with their rows)."""
    model = _random(CONFIGS[name], seed=29)
    grouped = fuse_projections(model, shards=2)
    assert grouped.config.fused_shards == 2 and grouped.layers[1].mlp.shards == 2
    attn, mlp = model.layers[1].self_attn, model.layers[1].mlp
    w = lambda lin: np.asarray(lin.weight[...])  # noqa: E731
    halves = lambda x: np.split(x, 2)  # noqa: E731
    want_qkv = np.concatenate([part for d in range(2) for part in
                               (halves(w(attn.q_proj))[d], halves(w(attn.k_proj))[d], halves(w(attn.v_proj))[d])])
    want_gate_up = np.concatenate([part for d in range(2) for part in
                                   (halves(w(mlp.gate_proj))[d], halves(w(mlp.up_proj))[d])])
    np.testing.assert_array_equal(w(grouped.layers[1].self_attn.qkv_proj), want_qkv)
    np.testing.assert_array_equal(w(grouped.layers[1].mlp.gate_up_proj), want_gate_up)
    if CONFIGS[name].qkv_bias:
        want_bias = np.concatenate([np.split(np.asarray(p.bias[...]), 2)[d] for d in range(2)
                                    for p in (attn.q_proj, attn.k_proj, attn.v_proj)])
        np.testing.assert_array_equal(np.asarray(grouped.layers[1].self_attn.qkv_proj.bias[...]), want_bias)
    ids = _ids(5)
    np.testing.assert_allclose(np.asarray(grouped(ids)), np.asarray(model(ids)), rtol=1e-5, atol=1e-5)
    # Regrouping a fused model is a permutation of its rows, and back is exact.
    back = fuse_projections(grouped, shards=1)
    canonical = fuse_projections(model).layers[1].self_attn.qkv_proj
    np.testing.assert_array_equal(w(back.layers[1].self_attn.qkv_proj), w(canonical))


def test_fused_shards_are_checked():
    base = CONFIGS["qwen3"]
    with pytest.raises(ValueError, match="fused_shards = 2 needs fused_projections"):
        dataclasses.replace(base, fused_shards=2)
    with pytest.raises(ValueError, match="need num_heads 4, num_kv_heads 2, intermediate_size 256 to divide by 3"):
        dataclasses.replace(base, fused_projections=True, fused_shards=3)
    with pytest.raises(ValueError, match="fused_shards must be an integer >= 1"):
        dataclasses.replace(base, fused_projections=True, fused_shards=0)
    with pytest.raises(ValueError, match="num_kv_heads 2 to divide by 4"):
        fuse_projections(_random(base, seed=1), shards=4)


def test_grouped_quantized_rows_are_bit_exact_and_fireq_cas_follows_them():
    """A quantized fused model regroups by a permutation of its codes and scales (no requantizing);
    FireQ's CAS scales the up rows wherever they lie, so quantizing a grouped model equals grouping a
    quantized one."""
    model = _random(CONFIGS["qwen3"], seed=31)
    q1 = quantize_model(fuse_projections(model), "w4a16-nvfp4")
    q2 = fuse_projections(q1, shards=2)
    rows = np.argsort(fused_order(q1.config, "qkv_proj"))[fused_order(q2.config, "qkv_proj")]
    w1, w2 = (q.layers[0].self_attn.qkv_proj.weight.get_value() for q in (q1, q2))
    np.testing.assert_array_equal(np.asarray(w2.dequantize()), np.asarray(w1.dequantize())[rows])
    back = fuse_projections(q2, shards=1)
    for a, b in zip(jax.tree.leaves(nnx.state(q1)), jax.tree.leaves(nnx.state(back))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

    # (CAS's column scales reduce over the rows in another order: equal to a few float32 ulps, so
    # the two agree to rounding, where a misplaced up row would move the logits by O(1).)
    f1 = quantize_model(fuse_projections(model), "w4a8-fireq")
    f2 = quantize_model(fuse_projections(model, shards=2), "w4a8-fireq")
    group_rows(f1, 2)
    ids = _ids(8)
    got, want = np.asarray(f2(ids), np.float64), np.asarray(f1(ids), np.float64)
    assert np.linalg.norm(got - want) <= 1e-3 * np.linalg.norm(want)
    up1, up2 = (f.layers[0].mlp.gate_up_proj.weight.get_value().dequantize() for f in (f1, f2))
    assert np.mean(np.asarray(up1) == np.asarray(up2)) > 0.99


def test_grouped_rows_save_under_hugging_face_names(tmp_path):
    model = _random(dataclasses.replace(CONFIGS["qwen2_bias_kv2"], mlp_bias=False), seed=37, dtype=jnp.bfloat16)
    jaxlp.save_pretrained(fuse_projections(model, shards=2), tmp_path / "hf")
    back = jaxlp.from_pretrained(tmp_path / "hf", dtype=jnp.bfloat16)
    assert not back.config.fused_projections and back.config.fused_shards == 1
    ids = _ids(6)
    np.testing.assert_array_equal(np.asarray(back(ids)), np.asarray(model(ids)))


def test_concatenate_rows_checks_its_inputs():
    rng = np.random.default_rng(0)
    a = nvfp4.quantize(jnp.asarray(rng.standard_normal((16, 64)), jnp.float32), amax=3.0)
    b = nvfp4.quantize(jnp.asarray(rng.standard_normal((8, 64)), jnp.float32), amax=3.0)
    ab = formats.concatenate_rows([a, b])
    assert ab.shape == (24, 64)
    np.testing.assert_array_equal(np.asarray(ab.dequantize()), np.concatenate([a.dequantize(), b.dequantize()]))
    with pytest.raises(ValueError, match="one K"):
        formats.concatenate_rows([a, nvfp4.quantize(jnp.ones((8, 32)), amax=3.0)])
    with pytest.raises(ValueError, match="cannot concatenate nvfp4 with mxfp4"):
        formats.concatenate_rows([a, formats.quantize(jnp.ones((8, 64)), "mxfp4")])
    with pytest.raises(ValueError, match="at least one"):
        formats.concatenate_rows([])


def test_fused_fireq_cas_matches_the_unfused_transform():
    """CAS scales gate/up columns together and divides the up rows: the same weights either way."""
    from jaxlp.quantization.model import _apply_cas

    model = _random(CONFIGS["qwen3"], seed=17)
    fused = fuse_projections(model)
    w = {f"layers.0.mlp.{n}": m.weight[...] for n, m in (("gate_proj", model.layers[0].mlp.gate_proj),
                                                          ("up_proj", model.layers[0].mlp.up_proj),
                                                          ("down_proj", model.layers[0].mlp.down_proj))}
    wf = {"layers.0.mlp.gate_up_proj": fused.layers[0].mlp.gate_up_proj.weight[...],
          "layers.0.mlp.down_proj": fused.layers[0].mlp.down_proj.weight[...]}
    _apply_cas(model, w)
    _apply_cas(fused, wf)
    np.testing.assert_allclose(np.asarray(wf["layers.0.mlp.gate_up_proj"]),
                               np.concatenate([w["layers.0.mlp.gate_proj"], w["layers.0.mlp.up_proj"]]), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(wf["layers.0.mlp.down_proj"]), np.asarray(w["layers.0.mlp.down_proj"]),
                               rtol=1e-6)
    np.testing.assert_allclose(np.asarray(fused.layers[0].post_attention_layernorm.weight[...]),
                               np.asarray(model.layers[0].post_attention_layernorm.weight[...]), rtol=1e-6)


def test_fused_checkpoints_round_trip(tmp_path):
    model = _random(CONFIGS["qwen3"], seed=19, dtype=jnp.bfloat16)
    fused = fuse_projections(model)
    jaxlp.save_pretrained(fused, tmp_path / "hf")  # Hugging Face names: split again
    back = jaxlp.from_pretrained(tmp_path / "hf", dtype=jnp.bfloat16)
    assert not back.config.fused_projections
    ids = _ids(3)
    np.testing.assert_array_equal(np.asarray(back(ids)), np.asarray(model(ids)))

    q = quantize_model(fused, "w4a4-nvfp4", calibration=np.arange(64).reshape(2, 32))
    save_quantized(q, tmp_path / "q")
    loaded = jaxlp.from_pretrained(tmp_path / "q")
    assert loaded.config.fused_projections and hasattr(loaded.layers[0].self_attn, "qkv_proj")
    np.testing.assert_array_equal(np.asarray(loaded(ids)), np.asarray(q(ids)))


def test_fused_models_refuse_per_projection_rewrites():
    from jax.sharding import Mesh

    from jaxlp.quantization import fireq_kv
    from jaxlp.models import shard_model

    fused = fuse_projections(_random(CONFIGS["qwen3"], seed=23))
    with pytest.raises(ValueError, match="fold before"):
        fireq_kv.fold_rpn(fused, [None, None])
    with pytest.raises(ValueError, match="calibrate before"):
        fireq_kv.collect_keys(fused, _ids(4))
    if jax.device_count() < 2:
        pytest.skip("needs two (simulated) devices for a tensor-parallel mesh")
    one_kv_head = fuse_projections(_random(CONFIGS["qwen2_bias"], seed=23))
    with pytest.raises(ValueError, match="num_kv_heads 1 to divide by 2: shard an unfused model"):
        shard_model(one_kv_head, Mesh(np.array(jax.devices()[:2]), ("tp",)))


@pytest.mark.gpu
@pytest.mark.skipif(jax.devices()[0].platform != "gpu", reason="needs a CUDA GPU")
@pytest.mark.parametrize("recipe", ["w4a16-nvfp4", "w4a4-nvfp4"])
def test_fused_nvfp4_model_on_the_gpu_kernels_matches_the_reference(recipe):
    """The fused qkv / gate_up linears through the NVFP4 kernels ("auto") against float64, layer by layer,
    and for W4A16 the whole model against the pure-JAX path. (A W4A4 model is compared per layer only:
    a last-bit difference of one BF16 output flips FP4 activation codes downstream, measured 17% apart
    in logits at M = 6 with every kernel exact per layer.)"""
    import ml_dtypes

    from jaxlp.quantization import nvfp4_dispatch  # noqa: F401  (registers the kernels)
    from jaxlp.quantization import set_implementation
    from jaxlp.quantization.activations import fake_quantize

    config = ModelConfig(model_type="qwen3", vocab_size=512, hidden_size=256, intermediate_size=768, num_layers=2,
                         num_heads=4, num_kv_heads=2, head_dim=64, qk_norm=True)
    model = fuse_projections(_random(config, seed=29, dtype=jnp.bfloat16))
    q = set_implementation(quantize_model(model, recipe, calibration=np.arange(256).reshape(2, 128)), "auto")
    rng = np.random.default_rng(31)
    for layer in (q.layers[1].self_attn.qkv_proj, q.layers[1].mlp.gate_up_proj):
        w = layer.weight.get_value()
        amax = None if layer.act_amax is None else layer.act_amax[...]
        for m in (1, 6, 40):
            x = jnp.asarray(rng.standard_normal((m, w.shape[1])), jnp.bfloat16)
            y = np.asarray(jax.jit(lambda x: layer(x))(x), np.float64)
            xq = np.asarray(fake_quantize(x, "nvfp4", amax) if amax is not None else x.astype(jnp.float32), np.float64)
            exact = (xq @ np.asarray(w.dequantize(jnp.float32), np.float64).T).astype(ml_dtypes.bfloat16)
            assert np.linalg.norm(y - exact) / np.linalg.norm(exact.astype(np.float64)) < 1e-3, (m, w.shape)
    if recipe == "w4a16-nvfp4":
        for shape in ((1, 1), (2, 3), (1, 40)):  # M = 1, 6 (GEMVs), 40
            ids = jnp.asarray(np.random.default_rng(sum(shape)).integers(0, 512, shape))
            got = np.asarray(nnx.jit(lambda m, i: m(i))(q, ids), np.float64)
            ref = np.asarray(set_implementation(nnx.clone(q), "xla")(ids), np.float64)
            assert np.linalg.norm(got - ref) / np.linalg.norm(ref) < 2e-2, shape
