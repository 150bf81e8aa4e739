"""Quantized caches against a step-by-step model of their semantics, and inside generate().

The reference (:class:`StepReference`) keeps every token's full-precision key and value and
decides per call, from the notes' rules alone, which old tokens a cache holds quantized: the
sink (FP16), whole units below ``unit * floor((m - lag) / unit)`` (quantized from the FP16
values of the unit, as its ring held them; FireQ, which has no ring: from the float32 values),
everything else FP16; the call's own tokens in full precision. It
attends in float64. The unit codecs themselves are checked against NumPy in the per-format
test files.
"""

import functools

import flax
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import jaxlp
from jaxlp import kvcache
from jaxlp.kvcache.quantized import QuantizedLayerCache
from jaxlp.models import ModelConfig, Transformer

# name -> (sink, (key unit, key lag), (value unit, value lag)), from shared/notes/kvcache.md
RULES = {
    "kivi-k2v2": (0, (128, 0), (1, 128)),
    "kivi-k4v4": (0, (128, 0), (1, 128)),
    "kivi-k2v2*": (32, (128, 0), (1, 128)),
    "kivi-k2v4*": (32, (128, 0), (1, 128)),
    "kivi-k4v2*": (32, (128, 0), (1, 128)),
    "kitty": (32, (128, 0), (128, 128)),
    "kitty-pro": (32, (128, 0), (128, 128)),
    "fireq-int4": (0, (1, 0), (1, 0)),
}
QUANTIZED = tuple(RULES)

H, KVH, D = 4, 2, 32
CONFIG = ModelConfig(
    model_type="llama", vocab_size=64, hidden_size=64, intermediate_size=96, num_layers=1,
    num_heads=H, num_kv_heads=KVH, head_dim=D, max_position_embeddings=2048,
)


def fp16(x):
    return np.asarray(x, np.float32).astype(np.float16).astype(np.float32)


def fp8_queries(q):
    """Per (token, head) FP8 E4M3 with scale max|q| / 448 (NumPy, ml_dtypes)."""
    s = np.abs(q).max(-1, keepdims=True) / 448.0
    s = np.where(s > 0, s, 1.0).astype(np.float32)
    return (q / s).astype(ml_dtypes.float8_e4m3fn).astype(np.float32) * s


