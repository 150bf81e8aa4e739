"""Quantized caches' one-token steps through the packed-unit kernel against the reference attend.

The kernel runs in Pallas' interpret mode (``attention="interpret"``): the decode path of
:class:`jaxlp.kvcache.quantized.QuantizedLayerCache` (kernel over the units + XLA over the sink,
the ring window and the new token, merged) must give the reference's output (dequantize the
whole cache, float32 attention) on fresh random caches: ragged rows, rows that rewind after a
right-padded prompt, prompts shorter than the sink, page boundaries, windows, softcap, GQA.

The CPU tests run each store and each step (kernel and reference) as one compiled program
(:func:`filled_layer`, :func:`both_compiled`): compiling it once costs a fraction of the
op-by-op dispatch, which compiles every operation of the interpreted kernel by itself.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxlp
from jaxlp import kvcache
from jaxlp.generation import pad_prompts
from jaxlp.models import ModelConfig

QUANTIZED = ("kivi-k2v2", "kivi-k4v4", "kivi-k2v4*", "kivi-k4v2*", "kitty", "kitty-pro", "fireq-int4")


def config(h, kvh, d=64):
    return ModelConfig(model_type="llama", vocab_size=64, hidden_size=64, intermediate_size=96, num_layers=1,
                       num_heads=h, num_kv_heads=kvh, head_dim=d, max_position_embeddings=4096)


def rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return np.linalg.norm(a - b) / np.linalg.norm(b)


@jax.jit
def _store(layer, k, v, positions):
    return layer.store(k, v, positions)


def filled_layer(name, stored, max_len, h, kvh, seed, d=64):
    """A layer cache after a prompt call (a bucket of ``max(stored)`` positions) storing each row's
    first ``stored[b]`` tokens (the bucket's later positions are padding). A row that then decodes
    at a length below ``stored[b]`` rewinds over real tokens, as after generate()'s right-padded
    prompts (padding kept in range)."""
    fmt = kvcache.get(name, attention="interpret")
    layer = fmt.init(config(h, kvh, d), len(stored), max_len).layers[0]
    layer = getattr(layer, "inner", layer)  # FireQ: the quantized layer under its query transform
    rng = np.random.default_rng(seed)
    s = max(stored)
    k = jnp.asarray(rng.standard_normal((len(stored), s, kvh, d)) * 2, jnp.float32)
    v = jnp.asarray(rng.standard_normal((len(stored), s, kvh, d)), jnp.float32)
    pos = np.tile(np.arange(s), (len(stored), 1))
    pos = np.where(pos < np.asarray(stored)[:, None], pos, max_len)
    return _store(layer, k, v, jnp.asarray(pos, jnp.int32))


def step_inputs(layer, h, seed):
    b, kvh, d = layer.sink_k.shape[0], layer.k_ring.shape[2], layer.k_ring.shape[3]
    rng = np.random.default_rng(seed + 1)
    q = jnp.asarray(rng.standard_normal((b, 1, h, d)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((b, 1, kvh, d)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((b, 1, kvh, d)), jnp.float32)
    return q, k, v


def assert_reference_state(new, layer, k, v, positions):
    """``new`` is the state the reference store leaves, run on the CPU: the quantization rule as
    written (XLA:GPU may contract a code's multiply-add into an FMA, which moves rounding ties;
    see :mod:`jaxlp.ffi.quantized_cache_store`)."""
    cpu = jax.devices("cpu")[0]
    want = _store(*jax.device_put((layer, k, v, jnp.asarray(positions, jnp.int32)), cpu))
    for a, b in zip(jax.tree.leaves(new), jax.tree.leaves(want)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def both(layer, q, k, v, positions, **kw):
    kw = dict(scale=0.125, window=None, softcap=None) | kw
    got, new = layer.attend(q, k, v, jnp.asarray(positions, jnp.int32)[:, None], **kw)
    want, _ = layer.reference_attend(q, k, v, jnp.asarray(positions, jnp.int32)[:, None], **kw)
    assert_reference_state(new, layer, k, v, jnp.asarray(positions, jnp.int32)[:, None])
    return got, want


@functools.partial(jax.jit, static_argnames=("scale", "window", "softcap"))
def _attend_and_reference(layer, q, k, v, positions, *, scale, window, softcap):
    got, new = layer.attend(q, k, v, positions, scale=scale, window=window, softcap=softcap)
    want, ref_new = layer.reference_attend(q, k, v, positions, scale=scale, window=window, softcap=softcap)
    return got, new, want, ref_new


def both_compiled(layer, q, k, v, positions, **kw):
    """:func:`both` as one compiled program: the kernel step's and the reference's outputs, after
    checking that the step leaves the reference store's state."""
    kw = dict(scale=0.125, window=None, softcap=None) | kw
    got, new, want, _ = _attend_and_reference(layer, q, k, v, jnp.asarray(positions, jnp.int32)[:, None], **kw)
    assert_reference_state(new, layer, k, v, jnp.asarray(positions, jnp.int32)[:, None])
    return got, want


def assert_rows_close(got, want, tol=2e-3):
    """Every row's output within ``tol`` (relative norm) of the reference's, and finite."""
    assert np.isfinite(np.asarray(got)).all()
    errors = [rel(got[b], want[b]) for b in range(got.shape[0])]
    assert max(errors) < tol, errors


# Rows decoding right after what they stored: at page boundaries (128, 129, 255 tokens), shorter
# than the sink (20), one long row (300). Then rows that rewind after a right-padded prompt: they
# stored a 280-token bucket and decode at 150 and 257, so later stored tokens (in rings and units)
# are stale and must be read as the reference reads them. One batch, one compilation per format.
STORED = [128, 129, 255, 20, 300, 280, 280]
LENGTHS = [128, 129, 255, 20, 300, 150, 257]


@pytest.mark.parametrize("name", QUANTIZED)
def test_decode_step_matches_the_reference(name):
    """Ragged rows at page boundaries and below the sink, and rows that rewind, in one batch."""
    layer = filled_layer(name, STORED, 320, h=4, kvh=2, seed=len(name))
    q, k, v = step_inputs(layer, 4, 0)
    got, want = both_compiled(layer, q, k, v, LENGTHS)
    assert_rows_close(got, want)


# A short window, a long one with a softcap, a softcap alone: each a compilation of its own. The
# kernel's head blocks do not depend on them, so 20 query heads per KV head (two head blocks) take
# the second only.
WINDOW_SETTINGS = (dict(window=64), dict(window=200, softcap=5.0), dict(softcap=2.0))


@pytest.mark.parametrize("name", ["kitty-pro", "kivi-k2v2*", "fireq-int4"])
@pytest.mark.parametrize("g, settings", [(1, WINDOW_SETTINGS), (20, WINDOW_SETTINGS[1:2])], ids=["g1", "g20"])
def test_windows_softcap_and_gqa(name, g, settings):
    """Windows and softcaps with one query head per KV head, and with 20 (GQA over two head blocks)."""
    lengths = [260, 140]
    layer = filled_layer(name, lengths, 300, h=2 * g, kvh=2, seed=g)
    q, k, v = step_inputs(layer, 2 * g, g)
    for kw in settings:
        got, want = both_compiled(layer, q, k, v, lengths, **kw)
        assert rel(got, want) < 2e-3, kw


def test_all_equal_keys_and_zero_values_are_nan_free():
    """Zeroed unit stores (every key of a unit equal, values zero): finite, as the reference.
    The shapes are test_decode_step_matches_the_reference's (its compiled step is reused)."""
    layer = filled_layer("kitty-pro", STORED, 320, h=4, kvh=2, seed=1)
    layer = dataclasses.replace(layer, k_store=jax.tree.map(jnp.zeros_like, layer.k_store),
                                v_store=jax.tree.map(jnp.zeros_like, layer.v_store))
    q, k, v = step_inputs(layer, 4, 1)
    got, want = both_compiled(layer, q, k, v, LENGTHS)
    assert_rows_close(got, want)


def test_attention_field_is_validated_and_static():
    with pytest.raises(ValueError, match="attention implementation must be one of"):
        kvcache.get("kitty", attention="triton")
    a = kvcache.get("kitty").init(config(4, 2), 1, 300)
    b = kvcache.get("kitty", attention="xla").init(config(4, 2), 1, 300)
    assert jax.tree.structure(a) != jax.tree.structure(b)  # part of the jit cache key


def test_kernel_options_are_validated_static_and_reach_the_kernel(monkeypatch):
    """kernel_options: checked by name (ValueError naming the unknown one; not on a dense cache; FireQ's
    INT4 kernel takes only splits), kept sorted and hashable in the format and every layer (a static
    part of the jit key), and given to the CUDA kernel's call of a one-token step as keywords."""
    from jaxlp.ffi import quantized_decode_attention as cuda_attention
    from jaxlp.kvcache.quantized import QuantizedLayerCache

    with pytest.raises(ValueError, match=r"unknown kernel_options \['warps'\]"):
        kvcache.get("kitty-pro", kernel_options={"warps": 8})
    with pytest.raises(ValueError, match="no CUDA kernel"):
        kvcache.get("bf16", kernel_options={"splits": 2})
    fmt = kvcache.get("kivi-k2v2*", kernel_options={"query_merge_splits": 8, "min_blocks": 4})
    assert fmt.kernel_options == (("min_blocks", 4), ("query_merge_splits", 8)) and hash(fmt)
    a = fmt.init(config(4, 2), 1, 300)
    assert a.layers[0].kernel_options == fmt.kernel_options
    assert jax.tree.structure(a) != jax.tree.structure(kvcache.get("kivi-k2v2*").init(config(4, 2), 1, 300))
    seen = {}

    def spy(q, *args, **kw):
        seen.update(kw)
        return jnp.zeros(q.shape, jnp.float32), None, None

    monkeypatch.setattr(cuda_attention, "attend_cache", spy)
    monkeypatch.setattr(QuantizedLayerCache, "_decode_implementation", lambda self, heads: "cuda")
    monkeypatch.setattr(QuantizedLayerCache, "_store_one", lambda self, k, v, p, impl: self)
    layer = dataclasses.replace(filled_layer("kivi-k2v2*", [130], 300, h=4, kvh=2, seed=0, d=128),
                                kernel_options=fmt.kernel_options)
    q, k, v = step_inputs(layer, 4, 0)
    layer.attend(q, k, v, jnp.asarray([[130]]), scale=0.1, window=None, softcap=None)
    assert seen["query_merge_splits"] == 8 and seen["min_blocks"] == 4
    fireq = kvcache.get("fireq-int4", kernel_options={"min_blocks": 4}).init(config(4, 2, 128), 1, 300)
    inner = fireq.layers[0].inner
    with pytest.raises(ValueError, match="do not apply to FireQ's INT4 kernel"):
        inner._attend_one(q[:, 0], k[:, 0], v[:, 0], jnp.asarray([130]), scale=0.1, window=None, softcap=None,
                          cuda_options=dict(inner.kernel_options))


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="checks the error without a GPU")
def test_pallas_without_a_gpu_says_why():
    layer = filled_layer("kitty", [130], 200, h=4, kvh=2, seed=0)
    layer = dataclasses.replace(layer, attention="pallas")
    q, k, v = step_inputs(layer, 4, 0)
    with pytest.raises(ValueError, match="needs a GPU"):
        layer.attend(q, k, v, jnp.asarray([[130]]), scale=0.1, window=None, softcap=None)


