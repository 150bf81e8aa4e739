"""The one-token CUDA store into Kitty, KIVI (2- and 4-bit keys and values) and FireQ caches: what it
takes and refuses, its lowering (one custom call, every state buffer aliased; on any machine), a NumPy
transliteration of the KIVI kernel (:func:`kivi_kernel_model`, its indexing, order of reads and writes
and float32 rounding, at either bit width) against the reference over decode steps (on any machine),
and on a GPU the kernel's state against the reference (``QuantizedLayerCache.store``, XLA, run on the
CPU) byte for byte: rows that complete a key page or block, a value page or token or both at this
step, rows in the sink, padding rows, and rewound rows whose ring slots were overwritten (their units'
old codes re-read), at head_dim 64, 128 and 256, and over 150 decode steps of the cache's CUDA step.

The reference runs on the CPU, where XLA rounds ``(x - min) * (1 / scale)`` and the ``+ 0.5`` of the
quantization rule (:mod:`jaxlp.kvcache.quant`) separately, as the kernel does; XLA:GPU may contract
them into one FMA, which can move a code that sits exactly on a rounding tie."""

import dataclasses
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxlp import kvcache
from jaxlp.ffi import quantized_cache_store as cuda_store
from jaxlp.kvcache import fireq, kitty, kivi
from jaxlp.kvcache.quantized import cuda_kernel
from jaxlp.models import ModelConfig

ON_GPU = jax.default_backend() == "gpu"
KIVI_FORMATS = ("kivi-k2v2", "kivi-k4v4", "kivi-k2v2*", "kivi-k2v4*", "kivi-k4v2*")


def on_cpu(tree):
    return jax.device_put(tree, jax.devices("cpu")[0])


@jax.jit
def _reference_store(layer, k, v, p):
    return state_of(layer.store(k[:, None], v[:, None], p[:, None]))


def reference_store(layer, k, v, p):
    """The XLA store of one token per row, on the CPU (module doc), as the kernel's state dict."""
    return _reference_store(on_cpu(layer), on_cpu(k), on_cpu(v), on_cpu(p))


def config(kvh, d):
    return ModelConfig(model_type="llama", vocab_size=64, hidden_size=64, intermediate_size=96, num_layers=1,
                       num_heads=2 * kvh, num_kv_heads=kvh, head_dim=d, max_position_embeddings=4096)


def state_of(layer):
    return {name: getattr(layer, name) for name in cuda_store.STATE_FIELDS}


def test_takes_kitty_pages_kivi_and_fireq_tokens_only():
    assert cuda_store.supports(kitty.KeyCodec(16), kitty.ValueCodec(), 128)
    assert cuda_store.supports(kitty.KeyCodec(8), kitty.ValueCodec(), 64)
    assert cuda_store.supports(kitty.KeyCodec(64), kitty.ValueCodec(), 256)
    assert not cuda_store.supports(kitty.KeyCodec(16), kitty.ValueCodec(), 96)
    assert not cuda_store.supports(kitty.KeyCodec(16, unit=64), kitty.ValueCodec(), 128)
    for d, (kb, vb) in itertools.product((64, 128, 256), itertools.product((2, 4), repeat=2)):
        assert cuda_store.supports(kivi.KeyCodec(kb), kivi.ValueCodec(vb), d)
        assert cuda_store.supports(kivi.KeyCodec(kb), kivi.ValueCodec(vb), d, sink=32)
        assert not cuda_store.supports(kivi.KeyCodec(kb), kivi.ValueCodec(vb), 96)
        assert not cuda_store.supports(kivi.KeyCodec(kb, group=64), kivi.ValueCodec(vb), 128)
        assert not cuda_store.supports(kivi.KeyCodec(kb), kivi.ValueCodec(vb, group=64), 128)
        assert not cuda_store.supports(kivi.KeyCodec(kb, unit=64), kivi.ValueCodec(vb), 128)
    for kb, vb in ((8, 2), (2, 8), (1, 4), (4, 1), (8, 8)):  # widths the kernel is not instantiated for
        assert not cuda_store.supports(kivi.KeyCodec(kb), kivi.ValueCodec(vb), 128)
    assert not cuda_store.supports(kitty.KeyCodec(16), kivi.ValueCodec(2), 128)
    assert not cuda_store.supports(kivi.KeyCodec(2), kitty.ValueCodec(), 128)
    for d in (64, 128, 256):
        assert cuda_store.supports(fireq.TokenCodec(), fireq.TokenCodec(), d)
    assert not cuda_store.supports(fireq.TokenCodec(), fireq.TokenCodec(), 128, sink=32)
    assert not cuda_store.supports(fireq.TokenCodec(), kivi.ValueCodec(2), 128)


