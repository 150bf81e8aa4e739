"""The CUDA decode attention over packed Kitty / 2- and 4-bit KIVI units: what it reads and refuses,
its lowering (CPU), NumPy models of its index math and arithmetic, and on a GPU the compiled kernel
against float64 NumPy (the layout decoded there) and the pure-JAX reference, on fresh random caches
encoded by the real codecs."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from packed_units import CODECS, exact, np_decode, np_unpack, random_kv, rel, stores

from jaxlp import kvcache
from jaxlp.ffi import quantized_decode_attention as cuda
from jaxlp.kvcache import fireq, kitty, kivi
from jaxlp.pallas.quantized_decode_attention import reference

ON_GPU = jax.default_backend() == "gpu"
TOL = 2e-3  # relative to float64: FP16 operands (a quarter of it is typical)
READ_4BIT = ("kivi-k4v4", "kivi-k2v4", "kivi-k4v2")  # KIVI with 4-bit keys and / or values: the staged path
READ = ("kitty", "kitty-pro", "kivi-k2v2") + READ_4BIT


def test_reads_kitty_and_2_or_4_bit_kivi_only():
    for name in READ:
        kc, vc = CODECS[name]
        assert cuda.supports(kc, vc, 128, 4) and cuda.supports(kc, vc, 64, 16) and cuda.supports(kc, vc, 256, 1)
    from jaxlp.models import ModelConfig

    for name in ("kivi-k4v4", "kivi-k2v4*", "kivi-k4v2*"):  # the registry's 4-bit formats, as the cache holds them
        for d in cuda.HEAD_DIMS:
            cfg = ModelConfig(model_type="llama", vocab_size=64, hidden_size=64, intermediate_size=96, num_layers=1,
                              num_heads=8, num_kv_heads=2, head_dim=d, max_position_embeddings=4096)
            (kc, _), (vc, _) = kvcache.get(name).streams(cfg)
            assert cuda.supports(kc, vc, d, 4), (name, d)
    assert cuda.layout(kitty.KeyCodec(32), kitty.ValueCodec(), 128, 4) == cuda.Layout(32, 1, 128, 128)
    assert cuda.layout(kivi.KeyCodec(2), kivi.ValueCodec(2), 128, 4) == cuda.Layout(0, 4, 1, 32)
    assert cuda.layout(kivi.KeyCodec(4), kivi.ValueCodec(4), 128, 4) == cuda.Layout(0, 4, 1, 32, 4, 4)
    assert cuda.layout(kivi.KeyCodec(4), kivi.ValueCodec(2), 64, 16) == cuda.Layout(0, 4, 1, 32, 4, 2)
    assert cuda.layout(kivi.KeyCodec(2), kivi.ValueCodec(4, group=64), 256, 1) == cuda.Layout(0, 4, 1, 64, 2, 4)
    assert cuda.layout(kitty.KeyCodec(8), kivi.ValueCodec(4, group=128), 128, 4) == cuda.Layout(8, 1, 1, 128, 2, 4)
    kc, vc = CODECS["kitty"]
    for args, match in [((kc, vc, 96, 4), "head_dim"), ((kc, vc, 128, 17), "query heads"), ((kc, vc, 128, 0), "query"),
                        ((kivi.KeyCodec(8), vc, 128, 4), "2- or 4-bit KIVI key blocks"),
                        ((kivi.KeyCodec(4, group=64), vc, 128, 4), "key blocks .* groups of 32"),
                        ((kivi.KeyCodec(4, unit=256), vc, 128, 4), "key blocks"),
                        ((kc, kivi.ValueCodec(8), 128, 4), "2- or 4-bit KIVI values"),
                        ((kc, kivi.ValueCodec(1), 128, 4), "2- or 4-bit KIVI values"),
                        ((fireq.TokenCodec(), fireq.TokenCodec(), 128, 4), "not"),
                        ((kc, kivi.ValueCodec(2, group=2), 128, 4), "multiple of 16 channels"),
                        ((kc, kivi.ValueCodec(2, group=8), 128, 4), "multiple of 16 channels"),  # 16 per scale read
                        ((kc, kivi.ValueCodec(4, group=16), 128, 4), "multiple of 32 channels"),  # 4-bit: 32
                        ((kc, kivi.ValueCodec(4, group=128), 64, 4), "dividing head_dim")]:
        with pytest.raises(ValueError, match=match):
            cuda.layout(*args)
        assert not cuda.supports(*args)


def test_default_splits_fill_the_gpu_and_never_exceed_the_blocks():
    assert cuda.default_splits(8, 8, 64) == 6  # 396 CTAs fit in one wave / 64 (row, head) pairs
    assert cuda.default_splits(1, 8, 256) == 43  # 49 would fit; 6 blocks each need only 43
    assert cuda.default_splits(1, 8, 65) == 33  # 2 blocks each (49 splits would leave 16 empty)
    assert cuda.default_splits(1, 8, 3) == 3
    assert cuda.default_splits(64, 8, 64) == 1
    for batch in (1, 2, 3, 8, 32):
        for blocks in (1, 2, 7, 64, 65, 129, 1025):
            splits = cuda.default_splits(batch, 8, blocks)
            per = -(-blocks // splits)  # the kernel's blocks per split for the longest row
            assert 1 <= splits <= blocks and splits * batch * 8 <= max(cuda.CTAS_PER_SM * 132, batch * 8)
            assert (splits - 1) * per < blocks  # the last split has work


def test_the_cache_picks_the_kernel_and_explains_refusals():
    assert kvcache.get("kitty", attention="cuda").attention == "cuda"
    with pytest.raises(ValueError, match="no CUDA decode-attention kernel"):
        kvcache.get("bf16", attention="cuda")
    with pytest.raises(ValueError, match="must be one of"):
        kvcache.get("kitty", attention="triton")


@pytest.mark.skipif(ON_GPU, reason="checks the error without a GPU")
def test_cuda_without_a_gpu_says_why():
    from jaxlp.models import ModelConfig

    cfg = ModelConfig(model_type="llama", vocab_size=64, hidden_size=64, intermediate_size=96, num_layers=1,
                      num_heads=4, num_kv_heads=2, head_dim=64, max_position_embeddings=4096)
    layer = kvcache.get("kitty", attention="cuda").init(cfg, 1, 300).layers[0]
    q = jnp.zeros((1, 1, 4, 64))
    kv = jnp.zeros((1, 1, 2, 64))
    with pytest.raises(ValueError, match="needs a GPU"):
        layer.attend(q, kv, kv, jnp.asarray([[200]]), scale=0.1, window=None, softcap=None)
    layer = dataclasses.replace(layer, attention="auto")  # off a GPU: the reference, no kernel
    out, _ = layer.attend(q, kv, kv, jnp.asarray([[200]]), scale=0.1, window=None, softcap=None)
    assert out.shape == (1, 1, 4, 64)


LOWERING = dict(b=2, kvh=2, d=64)  # 2 rows, 2 KV heads of 4 query heads, head_dim 64, 256 tokens


def lowering_inputs(name):
    """``(key codec, value codec, q, key store, value store)`` at the :data:`LOWERING` shape."""
    kc, vc = CODECS[name]
    b, kvh, d = LOWERING["b"], LOWERING["kvh"], LOWERING["d"]
    ks, vs = stores((kc, vc), *random_kv(0, b, 256, kvh, d))
    return kc, vc, jnp.zeros((b, kvh * 4, d), jnp.bfloat16), ks, vs


def test_staged_splits_drop_to_one_once_the_packed_ctas_fill_the_gpu():
    """default_staged_splits: GENERAL_SPLITS (a block each) while batch x KV heads leaves the packed
    path more than one split (packed_splits), one from the point where it gives one."""
    for b, kvh in [(1, 8), (8, 8), (16, 8), (33, 4), (32, 8), (64, 8), (1000, 1)]:
        one = cuda.packed_splits(b, kvh, 4096) == 1
        assert cuda.default_staged_splits(b, kvh) == (1 if one else cuda.GENERAL_SPLITS), (b, kvh)
    assert cuda.default_staged_splits(16, 8) == cuda.GENERAL_SPLITS and cuda.default_staged_splits(64, 8) == 1


def test_packed_ctas_take_more_blocks_once_the_grid_passes_one_wave():
    """default_min_blocks: 1 while every CTA of the grid is resident at once (132 SMs x 2), then
    MIN_BLOCKS (8 x 8 heads x 8 splits = 512 CTAs: batch 8 at any context)."""
    slots = cuda.PACKED_CTAS_PER_SM * 132
    assert cuda.default_min_blocks(1, 8, 33) == 1 and cuda.default_min_blocks(1, 8, slots // 8) == 1
    assert cuda.default_min_blocks(1, 8, slots // 8 + 1) == cuda.MIN_BLOCKS
    assert cuda.default_min_blocks(8, 8, 8) == cuda.MIN_BLOCKS > 1


def test_packed_path_reads_head_dim_128_and_splits_without_empty_ones():
    assert cuda.packed_reads(cuda.Layout(32, 1, 128, 128), 128, 4)
    assert cuda.packed_reads(cuda.Layout(16, 1, 128, 128), 128, 8)
    kivi2 = cuda.layout(*CODECS["kivi-k2v2"], 128, 4)
    assert kivi2 == cuda.Layout(0, 4, 1, 32)
    for g in range(1, 9):  # KIVI-2: four key groups, value groups of 32 channels (one per plane)
        assert cuda.packed_reads(kivi2, 128, g)
    for lay, d, g in [(cuda.Layout(32, 1, 128, 128), 256, 4), (cuda.Layout(32, 1, 128, 128), 128, 16),
                      (cuda.Layout(24, 1, 128, 128), 128, 4), (cuda.Layout(0, 4, 1, 16), 128, 4),
                      (cuda.Layout(0, 4, 1, 64), 128, 4), (cuda.Layout(0, 4, 1, 128), 128, 4),
                      (cuda.Layout(0, 4, 1, 32), 64, 4), (cuda.Layout(0, 4, 1, 32), 256, 4),
                      (cuda.Layout(0, 4, 1, 32), 128, 9), (cuda.Layout(0, 4, 1, 32), 128, 16),
                      (cuda.Layout(16, 1, 1, 32), 128, 4), (cuda.Layout(0, 1, 128, 128), 128, 4),
                      (cuda.Layout(0, 4, 1, 32, 4, 4), 128, 4), (cuda.Layout(0, 4, 1, 32, 2, 4), 128, 1),
                      (cuda.Layout(0, 4, 1, 32, 4, 2), 128, 8)]:  # 4-bit codes: the staged path
        assert not cuda.packed_reads(lay, d, g), (lay, d, g)
    for name in READ_4BIT:
        assert not any(cuda.packed_reads(cuda.layout(*CODECS[name], 128, g), 128, g) for g in range(1, 9))
    assert cuda.packed_splits(8, 8, 256) == 4  # 264 CTAs / 64 (row, head) pairs
    assert cuda.packed_splits(1, 8, 64) == 16  # one block per warp
    for batch in (1, 3, 8, 32):
        for blocks in (1, 2, 5, 64, 65, 1025):
            splits = cuda.packed_splits(batch, 8, blocks)
            per = -(-blocks // splits)
            assert 1 <= splits and (splits - 1) * per < blocks
    kc, vc, q, ks, vs = lowering_inputs("kitty")  # head_dim 64: no packed path
    rows = jnp.asarray([0, 128], jnp.int32)
    with pytest.raises(ValueError, match="packed path does not read"):
        cuda.attend_units(q, ks, vs, kc, vc, rows, rows, scale=1.0, packed=True)


@pytest.mark.parametrize("g, packed", [(4, None), (8, True), (16, None)])
def test_kivi2_at_head_dim_128_lowers_to_the_packed_path(g, packed):
    """KIVI-2 at head_dim 128 takes the packed path (its splits: packed_splits, no staged ones in
    attend_units) up to 8 query heads per KV head; 16 stay staged, and packed=True refuses them."""
    kc, vc = CODECS["kivi-k2v2"]
    b, kvh, d, n = 2, 2, 128, 512
    ks, vs = stores((kc, vc), *random_kv(1, b, n, kvh, d))
    q = jnp.zeros((b, kvh * g, d), jnp.bfloat16)
    rows = jnp.asarray([0, 128], jnp.int32)
    f = jax.jit(lambda q, ks, vs, lo, hi: cuda.attend_units(q, ks, vs, kc, vc, lo, hi, scale=0.125, packed=packed))
    text = f.trace(q, ks, vs, rows, rows + 300).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count(cuda.TARGET) == 1
    splits = cuda.packed_splits(b, kvh, n // 128) if g <= 8 else cuda.default_splits(b, kvh, n // 128)
    assert f"tensor<{b}x{kvh}x{splits}x{g}x{d}xf32>" in text
    with pytest.raises(ValueError, match="packed path does not read"):
        cuda.attend_units(jnp.zeros((b, kvh * 16, d)), ks, vs, kc, vc, rows, rows, scale=1.0, packed=True)


@pytest.mark.parametrize("name", READ_4BIT)
@pytest.mark.parametrize("g", (4, 16))
def test_4bit_kivi_at_head_dim_128_lowers_to_the_staged_path(name, g):
    """4-bit KIVI keys and / or values at head_dim 128 take the staged path in both entry points (its
    splits: default_splits, no packed ones), their codes passed at their own widths (keys [D, 64]
    bytes per block, values D / 2 bytes per token) with the bit widths as attributes; packed=True
    and staged_splits (an option of the packed path) are refused."""
    kc, vc = CODECS[name]
    b, kvh, d, n = 2, 2, 128, 512
    ks, vs = stores((kc, vc), *random_kv(1, b, n, kvh, d))
    assert ks.codes.shape[-1] == 16 * kc.bits and vs.codes.shape[-1] == d * vc.bits // 8
    q = jnp.zeros((b, kvh * g, d), jnp.bfloat16)
    rows = jnp.asarray([0, 128], jnp.int32)
    f = jax.jit(lambda q, ks, vs, lo, hi: cuda.attend_units(q, ks, vs, kc, vc, lo, hi, scale=0.125))
    text = f.trace(q, ks, vs, rows, rows + 300).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count(cuda.TARGET) == 1
    assert f"tensor<{b}x{kvh}x{cuda.default_splits(b, kvh, n // 128)}x{g}x{d}xf32>" in text
    assert f"tensor<{b}x{n // 128}x{kvh}x{d}x{16 * kc.bits}xui8>" in text  # key codes
    assert f"tensor<{b}x{n}x{kvh}x1x{d * vc.bits // 8}xui8>" in text  # value codes
    assert f"kbits = {kc.bits} : i64" in text and f"vbits = {vc.bits} : i64" in text
    ops = cache_operands(b, kvh, d, 127, 255, 32)
    step = jax.jit(lambda q, ks, vs, ops: cuda.attend_cache(q, ks, vs, kc, vc, *ops, scale=0.125))
    text = step.trace(q, ks, vs, ops).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count(cuda.TARGET) == 1 and "dot_general" not in text
    splits = cuda.default_splits(b, kvh, n // 128 + 2 + 1)  # the ring's 255 tokens: 2 blocks more, then the tail
    assert f"tensor<{b}x{kvh}x{splits}x{g}x{d}xf32>" in text
    with pytest.raises(ValueError, match="packed path does not read .*2-bit codes"):
        cuda.attend_units(q, ks, vs, kc, vc, rows, rows, scale=1.0, packed=True)
    with pytest.raises(ValueError, match="packed path does not read"):
        cuda.attend_cache(q, ks, vs, kc, vc, *ops, scale=1.0, packed=True)
    with pytest.raises(ValueError, match="takes the packed path .* with the staged path"):
        cuda.attend_cache(q, ks, vs, kc, vc, *ops, scale=1.0, staged_splits=2)


@pytest.mark.parametrize("name", READ)
def test_lowers_to_one_custom_call_for_cuda(name):
    """The wrapper's operands and attributes lower for CUDA on any machine (no kernel runs)."""
    kc, vc, q, ks, vs = lowering_inputs(name)
    rows = jnp.asarray([0, 128], jnp.int32)
    f = jax.jit(lambda q, ks, vs, lo, hi: cuda.attend_units(q, ks, vs, kc, vc, lo, hi, scale=0.125, softcap=30.0))
    text = f.trace(q, ks, vs, rows, rows + 128).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count(cuda.TARGET) == 1


