"""Tensor parallelism: on 4 simulated CPU devices, sharded logits equal single-device ones."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec as P

import jaxlp

pytestmark = pytest.mark.skipif(jax.device_count() < 4, reason="needs 4 (simulated) devices")


@pytest.mark.parametrize("name", ["llama", "gemma3", "qwen2_bias_tied"])
def test_sharded_logits_equal_single_device(hf_checkpoint, name):
    _, path = hf_checkpoint(name)
    mesh = Mesh(np.array(jax.devices()[:4]), ("tp",))
    single = jaxlp.from_pretrained(path, dtype=jnp.float32)
    sharded = jaxlp.from_pretrained(path, dtype=jnp.float32, mesh=mesh)

    q = sharded.layers[0].self_attn.q_proj.weight[...]
    assert q.sharding.spec == P("tp", None) and len(q.sharding.device_set) == 4
    down = sharded.layers[0].mlp.down_proj.weight[...]
    assert down.sharding.spec == P(None, "tp")

    ids = jnp.asarray(np.random.default_rng(0).integers(3, 256, size=(2, 19)))
    ref = np.asarray(single(ids))
    out = np.asarray(jax.jit(lambda m, x: m(x))(sharded, ids))
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())

    gen_single = jaxlp.generate(single, [ids[0, :7].tolist()], max_new_tokens=6, kv_cache="fp32", stop_tokens=())
    gen_sharded = jaxlp.generate(sharded, [ids[0, :7].tolist()], max_new_tokens=6, kv_cache="fp32", stop_tokens=())
    assert gen_sharded.sequences() == gen_single.sequences()


def test_mesh_needs_tp_axis(hf_checkpoint):
    _, path = hf_checkpoint("llama")
    mesh = Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("data", "model"))
    with pytest.raises(ValueError, match="'tp'"):
        jaxlp.from_pretrained(path, dtype=jnp.float32, mesh=mesh)


# --- quantized models -----------------------------------------------------------------------------

from flax import nnx  # noqa: E402

from jaxlp.models import ModelConfig, Transformer, shard_model  # noqa: E402
from jaxlp.models.sharding import role  # noqa: E402
from jaxlp.quantization import RECIPES, quantize_model, save_quantized  # noqa: E402


def mesh_of(n):
    return Mesh(np.array(jax.devices()[:n]), ("tp",))


def tp_model(hidden=512, intermediate=1024, layers=2):
    """K of every row-parallel layer splits over 4 devices at FireQ's 128-wide groups."""
    cfg = ModelConfig(model_type="llama", vocab_size=256, hidden_size=hidden, intermediate_size=intermediate,
                      num_layers=layers, num_heads=8, num_kv_heads=4, head_dim=64)
    return Transformer(cfg, dtype=jnp.float32, rngs=nnx.Rngs(0))


@pytest.fixture(scope="module")
def base():
    return tp_model()


def token_ids(seed, shape=(2, 12)):
    return jnp.asarray(np.random.default_rng(seed).integers(0, 256, shape))


def rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return np.linalg.norm(a - b) / np.linalg.norm(b)