@pytest.mark.parametrize("name", ["kitty-pro", "fireq-int4"])
def test_generation_gives_the_same_greedy_tokens(name):
    """The shipped reasoner (head_dim 64, 8 layers): kernel (interpret) and reference, same tokens."""
    from importlib.resources import files

    model = jaxlp.from_pretrained(files("jaxlp") / "assets" / "reasoner", dtype=jnp.float32)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 60, 140).tolist(), rng.integers(3, 60, 30).tolist()]
    runs = [jaxlp.generate(model, prompts, max_new_tokens=6, stop_tokens=[], kv_cache=kvcache.get(name, attention=a))
            for a in ("xla", "interpret")]
    np.testing.assert_array_equal(runs[0].tokens, runs[1].tokens)


ON_GPU = jax.default_backend() == "gpu"


CUDA_READS = ("kivi-k2v2", "kivi-k4v4", "kitty", "kitty-pro")  # Kitty and KIVI units: jaxlp.ffi.quantized_decode_attention
# FireQ's per-token INT4 units: jaxlp.ffi.int4_decode_attention
KERNELS = [(n, "pallas") for n in QUANTIZED] + [(n, "cuda") for n in CUDA_READS + ("fireq-int4",)]


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize("name,attention", KERNELS)
def test_gpu_decode_step_matches_the_reference(name, attention):
    """The compiled kernel path at the Qwen3-8B head shape: ragged rows, a window, GQA 4."""
    lengths = [4000, 129, 1500, 2049]
    fmt = kvcache.get(name, attention=attention)
    cfg = config(32, 8, 128)
    layer = fmt.init(cfg, len(lengths), 4096).layers[0]
    layer = getattr(layer, "inner", layer)
    rng = np.random.default_rng(len(name))
    for c0 in range(0, 4096, 1024):
        k = jnp.asarray(rng.standard_normal((4, 1024, 8, 128)), jnp.float32)
        v = jnp.asarray(rng.standard_normal((4, 1024, 8, 128)), jnp.float32)
        pos = np.arange(c0, c0 + 1024)[None].repeat(4, 0)
        layer = layer.store(k, v, jnp.asarray(np.where(pos < np.asarray(lengths)[:, None], pos, 4096), jnp.int32))
    q, k, v = step_inputs(layer, 32, 3)
    for kw in (dict(), dict(window=1024)):
        got, want = both(layer, q, k, v, lengths, scale=128**-0.5, **kw)
        assert rel(got, want) < 2e-3, kw


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize("name,attention", KERNELS)
def test_gpu_decode_step_at_the_reasoner_shape(name, attention):
    """head_dim 64, 3 query heads per KV head, a cache length that is not a multiple of the
    128-token block, rows shorter than one block, at one block and past two."""
    lengths = [300, 40, 129, 536 - 1]
    layer = dataclasses.replace(filled_layer(name, lengths, 536, h=6, kvh=2, seed=5), attention=attention)
    q, k, v = step_inputs(layer, 6, 5)
    for kw in (dict(), dict(window=200)):
        got, want = both(layer, q, k, v, lengths, **kw)
        assert rel(got, want) < 2e-3, (kw, rel(got, want))


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize("name", CUDA_READS + ("kivi-k2v2*", "kivi-k2v4*", "kivi-k4v2*"))
def test_gpu_cuda_step_is_one_kernel_over_rings_sink_and_rewound_rows(name):
    """The CUDA step reads units, rings, sink and the new token in one kernel: rows at page
    boundaries, below the sink, and rows that rewind (stale ring slots read from their units), with
    and without a window and a softcap; its program holds one custom call and no XLA attention."""
    layer = dataclasses.replace(filled_layer(name, STORED, 320, h=8, kvh=2, seed=7), attention="cuda")
    q, k, v = step_inputs(layer, 8, 7)
    for kw in (dict(), dict(window=100, softcap=5.0)):
        got, want = both_compiled(layer, q, k, v, LENGTHS, **kw)
        assert_rows_close(got, want)
    step = jax.jit(lambda layer, q, k, v, p: layer.attend(q, k, v, p, scale=0.125, window=None, softcap=None)[0])
    text = step.lower(layer, q, k, v, jnp.asarray(LENGTHS, jnp.int32)[:, None]).as_text()
    assert text.count("jaxlp_quantized_decode_attention") == 1 and "dot_general" not in text


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize("h, kvh, d", [(8, 2, 64), (32, 8, 128), (16, 1, 128)])
def test_gpu_fireq_cuda_step_is_one_kernel_over_units_and_the_new_token(h, kvh, d):
    """FireQ's CUDA step (no sink, no ring): the INT4 units and the new token in one kernel, rows at
    and past chunk edges, short and rewound, with and without a window and a softcap, 4 to 16 query
    heads per KV head; its program holds one custom call and no XLA attention."""
    layer = dataclasses.replace(filled_layer("fireq-int4", STORED, 320, h=h, kvh=kvh, seed=h, d=d), attention="cuda")
    q, k, v = step_inputs(layer, h, h)
    for kw in (dict(), dict(window=100, softcap=5.0)):
        got, want = both_compiled(layer, q, k, v, LENGTHS, **kw)
        assert_rows_close(got, want)
    step = jax.jit(lambda layer, q, k, v, p: layer.attend(q, k, v, p, scale=0.125, window=None, softcap=None)[0])
    text = step.lower(layer, q, k, v, jnp.asarray(LENGTHS, jnp.int32)[:, None]).as_text()
    assert text.count("jaxlp_int4_decode_attention") == 1 and "dot_general" not in text


