"""Decode attention over packed KV units (Pallas, Triton): interpret mode and the CUDA lowering on
the CPU, the compiled kernel on a GPU; against float64 NumPy (its own decoding of the planar
layout) and the pure-JAX reference."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from packed_units import CODECS, exact, np_decode, random_kv, rel, stores

from jaxlp.kvcache import fireq, kitty, kivi
from jaxlp.pallas.quantized_decode_attention import (
    UnitsConfig,
    attend_units,
    decode_units,
    default_config,
    reference,
)

ON_GPU = jax.default_backend() == "gpu"
TOL = 1e-3  # relative to float64, what the GPU kernel must meet too


def check(name, q, k, v, lo, hi, scale, softcap=None, config=None, interpret=True):
    """Kernel against float64 NumPy (layout decoded here) and against ``reference``."""
    kc, vc = CODECS[name] if isinstance(name, str) else name
    ks, vs = stores((kc, vc), k, v)
    lo, hi = jnp.asarray(lo, jnp.int32), jnp.asarray(hi, jnp.int32)
    out, m, l = attend_units(q, ks, vs, kc, vc, lo, hi, scale=scale, softcap=softcap, config=config,
                             interpret=interpret)
    b, h, d = q.shape
    assert out.shape == (b, h, d) and m.shape == l.shape == (b, h)
    assert out.dtype == m.dtype == l.dtype == jnp.float32
    out, m, l = (np.asarray(a, np.float64) for a in (out, m, l))
    assert not np.isnan(out).any() and not np.isnan(m).any() and not np.isnan(l).any()
    kd, vd = np_decode(kc, ks), np_decode(vc, vs)
    want_out, want_m, want_l = exact(q, kd, vd, lo, hi, scale, softcap)
    assert rel(out, want_out) <= TOL, rel(out, want_out)
    live = np.asarray(hi) > np.asarray(lo)
    np.testing.assert_array_equal(m[~live], -np.inf)
    assert (l[~live] == 0).all() and (out[~live] == 0).all()
    if live.any():
        assert rel(l[live], want_l[live]) <= TOL
        np.testing.assert_allclose(m[live], want_m[live], rtol=TOL, atol=TOL * np.abs(want_m[live]).max())
    ref = reference(q, ks, vs, kc, vc, lo, hi, scale=scale, softcap=softcap)
    np.testing.assert_array_equal(np.isneginf(m), np.isneginf(np.asarray(ref[1])))
    assert rel(out, ref[0]) <= TOL and (not live.any() or rel(l[live], np.asarray(ref[2])[live]) <= TOL)
    return out, m, l


# Rows: a page (boundary to boundary), 129 tokens starting mid-block, 255 tokens ending
# mid-block across three blocks, an empty range, the whole cache with a page of all-equal keys
# (zero range: the scale floor), a zero page (keys and values: uniform weights, zeros, no NaN).
LO, HI = [128, 5, 100, 7, 0, 0], [256, 134, 355, 7, 384, 128]
B, KVH, G, D, N = 6, 2, 4, 64, 384
# Steps of 32, 64 (the default) and 128 tokens (a whole page: static planes) across the formats.
CONFIGS = {"kitty": UnitsConfig(block_k=32), "kitty-pro": UnitsConfig(splits=2), "kivi-k2v2": UnitsConfig(splits=3),
           "kivi-k2v4": UnitsConfig(splits=2, block_k=32), "kivi-k4v2": UnitsConfig(block_k=128),
           "fireq": UnitsConfig(splits=2, block_k=128)}


def main_case(name):
    k, v = random_kv(list(CODECS).index(name), B, N, KVH, D)
    k[4, 128:256] = 1.5
    k[5, :128], v[5, :128] = 0.0, 0.0
    q = np.random.default_rng(1).normal(size=(B, KVH * G, D)).astype(np.float32)
    return q, k, v


@pytest.mark.parametrize("name", list(CODECS))
def test_interpret_matches_float64(name):
    q, k, v = main_case(name)
    softcap = 4.0 if name in ("kitty", "kivi-k4v2", "fireq") else None
    out, m, l = check(name, jnp.asarray(q, jnp.bfloat16), k, v, LO, HI, D**-0.5, softcap,
                      CONFIGS.get(name, UnitsConfig()))
    np.testing.assert_allclose(l[5], 128.0, rtol=1e-6)  # the zero page: uniform weights over zero values
    assert (out[5] == 0).all() and (m[5] == 0).all()


def test_large_scores_and_empty_batch():
    """Scores in the thousands (the online softmax must not overflow); a batch of empty rows
    gives zeros, -inf and 0 (same shapes and config as the kivi-k2v2 case: no new compile)."""
    q, k, v = main_case("kivi-k2v2")
    out, m, _ = check("kivi-k2v2", jnp.asarray(q * 1000.0, jnp.bfloat16), k, v, LO, HI, D**-0.5,
                      config=CONFIGS["kivi-k2v2"])
    assert np.abs(m[0]).max() > 1e3 and np.isfinite(out).all()
    kc, vc = CODECS["kivi-k2v2"]
    ks, vs = stores((kc, vc), k, v)
    n = jnp.asarray([0, 9, 384, 100, 128, 5])
    out, m, l = attend_units(jnp.asarray(q, jnp.bfloat16), ks, vs, kc, vc, n, n, scale=D**-0.5,
                             config=CONFIGS["kivi-k2v2"], interpret=True)
    assert (np.asarray(out) == 0).all() and np.isneginf(np.asarray(m)).all() and (np.asarray(l) == 0).all()


@pytest.mark.parametrize("name, g, d", [("kitty-pro", 1, 128), ("kivi-k2v4", 16, 64), ("fireq", 20, 64)])
def test_query_heads_per_kv_head(name, g, d):
    """1 (padded to 16 rows), 16 (one full head block), 20 (two head blocks) query heads per KV head."""
    b, kvh, n = 2, 2, 256
    k, v = random_kv(g + d, b, n, kvh, d)
    q = np.random.default_rng(g).normal(size=(b, kvh * g, d)).astype(np.float32)
    config = UnitsConfig(splits=3)
    if name == "kitty-pro":
        name = (kitty.KeyCodec(32), kitty.ValueCodec())  # 25% of 128 channels
        config = UnitsConfig(splits=3, block_k=128)
    check(name, jnp.asarray(q), k, v, [0, 33], [256, 200], d**-0.5, config=config)


def test_bad_input_is_refused():
    kc, vc = CODECS["kivi-k2v2"]
    k, v = random_kv(0, 2, 128, 2, 64)
    ks, vs = stores((kc, vc), k, v)
    q = jnp.zeros((2, 4, 64))
    n = jnp.asarray([0, 128])
    call = functools.partial(attend_units, scale=1.0, interpret=True)
    with pytest.raises(ValueError, match="multiple of 2 KV heads"):
        call(q[:, :3], ks, vs, kc, vc, n, n)
    with pytest.raises(ValueError, match="lo and hi must be"):
        call(q, ks, vs, kc, vc, n[:1], n)
    with pytest.raises(ValueError, match="q must be"):
        call(q[0], ks, vs, kc, vc, n, n)
    with pytest.raises(ValueError, match="batch 2, q 1"):
        call(q[:1], ks, vs, kc, vc, n[:1], n[:1])
    with pytest.raises(ValueError, match="not a unit store"):
        call(q, vs, vs, kc, vc, n, n)
    with pytest.raises(ValueError, match="2 KV heads, v_store 1"):
        call(q, ks, jax.tree.map(lambda x: x[:, :, :1], vs), kc, vc, n, n)
    with pytest.raises(ValueError, match="units of"):  # head_dim of q and the stores differ
        call(jnp.zeros((2, 4, 128)), ks, vs, kc, vc, n, n)
    with pytest.raises(ValueError, match="unknown key codec"):
        call(q, ks, vs, kitty.ValueCodec(), vc, n, n)
    kt, vt = stores(CODECS["kitty"], *random_kv(0, 1, 128, 1, 32))
    with pytest.raises(ValueError, match="head_dim 32 not supported"):  # 2-bit value planes of 8 channels
        call(jnp.zeros((1, 1, 32)), kt, vt, *CODECS["kitty"], n[:1], n[:1])
    with pytest.raises(ValueError, match="block_k must be in"):
        call(q, ks, vs, kc, vc, n, n, config=UnitsConfig(block_k=256))
    with pytest.raises(ValueError, match="precision"):
        call(q, ks, vs, kc, vc, n, n, config=UnitsConfig(precision="fp8"))


def test_default_config_fills_the_gpu():
    assert default_config(1, 8, 8192) == UnitsConfig(splits=32)  # 256 programs, 2 blocks per split
    assert default_config(8, 8, 4096).splits == 4  # 256 programs: one wave
    assert default_config(64, 8, 4096).splits == 1
    assert default_config(1, 8, 200).splits == 1  # no split shorter than two blocks


def test_reference_matches_decode():
    """``reference`` attends exactly the decoded units (``decode_units``), cut to the shorter stream."""
    kc, vc = CODECS["kivi-k4v4"]
    k, v = random_kv(11, 1, 256, 1, 32)
    ks, vs = stores((kc, vc), k, v)
    vs = jax.tree.map(lambda x: x[:, :200], vs)  # values quantized up to 200
    np.testing.assert_array_equal(np.asarray(decode_units(kc, ks)), np_decode(kc, ks).astype(np.float32))
    q = jnp.asarray(np.random.default_rng(0).normal(size=(1, 2, 32)), jnp.float32)
    out, _, l = reference(q, ks, vs, kc, vc, jnp.asarray([10]), jnp.asarray([200]), scale=0.2)
    want = exact(q, np_decode(kc, ks)[:, :200], np_decode(vc, vs), [10], [200], 0.2)
    assert rel(out, want[0]) < 1e-6 and rel(l, want[2]) < 1e-6


def _specs(kc, vc, b, n, kvh, d):
    def spec(c):
        return jax.tree.map(lambda s: jax.ShapeDtypeStruct((b, n // c.unit, kvh) + s.shape, s.dtype), c.unit_shapes(d))

    return spec(kc), spec(vc)


def test_lowers_to_one_triton_call_for_cuda(monkeypatch):
    """The Triton lowering runs on the CPU too (given an H100 as the target): one custom call, and
    no dequantized [B, L, KVH, D] array (nor a transposed copy of the units) in the HLO."""
    from jax._src.pallas.triton import gpu_info, pallas_call_registration

    h100 = gpu_info.get_gpu_info_from_version(gpu_info.GpuVersion.H100)
    monkeypatch.setattr(pallas_call_registration.gpu_info_lib, "get_gpu_info", lambda: h100)
    b, kvh, h, d, n = 8, 8, 32, 128, 4096
    q = jax.ShapeDtypeStruct((b, h, d), jnp.bfloat16)
    rows = jax.ShapeDtypeStruct((b,), jnp.int32)
    pairs = [(kitty.KeyCodec(16), kitty.ValueCodec()), (kitty.KeyCodec(32), kitty.ValueCodec())]
    pairs += [(kivi.KeyCodec(kb), kivi.ValueCodec(vb)) for kb in (2, 4) for vb in (2, 4)]
    pairs += [(fireq.TokenCodec(), fireq.TokenCodec())]
    for i, (kc, vc) in enumerate(pairs):
        softcap = 30.0 if i % 2 else None
        f = jax.jit(lambda q, ks, vs, lo, hi: attend_units(q, ks, vs, kc, vc, lo, hi, scale=d**-0.5,  # noqa: B023
                                                           softcap=softcap))  # noqa: B023
        text = f.trace(q, *_specs(kc, vc, b, n, kvh, d), rows, rows).lower(lowering_platforms=("cuda",)).as_text()
        assert text.count("xla.gpu.triton") == 1, kc
        assert "stablehlo.transpose" not in text and f"{b}x{n}x{kvh}x{d}" not in text, kc


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize("name", ["kitty", "kitty-pro", "kivi-k2v2", "kivi-k4v4", "kivi-k2v4", "fireq"])
def test_gpu_matches_reference_qwen3_8b_shape(name):
    """Compiled kernel, Qwen3-8B-like decode: B=8, KVH=8, H=32, D=128, 4K quantized tokens, ragged rows."""
    b, kvh, h, d, n = 8, 8, 32, 128, 4096
    kc, vc = CODECS[name]
    if isinstance(kc, kitty.KeyCodec):
        kc = kitty.KeyCodec(16 if name == "kitty" else 32)
    k, v = random_kv(3, b, n, kvh, d)
    rng = np.random.default_rng(4)
    q = jnp.asarray(rng.normal(size=(b, h, d)), jnp.bfloat16)
    hi = np.asarray([n, n, 4000, 3001, 129, 2048, 1, n])
    lo = np.asarray([0, 1000, 0, 17, 0, 2048, 0, n - 64])
    check((kc, vc), q, k, v, lo, hi, d**-0.5, interpret=False)
    ks, vs = stores((kc, vc), k, v)
    lo, hi = jnp.asarray(lo), jnp.asarray(hi)
    ref = reference(q, ks, vs, kc, vc, lo, hi, scale=d**-0.5, softcap=20.0)
    for config in (None, UnitsConfig(block_k=32, splits=8), UnitsConfig(block_k=128, splits=3, num_warps=8)):
        got = attend_units(q, ks, vs, kc, vc, lo, hi, scale=d**-0.5, softcap=20.0, config=config)
        assert rel(got[0], ref[0]) <= TOL and rel(got[2], ref[2]) <= TOL, config