@pytest.mark.parametrize("name", KIVI_FORMATS)
@pytest.mark.parametrize("d", [64, 128, 256])
def test_kivi_formats_take_the_store(name, d):
    """Every KIVI format of the registry (2- or 4-bit keys and values, with or without the sink) has
    codecs the store encodes (the dispatch in QuantizedLayerCache._store_one asks supports()), and the
    bit widths the store reads off its packed codes are the codecs'."""
    layer = small_layer(name, d=d)
    kc, vc = layer.k_spec.codec, layer.v_spec.codec
    assert cuda_store.supports(kc, vc, d, sink=layer.sink_len)
    assert cuda_store.kivi_bits(layer.k_store.codes.shape[-1], layer.v_store.codes.shape[-1], d) == (kc.bits, vc.bits)


def small_layer(name="kitty", b=2, kvh=2, d=64, max_len=300):
    return kvcache.get(name).init(config(kvh, d), b, max_len).layers[0]


@pytest.mark.parametrize("name,target,leaves", [("kitty", cuda_store.TARGET, 14),
                                                 *[(name, cuda_store.KIVI_TARGET, 12) for name in KIVI_FORMATS]])
def test_lowers_to_one_custom_call_with_every_state_buffer_aliased(name, target, leaves):
    layer = small_layer(name)
    b, kvh, d = 2, 2, 64
    new = jnp.zeros((b, kvh, d), jnp.bfloat16)
    f = jax.jit(lambda s, p, k, v: cuda_store.store_token(p, k, v, s, k_lag=0, v_lag=128, max_len=300),
                donate_argnums=0)
    text = f.trace(state_of(layer), jnp.zeros((b,), jnp.int32), new, new).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count(f"@{target}(") == 1
    other = cuda_store.KIVI_TARGET if target == cuda_store.TARGET else cuda_store.TARGET
    assert f"@{other}(" not in text
    assert len(jax.tree.leaves(state_of(layer))) == leaves
    assert text.count("#stablehlo.output_operand_alias<") == leaves
    if target == cuda_store.KIVI_TARGET:  # the kernel instance: the codecs' bit widths
        kc, vc = layer.k_spec.codec, layer.v_spec.codec
        assert f"key_bits = {kc.bits} : i64" in text and f"value_bits = {vc.bits} : i64" in text


def test_fireq_lowers_to_one_custom_call_with_its_four_unit_buffers_aliased():
    layer = small_layer("fireq-int4").inner
    new = jnp.zeros((2, 2, 64), jnp.bfloat16)
    f = jax.jit(lambda s, p, k, v: cuda_store.store_token(p, k, v, s, k_lag=0, v_lag=0, max_len=300),
                donate_argnums=0)
    text = f.trace(state_of(layer), jnp.zeros((2,), jnp.int32), new, new).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count(f"@{cuda_store.INT4_TARGET}(") == 1
    assert text.count("#stablehlo.output_operand_alias<") == 4
    with pytest.raises(ValueError, match="without a sink"):
        cuda_store.store_token(jnp.zeros((2,), jnp.int32), new, new, state_of(small_layer("kitty")) |
                               {"k_store": layer.k_store, "v_store": layer.v_store}, k_lag=0, v_lag=0, max_len=300)
    bad = state_of(layer) | {"k_store": dataclasses.replace(layer.k_store, scale=layer.k_store.scale.astype(jnp.float16))}
    with pytest.raises(ValueError, match="float8_e4m3fn scales"):
        cuda_store.store_token(jnp.zeros((2,), jnp.int32), new, new, bad, k_lag=0, v_lag=0, max_len=300)


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
    st = state_of(small_layer("kivi-k2v2*"))
    f32 = st | {"k_store": dataclasses.replace(st["k_store"], scale=st["k_store"].scale.astype(jnp.float32))}
    with pytest.raises(ValueError, match="state arrays must be"):
        cuda_store.store_token(p, new, new, f32, k_lag=0, v_lag=128, max_len=300)
    st = state_of(small_layer("kivi-k4v4"))  # codes of no 2- or 4-bit width (3 bits: 48 and 24 bytes)
    ks, vs = st["k_store"], st["v_store"]
    for odd in ({"k_store": dataclasses.replace(ks, codes=ks.codes[..., :48])},
                {"v_store": dataclasses.replace(vs, codes=vs.codes[..., :24])}):
        with pytest.raises(ValueError, match="KIVI codes must be"):
            cuda_store.store_token(p, new, new, st | odd, k_lag=0, v_lag=128, max_len=300)


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
    layer = getattr(layer, "inner", layer)  # FireQ: the quantized layer under its query transform
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