@functools.partial(jax.jit, static_argnames=("window", "softcap", "options"))
def _cuda_step(layer, q, k, v, positions, *, window, softcap, options):
    return layer._attend_one(q[:, 0], k[:, 0], v[:, 0], positions, scale=0.125, window=window, softcap=softcap,
                             cuda_options=dict(options))


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize("name", ("kitty", "kitty-pro", "kivi-k2v2"))
@pytest.mark.parametrize("batch, kvh", [(7, 2), (64, 4)], ids=["small-grid", "full-grid"])
def test_gpu_cuda_step_packed_and_staged_paths_agree_with_the_reference(name, batch, kvh):
    """The packed path with the ring, sink and new-token blocks in staged CTAs beside it, and the
    staged path alone, at head_dim 128: a few CTAs, and a grid whose packed CTAs alone fill the GPU
    (64 rows x 4 KV heads; the staged CTAs then queue behind them); rows ragged and rewound; one
    staged CTA per (row, KV head), and more than it has blocks (empty ones); packed CTAs of at least
    1 or 3 blocks, and of more blocks than a row has (the packed splits past it exit); the split
    merge with a warp per query."""
    rng = np.random.default_rng(batch)
    stored = STORED if batch == 7 else list(rng.integers(1, 700, batch))
    lengths = LENGTHS if batch == 7 else [int(n) - int(rng.integers(0, 2)) * int(rng.integers(0, n)) for n in stored]
    layer = dataclasses.replace(filled_layer(name, stored, 720, h=4 * kvh, kvh=kvh, seed=batch, d=128),
                                attention="cuda")
    q, k, v = step_inputs(layer, 4 * kvh, batch)
    p = jnp.asarray(lengths, jnp.int32)
    for kw in (dict(window=None, softcap=None), dict(window=100, softcap=5.0)):
        want = layer.reference_attend(q, k, v, p[:, None], scale=0.125, **kw)[0][:, 0]
        for options in (dict(), dict(packed=True), dict(packed=False), dict(staged_splits=1), dict(staged_splits=7),
                        dict(min_blocks=1), dict(min_blocks=3), dict(min_blocks=64), dict(query_merge_splits=32)):
            got = _cuda_step(layer, q, k, v, p, options=tuple(options.items()), **kw)
            assert_rows_close(got, want)


