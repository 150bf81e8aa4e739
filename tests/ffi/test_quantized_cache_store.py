"""The one-token CUDA store into Kitty caches: what it takes and refuses, its lowering (one custom
call, every state buffer aliased; on any machine), and on a GPU the kernel's state against the
reference (``QuantizedLayerCache.store``, XLA, run on the CPU) byte for byte: rows that complete a
key page, a value page or both at this step, rows in the sink, padding rows, and rewound rows whose
ring slots were overwritten (their units' old codes re-read), at head_dim 64, 128 and 256.

The reference runs on the CPU, where XLA rounds ``(x - min) * (1 / scale)`` and the ``+ 0.5`` of the
quantization rule (:mod:`jaxlp.kvcache.quant`) separately, as the kernel does; XLA:GPU may contract
them into one FMA, which can move a code that sits exactly on a rounding tie."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxlp import kvcache
from jaxlp.ffi import quantized_cache_store as cuda_store
from jaxlp.kvcache import fireq, kitty, kivi
from jaxlp.models import ModelConfig

ON_GPU = jax.default_backend() == "gpu"


def on_cpu(tree):
    return jax.device_put(tree, jax.devices("cpu")[0])


def reference_store(layer, k, v, p):
    """The XLA store of one token per row, on the CPU (module doc), as the kernel's state dict."""
    return jax.jit(lambda lay, k, v, p: state_of(lay.store(k[:, None], v[:, None], p[:, None])))(
        on_cpu(layer), on_cpu(k), on_cpu(v), on_cpu(p))


def config(kvh, d):
    return ModelConfig(model_type="llama", vocab_size=64, hidden_size=64, intermediate_size=96, num_layers=1,
                       num_heads=2 * kvh, num_kv_heads=kvh, head_dim=d, max_position_embeddings=4096)


def state_of(layer):
    return {name: getattr(layer, name) for name in cuda_store.STATE_FIELDS}


def test_takes_kitty_pages_only():
    assert cuda_store.supports(kitty.KeyCodec(16), kitty.ValueCodec(), 128)
    assert cuda_store.supports(kitty.KeyCodec(8), kitty.ValueCodec(), 64)
    assert cuda_store.supports(kitty.KeyCodec(64), kitty.ValueCodec(), 256)
    assert not cuda_store.supports(kitty.KeyCodec(16), kitty.ValueCodec(), 96)
    assert not cuda_store.supports(kitty.KeyCodec(16, unit=64), kitty.ValueCodec(), 128)
    assert not cuda_store.supports(kivi.KeyCodec(2), kivi.ValueCodec(2), 128)
    assert not cuda_store.supports(fireq.TokenCodec(), fireq.TokenCodec(), 128)


def small_layer(name="kitty", b=2, kvh=2, d=64, max_len=300):
    return kvcache.get(name).init(config(kvh, d), b, max_len).layers[0]


def test_lowers_to_one_custom_call_with_every_state_buffer_aliased():
    layer = small_layer()
    b, kvh, d = 2, 2, 64
    new = jnp.zeros((b, kvh, d), jnp.bfloat16)
    f = jax.jit(lambda s, p, k, v: cuda_store.store_token(p, k, v, s, k_lag=0, v_lag=128, max_len=300),
                donate_argnums=0)
    text = f.trace(state_of(layer), jnp.zeros((b,), jnp.int32), new, new).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count(cuda_store.TARGET) == 1
    assert text.count("#stablehlo.output_operand_alias<") == len(jax.tree.leaves(state_of(layer)))


def test_refuses_wrong_shapes_and_dtypes():
    layer = small_layer()
    st = state_of(layer)
    new = jnp.zeros((2, 2, 64), jnp.float16)
    p = jnp.zeros((2,), jnp.int32)
    with pytest.raises(ValueError, match="do not match"):
        cuda_store.store_token(p, new, new[:, :1], st, k_lag=0, v_lag=128, max_len=300)
    with pytest.raises(ValueError, match="head_dim"):
        cuda_store.store_token(p, new[..., :32], new[..., :32], st, k_lag=0, v_lag=128, max_len=300)
    bf16 = st | {"k_ring": st["k_ring"].astype(jnp.bfloat16)}
    with pytest.raises(ValueError, match="state arrays must be"):
        cuda_store.store_token(p, new, new, bf16, k_lag=0, v_lag=128, max_len=300)


# --- on the GPU: the kernel's state against the reference's -------------------------------------

SINK = kitty.SINK


def separable_keys(rng, shape):
    """Keys whose channels' mean |k| over any page are far apart (offsets 0.5 apart, noise 0.2):
    no two channels' scores tie within float32 summation order, so the kernel and XLA rank them
    alike and the pages must agree byte for byte."""
    b, s, kvh, d = shape
    offsets = np.stack([np.stack([rng.permutation(d) for _ in range(kvh)]) for _ in range(b)]) * 0.5 + 1.0
    sign = np.where(rng.random(shape) < 0.5, -1.0, 1.0)  # |k| keeps the offset, the sign varies
    return sign * (offsets[:, None] + 0.2 * rng.standard_normal(shape))