def assert_same_state(got, want, msg=""):
    for path, a, b in zip(jax.tree_util.tree_flatten_with_path(want)[0], jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=f"{msg} {jax.tree_util.keystr(path[0])}")


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize("name", ["kitty-pro", "kivi-k2v2*", "kivi-k4v2*", "kivi-k2v4*"])
def test_gpu_store_of_constant_and_zero_units(name):
    """All-equal keys (every scale at the floor; Kitty: every score tied, ranks by channel) and
    all-zero values (value scales at the floor): the same bytes as the reference, finite (KIVI: the
    sink puts a key block's end at both positions, and a value token is encoded at each)."""
    kvh, d = 2, 128
    layer = kvcache.get(name, attention="cuda").init(config(kvh, d), 2, 300).layers[0]
    k = jnp.full((2, 287, kvh, d), 0.75, jnp.float32)
    v = jnp.zeros((2, 287, kvh, d), jnp.float32)
    layer = jax.jit(lambda lay: lay.store(k, v, jnp.tile(jnp.arange(287, dtype=jnp.int32), (2, 1))))(layer)
    p = jnp.asarray([159, 287], jnp.int32)
    k1, v1 = jnp.full((2, kvh, d), 0.75, jnp.bfloat16), jnp.zeros((2, kvh, d), jnp.bfloat16)
    want = reference_store(layer, k1, v1, p)
    got = jax.jit(lambda s: cuda_store.store_token(p, k1, v1, s, k_lag=0, v_lag=128, max_len=300))(state_of(layer))
    assert_same_state(got, want, name)
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


# --- KIVI ------------------------------------------------------------------------------------------

F32 = np.float32


