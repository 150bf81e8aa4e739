"""The CUDA decode attention over per-token INT4 units (FireQ's cache): what it reads and refuses,
its lowering (CPU), and on a GPU the compiled kernel against float64 NumPy (the layout decoded
there, independent of the codec) on fresh random caches encoded by the real codec."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from packed_units import CODECS, exact, np_decode, random_kv, rel, stores

from jaxlp.ffi import int4_decode_attention as cuda
from jaxlp.kvcache import fireq, kitty, kivi
from jaxlp.kvcache.quantized import QueryScaling

ON_GPU = jax.default_backend() == "gpu"
FIREQ = CODECS["fireq"]


def test_reads_per_token_int4_only():
    for d, g in ((64, 1), (128, 4), (128, 16), (64, 3)):
        assert cuda.supports(*FIREQ, d, g)
    for args, match in [((*FIREQ, 256, 4), "head_dim"), ((*FIREQ, 96, 4), "head_dim"),
                        ((*FIREQ, 128, 17), "query heads"), ((*FIREQ, 128, 0), "query heads"),
                        ((kitty.KeyCodec(16), kitty.ValueCodec(), 128, 4), "keys"),
                        ((fireq.TokenCodec(), kivi.ValueCodec(2), 128, 4), "values")]:
        with pytest.raises(ValueError, match=match):
            cuda.check(*args)
        assert not cuda.supports(*args)


def test_default_splits_fill_one_wave_and_never_leave_a_split_empty():
    assert cuda.default_splits(8, 8, 32768) == 4  # 264 CTAs / 64 (row, head) pairs
    assert cuda.default_splits(1, 8, 8192) == 33
    assert cuda.default_splits(1, 8, 300) == 3  # at least 128 tokens each
    assert cuda.default_splits(64, 8, 4096) == 1
    for batch in (1, 2, 8, 32):
        for tokens in (1, 127, 128, 129, 1000, 32768):
            splits = cuda.default_splits(batch, 8, tokens)
            per = -(-tokens // splits)
            assert 1 <= splits and (splits - 1) * per < tokens
            assert splits == 1 or splits * batch * 8 <= cuda.CTAS_PER_SM * 132


def inputs(seed, b, n, kvh, d, g):
    k, v = random_kv(seed, b, n, kvh, d)
    ks, vs = stores(FIREQ, k, v)
    rng = np.random.default_rng(seed + 100)
    q = jnp.asarray(rng.standard_normal((b, kvh * g, d)), jnp.float32)
    new = (jnp.asarray(rng.standard_normal((b, kvh, d)), jnp.float32),
           jnp.asarray(rng.standard_normal((b, kvh, d)), jnp.float32))
    return q, ks, vs, new


def test_lowers_to_one_custom_call_with_the_new_token_inside():
    """The wrapper's operands lower for CUDA on any machine (no kernel runs): one custom call, no
    XLA attention (the new token is the kernel's), the splits in the output shape."""
    b, kvh, d, g, n = 2, 2, 128, 4, 512
    q, ks, vs, (nk, nv) = inputs(0, b, n, kvh, d, g)
    lo, hi, ok = jnp.asarray([0, 100]), jnp.asarray([512, 300]), jnp.asarray([True, False])
    f = jax.jit(lambda q, ks, vs, nk, nv: cuda.attend_units(q, ks, vs, *FIREQ, lo, hi, scale=0.1, softcap=30.0,
                                                            new=(nk, nv, ok), splits=3))
    text = f.trace(q, ks, vs, nk, nv).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count(cuda.TARGET) == 1 and "dot_general" not in text
    assert f"tensor<{b}x{kvh}x3x{g}x{d}xf32>" in text


def test_query_scaling_is_the_kernels_own():
    """FireQ's query transform (CRS division, FP8 per head) and the softmax scale run inside the
    kernel: the program is the custom call and the reshape, no XLA reduction or arithmetic on q."""
    b, kvh, d, g, n = 2, 2, 128, 4, 256
    q, ks, vs, (nk, nv) = inputs(0, b, n, kvh, d, g)
    scaling = QueryScaling(jnp.ones((kvh, d), jnp.float32) * 2, True)
    lo, hi, ok = jnp.asarray([0, 10]), jnp.asarray([256, 200]), jnp.asarray([True, True])
    f = jax.jit(lambda q, ks, vs, nk, nv, sc: cuda.attend_units(q, ks, vs, *FIREQ, lo, hi, scale=0.1, new=(nk, nv, ok),
                                                                splits=1, query_scaling=sc))
    text = f.trace(q, ks, vs, nk, nv, scaling).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count(cuda.TARGET) == 1 and "fp8_queries = 1 : i32" in text
    before = text.split(cuda.TARGET)[0]  # the operands' preparation (the split merge follows the call)
    assert not any(f"stablehlo.{op}" in before for op in ("reduce", "divide", "multiply"))
    with pytest.raises(ValueError, match="channel scales must be"):
        f(q, ks, vs, nk, nv, QueryScaling(jnp.ones((kvh, d // 2)), True))


def test_bad_operands_are_refused():
    q, ks, vs, new = inputs(0, 1, 128, 2, 64, 4)
    rows = jnp.asarray([0])
    with pytest.raises(ValueError, match="not a multiple"):
        cuda.attend_units(q[:, :3], ks, vs, *FIREQ, rows, rows, scale=1.0)
    with pytest.raises(ValueError, match="value scales must be float8_e4m3fn"):
        cuda.attend_units(q, ks, fireq.Int4Tokens(vs.codes, vs.scale.astype(jnp.float16)), *FIREQ, rows, rows, scale=1.0)
    with pytest.raises(ValueError, match="value codes must be uint8"):
        cuda.attend_units(q, ks, fireq.Int4Tokens(vs.codes[:, :64], vs.scale), *FIREQ, rows, rows, scale=1.0)
    with pytest.raises(ValueError, match="new key must be"):
        cuda.attend_units(q, ks, vs, *FIREQ, rows, rows, scale=1.0, new=(new[0][:, :1], new[1], rows > 0))
    for splits in (0, -1):
        with pytest.raises(ValueError, match="splits must be >= 1"):
            cuda.attend_units(q, ks, vs, *FIREQ, rows, rows, scale=1.0, splits=splits)
    with pytest.raises(ValueError, match="reads per-token INT4 keys"):
        cuda.attend_units(q, ks, vs, *CODECS["kivi-k2v2"], rows, rows, scale=1.0)


def exact_with_new(q, k, v, lo, hi, new, ok, scale, softcap):
    """float64 attention over [lo, hi) of the decoded k, v plus the new token where ok."""
    b, n = k.shape[:2]
    k = np.concatenate([k, np.asarray(new[0], np.float64)[:, None]], axis=1)
    v = np.concatenate([v, np.asarray(new[1], np.float64)[:, None]], axis=1)
    keep = np.arange(n + 1)[None] < np.asarray(hi)[:, None]
    keep |= (np.arange(n + 1)[None] == n) & np.asarray(ok)[:, None]
    keep &= (np.arange(n + 1)[None] >= np.asarray(lo)[:, None])
    # move the kept tokens to the front of each row so that exact() takes [0, count)
    order = np.argsort(~keep, axis=1, kind="stable")
    k, v = np.take_along_axis(k, order[..., None, None], 1), np.take_along_axis(v, order[..., None, None], 1)
    return exact(q, k, v, np.zeros(b, int), keep.sum(1), scale, softcap)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize("d, g", [(128, 4), (128, 1), (128, 16), (64, 3), (64, 8)])
@pytest.mark.parametrize("softcap", [None, 5.0])
def test_gpu_kernel_matches_float64(d, g, softcap):
    """Ragged rows (empty, one token, inside one chunk, crossing chunks and splits), a window start,
    the new token on and off, default and forced splits (more splits than tokens: empty ones)."""
    b, kvh, n = 6, 2, 1100
    q, ks, vs, new = inputs(d + g, b, n, kvh, d, g)
    k64, v64 = np_decode(FIREQ[0], ks), np_decode(FIREQ[1], vs)
    lo = np.asarray([0, 0, 5, 0, 300, 1000])
    hi = np.asarray([0, 1, 37, 1100, 1099, 1100])
    ok = np.asarray([True, True, False, True, False, True])
    scale = d**-0.5
    want_o, want_m, want_l = exact_with_new(q, k64, v64, lo, hi, new, ok, scale, softcap)
    for splits in (None, 1, 7, 64):
        f = jax.jit(lambda q, ks, vs, nk, nv, lo, hi, ok: cuda.attend_units(
            q, ks, vs, *FIREQ, lo, hi, scale=scale, softcap=softcap, new=(nk, nv, ok), splits=splits))
        o, m, l = f(q, ks, vs, *new, jnp.asarray(lo), jnp.asarray(hi), jnp.asarray(ok))
        assert np.isfinite(np.asarray(o)).all()
        live = want_l > 0
        assert rel(np.asarray(o)[live], want_o[live]) < 2e-3, splits
        assert (np.asarray(o)[~live] == 0).all() and (np.asarray(l)[~live] == 0).all()
        # m and log(l) + m (l is relative to m) carry the scores' error: FP16 queries, 2^-12 relative
        np.testing.assert_allclose(np.asarray(m)[live], want_m[live], rtol=1e-3, atol=1e-3)
        np.testing.assert_allclose(np.log(np.asarray(l)[live]) + np.asarray(m)[live],
                                   np.log(want_l[live]) + want_m[live], rtol=1e-3, atol=1e-3)


def fp8_per_head(x):
    """``x [..., D]`` through FP8 E4M3 with the float32 scale max|x| / 448 per row (ml_dtypes)."""
    x = np.asarray(x, np.float32)
    s = (np.abs(x).max(-1, keepdims=True) / np.float32(448)).astype(np.float32)
    s = np.where(s > 0, s, np.float32(1))
    return (x / s).astype(ml_dtypes.float8_e4m3fn).astype(np.float32) * s


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize("fp8", [True, False])
def test_gpu_query_scaling_in_the_kernel_matches_float64(fp8):
    """The kernel's own query transform: q divided by random CRS channel scales of each KV head
    (orders of magnitude apart), through FP8 per query head (one head all zero: scale 1), against
    float64 attention of the transform computed in NumPy; and against the kernel given the XLA
    transform's queries."""
    b, kvh, d, g, n = 3, 2, 128, 4, 700
    q, ks, vs, new = inputs(7, b, n, kvh, d, g)
    q = q.at[1, 2].set(0.0)
    rng = np.random.default_rng(8)
    channel = np.exp(rng.normal(size=(kvh, d)) * 1.5).astype(np.float32)
    scaling = QueryScaling(jnp.asarray(channel), fp8)
    qt = np.asarray(q) / np.repeat(channel, g, axis=0)
    qt = fp8_per_head(qt) if fp8 else qt
    lo, hi, ok = np.asarray([0, 3, 600]), np.asarray([700, 650, 700]), np.asarray([True, False, True])
    scale = d**-0.5
    want_o, _, want_l = exact_with_new(qt, np_decode(FIREQ[0], ks), np_decode(FIREQ[1], vs), lo, hi, new, ok, scale,
                                       None)
    args = (ks, vs, *FIREQ, jnp.asarray(lo), jnp.asarray(hi))
    o, _, l = cuda.attend_units(q, *args, scale=scale, new=(*new, jnp.asarray(ok)), query_scaling=scaling)
    assert np.isfinite(np.asarray(o)).all()
    assert rel(np.asarray(o), want_o) < 2e-3
    o_xla, _, _ = cuda.attend_units(jax.jit(lambda sc, q: sc(q))(scaling, q), *args, scale=scale, new=(*new, jnp.asarray(ok)))
    assert rel(np.asarray(o), np.asarray(o_xla)) < 1e-3


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
def test_gpu_zero_and_saturated_tokens_are_nan_free():
    """All-zero tokens (the smallest scale, codes 0) and tokens at the FP8 scale's top (448 * 7)."""
    b, kvh, d, g, n = 2, 2, 128, 4, 300
    k = np.zeros((b, n, kvh, d), np.float32)
    v = np.zeros((b, n, kvh, d), np.float32)
    k[1, ::3] = 3000.0
    v[1, 1::3] = -3136.0
    ks, vs = stores(FIREQ, k, v)
    q = jnp.ones((b, kvh * g, d), jnp.float32) * 1e-3
    o, m, l = cuda.attend_units(q, ks, vs, *FIREQ, jnp.zeros(b, int), jnp.full(b, n), scale=1.0)
    want = exact(np.asarray(q), np_decode(FIREQ[0], ks), np_decode(FIREQ[1], vs), [0, 0], [n, n], 1.0)
    assert np.isfinite(np.asarray(o)).all()
    assert rel(o, want[0]) < 2e-3