def prompt_layer(name, stored, max_len, kvh, d, seed):
    """A layer after a prompt call storing row b's first ``stored[b]`` tokens (later bucket
    positions padding), as generate() leaves it."""
    layer = kvcache.get(name, attention="cuda").init(config(kvh, d), len(stored), max_len).layers[0]
    rng = np.random.default_rng(seed)
    s = max(stored)
    k = jnp.asarray(separable_keys(rng, (len(stored), s, kvh, d)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((len(stored), s, kvh, d)), jnp.float32)
    pos = np.tile(np.arange(s), (len(stored), 1))
    pos = np.where(pos < np.asarray(stored)[:, None], pos, max_len)
    return jax.jit(lambda lay: lay.store(k, v, jnp.asarray(pos, jnp.int32)))(layer)


# Per row: what it stored (the prompt), and the position of the token stored now. With the sink of
# 32: the key page u completes at j = p - 32 = 128 u + 127, the value page u at j = 128 u + 255.
# Rows: the first key page (p 159), a key page and the first value page together (287), both again
# (415), mid-page (200), in the sink (5 and 31), a padding row (position max_len), and rows that
# rewind after a 480-token bucket to complete a key page (159) and both pages (287) from stale rings.
STORED = [159, 287, 415, 200, 5, 31, 100, 480, 480]
POSITIONS = [159, 287, 415, 200, 5, 31, 520, 159, 287]


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize("name,d,kvh", [("kitty", 64, 2), ("kitty-pro", 128, 8), ("kitty-pro", 256, 1)])
def test_gpu_store_matches_the_reference_byte_for_byte(name, d, kvh):
    layer = prompt_layer(name, STORED, 520, kvh, d, seed=d + kvh)
    rng = np.random.default_rng(d)
    k = jnp.asarray(separable_keys(rng, (len(STORED), 1, kvh, d))[:, 0], jnp.bfloat16)
    v = jnp.asarray(rng.standard_normal((len(STORED), kvh, d)), jnp.bfloat16)
    p = jnp.asarray(POSITIONS, jnp.int32)
    want = reference_store(layer, k, v, p)
    got = jax.jit(lambda s: cuda_store.store_token(p, k, v, s, k_lag=layer.k_spec.lag, v_lag=layer.v_spec.lag,
                                                   max_len=layer.max_len))(state_of(layer))
    for path, a, b in zip(jax.tree_util.tree_flatten_with_path(want)[0], jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=jax.tree_util.keystr(path[0]))
    # The encodes ran: the rows completing a page changed it.
    changed = np.asarray(got["k_store"].scale != layer.k_store.scale).any(axis=(1, 2, 3))
    assert changed[[0, 1, 2, 7, 8]].all() and not changed[[3, 4, 5, 6]].any()


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
def test_gpu_store_of_constant_and_zero_pages():
    """All-equal keys in a page (every channel's scale at the floor, every score tied: ranks by
    channel) and all-zero values: the same bytes as the reference, finite."""
    kvh, d = 2, 128
    layer = kvcache.get("kitty-pro", attention="cuda").init(config(kvh, d), 2, 300).layers[0]
    k = jnp.full((2, 287, kvh, d), 0.75, jnp.float32)
    v = jnp.zeros((2, 287, kvh, d), jnp.float32)
    layer = jax.jit(lambda lay: lay.store(k, v, jnp.tile(jnp.arange(287, dtype=jnp.int32), (2, 1))))(layer)
    p = jnp.asarray([159, 287], jnp.int32)
    k1, v1 = jnp.full((2, kvh, d), 0.75, jnp.bfloat16), jnp.zeros((2, kvh, d), jnp.bfloat16)
    want = reference_store(layer, k1, v1, p)
    got = jax.jit(lambda s: cuda_store.store_token(p, k1, v1, s, k_lag=0, v_lag=128, max_len=300))(state_of(layer))
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert np.isfinite(np.asarray(got["k_store"].scale, np.float32)).all()


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
def test_gpu_decode_steps_through_page_boundaries_keep_the_reference_state():
    """The cache's CUDA step (attend, then this store) over 140 steps crossing a key page and a
    value page: the state after every step equals the reference's (the XLA store on the CPU), and
    the program holds the store's custom call and no conditional."""
    kvh, d, h = 2, 128, 8
    layer = prompt_layer("kitty-pro", [250, 120], 400, kvh, d, seed=3)
    state = on_cpu(state_of(layer))
    rng = np.random.default_rng(4)
    step = jax.jit(lambda lay, q, k, v, p: lay.attend(q, k, v, p, scale=d**-0.5, window=None, softcap=None))
    lengths = np.asarray([250, 120])
    for i in range(140):
        q = jnp.asarray(rng.standard_normal((2, 1, h, d)), jnp.float32)
        k = jnp.asarray(separable_keys(rng, (2, 1, kvh, d)), jnp.float32)
        v = jnp.asarray(rng.standard_normal((2, 1, kvh, d)), jnp.float32)
        p = jnp.asarray(lengths + i, jnp.int32)[:, None]
        state = reference_store(dataclasses.replace(layer, **state), k[:, 0], v[:, 0], p[:, 0])
        _, layer = step(layer, q, k, v, p)
        for a, b in zip(jax.tree.leaves(state_of(layer)), jax.tree.leaves(state)):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=f"step {i}")
    text = step.lower(layer, q, k, v, p).as_text()
    assert text.count(cuda_store.TARGET) == 1 and "stablehlo.case" not in text and "stablehlo.if" not in text