def _kivi_key_value(st, b, u, t, bits):
    """The kernel's old_value<kKivi, KB>: token t of key block u, all heads, FP16 (code * scale exact).
    Token t is in byte t % M of its channel (M = 128 bits / 8), plane t // M."""
    m = st["k_codes"].shape[-1]
    code = (st["k_codes"][b, u, :, :, t % m] >> (bits * (t // m))) & (2**bits - 1)  # [KVH, D]
    return (code.astype(F32) * st["k_scale"][b, u, :, t // 32].astype(F32)
            + st["k_min"][b, u, :, t // 32].astype(F32)).astype(np.float16)


def _kivi_value_token(st, b, jt, bits):
    """The kernel's old value of value token jt: all heads and channels, FP16. Channel c is in byte
    c % m (m = D bits / 8), plane c // m."""
    codes = st["v_codes"][b, jt, :, 0]  # [KVH, m]
    m = codes.shape[-1]
    c = np.arange(m * (8 // bits))
    code = (codes[:, c % m] >> (bits * (c // m))) & (2**bits - 1)  # [KVH, D]
    g = c // 32
    return (code.astype(F32) * st["v_scale"][b, jt, :, 0][:, g].astype(F32)
            + st["v_min"][b, jt, :, 0][:, g].astype(F32)).astype(np.float16)


def _minmax_codes(x, axis, bits):
    """The kernel's scale_of / code_of over ``axis`` of FP16 ``x`` with levels 2^bits - 1: float32
    ops rounded one by one, the divisions as products with float32 reciprocals. (codes, FP16 scale,
    FP16 min), keepdims."""
    levels = 2**bits - 1
    x = x.astype(F32)
    lo, hi = x.min(axis=axis, keepdims=True), x.max(axis=axis, keepdims=True)
    scale = np.maximum((hi - lo) * (F32(1) / F32(levels)), F32(1e-6)).astype(np.float16)
    mn = lo.astype(np.float16)
    rcp = F32(1) / scale.astype(F32)
    codes = np.floor((x - mn.astype(F32)) * rcp + F32(0.5))
    return np.clip(codes, 0, levels).astype(np.uint8), scale, mn


def _pack_planar(codes, bits):
    """``codes [N, ...]`` packed planar over the first axis: ``[N bits / 8, ...]`` uint8, element i in
    byte i % M at bits (i // M) bits (M = N bits / 8)."""
    per = 8 // bits
    planes = codes.astype(np.uint32).reshape(per, codes.shape[0] // per, *codes.shape[1:])
    return sum(planes[q] << (bits * q) for q in range(per)).astype(np.uint8)


def kivi_kernel_model(state, positions, k, v, *, k_lag, v_lag, max_len):
    """NumPy transliteration of store_kernel<kKivi, KB, VB> (jaxlp/ffi/quantized_cache_store.cu): per
    row, the key stream (128-token blocks: the block's tokens from the new token, the ring where its
    slot holds the token, else the block's old codes) and the value stream (one token per step: the
    token leaving the window, read from its ring slot or its old codes before the slot takes the new
    token), all heads at once (each head's CTA only reads its own head; every head's CTA reads the
    slot positions before the last one writes them). The bit widths from the codes' widths
    (key blocks [.., D, 128 KB / 8], value tokens [.., 1, D VB / 8])."""
    ks, vs = state["k_store"], state["v_store"]
    st = {name: np.array(state[name]) for name in cuda_store.STATE_FIELDS[:6]}
    st |= {"k_codes": np.array(ks.codes), "k_scale": np.array(ks.scale), "k_min": np.array(ks.min),
           "v_codes": np.array(vs.codes), "v_scale": np.array(vs.scale), "v_min": np.array(vs.min)}
    k, v, positions = np.asarray(k, np.float16), np.asarray(v, np.float16), np.asarray(positions)
    off, kvh, d = st["sink_k"].shape[1], k.shape[1], k.shape[2]
    rk, rv = st["k_ring"].shape[1], st["v_ring"].shape[1]
    uk, uv = st["k_codes"].shape[1], st["v_codes"].shape[1]
    kb, vb = st["k_codes"].shape[-1] * 8 // 128, st["v_codes"].shape[-1] * 8 // d
    for b, pos in enumerate(positions):
        if not 0 <= pos < max_len:
            continue
        if pos < off:
            st["sink_k"][b, pos], st["sink_v"][b, pos] = k[b], v[b]
            continue
        j = int(pos) - off
        # keys: unit 128
        q0, q1 = 128 * (max(j - k_lag, 0) // 128), 128 * (max(j + 1 - k_lag, 0) // 128)
        u = q0 // 128
        if q1 > q0 and u < uk:
            tile = np.empty((128, kvh, d), np.float16)
            for t in range(128):
                jt = 128 * u + t
                if jt == j:
                    tile[t] = k[b]
                elif rk > 0 and st["k_ring_pos"][b, jt % rk] == jt:
                    tile[t] = st["k_ring"][b, jt % rk]
                else:
                    tile[t] = _kivi_key_value(st, b, u, t, kb)
            codes, scale, mn = _minmax_codes(tile.reshape(4, 32, kvh, d), axis=1, bits=kb)  # [4, 32, KVH, D]
            st["k_scale"][b, u], st["k_min"][b, u] = np.moveaxis(scale[:, 0], 0, 1), np.moveaxis(mn[:, 0], 0, 1)
            packed = _pack_planar(codes.reshape(128, kvh, d), kb)  # [128 KB / 8 (byte k), KVH, D]
            st["k_codes"][b, u] = np.moveaxis(packed, 0, -1)
        if rk > 0 and j >= q1:
            st["k_ring"][b, j % rk], st["k_ring_pos"][b, j % rk] = k[b], j
        # values: unit 1
        q0, q1 = max(j - v_lag, 0), max(j + 1 - v_lag, 0)
        if q1 > q0 and q0 < uv:
            jt = q0
            if jt == j:
                x = v[b]
            elif rv > 0 and st["v_ring_pos"][b, jt % rv] == jt:
                x = st["v_ring"][b, jt % rv].copy()
            else:
                x = _kivi_value_token(st, b, jt, vb)
            codes, scale, mn = _minmax_codes(x.reshape(kvh, d // 32, 32), axis=2, bits=vb)
            st["v_scale"][b, jt, :, 0], st["v_min"][b, jt, :, 0] = scale[..., 0], mn[..., 0]
            # plane q: channels [q m, (q + 1) m), m = D VB / 8
            st["v_codes"][b, jt, :, 0] = _pack_planar(codes.reshape(kvh, d).T, vb).T
        if rv > 0 and j >= q1:
            st["v_ring"][b, j % rv], st["v_ring_pos"][b, j % rv] = v[b], j
    out = {name: st[name] for name in cuda_store.STATE_FIELDS[:6]}
    out["k_store"] = kivi.KeyBlock(st["k_codes"], st["k_scale"], st["k_min"])
    out["v_store"] = kivi.ValueTokens(st["v_codes"], st["v_scale"], st["v_min"])
    return out


def kivi_rows(off):
    """(stored, positions) per row for a KIVI cache with a sink of ``off`` (max_len 520): with
    j = p - off, key block u completes at j = 128 u + 127 and every j >= 128 quantizes value token
    j - 128. Rows: the first key block with no value yet (j 127), the first value token (j 128), a
    key block and a value token (j 255, 383), mid-block (j 168), positions 5 and 31 (the sink where
    there is one), a padding row (position max_len), and rows that rewind after a 480-token bucket:
    a key block and a value token from stale rings (j 255, the block's tokens and token 127 from
    their old codes), and a value token mid-block (j 200)."""
    j = [127, 128, 255, 383, 168]
    stored = [off + x for x in j] + [5, 31, 100, 480, 480]
    positions = [off + x for x in j] + [5, 31, 520, off + 255, off + 200]
    return stored, positions


@pytest.mark.parametrize("name,d,kvh", [("kivi-k2v2*", 64, 2), ("kivi-k2v2", 128, 1), ("kivi-k4v4", 64, 2),
                                        ("kivi-k4v4", 256, 1), ("kivi-k2v4*", 128, 2), ("kivi-k4v2*", 64, 2),
                                        ("kivi-k4v2*", 256, 1)])
def test_kivi_kernel_model_matches_the_reference(name, d, kvh):
    """The kernel's transliteration gives the reference's bytes on every row kind of kivi_rows."""
    off = 32 if name.endswith("*") else 0
    stored, positions = kivi_rows(off)
    layer = on_cpu(prompt_layer(name, stored, 520, kvh, d, seed=d + kvh))
    rng = np.random.default_rng(d)
    k = jnp.asarray(rng.standard_normal((len(stored), kvh, d)), jnp.bfloat16)
    v = jnp.asarray(rng.standard_normal((len(stored), kvh, d)), jnp.bfloat16)
    p = jnp.asarray(positions, jnp.int32)
    want = reference_store(layer, k, v, p)
    got = kivi_kernel_model(state_of(layer), p, k, v, k_lag=layer.k_spec.lag, v_lag=layer.v_spec.lag,
                            max_len=layer.max_len)
    assert_same_state(got, want)


def kivi_decode_rows(off):
    """(stored, starts) of the decode-step tests: rows at different positions, one whose prompt is
    shorter than the sink (where there is one), and one that rewinds from a 300-token prompt to 150."""
    return [250, 120, min(10, off) if off else 3, 300], [250, 120, min(10, off) if off else 3, 150]


@pytest.mark.parametrize("name", ["kivi-k2v2*", "kivi-k4v4", "kivi-k2v4*", "kivi-k4v2*"])
def test_kivi_kernel_model_through_decode_steps(name):
    """The transliteration over 150 decode steps from kivi_decode_rows (key blocks, a value token
    every step, the sink where there is one, a rewound row) keeps the reference's state after every step."""
    kvh, d, off = 2, 64, 32 if name.endswith("*") else 0
    stored, starts = kivi_decode_rows(off)
    layer = on_cpu(prompt_layer(name, stored, 460, kvh, d, seed=5))
    state = want = state_of(layer)
    rng = np.random.default_rng(6)
    for i in range(150):
        k = jnp.asarray(rng.standard_normal((len(stored), kvh, d)), jnp.float32)
        v = jnp.asarray(rng.standard_normal((len(stored), kvh, d)), jnp.float32)
        p = jnp.asarray(np.asarray(starts) + i, jnp.int32)
        want = reference_store(dataclasses.replace(layer, **want), k, v, p)
        state = kivi_kernel_model(state, p, k, v, k_lag=0, v_lag=128, max_len=460)
        assert_same_state(state, want, f"step {i}")


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize("name,d,kvh", [("kivi-k2v2*", 64, 2), ("kivi-k2v2", 128, 8), ("kivi-k2v2*", 256, 1),
                                        ("kivi-k2v2*", 128, 8), ("kivi-k4v4", 64, 2), ("kivi-k4v4", 128, 8),
                                        ("kivi-k4v4", 256, 1), ("kivi-k2v4*", 64, 2), ("kivi-k2v4*", 128, 8),
                                        ("kivi-k2v4*", 256, 1), ("kivi-k4v2*", 64, 2), ("kivi-k4v2*", 128, 8),
                                        ("kivi-k4v2*", 256, 1), ("kivi-k2v2*", 256, 8), ("kivi-k4v4", 128, 12)])
def test_gpu_kivi_store_matches_the_reference_byte_for_byte(name, d, kvh):
    """Every row kind of kivi_rows, byte for byte (up to 12 head CTAs per row and stream meeting at
    the slot positions' counter)."""
    off = 32 if name.endswith("*") else 0
    stored, positions = kivi_rows(off)
    layer = prompt_layer(name, stored, 520, kvh, d, seed=d + kvh)
    rng = np.random.default_rng(d)
    k = jnp.asarray(rng.standard_normal((len(stored), kvh, d)), jnp.bfloat16)
    v = jnp.asarray(rng.standard_normal((len(stored), kvh, d)), jnp.bfloat16)
    p = jnp.asarray(positions, jnp.int32)
    want = reference_store(layer, k, v, p)
    got = jax.jit(lambda s: cuda_store.store_token(p, k, v, s, k_lag=layer.k_spec.lag, v_lag=layer.v_spec.lag,
                                                   max_len=layer.max_len))(state_of(layer))
    assert_same_state(got, want)
    # The encodes ran: the rows completing a key block changed it, the rows past j 128 a value token.
    changed = np.asarray(got["k_store"].scale != layer.k_store.scale).any(axis=(1, 2, 3, 4))
    assert changed[[0, 2, 3, 8]].all() and not changed[[1, 4, 5, 6, 7, 9]].any()
    changed = np.asarray(got["v_store"].scale != layer.v_store.scale).any(axis=(1, 2, 3, 4))
    assert changed[[1, 2, 3, 4]].all() and not changed[[0, 5, 6, 7]].any()


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
def cuda_step(layer, num_heads):
    """The cache's CUDA one-token step, jitted: ``(lay, q, k, v, p) -> (out, lay)``. Where the CUDA
    attention reads the format, its attend (the attention, then this store); else the store alone as
    that step runs it (QuantizedLayerCache._store_one with the "cuda" implementation; out None)."""
    d, kvh = layer.k_ring.shape[-1], layer.k_ring.shape[2]
    if cuda_kernel(layer.k_spec.codec, layer.v_spec.codec, d, num_heads // kvh) is not None:
        assert layer._decode_implementation(num_heads) == "cuda"
        return jax.jit(lambda lay, q, k, v, p: lay.attend(q, k, v, p, scale=d**-0.5, window=None, softcap=None))
    return jax.jit(lambda lay, q, k, v, p: (None, lay._store_one(k[:, 0], v[:, 0], p[:, 0], "cuda")))


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize("name,d,kvh", [("kivi-k2v2*", 128, 2), ("kivi-k2v2", 64, 8), ("kivi-k2v2*", 256, 1),
                                        ("kivi-k4v4", 128, 2), ("kivi-k4v4", 64, 8), ("kivi-k2v4*", 64, 8),
                                        ("kivi-k4v2*", 256, 1)])
def test_gpu_kivi_decode_steps_keep_the_reference_state(name, d, kvh):
    """The cache's CUDA step (:func:`cuda_step`: attend, then this store; the store alone where the
    CUDA attention does not read the format) over 150 steps from kivi_decode_rows (rows at different
    positions crossing key blocks, a value token every step past the window, a prompt shorter than
    the sink, a rewound row): the state after every step equals the reference's (the XLA store on the
    CPU), and the program holds the KIVI store's custom call and no conditional."""
    off = 32 if name.endswith("*") else 0
    stored, starts = kivi_decode_rows(off)
    h = 2 * kvh
    layer = prompt_layer(name, stored, 460, kvh, d, seed=3)
    state = on_cpu(state_of(layer))
    rng = np.random.default_rng(4)
    step = cuda_step(layer, h)
    b = len(stored)
    for i in range(150):
        q = jnp.asarray(rng.standard_normal((b, 1, h, d)), jnp.float32)
        k = jnp.asarray(rng.standard_normal((b, 1, kvh, d)), jnp.float32)
        v = jnp.asarray(rng.standard_normal((b, 1, kvh, d)), jnp.float32)
        p = jnp.asarray(np.asarray(starts) + i, jnp.int32)[:, None]
        state = reference_store(dataclasses.replace(layer, **state), k[:, 0], v[:, 0], p[:, 0])
        _, layer = step(layer, q, k, v, p)
        assert_same_state(state_of(layer), state, f"step {i}")
    text = step.lower(layer, q, k, v, p).as_text()
    assert text.count(f"@{cuda_store.KIVI_TARGET}(") == 1
    assert "stablehlo.case" not in text and "stablehlo.if" not in text


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize("d,kvh", [(64, 2), (128, 8), (256, 1)])
def test_gpu_fireq_store_matches_the_reference_byte_for_byte(d, kvh):
    """FireQ's INT4 tokens: rows appending, rewinding, at position 0 and padding (outside [0,
    max_len)); tokens of random magnitudes, all zero (the scale floor) and past the FP8 scale's top
    (saturated at 448)."""
    stored = [100, 5, 300, 300, 0, 250]
    positions = [100, 5, 150, 299, 0, 600]
    layer = prompt_layer("fireq-int4", [max(n, 1) for n in stored], 520, kvh, d, seed=d)
    rng = np.random.default_rng(d)
    scale = np.exp(rng.normal(size=(len(stored), kvh, 1)) * 2)
    k = rng.standard_normal((len(stored), kvh, d)) * scale
    k[1] = 0.0
    k[2, :, 3] = 5e4  # max|x| / 7 > 448: the scale saturates
    v = rng.standard_normal((len(stored), kvh, d)) * scale[::-1]
    k, v = jnp.asarray(k, jnp.float32), jnp.asarray(v, jnp.bfloat16)
    p = jnp.asarray(positions, jnp.int32)
    want = reference_store(layer, k, v, p)
    got = jax.jit(lambda s: cuda_store.store_token(p, k, v, s, k_lag=0, v_lag=0, max_len=layer.max_len))(
        state_of(layer))
    assert_same_state(got, want)
    changed = np.asarray(got["k_store"].scale != layer.k_store.scale).any(axis=(1, 2, 3))
    assert changed[[0, 2, 3]].all() and not changed[5]


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
def test_gpu_fireq_decode_steps_keep_the_reference_state():
    """FireQ's CUDA step (the INT4 attention, then this store) over 40 steps of ragged and rewound
    rows: the state after every step equals the reference's, and the program holds the INT4 store's
    custom call."""
    kvh, d, h = 2, 128, 8
    layer = prompt_layer("fireq-int4", [200, 37, 300], 400, kvh, d, seed=9)
    assert layer._decode_implementation(h) == "cuda"
    state = on_cpu(state_of(layer))
    rng = np.random.default_rng(10)
    step = jax.jit(lambda lay, q, k, v, p: lay.attend(q, k, v, p, scale=d**-0.5, window=None, softcap=None))
    starts = [200, 37, 120]
    for i in range(40):
        q = jnp.asarray(rng.standard_normal((3, 1, h, d)), jnp.float32)
        k = jnp.asarray(rng.standard_normal((3, 1, kvh, d)), jnp.float32)
        v = jnp.asarray(rng.standard_normal((3, 1, kvh, d)), jnp.float32)
        p = jnp.asarray(np.asarray(starts) + i, jnp.int32)[:, None]
        state = reference_store(dataclasses.replace(layer, **state), k[:, 0], v[:, 0], p[:, 0])
        _, layer = step(layer, q, k, v, p)
        assert_same_state(state_of(layer), state, f"step {i}")
    assert step.lower(layer, q, k, v, p).as_text().count(f"@{cuda_store.INT4_TARGET}(") == 1