def teacher_forced_logits(model, fmt, prompts, tokens):
    """Logits ``[B, T, V]`` of each decode step fed the given ``tokens [B, T]`` (no sampling), after
    the prompt call on prompts padded as :func:`jaxlp.generate` pads them, in a cache of its length."""
    ids, lengths = pad_prompts(prompts)
    s, t = ids.shape[1], tokens.shape[1]
    cache = fmt.init(model.config, len(prompts), s + t)
    pos = np.where(np.arange(s) < lengths[:, None], np.arange(s), s + t)
    step = jax.jit(lambda ids, pos, cache, fresh: model.forward(ids, pos, cache, fresh=fresh), static_argnums=3)
    _, cache = step(jnp.asarray(ids), jnp.asarray(pos, jnp.int32), cache, True)
    out = []
    for i in range(t):
        hidden, cache = step(jnp.asarray(tokens[:, i : i + 1]), jnp.asarray(lengths + i, jnp.int32)[:, None], cache,
                             False)
        out.append(np.asarray(model.logits(hidden[:, 0]), np.float64))
    return np.stack(out, axis=1)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize("name", ["kitty", "kitty-pro", "kivi-k2v2", "kivi-k2v2*", "kivi-k4v4", "kivi-k2v4*", "kivi-k4v2*",
                                  "fireq-int4", "fireq-int4 fp16 queries"])