@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_every_recipe_sharded_gives_the_single_device_logits(base, recipe):
    """Quantized weights split along their blocks over 4 devices: the logits of the single-device
    model (local products under shard_map, or XLA's partitioner for per-token FP8 activations)."""
    single = quantize_model(base, recipe, calibration=token_ids(1, (4, 16)))
    sharded = shard_model(nnx.clone(single), mesh_of(4))
    q, down = sharded.layers[0].self_attn.q_proj, sharded.layers[0].mlp.down_proj
    assert q.parallel[1] == "column" and down.parallel[1] == "row"
    for layer, spec in ((q, P("tp", None)), (down, P(None, "tp"))):
        fields = [leaf for leaf in jax.tree.leaves(layer.weight.get_value()) if leaf.ndim == 2]
        assert fields and all(f.sharding.spec == spec and len(f.sharding.device_set) == 4 for f in fields)
    scalars = [leaf for leaf in jax.tree.leaves(down.weight.get_value()) if leaf.ndim == 0]
    assert all(s.sharding.spec == P() for s in scalars)  # tensor scales replicated
    ids = token_ids(0)
    forward = jax.jit(lambda m, x: m(x))
    want = np.asarray(forward(single, ids))
    got = np.asarray(forward(sharded, ids))
    if RECIPES[recipe].activation is None:
        assert rel(got, want) <= 1e-4, rel(got, want)
        return
    # Activation quantizers round each activation: a summation-order difference of 1e-7 upstream can
    # move one FP8 (or FP4) code across a rounding boundary, and attention carries that to every later
    # position of the row (w8a8-fp8 on an AMD EPYC host: 1.7% here, and 1.9% between the unsharded
    # model's jitted and eager forward passes). So each sharded product on the same input to 1e-3 (a
    # flipped code moves one element), the logits only to 5e-2 (a wrong shard would move them by O(1)).
    x = jnp.asarray(np.random.default_rng(2).standard_normal((24, q.in_features)), jnp.float32)
    h = jnp.asarray(np.random.default_rng(3).standard_normal((24, down.in_features)), jnp.float32)
    for one, many, inp in ((single.layers[0].self_attn.q_proj, q, x), (single.layers[0].mlp.down_proj, down, h)):
        assert rel(forward(many, inp), forward(one, inp)) <= 1e-3
    assert rel(got, want) <= 5e-2, rel(got, want)


def test_row_parallel_kernels_run_on_local_shards(base):
    """A weight-only row-parallel layer: one shard_map with an all-reduce, no gathered weight."""
    sharded = shard_model(quantize_model(base, "w4a16-nvfp4"), mesh_of(4))
    layer = sharded.layers[0].mlp.down_proj
    x = jax.device_put(jnp.ones((2, 1024), jnp.float32), jax.sharding.NamedSharding(mesh_of(4), P(None, "tp")))
    text = jax.jit(lambda layer, x: layer(x)).lower(layer, x).as_text()
    assert "all_reduce" in text or "all-reduce" in text
    assert "all_gather" not in text and "all-gather" not in text


def test_the_local_product_sees_each_shards_own_shape(base):
    """Under shard_map a kernel gets the shard as a weight of its own shape (a kernel reading
    ``w.shape`` of the whole layer crashed on two H100s): column rows / tp, row K / tp."""
    sharded = shard_model(quantize_model(base, "w4a16-nvfp4"), mesh_of(4))
    for layer, local in ((sharded.layers[0].self_attn.q_proj, (128, 512)), (sharded.layers[0].mlp.down_proj,
                                                                            (512, 256))):
        seen = []

        def spy(view, x):
            w = view.weight.get_value()
            w.check()  # fields agree with the shape
            seen.append(w.shape)
            return type(layer).reference(view, x)

        y = layer._product(spy, jnp.ones((2, layer.in_features)))
        assert seen == [local] and y.shape == (2, layer.out_features)


def test_kernel_checks_see_each_shards_own_shape():
    """A kernel's shape rules apply to the shard it runs on, not only to the whole layer: down_proj
    1088 -> 512 splits K into 272-wide shards, no multiple of the NestedFP GEMV's 64-wide K steps
    (the whole 1088 is), so the explicit kernel is refused naming the shard (and "auto" passes it
    over); the views the checks get: column rows / tp, row K / tp with the input's local features,
    the layer itself where the product is not sharded (replicated, or left to XLA's partitioner)."""
    model = shard_model(quantize_model(tp_model(intermediate=1088, layers=1), "nestedfp"), mesh_of(4))
    down, up = model.layers[0].mlp.down_proj, model.layers[0].mlp.up_proj
    x = jnp.ones((2, 1088), jnp.float16)
    view, local_x = down._operands(x)
    assert view.weight.get_value().shape == (512, 272) and local_x.shape == (2, 272) and local_x.dtype == x.dtype
    view, local_x = up._operands(jnp.ones((2, 512), jnp.float16))
    assert view.weight.get_value().shape == (272, 512) and local_x.shape == (2, 512)
    down.set_implementation("nestedfp_cuda")
    with pytest.raises(ValueError, match="weight 512 x 272: N must be a multiple of 16 and K of 64"):
        down(x)
    replicated = quantize_model(tp_model(layers=1), "w8a8-fp8")
    layer = replicated.layers[0].mlp.down_proj
    assert layer._operands(x)[0] is layer
    fp8 = shard_model(replicated, mesh_of(4)).layers[0].mlp.down_proj  # per-token FP8: XLA's partitioner
    assert fp8._operands(jnp.ones((2, 1024), jnp.bfloat16))[0] is fp8