class StepReference:
    """Slow model of one layer's cache for a batch (see module doc)."""

    def __init__(self, name, batch, max_len, k_scale=None):
        fmt = kvcache.get(name)
        self.sink, self.k_rule, self.v_rule = RULES[name]
        self.off = min(self.sink, max_len)
        (kc, _), (vc, _) = fmt.streams(CONFIG)
        assert (kc.unit, vc.unit) == (self.k_rule[0], self.v_rule[0])
        self.codecs = (jax.jit(lambda x: kc.decode(kc.encode(x))), jax.jit(lambda x: vc.decode(vc.encode(x))))
        self.fireq = name.startswith("fireq")
        self.k_scale = np.ones((KVH, D), np.float32) if k_scale is None else np.asarray(k_scale, np.float32)
        self.hist = np.zeros((2, batch, max_len, KVH, D), np.float32)  # raw keys, values
        self.decoded = {}
        self.max_len = max_len

    def _old(self, which, row, start):
        """The first ``start`` tokens as the cache holds them before a call starting there."""
        x = fp16(self.hist[which, row, :start])
        unit, lag = (self.k_rule, self.v_rule)[which]
        m = max(start - self.off, 0)
        quantized = unit * (max(m - lag, 0) // unit)
        dec = self.decoded.setdefault((which, row), [])  # decoded units, computed once each
        while len(dec) * unit < quantized:
            u = len(dec)
            page = self.hist[which, row, self.off + u * unit: self.off + (u + 1) * unit]  # [unit, KVH, D]
            page = page if self.fireq else fp16(page)
            dec.append(np.asarray(self.codecs[which](jnp.asarray(np.swapaxes(page, 0, 1)))).swapaxes(0, 1))
        if quantized:
            x[self.off: self.off + quantized] = np.concatenate(dec)[:quantized]
        return x

    def call(self, q, k, v, positions, *, window=None, softcap=None):
        """Output ``[B, S, H, D]`` (float64; rows of padding only: zeros)."""
        q, k, v = (np.asarray(a, np.float32) for a in (q, k, v))
        if self.fireq:
            k = k * self.k_scale
            q = q / np.repeat(self.k_scale, H // KVH, axis=0)
            q = fp8_queries(q)
        positions = np.asarray(positions)
        out = np.zeros(q.shape, np.float64)
        for r in range(q.shape[0]):
            valid = (positions[r] >= 0) & (positions[r] < self.max_len)
            if not valid.any():
                continue
            start, end = positions[r][valid].min(), positions[r][valid].max() + 1
            pad = np.zeros((end - start, KVH, D), np.float32)
            keys = np.concatenate([self._old(0, r, start), pad])
            vals = np.concatenate([self._old(1, r, start), pad])
            for i in np.flatnonzero(valid):
                keys[positions[r, i]], vals[positions[r, i]] = k[r, i], v[r, i]
            for i in np.flatnonzero(valid):
                p = positions[r, i]
                vis = np.arange(end) <= p
                if window is not None:
                    vis &= np.arange(end) > p - window
                for h in range(H):
                    kv = h // (H // KVH)
                    s = keys[:, kv].astype(np.float64) @ q[r, i, h].astype(np.float64) * D**-0.5
                    if softcap is not None:
                        s = np.tanh(s / softcap) * softcap
                    s = np.where(vis, s, -np.inf)
                    w = np.exp(s - s.max())
                    out[r, i, h] = (w / w.sum()) @ vals[:, kv].astype(np.float64)
            self.hist[0, r, positions[r, valid]] = k[r, valid]
            self.hist[1, r, positions[r, valid]] = v[r, valid]
        return out


@functools.partial(jax.jit, static_argnames=("window", "softcap"))
def _attend(layer, q, k, v, positions, window=None, softcap=None):
    return layer.attend(q, k, v, positions, scale=D**-0.5, window=window, softcap=softcap)


def _qkv(rng, b, s):
    chan = np.exp(rng.normal(size=(1, 1, KVH, D))).astype(np.float32)  # channels of different magnitude
    q = rng.normal(size=(b, s, H, D)).astype(np.float32)
    k = (rng.normal(size=(b, s, KVH, D)) * chan + 0.5 * rng.normal(size=(1, 1, KVH, D))).astype(np.float32)
    v = rng.normal(size=(b, s, KVH, D)).astype(np.float32)
    return q, k, v


def _check(out, ref, positions, max_len, what):
    valid = (np.asarray(positions) >= 0) & (np.asarray(positions) < max_len)
    np.testing.assert_allclose(np.asarray(out)[valid], ref[valid], rtol=2e-4, atol=2e-5, err_msg=what)


def _run(name, lengths, prefill, steps, max_len, seed, *, pad=-1, rewind=False, window=None, softcap=None, k_scale=None):
    """Prefill ``prefill`` positions (padding marked ``pad`` past each row's length unless
    ``rewind``: then all in range, as generate does today), then ``steps`` decode steps at
    ``lengths + t``; compare every call with the reference."""
    rng = np.random.default_rng(seed)
    b = len(lengths)
    fmt = kvcache.get(name) if k_scale is None else kvcache.FireQInt4.calibrated([k_scale])
    layer = fmt.init(CONFIG, b, max_len).layers[0]
    ref = StepReference(name, b, max_len, k_scale)
    lengths = np.asarray(lengths)
    positions = np.broadcast_to(np.arange(prefill), (b, prefill)).copy()
    if not rewind:
        positions[positions >= lengths[:, None]] = pad
    for t in range(-1, steps):
        if t >= 0:
            positions = (lengths + t)[:, None]
        q, k, v = _qkv(rng, b, positions.shape[1])
        out, layer = _attend(layer, q, k, v, jnp.asarray(positions, jnp.int32), window=window, softcap=softcap)
        _check(out, ref.call(q, k, v, positions, window=window, softcap=softcap), positions, max_len, f"{name} step {t}")
    return layer


# Both tests below prefill 512 positions of batches of 3 rows in caches of 520 positions, so
# that they share the compiled prefill and decode steps.
LONG = ("kivi-k2v2", "kivi-k4v2*", "kitty-pro", "fireq-int4")  # every code path; the rest differ in bits


@pytest.mark.parametrize("name", LONG)
def test_long_decode_matches_step_reference(name):
    """Rows of lengths 5 (shorter than the sink), 100 and 40 decode until row 1 has passed
    32 + 3 * 128 + 50 positions: pages fill at different steps per row."""
    _run(name, [5, 100, 40], prefill=512, steps=370, max_len=520, seed=QUANTIZED.index(name))


@pytest.mark.parametrize("name", QUANTIZED)
def test_prefill_packs_several_pages_at_once(name):
    _run(name, [450, 300, 1], prefill=512, steps=12, max_len=520, seed=7 + len(name), pad=10_000)


@pytest.mark.parametrize("name", ["kitty-pro"])
def test_sliding_window_and_softcap(name):
    _run(name, [150, 90], prefill=256, steps=40, max_len=300, seed=3, window=40, softcap=20.0)


@pytest.mark.parametrize("name", ["kitty", "kitty-pro"])
def test_rewind_after_in_range_padding(name):
    """generate() today: padded prompt positions in range; a decode step at the row's length
    rewinds. Exact here: the rewound tokens are still in the rings (when later padding
    positions overwrote them, they are read back quantized: KIVI's value window)."""
    _run(name, [170, 256], prefill=256, steps=30, max_len=290, seed=11, rewind=True)


def test_fireq_channel_scales_in_reference():
    k_scale = np.exp(np.random.default_rng(5).normal(size=(KVH, D))).astype(np.float32)
    _run("fireq-int4", [20, 3], prefill=32, steps=20, max_len=60, seed=5, k_scale=k_scale)


def test_max_len_below_sink():
    _run("kitty", [3, 9], prefill=16, steps=4, max_len=20, seed=2)


def test_padding_only_row_is_left_alone():
    layer = kvcache.get("kitty").init(CONFIG, 2, 200).layers[0]
    q, k, v = _qkv(np.random.default_rng(0), 2, 16)
    positions = jnp.asarray(np.stack([np.arange(16), np.full(16, -1)]), jnp.int32)
    _, new = _attend(layer, q, k, v, positions)
    for a, b in zip(jax.tree.leaves(layer), jax.tree.leaves(new)):
        np.testing.assert_array_equal(np.asarray(a)[1], np.asarray(b)[1])


@pytest.mark.parametrize("name", QUANTIZED)
def test_store_branches_only_where_units_are_pages(name):
    """A one-token store encodes under a conditional only where both streams' units are pages
    (Kitty: a page completes once every 128 steps); with single-token units (KIVI values,
    FireQ), which complete at nearly every step, it encodes unconditionally (the conditional
    would only add XLA:GPU's host read-back of its predicate)."""
    layer = kvcache.get(name).init(CONFIG, 2, 300).layers[0]
    layer = getattr(layer, "inner", layer)
    kv = jnp.zeros((2, 1, KVH, D), jnp.float32)
    store = jax.jit(lambda lay, p: lay.store(kv, kv, p))
    text = store.lower(layer, jnp.zeros((2, 1), jnp.int32)).as_text()
    paged = min(RULES[name][1][0], RULES[name][2][0]) > 1
    assert ("stablehlo.case" in text) == paged, name


def test_shape_mismatch_raises():
    layer = kvcache.get("kitty").init(CONFIG, 1, 64).layers[0]
    q, k, v = _qkv(np.random.default_rng(0), 1, 4)
    with pytest.raises(ValueError, match="do not match"):
        layer.attend(q, k[:, :3], v[:, :3], jnp.zeros((1, 4), jnp.int32), scale=1.0, window=None, softcap=None)


# --- inside the model and generate() ---------------------------------------------------

@functools.lru_cache(maxsize=None)
def _model():
    return Transformer(CONFIG, dtype=jnp.float32, rngs=flax.nnx.Rngs(0))


def _prompts(seed, lengths):
    rng = np.random.default_rng(seed)
    return [rng.integers(1, CONFIG.vocab_size, n).tolist() for n in lengths]


@pytest.mark.parametrize("name", QUANTIZED)
def test_generate_runs_with_every_cache(name):
    prompts = _prompts(0, [170, 9])
    result = jaxlp.generate(_model(), prompts, max_new_tokens=4, kv_cache=name, stop_tokens=())
    assert result.tokens.shape == (2, 4)
    assert (result.num_tokens == 4).all()
    assert ((result.tokens >= 0) & (result.tokens < CONFIG.vocab_size)).all()


def test_generate_rows_equal_prompts_alone():
    """A short row (shorter than the sink) decodes in a batch as alone, although its prompt
    bucket differs (256 in the batch, 32 alone) and the batch's prefill packs a page of its
    padding (generate() today keeps padded positions in range; the decode rewinds)."""
    prompts = _prompts(1, [150, 20])
    batch = jaxlp.generate(_model(), prompts, max_new_tokens=5, kv_cache="kitty-pro", stop_tokens=())
    alone = jaxlp.generate(_model(), prompts[1:], max_new_tokens=5, kv_cache="kitty-pro", stop_tokens=())
    np.testing.assert_array_equal(batch.tokens[1], alone.tokens[0])


@functools.lru_cache(maxsize=None)
def _jit_forward(model):
    return jax.jit(lambda ids, pos, c: model.forward(ids, pos, c))


def _forward_logits(model, name, prompts, steps, pad, bucket=True):
    """Prefill (prompts right-padded to a power of two if ``bucket``) with padded positions set
    to ``pad`` (or kept in range if None), then greedy decode ``steps`` tokens; returns the
    decode-step logits ``[B, steps, V]``."""
    lengths = np.array([len(p) for p in prompts])
    s = max(16, 1 << int(lengths.max() - 1).bit_length()) if bucket else int(lengths.max())
    tokens = np.zeros((len(prompts), s), np.int32)
    for i, p in enumerate(prompts):
        tokens[i, : len(p)] = p
    positions = np.broadcast_to(np.arange(s), tokens.shape).copy()
    if pad is not None:
        positions[positions >= lengths[:, None]] = pad
    cache = kvcache.get(name).init(CONFIG, len(prompts), s + steps)
    forward = _jit_forward(model)
    hidden, cache = forward(jnp.asarray(tokens), jnp.asarray(positions, jnp.int32), cache)
    logits = model.logits(hidden[np.arange(len(prompts)), lengths - 1])
    out = []
    for t in range(steps):
        out.append(np.asarray(logits))
        token = jnp.argmax(logits, -1).astype(jnp.int32)[:, None]
        hidden, cache = forward(token, jnp.asarray(lengths + t, jnp.int32)[:, None], cache)
        logits = model.logits(hidden[:, 0])
    return np.stack(out, 1)


@pytest.mark.parametrize("name", ["kitty-pro"])
def test_marked_padding_makes_rows_exact(name):
    """With padded prompt positions marked out of range, a batch row's logits equal those of
    its prompt run alone without any padding; with padding kept in range (generate() today)
    they do not: the padding was packed into the row's first key page and the ring slots of
    the row's own tokens were overwritten by later padding positions."""
    model = _model()
    prompts = _prompts(2, [250, 140])
    exact = _forward_logits(model, name, prompts[1:], steps=3, pad=None, bucket=False)
    marked = _forward_logits(model, name, prompts, steps=3, pad=-1)
    np.testing.assert_allclose(marked[1], exact[0], rtol=1e-5, atol=1e-5)
    in_range = _forward_logits(model, name, prompts, steps=3, pad=None)
    assert np.abs(in_range[1] - exact[0]).max() > 1e-4


# --- memory accounting --------------------------------------------------------------------

@pytest.mark.parametrize("name", QUANTIZED + ("bf16",))
def test_nbytes_and_max_batch_size(name):
    fmt = kvcache.get(name)
    max_len = 700
    row = (fmt.bytes_for(CONFIG, max_len) + 0) if hasattr(fmt, "bytes_for") else 2 * KVH * D * 2 * max_len
    fixed = getattr(fmt, "fixed_bytes", lambda c: 0)(CONFIG)
    for batch in (1, 3):
        assert fmt.init(CONFIG, batch, max_len).nbytes == CONFIG.num_layers * (batch * row + fixed)
        assert kvcache.cache_bytes(name, CONFIG, batch, max_len) == CONFIG.num_layers * (batch * row + fixed)
    budget = CONFIG.num_layers * (5 * row + fixed)
    assert kvcache.max_batch_size(name, CONFIG, max_len, budget) == 5
    assert kvcache.max_batch_size(fmt, CONFIG, max_len, budget - 1) == 4
    assert kvcache.max_batch_size(name, CONFIG, max_len, 10) == 0


def test_quantized_caches_are_smaller():
    """At long contexts every quantized format takes well under the BF16 cache."""
    dense = kvcache.get("bf16").bytes_per_token(CONFIG)
    ratios = {name: kvcache.get(name).bytes_per_token(CONFIG) / dense for name in QUANTIZED}
    assert all(r < 0.4 for r in ratios.values()), ratios
    assert ratios["kitty"] < ratios["kitty-pro"] < ratios["kivi-k4v2*"] < ratios["kivi-k4v4"]