def test_gpu_generation_steps_match_the_reference(name):
    """The shipped reasoner in BF16 on the GPU, fed the reference's greedy tokens: every decode
    step's logits through the kernels ("auto": CUDA or Pallas over the packed units) stay within a
    quarter of the cache format's own error (its distance from a BF16 cache), or one BF16 ulp
    (2^-8, relative) where the format is that accurate, or the reference's own distance between
    the CPU and the GPU where that is larger; and the argmax agrees wherever the reference's top-2
    margin is wider than the kernels' largest logit error.

    The last bound is FireQ's (FP8 queries, the registry's format): every token's keys and values
    round to INT4 codes under an FP8 scale of their own, and its queries to FP8, roundings that
    BF16-level differences (the GPU's and the CPU's matmuls) flip, the flips growing through the
    layers: its XLA reference on the GPU is 2.2e-2 from the same reference on the CPU (H100,
    session 24), more than a quarter of its format error (3.9e-2); the kernels were 1.4e-2 from
    it. With FP16 queries ("fp16 queries": 2.5e-2 between the platforms, format error 4.8e-2) the
    kernels' 9.4e-3 takes the format's bound like the others."""
    from importlib.resources import files

    fp16_queries = name.endswith(" fp16 queries")
    fmt = kvcache.get(name.split()[0])
    if fp16_queries:
        fmt = dataclasses.replace(fmt, fp8_queries=False)
    path = files("jaxlp") / "assets" / "reasoner"
    model = jaxlp.from_pretrained(path)
    rng = np.random.default_rng(1)
    prompts = [rng.integers(3, 60, n).tolist() for n in (300, 40, 129)]
    ref = jaxlp.generate(model, prompts, max_new_tokens=24, stop_tokens=[], kv_cache=kvcache.get(fmt, attention="xla"))
    logits = {a: teacher_forced_logits(model, kvcache.get(fmt, attention=a), prompts, ref.tokens)
              for a in ("xla", "auto")}
    dense = teacher_forced_logits(model, kvcache.get("bf16"), prompts, ref.tokens)
    with jax.default_device(jax.devices("cpu")[0]):
        on_cpu = teacher_forced_logits(jaxlp.from_pretrained(path), kvcache.get(fmt, attention="xla"), prompts,
                                       np.asarray(ref.tokens))
    kernel_err, format_err = rel(logits["auto"], logits["xla"]), rel(dense, logits["xla"])
    platform_err = rel(on_cpu, logits["xla"])
    print(f"{name}: kernel error {kernel_err:.2e}, format error {format_err:.2e}, reference CPU vs GPU "
          f"{platform_err:.2e} (relative, logits)")
    # A 4-bit cache's own error is small (kivi-k4v4: 8e-3 on the H100), and the kernels' error then
    # sits at BF16 rounding (3e-3): the bound is a quarter of the format's error or one BF16 ulp.
    bound = max(0.25 * format_err, 2.0**-8)
    if name == "fireq-int4":
        bound = max(bound, platform_err)
    assert kernel_err < bound, (kernel_err, format_err, platform_err)
    top2 = np.sort(logits["xla"], axis=-1)[..., -2:]
    margin = top2[..., 1] - top2[..., 0]
    clear = margin > np.abs(logits["auto"] - logits["xla"]).max()
    np.testing.assert_array_equal(logits["auto"].argmax(-1)[clear], logits["xla"].argmax(-1)[clear])
    same_calls = margin[:, :-1] > 0.05  # generate's loop is the same calls, compiled as one program
    np.testing.assert_array_equal(logits["xla"].argmax(-1)[:, :-1][same_calls], ref.tokens[:, 1:][same_calls])