def cache_operands(b, kvh, d, rk, rv, off):
    f16 = functools.partial(jnp.zeros, dtype=jnp.float16)
    ring = lambda r: (f16((b, r, kvh, d)), jnp.full((b, r), -1, jnp.int32))  # noqa: E731
    return (jnp.zeros((b, 8), jnp.int32), ring(rk), ring(rv), (f16((b, off, kvh, d)), f16((b, off, kvh, d))),
            (jnp.zeros((b, kvh, d), jnp.bfloat16), jnp.zeros((b, kvh, d), jnp.bfloat16)))


@pytest.mark.parametrize("name", READ)
def test_the_cache_step_lowers_to_one_custom_call_for_cuda(name):
    """attend_cache: units, rings, sink and new token in the one custom call (no XLA attention)."""
    kc, vc, q, ks, vs = lowering_inputs(name)
    f = jax.jit(lambda q, ks, vs, ops: cuda.attend_cache(q, ks, vs, kc, vc, *ops, scale=0.125))
    ops = cache_operands(LOWERING["b"], LOWERING["kvh"], LOWERING["d"], 127, 255, 32)
    text = f.trace(q, ks, vs, ops).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count(cuda.TARGET) == 1
    assert "dot_general" not in text


@pytest.mark.parametrize("staged", [None, 1, 3])
def test_the_cache_step_takes_its_staged_splits(staged):
    """attend_cache on the packed path: staged_splits staged CTAs per (row, KV head) after the
    packed ones (default: default_staged_splits); 0 is refused, and so is the option off the packed
    path; min_blocks goes to the kernel (default: default_min_blocks), 0 refused."""
    kc, vc = CODECS["kitty-pro"]
    b, kvh, d, n = 2, 2, 128, 512
    ks, vs = stores((kc, vc), *random_kv(1, b, n, kvh, d))
    q = jnp.zeros((b, kvh * 4, d), jnp.bfloat16)
    f = jax.jit(lambda q, ks, vs, ops: cuda.attend_cache(q, ks, vs, kc, vc, *ops, scale=0.125, staged_splits=staged))
    text = f.trace(q, ks, vs, cache_operands(b, kvh, d, 127, 255, 32)).lower(lowering_platforms=("cuda",)).as_text()
    splits = cuda.packed_splits(b, kvh, n // 128) + (staged or cuda.default_staged_splits(b, kvh))
    assert f"tensor<{b}x{kvh}x{splits}x4x{d}xf32>" in text
    assert f"min_per = {cuda.default_min_blocks(b, kvh, splits)} : i64" in text
    text = jax.jit(lambda q, ks, vs, ops: cuda.attend_cache(q, ks, vs, kc, vc, *ops, scale=0.125, min_blocks=7)).trace(
        q, ks, vs, cache_operands(b, kvh, d, 127, 255, 32)).lower(lowering_platforms=("cuda",)).as_text()
    assert "min_per = 7 : i64" in text
    text = jax.jit(lambda q, ks, vs, ops: cuda.attend_cache(q, ks, vs, kc, vc, *ops, scale=0.125,
                                                             query_merge_splits=8)).trace(
        q, ks, vs, cache_operands(b, kvh, d, 127, 255, 32)).lower(lowering_platforms=("cuda",)).as_text()
    assert "few_splits = 8 : i64" in text
    with pytest.raises(ValueError, match="query_merge_splits must be in"):
        cuda.attend_cache(q, ks, vs, kc, vc, *cache_operands(b, kvh, d, 127, 255, 32), scale=1.0, query_merge_splits=33)
    with pytest.raises(ValueError, match="min_blocks must be >= 1"):
        cuda.attend_cache(q, ks, vs, kc, vc, *cache_operands(b, kvh, d, 127, 255, 32), scale=1.0, min_blocks=0)
    with pytest.raises(ValueError, match="staged_splits must be >= 1"):
        cuda.attend_cache(q, ks, vs, kc, vc, *cache_operands(b, kvh, d, 127, 255, 32), scale=1.0, staged_splits=0)
    with pytest.raises(ValueError, match="takes the packed path .* with the staged path"):
        cuda.attend_cache(q, ks, vs, kc, vc, *cache_operands(b, kvh, d, 127, 255, 32), scale=1.0, packed=False,
                          staged_splits=2)


def test_the_cache_step_refuses_a_sink_of_a_block():
    kc, vc = CODECS["kitty"]
    k, v = random_kv(0, 1, 128, 2, 64)
    ks, vs = stores((kc, vc), k, v)
    with pytest.raises(ValueError, match="fit one 128-token block"):
        cuda.attend_cache(jnp.zeros((1, 4, 64)), ks, vs, kc, vc, *cache_operands(1, 2, 64, 127, 255, 128), scale=1.0)


def test_bad_operands_are_refused():
    kc, vc = CODECS["kitty"]
    k, v = random_kv(0, 1, 128, 2, 64)
    ks, vs = stores((kc, vc), k, v)
    rows = jnp.asarray([0], jnp.int32)
    with pytest.raises(ValueError, match="not a multiple"):
        cuda.attend_units(jnp.zeros((1, 3, 64)), ks, vs, kc, vc, rows, rows, scale=1.0)
    with pytest.raises(ValueError, match="head_dim"):
        cuda.attend_units(jnp.zeros((1, 4, 32)), ks, vs, kc, vc, rows, rows, scale=1.0)
    bad = dataclasses.replace(ks, low=ks.low[..., :16])
    with pytest.raises(ValueError, match="key codes must be uint8"):
        cuda.attend_units(jnp.zeros((1, 4, 64)), bad, vs, kc, vc, rows, rows, scale=1.0)
    ks, vs = stores(CODECS["kivi-k2v2"], k, v)  # 2-bit stores read as 4-bit: the codes' widths differ
    for kc, vc, match in [(kivi.KeyCodec(4), kivi.ValueCodec(2), r"key codes must be uint8 \(1, 1, 2, 64, 64\)"),
                          (kivi.KeyCodec(2), kivi.ValueCodec(4), r"value codes must be uint8 \(1, 128, 2, 1, 32\)")]:
        with pytest.raises(ValueError, match=match):
            cuda.attend_units(jnp.zeros((1, 4, 64)), ks, vs, kc, vc, rows, rows, scale=1.0)


# --- the compiled kernel -----------------------------------------------------------------------


def check(kc, vc, q, k, v, lo, hi, scale, softcap=None, splits=None, packed=None, min_blocks=None,
          query_merge_splits=cuda.QUERY_MERGE_SPLITS):
    ks, vs = stores((kc, vc), k, v)
    lo, hi = jnp.asarray(lo, jnp.int32), jnp.asarray(hi, jnp.int32)
    out, m, l = jax.jit(lambda *a: cuda.attend_units(*a, kc, vc, lo, hi, scale=scale, softcap=softcap,
                                                     splits=splits, packed=packed, min_blocks=min_blocks,
                                                     query_merge_splits=query_merge_splits))(q, ks, vs)
    out, m, l = (np.asarray(a, np.float64) for a in (out, m, l))
    assert np.isfinite(out).all() and not np.isnan(m).any() and np.isfinite(l).all()
    want_out, want_m, want_l = exact(q, np_decode(kc, ks), np_decode(vc, vs), lo, hi, scale, softcap)
    live = np.asarray(hi) > np.asarray(lo)
    np.testing.assert_array_equal(m[~live], -np.inf)
    assert (l[~live] == 0).all() and (out[~live] == 0).all()
    assert rel(out, want_out) <= TOL, rel(out, want_out)
    # l = sum exp(s - m) carries the scores' absolute error (FP16 queries and keys) through exp:
    # 2.01e-3 measured with 4-bit KIVI keys and 8 query heads per KV head (H100), so 1.5 TOL.
    assert rel(l[live], want_l[live]) <= 1.5 * TOL, rel(l[live], want_l[live])
    np.testing.assert_allclose(m[live], want_m[live], rtol=TOL, atol=TOL * np.abs(want_m[live]).max())
    ref = reference(q, ks, vs, kc, vc, lo, hi, scale=scale, softcap=softcap)
    assert rel(out, ref[0]) <= TOL
    return out


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize("name", READ)
@pytest.mark.parametrize("d, packed", [(64, None), (128, None), (128, False), (256, None)])
def test_gpu_matches_float64_at_block_edges(name, d, packed):
    """Rows: a block boundary to boundary, 129 tokens from mid-block, 255 across three blocks, an
    empty range, the whole cache with a block of all-equal keys (scale floor), a zero block; at
    head_dim 128 both paths on Kitty pages and KIVI-2 (packed: the default there), 4-bit KIVI on
    the staged path at every head_dim."""
    kc, vc = CODECS[name]
    if isinstance(kc, kitty.KeyCodec):
        kc = kitty.KeyCodec(d // 8 if name == "kitty" else d // 4)
    b, kvh, g, n = 6, 2, 4, 384
    k, v = random_kv(d + len(name), b, n, kvh, d)
    k[4, 128:256] = 1.5
    k[5, :128], v[5, :128] = 0.0, 0.0
    q = np.random.default_rng(d).normal(size=(b, kvh * g, d)).astype(np.float32)
    lo, hi = [128, 5, 100, 7, 0, 0], [256, 134, 355, 7, 384, 128]
    check(kc, vc, q, k, v, lo, hi, d**-0.5, packed=packed)
    check(kc, vc, q, k, v, lo, hi, d**-0.5, softcap=5.0, splits=2, packed=packed)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize("name", ("kitty",) + READ_4BIT)
@pytest.mark.parametrize("g", [1, 3, 8, 16])
def test_gpu_query_heads_per_kv_head(name, g):
    kc, vc = (kitty.KeyCodec(32), kitty.ValueCodec()) if name == "kitty" else CODECS[name]
    k, v = random_kv(g, 3, 512, 2, 128)
    q = np.random.default_rng(g).normal(size=(3, 2 * g, 128)).astype(np.float32) * 3  # peaked softmax
    check(kc, vc, q, k, v, [0, 64, 300], [512, 384, 301], 128**-0.5)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize("name", READ)
def test_gpu_qwen3_8b_shape_any_split(name):
    """B=8, KVH=8, H=32, D=128, 4K quantized tokens, ragged rows; every split count agrees, on the
    packed path every fewest-blocks-per-CTA (min_blocks: splits past a row's blocks exit), and the
    split merge with a warp per query (query_merge_splits) as with 8 warps."""
    kc, vc = CODECS[name]
    if isinstance(kc, kitty.KeyCodec):
        kc = kitty.KeyCodec(16 if name == "kitty" else 32)
    b, kvh, h, d, n = 8, 8, 32, 128, 4096
    k, v = random_kv(3, b, n, kvh, d)
    q = jnp.asarray(np.random.default_rng(4).normal(size=(b, h, d)), jnp.bfloat16)
    lo, hi = [0, 1000, 0, 17, 0, 2048, 0, n - 64], [n, n, 4000, 3001, 129, 2048, 1, n]
    # Each path: float64 within TOL (check), its split counts alike: the staged path's FP16
    # probabilities are relative to each split's max, the packed path's 16-bit fixed-point P' to
    # each block's largest and its Q' to each page's (2-bit codes only: 4-bit KIVI is staged).
    reads_packed = cuda.packed_reads(cuda.layout(kc, vc, d, h // kvh), d, h // kvh)
    assert reads_packed == (name not in READ_4BIT)
    for packed, agree in [(False, 1e-4), (True, 5e-4)] if reads_packed else [(False, 1e-4)]:
        options = [(None, None), (1, None), (5, None), (32, None)]
        options += [(32, 1), (5, 9), (32, 40)] if packed else []
        outs = [check(kc, vc, q, k, v, lo, hi, d**-0.5, splits=s, packed=packed, min_blocks=mb) for s, mb in options]
        outs += [check(kc, vc, q, k, v, lo, hi, d**-0.5, splits=s, packed=packed, query_merge_splits=32)
                 for s in (1, 5, 32)]
        for o in outs[1:]:
            assert rel(o, outs[0]) <= agree


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize("name", ("kitty", "kitty-pro", "kivi-k2v2"))
def test_gpu_packed_path_with_outlier_channels(name):
    """Keys with a few channels 30x the rest and queries peaked on them (the packed path's
    fixed-point Q' spends its 16 bits on the largest |Q * scale| of a page, KIVI's of each 32-token
    group), values with outlier tokens (P' on the block's largest P * scale, KIVI's per 32-channel
    group): float64 within TOL, the staged path alike."""
    kc, vc = CODECS[name]
    if isinstance(kc, kitty.KeyCodec):
        kc = kitty.KeyCodec(16 if name == "kitty" else 32)  # what the packed path reads
    b, kvh, g, d, n = 2, 2, 4, 128, 768
    k, v = random_kv(11, b, n, kvh, d)
    rng = np.random.default_rng(12)
    hot = rng.choice(d, 4, replace=False)
    k[..., hot] *= 30.0
    v[:, rng.choice(n, 20, replace=False)] *= 25.0
    q = rng.normal(size=(b, kvh * g, d)).astype(np.float32)
    q[..., hot] *= 8.0
    lo, hi = [0, 130], [700, 512]
    scale = d**-0.5 / 4
    packed = check(kc, vc, q, k, v, lo, hi, scale, packed=True)
    staged = check(kc, vc, q, k, v, lo, hi, scale, packed=False)
    assert rel(packed, staged) <= TOL


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize("name", ("kitty-pro", "kivi-k2v2"))
@pytest.mark.parametrize("packed", (True, False))
def test_gpu_long_rows_in_one_split(name, packed):
    """16K tokens in one split: each warp walks 32 blocks, most far below the running max (the
    packed path's P' scale is each block's own largest P'; the FP16-MMA design before it drifted
    to 1e-2 here)."""
    kc, vc = CODECS[name]
    b, kvh, g, d, n = 2, 2, 4, 128, 16384
    k, v = random_kv(13, b, n, kvh, d)
    q = np.random.default_rng(14).normal(size=(b, kvh * g, d)).astype(np.float32)
    check(kc, vc, q, k, v, [0, 3000], [n, n - 5], d**-0.5, splits=1, packed=packed)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize("g", range(1, 9))
def test_gpu_kivi2_packed_path_at_block_edges(g):
    """KIVI-2 on the packed path, 1 to 8 query heads per KV head: a block boundary to boundary,
    129 tokens from mid-block, 255 across three blocks, an empty range, the whole cache with a
    block of all-equal keys (scale floor), a block of zero keys and values, a row of one token;
    against float64 and the reference, and the staged path within TOL of it."""
    kc, vc = CODECS["kivi-k2v2"]
    b, kvh, d, n = 7, 2, 128, 384
    k, v = random_kv(100 + g, b, n, kvh, d)
    k[4, 128:256] = 1.5
    k[5, :128], v[5, :128] = 0.0, 0.0
    q = np.random.default_rng(g).normal(size=(b, kvh * g, d)).astype(np.float32)
    lo, hi = [128, 5, 100, 7, 0, 0, 383], [256, 134, 355, 7, 384, 128, 384]
    packed = check(kc, vc, q, k, v, lo, hi, d**-0.5, packed=True)
    staged = check(kc, vc, q, k, v, lo, hi, d**-0.5, packed=False)
    assert rel(packed, staged) <= TOL
    check(kc, vc, q, k, v, lo, hi, d**-0.5, softcap=5.0, splits=2, packed=True)
    check(kc, vc, q * 3, k, v, lo, hi, d**-0.5, splits=1, packed=True)  # peaked softmax, one split


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize("name", ("kivi-k2v2",) + READ_4BIT)
def test_gpu_kivi_value_store_ending_inside_a_block(name):
    """The cache's KIVI value store holds any number of tokens (its length less the FP16 window):
    a block past the store's end reads zeros there (the tokens are past hi; the packed path copies
    them, the staged path skips the loads), reading no byte beyond it. Keys of 384 tokens, values
    of 300 (the store cut after encoding); KIVI-2 on both paths, 4-bit KIVI on the staged one."""
    kc, vc = CODECS[name]
    b, kvh, g, d, n, t = 4, 2, 4, 128, 384, 300
    k, v = random_kv(21, b, n, kvh, d)
    ks, vs = stores((kc, vc), k, v)
    vs = jax.tree.map(lambda a: a[:, :t], vs)
    q = np.random.default_rng(22).normal(size=(b, kvh * g, d)).astype(np.float32)
    lo, hi = jnp.asarray([0, 130, 256, 299], jnp.int32), jnp.asarray([300, 300, 290, 300], jnp.int32)
    want = exact(q, np_decode(kc, ks)[:, :t], np_decode(vc, vs), lo, hi, d**-0.5)[0]
    for packed in (True, False) if name == "kivi-k2v2" else (False,):
        out, m, l = jax.jit(lambda q, ks, vs: cuda.attend_units(q, ks, vs, kc, vc, lo, hi, scale=d**-0.5,
                                                                 packed=packed))(q, ks, vs)
        assert np.isfinite(np.asarray(out)).all()
        assert rel(out, want) <= TOL, (packed, rel(out, want))


@functools.partial(jax.jit, static_argnames=("window", "softcap"))
def _cache_step_and_reference(layer, q, k, v, positions, *, window, softcap):
    kw = dict(scale=0.125, window=window, softcap=softcap)
    return layer.attend(q, k, v, positions, **kw)[0], layer.reference_attend(q, k, v, positions, **kw)[0]


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize("name", ("kivi-k4v4", "kivi-k2v4*", "kivi-k4v2*"))
@pytest.mark.parametrize("d", (64, 128))
def test_gpu_4bit_kivi_cache_step_is_one_kernel_over_rings_sink_and_rewound_rows(name, d):
    """attend_cache as the cache calls it (attention="cuda"): the 4-bit KIVI units, the FP16 rings,
    the sink and the new token in one kernel; rows at block boundaries (128, 129, 255 tokens),
    below the sink (20), one long row (300), and rows that rewind after a right-padded prompt
    (stored 280, decoding at 150 and 257: stale ring slots read from their units), with and without
    a window and a softcap; against the cache's reference attend, row by row."""
    from jaxlp.models import ModelConfig

    stored, lengths, h, kvh = [128, 129, 255, 20, 300, 280, 280], [128, 129, 255, 20, 300, 150, 257], 8, 2
    cfg = ModelConfig(model_type="llama", vocab_size=64, hidden_size=64, intermediate_size=96, num_layers=1,
                      num_heads=h, num_kv_heads=kvh, head_dim=d, max_position_embeddings=4096)
    layer = kvcache.get(name, attention="cuda").init(cfg, len(stored), 320).layers[0]
    rng = np.random.default_rng(d + len(name))
    s = max(stored)
    k, v = (jnp.asarray(rng.standard_normal((len(stored), s, kvh, d)) * a, jnp.float32) for a in (2.0, 1.0))
    pos = np.where(np.arange(s) < np.asarray(stored)[:, None], np.arange(s), 320)
    layer = jax.jit(lambda layer, k, v, p: layer.store(k, v, p))(layer, k, v, jnp.asarray(pos, jnp.int32))
    q = jnp.asarray(rng.standard_normal((len(stored), 1, h, d)), jnp.float32)
    kn, vn = (jnp.asarray(rng.standard_normal((len(stored), 1, kvh, d)), jnp.float32) for _ in range(2))
    p = jnp.asarray(lengths, jnp.int32)[:, None]
    for kw in (dict(window=None, softcap=None), dict(window=100, softcap=5.0)):
        got, want = _cache_step_and_reference(layer, q, kn, vn, p, **kw)
        assert np.isfinite(np.asarray(got)).all()
        errors = [rel(got[r], want[r]) for r in range(len(stored))]
        assert max(errors) < TOL, (kw, errors)
    step = jax.jit(lambda layer, q, k, v, p: layer.attend(q, k, v, p, scale=0.125, window=None, softcap=None)[0])
    text = step.lower(layer, q, kn, vn, p).as_text()
    assert text.count(cuda.TARGET) == 1 and "dot_general" not in text


# --- The packed path's integer arithmetic, mirrored in NumPy (the .cu file's `packed` namespace) ---

MAGIC, Q_RANGE, Q_OFFSET, P_RANGE = 2.0**23, 32512.0, 32896.0, 65280.0  # kMagic, kQRange, kQOffset, kPRange


def fixed_bits(x, f, magic):
    """``__float_as_uint(fmaf(x, f, magic))``: the float32 products are exact in float64, and so
    is the sum (< 2^24), so one rounding to float32 is fmaf's."""
    y = (np.float64(np.float32(x)) * np.float64(np.float32(f)) + magic).astype(np.float32)
    return y.view(np.uint32)


def prmt(a, b, sel):
    """PTX ``prmt.b32`` (default mode) on uint32 arrays."""
    src = np.stack([(a >> (8 * i)) & 0xFF for i in range(4)] + [(b >> (8 * i)) & 0xFF for i in range(4)])
    return sum(src[(sel >> (4 * i)) & 7].astype(np.uint32) << np.uint32(8 * i) for i in range(4)).astype(np.uint32)


def test_packed_fixed_point_q_splits_into_signed_bytes_without_overflow():
    """Q' of a query (a page's channels, one outlier, one all-zero query): x = round(Q' f) with f =
    32512 / max|Q'|, the low 16 bits of fmaf(Q', f, 2^23 + 32896) give hi, lo with x = 256 (hi -
    128) + (lo - 128) and nothing carried past them."""
    rng = np.random.default_rng(0)
    for q in [rng.normal(size=128), rng.normal(size=128) * np.exp(rng.normal(size=128)),
              np.r_[rng.normal(size=127), -4e3], np.r_[np.full(127, 1e-30), 7.0]]:
        q = q.astype(np.float32)
        amax = np.abs(q).max()
        f = np.float32(Q_RANGE) / amax
        bits = fixed_bits(q, f, MAGIC + Q_OFFSET)
        assert (bits >> 16 == 0x4B00).all()
        v = (bits & 0xFFFF).astype(np.int64)
        hi, lo = (v >> 8) - 128, (v & 0xFF) - 128
        assert (np.abs(hi) <= 128).all() and hi.max() <= 127 and lo.min() >= -128 and lo.max() <= 127
        np.testing.assert_array_equal(256 * hi + lo, np.rint(np.float64(q) * np.float64(f)))
    assert (fixed_bits(np.zeros(4, np.float32), 0.0, MAGIC + Q_OFFSET) & 0xFFFF == 0x8080).all()  # zero query


def test_packed_fixed_point_p_is_unsigned_16_bit():
    """P' = P * value scale over the block's largest: u = round(P' fp) in [0, 65280], fp = 65280 / max P'."""
    rng = np.random.default_rng(1)
    p = np.exp2(-rng.exponential(4.0, size=128)).astype(np.float32) * np.float32(2.0**-20)  # far below the running max
    pv = (p * rng.uniform(0.01, 3.0, size=128).astype(np.float32)).astype(np.float32)
    fp = np.float32(P_RANGE) / pv.max()
    bits = fixed_bits(pv, fp, MAGIC)
    assert (bits >> 16 == 0x4B00).all()
    u = bits & 0xFFFF
    assert u.max() == P_RANGE and u.min() >= 0
    np.testing.assert_array_equal(u, np.rint(np.float64(pv) * np.float64(fp)))
    # The s32 sums cannot overflow: 128 tokens of 255 * (3 * 64) in the high row, times 256.
    assert 256 * 128 * 255 * 192 + 128 * 255 * 192 < 2**31
    assert 256 * (128 + 32) * 128 * 192 + 160 * 128 * 192 < 2**31  # S: 128 + 32 boosted channels of |hi| <= 128


def test_packed_operand_bytes_are_codes_of_four_rows():
    """transpose4 + plane / high_plane: byte i of the B register (b, t) is row i's code of token
    4 g + b + 32 t, times 4^t (plane 3: times 16; high bits h: 4 h times the same); KIVI's
    plane_kivi: times 4^t for every plane."""
    rng = np.random.default_rng(2)
    words = rng.integers(0, 2**32, size=(4, 1000), dtype=np.uint64).astype(np.uint32)  # 4 rows' word g
    t0, t1 = prmt(words[0], words[1], 0x5140), prmt(words[0], words[1], 0x7362)
    t2, t3 = prmt(words[2], words[3], 0x5140), prmt(words[2], words[3], 0x7362)
    r = [prmt(t0, t2, 0x5410), prmt(t0, t2, 0x7632), prmt(t1, t3, 0x5410), prmt(t1, t3, 0x7632)]
    for b in range(4):
        for t in range(4):
            code = (words >> np.uint32(8 * b + 2 * t)) & 3  # [row, word]: byte b, plane t
            low = r[b] & np.uint32(0x03030303 << 2 * t) if t < 3 else (r[b] >> np.uint32(2)) & np.uint32(0x30303030)
            high = (r[b] << np.uint32(2)) & np.uint32(0x03030303 << (2 * t + 2)) if t < 3 else r[b] & np.uint32(0xC0C0C0C0)
            weight = 4**t if t < 3 else 16
            kivi = r[b] & np.uint32(0x03030303 << 2 * t)  # plane_kivi: no high bits, plane 3 as code * 64
            for i in range(4):
                np.testing.assert_array_equal((low >> np.uint32(8 * i)) & 0xFF, code[i] * weight)
                np.testing.assert_array_equal((high >> np.uint32(8 * i)) & 0xFF, 4 * code[i] * weight)
                np.testing.assert_array_equal((kivi >> np.uint32(8 * i)) & 0xFF, code[i] * 4**t)


def kivi_packed_block(q, codes, ks, km, vcodes, vs, vm, tiny=np.float32(2.0**-100)):
    """The KIVI-2 packed path's arithmetic on one 128-token block (packed_path<true>), rows = query
    heads: q [G, D] FP32 (times the softmax scale), key codes [D, 128 tokens], FP16 ks / km [4, D];
    value codes [128 tokens, D], FP16 vs / vm [128 tokens, 4]. Returns the block's scores s [G, 128]
    and, for P = exp(s - max) (float32), its O [G, D] with the minimums' sums added."""
    f32 = np.float32
    s = np.zeros((q.shape[0], 128))
    for t in range(4):  # key group t = plane t: Q'_t, its own range and beta_t
        qs = (q * ks[t].astype(f32)).astype(f32)
        amax = np.abs(qs).max(axis=1, keepdims=True)
        f = np.where(amax > tiny, f32(Q_RANGE) / np.maximum(amax, tiny), 0).astype(f32)
        v = (fixed_bits(qs, f, MAGIC + Q_OFFSET) & 0xFFFF).astype(np.int64)
        hi, lo = (v >> 8) - 128, (v & 0xFF) - 128
        c = codes[:, 32 * t : 32 * t + 32].astype(np.int64) * 4**t  # plane t in place: u8 code * 4^t
        assert c.max() <= 255 and np.abs(256 * (hi @ c)).max() + np.abs(lo @ c).max() < 2**31
        beta = q.astype(np.float64) @ km[t].astype(np.float64)[:, None]
        s[:, 32 * t : 32 * t + 32] = (256 * (hi @ c) + lo @ c) * (amax * f32(1 / Q_RANGE)) / 4**t + beta
    p = np.exp(s - s.max(axis=1, keepdims=True)).astype(f32)
    o = np.zeros((q.shape[0], vcodes.shape[1]))
    for u in range(4):  # value group u = plane u: P'_u, its own range; P . min_u
        pv = (p * vs[:, u].astype(f32)).astype(f32)
        pmax = pv.max(axis=1, keepdims=True)
        fp = np.where(pmax > tiny, f32(P_RANGE) / np.maximum(pmax, tiny), 0).astype(f32)
        v = (fixed_bits(pv, fp, MAGIC) & 0xFFFF).astype(np.int64)
        assert v.max() <= P_RANGE
        c = vcodes[:, 32 * u : 32 * u + 32].astype(np.int64) * 4**u
        assert (256 * ((v >> 8) @ c) + (v & 0xFF) @ c).max() < 2**31
        o[:, 32 * u : 32 * u + 32] = ((256 * ((v >> 8) @ c) + (v & 0xFF) @ c) * (pmax * f32(1 / P_RANGE)) / 4**u
                                      + p.astype(np.float64) @ vm[:, u : u + 1].astype(np.float64))
    return s, p, o


@pytest.mark.parametrize("outliers", (False, True))
def test_packed_kivi_fixed_point_arithmetic_is_within_5e_4_of_float64(outliers):
    """kivi_packed_block (the .cu file's KIVI-2 arithmetic) on blocks encoded by the real codecs
    against float64 over the decoded block: the scores and the block's output P V (about 2e-4)."""
    kc, vc = CODECS["kivi-k2v2"]
    rng = np.random.default_rng(outliers)
    k, v = random_kv(30 + outliers, 1, 512, 1, 128)
    q = rng.normal(size=(8, 128)).astype(np.float32) * np.float32(128**-0.5)
    if outliers:
        hot = rng.choice(128, 4, replace=False)
        k[..., hot] *= 30.0
        v[:, rng.choice(512, 20, replace=False)] *= 25.0
        q[:, hot] *= 8.0
    ks, vs = stores((kc, vc), k, v)
    kd, vd = np_decode(kc, ks)[0, :, 0], np_decode(vc, vs)[0, :, 0]  # [512, 128] float64
    codes = np_unpack(ks.codes, 2)[0, :, 0]  # [4 blocks, D, 128]
    vcodes = np_unpack(vs.codes, 2)[0, :, 0, 0]  # [512, D]
    kscale, kmin = np.asarray(ks.scale)[0, :, 0], np.asarray(ks.min)[0, :, 0]  # [4 blocks, 4, D]
    vscale, vmin = np.asarray(vs.scale)[0, :, 0, 0], np.asarray(vs.min)[0, :, 0, 0]  # [512, 4]
    for blk in range(4):
        tok = slice(128 * blk, 128 * blk + 128)
        s, p, o = kivi_packed_block(q, codes[blk], kscale[blk], kmin[blk], vcodes[tok], vscale[tok], vmin[tok])
        want_s = q.astype(np.float64) @ kd[tok].T
        assert np.abs(s - want_s).max() <= 5e-4 * np.abs(want_s).max()
        assert rel(o, p.astype(np.float64) @ vd[tok]) <= 5e-4


# --- The staged path's unpacking, mirrored in NumPy (the .cu file's load_block / unpack_block) ---


def dequant2(c, scale, mn):
    """``dequant2``: the 16-bit lanes of ``c`` (codes, low lane first) as FP16 ``code | 0x6400`` =
    1024 + code, less 1024, times ``scale`` plus ``mn`` rounded once (HFMA2; the float64 product
    and sum of FP16 operands are exact): FP16 ``[..., 2]``."""
    lanes = (np.stack([c & 0xFFFF, c >> 16], axis=-1) | 0x6400).astype(np.uint16)
    x = lanes.view(np.float16).astype(np.float64) - 1024
    return (x * np.float64(scale)[..., None] + np.float64(mn)[..., None]).astype(np.float16)


def dequant8(p0, p1, t, bits, scale, mn):
    """``dequant8`` (no boosted bits): plane t's ``bits``-bit codes of the bytes of two words (each
    byte-permuted 0x3120), 8 consecutive elements of the plane."""
    mask = np.uint32(0x00030003 if bits == 2 else 0x000F000F)
    parts = [(p >> np.uint32(bits * t + sh)) & mask for p in (p0, p1) for sh in (0, 8)]
    return np.concatenate([dequant2(x, scale, mn) for x in parts], axis=-1)


def perm3120(w):
    return prmt(w, np.zeros_like(w), 0x3120)


THREADS = np.arange(128)


def staged_key_tile(codes, scale, mn, bits):
    """load_block + unpack_block of one KIVI key block (no boosted channels): codes uint8
    ``[D, 16 bits]`` (channel-major, planar over tokens), FP16 ``scale, min [4, D]`` -> the FP16
    tile ``Kt [D, 128]`` the 128 threads write, and how often each element is written."""
    d = codes.shape[0]
    words = np.ascontiguousarray(codes).view("<u4")  # [D, 4 bits]: four words per 16-byte piece
    kt, writes = np.zeros((d, 128), np.float16), np.zeros((d, 128), np.int64)
    kp, plane = bits // 2, 16 * bits  # 16-byte pieces per share (half a channel row), tokens per plane

    def put(c, tok0, x):
        cols = tok0[:, None] + np.arange(x.shape[-1])
        kt[c[:, None], cols] = x
        writes[c[:, None], cols] += 1

    for i in range(d // 64):
        idx = THREADS + 128 * i
        c, half = idx >> 1, idx & 1
        for k in range(kp):
            piece = words[c[:, None], 4 * (half * kp + k)[:, None] + np.arange(4)]  # [128, 4]
            for t in range(8 // bits):  # plane t: 2-bit, group t; 4-bit, tokens 64 t + 32 half + .., group 2 t + half
                grp = t if bits == 2 else 2 * t + half
                for w in (0, 2):
                    x = dequant8(perm3120(piece[:, w]), perm3120(piece[:, w + 1]), t, bits, scale[grp, c], mn[grp, c])
                    put(c, plane * t + 16 * kp * half + 16 * k + 4 * w, x)
    return kt, writes


def staged_value_tile(codes, scale, mn, bits):
    """load_block + unpack_block of one block of KIVI value tokens: codes uint8 ``[128, D bits / 8]``
    (planar over channels), FP16 ``scale, min [128, D / group]`` -> the FP16 tile ``V [128, D]``
    the 128 threads write, and how often each element is written."""
    vrow = codes.shape[1]
    d, group = vrow * 8 // bits, vrow * 8 // bits // scale.shape[1]
    words = np.ascontiguousarray(codes).view("<u4")  # [128, D bits / 32]
    vt, writes = np.zeros((128, d), np.float16), np.zeros((128, d), np.int64)
    vp, shares = bits // 2, d // 64  # 16-byte pieces per share, shares per token

    def put(tok, ch0, x):
        cols = ch0[:, None] + np.arange(x.shape[-1])
        vt[tok[:, None], cols] = x
        writes[tok[:, None], cols] += 1

    for i in range(d // 64):
        idx = THREADS + 128 * i
        tok, share = idx // shares, idx % shares
        for k in range(vp):
            piece = words[tok[:, None], 4 * (share * vp + k)[:, None] + np.arange(4)]
            for u in range(8 // bits):  # plane u: channels u vrow + 16 vp share + [0, 16 vp), one scale group
                grp = (u * vrow + share * 16 * vp) // group
                for w in (0, 2):
                    x = dequant8(perm3120(piece[:, w]), perm3120(piece[:, w + 1]), u, bits, scale[tok, grp],
                                 mn[tok, grp])
                    put(tok, u * vrow + 16 * vp * share + 16 * k + 4 * w, x)
    return vt, writes


@pytest.mark.parametrize("bits", (2, 4))
@pytest.mark.parametrize("d", cuda.HEAD_DIMS)
def test_staged_unpack_puts_each_code_at_its_token_and_channel(bits, d):
    """load_block / unpack_block's index math mirrored in NumPy (staged_key_tile, staged_value_tile;
    4-bit: a thread's share is two 16-byte pieces, byte j's low / high nibble token j / 64 + j of a
    key row, channel j / D/2 + j of a value row) on blocks encoded by the real codecs: every element
    of the tiles written once; with unit scales and zero minimums the tiles are kivi's decoded codes
    exactly, with the codecs' scales kivi.dequantize_keys / dequantize_values within FP16 rounding
    (a wrong scale group is far outside it). Value groups of 16 (2-bit), 32, 64 and D channels."""
    k, v = (x[0, :, 0] for x in random_kv(bits * d, 1, 128, 1, d))
    keys = kivi.quantize_keys(jnp.asarray(k), bits)  # codes [D, 16 bits], scale / min [4, D]
    assert keys.codes.shape == (d, 16 * bits)
    unit = lambda a: (np.ones(a.shape, np.float16), np.zeros(a.shape, np.float16))  # noqa: E731
    codes = np.asarray(keys.codes)
    kt, writes = staged_key_tile(codes, *unit(keys.scale), bits)
    assert (writes == 1).all()
    want = np.asarray(kivi.dequantize_keys(kivi.KeyBlock(keys.codes, *map(jnp.asarray, unit(keys.scale))), bits))
    np.testing.assert_array_equal(kt.astype(np.float32).T, want)
    kt, _ = staged_key_tile(codes, np.asarray(keys.scale), np.asarray(keys.min), bits)
    want = np.asarray(kivi.dequantize_keys(keys, bits))
    np.testing.assert_allclose(kt.astype(np.float32).T, want, rtol=2**-10, atol=2**-20 * np.abs(want).max())
    for group in sorted({g for g in (16, 32, 64, d) if g % (8 * bits) == 0}):
        values = kivi.quantize_values(jnp.asarray(v), bits, group)  # codes [128, D bits / 8], scale [128, D / group]
        codes = np.asarray(values.codes)
        vt, writes = staged_value_tile(codes, *unit(values.scale), bits)
        assert (writes == 1).all()
        ones = kivi.ValueTokens(values.codes, *map(jnp.asarray, unit(values.scale)))
        np.testing.assert_array_equal(vt.astype(np.float32), np.asarray(kivi.dequantize_values(ones, bits)))
        vt, _ = staged_value_tile(codes, np.asarray(values.scale), np.asarray(values.min), bits)
        want = np.asarray(kivi.dequantize_values(values, bits))
        np.testing.assert_allclose(vt.astype(np.float32), want, rtol=2**-10, atol=2**-20 * np.abs(want).max())