def test_quantize_model_keeps_the_mesh_of_a_sharded_model(base):
    sharded = shard_model(nnx.clone(base), mesh_of(4))
    q = quantize_model(sharded, "w4a16-mxfp4")
    data = q.layers[1].self_attn.o_proj.weight.get_value().data
    assert data.sharding.spec == P(None, "tp") and q.layers[1].self_attn.o_proj.parallel[1] == "row"
    q2 = quantize_model(base, "w4a16-mxfp4", mesh=mesh_of(2))
    assert len(q2.layers[0].mlp.up_proj.weight.get_value().data.sharding.device_set) == 2


def test_a_split_that_cuts_a_block_is_refused():
    """FireQ's 128-wide groups: down_proj's K = 768 is 192 per device of 4 (a group cut in half),
    384 per device of 2 (three whole groups)."""
    fireq = quantize_model(tp_model(hidden=512, intermediate=768), "w4a8-fireq")
    with pytest.raises(ValueError, match=r"layers\.0\.mlp\.down_proj.*K = 768.*128-element block boundaries"):
        shard_model(nnx.clone(fireq), mesh_of(4))
    shard_model(fireq, mesh_of(2))  # 384 per device: whole groups


def test_save_on_one_mesh_load_on_another_is_bit_exact(base, tmp_path):
    single = quantize_model(base, "w4a16-nvfp4")
    save_quantized(shard_model(nnx.clone(single), mesh_of(4)), tmp_path / "q")
    loaded = jaxlp.from_pretrained(tmp_path / "q", mesh=mesh_of(2))
    for a, b in zip(jax.tree.leaves(nnx.state(single)), jax.tree.leaves(nnx.state(loaded))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert len(loaded.layers[0].mlp.down_proj.weight.get_value().data.sharding.device_set) == 2
    ids = token_ids(3)
    np.testing.assert_allclose(np.asarray(loaded(ids)), np.asarray(single(ids)), rtol=1e-5, atol=1e-5)


def test_a_quantized_checkpoint_is_restored_straight_onto_the_mesh(base, tmp_path, monkeypatch):
    from jaxlp import checkpoint
    from jaxlp.quantization.saving import load_quantized

    single = quantize_model(base, "w4a16-nvfp4")
    save_quantized(single, tmp_path / "q")
    seen = []
    real_load = checkpoint.load
    monkeypatch.setattr(checkpoint, "load", lambda *a, **k: seen.append(k.get("sharding")) or real_load(*a, **k))
    loaded = load_quantized(tmp_path / "q", mesh=mesh_of(2))
    assert seen and seen[0] is not None  # one sharding per array, not one device then a reshard
    placed = shard_model(nnx.clone(single), mesh_of(2))
    for a, b in zip(jax.tree.leaves(nnx.state(placed)), jax.tree.leaves(nnx.state(loaded))):
        assert b.sharding.is_equivalent_to(a.sharding, b.ndim)
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert loaded.layers[0].mlp.down_proj.parallel[1] == "row"
    ids = token_ids(3)
    np.testing.assert_allclose(np.asarray(loaded(ids)), np.asarray(single(ids)), rtol=1e-5, atol=1e-5)


def test_a_checkpoint_that_cannot_split_says_so(tmp_path):
    from jaxlp.quantization.saving import load_quantized

    fireq = quantize_model(tp_model(hidden=512, intermediate=768), "w4a8-fireq")
    save_quantized(fireq, tmp_path / "q")
    with pytest.raises(ValueError, match="cannot shard this model over 4 devices.*block boundaries"):
        load_quantized(tmp_path / "q", mesh=mesh_of(4))


@pytest.fixture(scope="module")
def w4a16_pair(base):
    single = quantize_model(base, "w4a16-nvfp4")
    return single, shard_model(nnx.clone(single), mesh_of(4))


@pytest.fixture(scope="module")
def one_layer_pair():
    single = tp_model(layers=1)
    return single, shard_model(nnx.clone(single), mesh_of(4))


@pytest.mark.parametrize("cache", jaxlp.kvcache.formats())
def test_every_cache_format_attends_on_local_heads(one_layer_pair, cache):
    """Attention runs on each device's heads and its share of the cache: after a prompt and a
    decode step every non-empty cache array of the sharded model is split by KV head, and the
    logits are the single-device ones (one dense layer: the cache is what is tested here)."""
    single, sharded = one_layer_pair
    assert sharded.layers[0].self_attn.mesh is not None
    fmt = jaxlp.kvcache.get(cache)
    step = jax.jit(lambda m, ids, pos, c, fresh: m.forward(ids, pos, c, fresh=fresh), static_argnums=4)
    ids, pos = token_ids(7, (2, 140)), jnp.tile(jnp.arange(140), (2, 1))  # past one 128-token unit
    outs = []
    for model in (single, sharded):
        c = fmt.init(model.config, 2, 160)
        _, c = step(model, ids, pos, c, True)
        hidden, c = step(model, ids[:, :1], pos[:, :1] + 140, c, False)
        outs.append(np.asarray(model.logits(hidden[:, 0])))
    assert rel(outs[1], outs[0]) <= 1e-4, rel(outs[1], outs[0])
    for leaf in jax.tree.leaves(c.layers[0]):
        if leaf.ndim >= 3 and leaf.size:
            assert leaf.sharding.spec[:3] == (None, None, "tp"), (leaf.shape, leaf.sharding.spec)


@pytest.mark.parametrize("cache", ["kitty-pro", "fireq-int4"])
def test_greedy_tokens_under_tp_with_quantized_caches(w4a16_pair, cache):
    """generate's compiled loop (prompt buckets, a cache too short for one quantized unit)."""
    single, sharded = w4a16_pair
    prompts = [token_ids(5, (1, 9))[0].tolist(), token_ids(6, (1, 4))[0].tolist()]
    runs = [jaxlp.generate(m, prompts, max_new_tokens=5, kv_cache=cache, stop_tokens=()) for m in (single, sharded)]
    assert runs[1].sequences() == runs[0].sequences()


def test_the_lm_head_splits_over_the_vocabulary_and_gives_the_single_device_logits(base):
    """The LM head, BF16 or quantized (``lm_head=True``), is vocabulary-parallel: each device holds
    its rows (and their block scales), beside the sharded decoder layers; the logits and greedy
    tokens are the single device's."""
    from jaxlp.quantization import get_recipe

    assert role("lm_head.weight", base.config, 4) == "column"
    assert role("lm_head.weight", dataclasses.replace(base.config, vocab_size=base.config.vocab_size + 1), 4) is None
    for single in (base, quantize_model(base, get_recipe("w4a16-nvfp4").replace(lm_head=True))):
        sharded = shard_model(nnx.clone(single), mesh_of(4))
        fields = [leaf for leaf in jax.tree.leaves(sharded.lm_head.weight.get_value()) if leaf.ndim == 2]
        assert fields and all(f.sharding.spec[0] == "tp" for f in fields)
        ids = token_ids(0)
        logits = jax.jit(lambda m, x: m(x))(sharded, ids)
        assert logits.sharding.is_fully_replicated  # whole rows for any sampler
        assert rel(logits, single(ids)) <= 1e-4
        prompts = [token_ids(3, (1, 7))[0].tolist()]
        runs = [jaxlp.generate(m, prompts, max_new_tokens=4, stop_tokens=()) for m in (single, sharded)]
        assert runs[1].sequences() == runs[0].sequences()


# --- fused projections, rows grouped per device -------------------------------------------------


def test_fused_projections_split_per_device_give_the_single_device_logits(base):
    """A fused model on 4 devices: shard_model groups the fused rows per device (fused_shards = 4),
    qkv_proj and gate_up_proj are column-parallel, and the logits are the single-device ones, in
    float32 and with NVFP4 weights on local shards (no gathered weight)."""
    from jaxlp.models import fuse_projections

    fused = fuse_projections(base)
    sharded = shard_model(nnx.clone(fused), mesh_of(4))
    assert sharded.config.fused_shards == 4 and fused.config.fused_shards == 1
    assert sharded.layers[0].self_attn.qkv_proj.weight[...].sharding.spec == P("tp", None)
    assert sharded.layers[0].mlp.gate_up_proj.weight[...].sharding.spec == P("tp", None)
    ids = token_ids(4)
    forward = jax.jit(lambda m, x: m(x))
    want = np.asarray(forward(base, ids))
    assert rel(forward(sharded, ids), want) <= 1e-5

    q = quantize_model(fused, "w4a16-nvfp4")
    qs = shard_model(nnx.clone(q), mesh_of(4))
    layer = qs.layers[0].self_attn.qkv_proj
    assert layer.parallel[1] == "column" and qs.layers[0].mlp.gate_up_proj.parallel[1] == "column"
    assert rel(forward(qs, ids), forward(q, ids)) <= 1e-4
    x = jnp.ones((2, 512), jnp.float32)
    text = jax.jit(lambda layer, x: layer(x)).lower(layer, x).as_text()
    assert "all_gather" not in text and "all-gather" not in text
    gen = [jaxlp.generate(m, [ids[0, :7].tolist()], max_new_tokens=5, kv_cache="fp32", stop_tokens=()).sequences()
           for m in (q, qs)]
    assert gen[0] == gen[1]


def test_fusing_a_sharded_model_keeps_its_mesh(base):
    from jaxlp.models import fuse_projections

    fused = fuse_projections(shard_model(nnx.clone(base), mesh_of(2)))
    assert fused.config.fused_shards == 2
    w = fused.layers[1].mlp.gate_up_proj.weight[...]
    assert w.sharding.spec == P("tp", None) and len(w.sharding.device_set) == 2
    ids = token_ids(5)
    assert rel(jax.jit(lambda m, x: m(x))(fused, ids), base(ids)) <= 1e-5
    with pytest.raises(ValueError, match="lies on a mesh of 2 devices.*not shards=4"):
        fuse_projections(fused, shards=4)


def test_a_fused_checkpoint_loads_onto_another_mesh(base, tmp_path):
    """Saved with rows grouped for 4 devices: loaded whole (as saved), onto 2 devices (regrouped)."""
    from jaxlp.models import fuse_projections

    q = quantize_model(fuse_projections(base), "w4a16-nvfp4")
    save_quantized(shard_model(nnx.clone(q), mesh_of(4)), tmp_path / "q")
    ids = token_ids(6)
    want = np.asarray(q(ids))
    whole = jaxlp.from_pretrained(tmp_path / "q")
    assert whole.config.fused_shards == 4
    on_two = jaxlp.from_pretrained(tmp_path / "q", mesh=mesh_of(2))  # regrouped in host memory, then placed
    assert on_two.config.fused_shards == 2 and on_two.layers[0].self_attn.qkv_proj.parallel[1] == "column"
    placed = shard_model(nnx.clone(q), mesh_of(2))
    for a, b in zip(jax.tree.leaves(nnx.state(placed)), jax.tree.leaves(nnx.state(on_two))):
        assert b.sharding.is_equivalent_to(a.sharding, b.ndim)
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    for m in (whole, on_two):
        np.testing.assert_allclose(np.asarray(jax.jit(lambda m, x: m(x))(m, ids)), want, rtol=1e-5, atol=1e-5)
