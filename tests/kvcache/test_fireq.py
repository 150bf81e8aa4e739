"""FireQ INT4 K/V tokens against NumPy (ml_dtypes), RPN/CRS calibration and folding, bytes."""

import functools

import flax
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import jaxlp
from jaxlp import kvcache
from jaxlp.kvcache import fireq
from jaxlp.quantization import fireq_kv
from jaxlp.kvcache.quant import fake_quantize_fp8
from jaxlp.models import ModelConfig, Transformer

E4M3 = ml_dtypes.float8_e4m3fn
quantize_tokens = jax.jit(fireq.quantize_tokens)
dequantize_tokens = jax.jit(fireq.dequantize_tokens)


def np_int4_tokens(x):
    absmax = np.abs(x).max(-1, keepdims=True)
    scale = np.clip(absmax / np.float32(7), 2.0**-9, 448).astype(np.float32).astype(E4M3)
    codes = np.clip(np.round(x / scale.astype(np.float32)), -8, 7).astype(np.int8)
    return codes, scale[..., 0]


def test_tokens_match_numpy():
    rng = np.random.default_rng(0)
    x = (rng.normal(size=(3, 7, 64)) * np.exp(2 * rng.normal(size=(3, 7, 1)))).astype(np.float32)
    x[0, 0] = 0.0  # zero token: smallest scale, zero codes
    x[0, 1] *= 1e5  # saturating scale (absmax / 7 > 448): codes clip to [-8, 7]
    x[0, 2] = 1e-4 * rng.normal(size=64)  # scale below the FP8 range: floored at 2**-9
    tokens = quantize_tokens(jnp.asarray(x))
    codes, scale = np_int4_tokens(x)
    assert tokens.codes.shape == (3, 7, 32) and tokens.codes.dtype == jnp.uint8 and tokens.scale.dtype == E4M3
    np.testing.assert_array_equal(np.asarray(tokens.scale).astype(np.float32), scale.astype(np.float32))
    nibbles = codes.astype(np.uint8) & 0xF  # planar: channel i low nibble, channel i + 32 high nibble
    np.testing.assert_array_equal(np.asarray(tokens.codes), nibbles[..., :32] | nibbles[..., 32:] << 4)
    deq = np.asarray(dequantize_tokens(tokens))
    np.testing.assert_array_equal(deq, codes * scale.astype(np.float32)[..., None])
    assert (deq[0, 0] == 0).all() and np.float32(scale[0, 0]) == 2.0**-9 and np.float32(scale[0, 1]) == 448
    normal = np.ones((3, 7), bool)
    normal[0, :3] = False
    s = scale.astype(np.float64)[..., None]
    over = np.maximum(np.abs(x).max(-1, keepdims=True) - 7 * s, 0)  # FP8 rounding of the scale may clip a little
    bound = np.broadcast_to(0.5 * s + over + 1e-6, x.shape)
    assert (np.abs(deq - x)[normal] <= bound[normal]).all()


def test_fp8_queries_match_ml_dtypes():
    q = np.random.default_rng(1).normal(size=(2, 3, 4, 32)).astype(np.float32) * 50
    q[0, 0, 0] = 0.0
    s = np.abs(q).max(-1, keepdims=True) / 448
    s = np.where(s > 0, s, 1).astype(np.float32)
    want = (q / s).astype(E4M3).astype(np.float32) * s
    # Same FP8 codes (a different code is >= 6% off); XLA may round q / s or the product by an ulp.
    np.testing.assert_allclose(np.asarray(jax.jit(fake_quantize_fp8)(jnp.asarray(q))), want, rtol=1e-6)


def test_rpn_factors_bound_pairs():
    rng = np.random.default_rng(2)
    keys = rng.normal(size=(50, 3, 16)) * np.exp(rng.normal(size=(1, 3, 16)))
    keys[:, 1, [2, 10]] = 0.0  # pair (2, 10) of head 1 is all zeros: factor 1
    f = fireq.rpn_factors(keys, alpha=8)
    assert f.shape == (3, 16) and f.dtype == np.float32
    np.testing.assert_array_equal(f[:, :8], f[:, 8:])  # one factor per rotate-half pair
    scaled = keys * f
    norms = np.sqrt(scaled[..., :8] ** 2 + scaled[..., 8:] ** 2).max(0)
    np.testing.assert_allclose(np.delete(norms.reshape(-1), 8 + 2), 8.0, rtol=1e-5)
    assert f[1, 2] == f[1, 10] == 1.0
    exclude = np.zeros((3, 16), bool)
    exclude[0, 11] = True  # either channel of a pair excludes the pair
    g = fireq.rpn_factors(keys, alpha=8, exclude=exclude)
    assert g[0, 3] == g[0, 11] == 1.0 and (np.delete(g, [3, 11], axis=1) == np.delete(f, [3, 11], axis=1)).all()
    with pytest.raises(ValueError, match="alpha"):
        fireq.rpn_factors(keys, alpha=0)
    with pytest.raises(ValueError, match="even head_dim"):
        fireq.rpn_factors(keys[..., :15])


def test_crs_picks_outlier_pairs():
    rng = np.random.default_rng(3)
    keys = rng.normal(size=(40, 2, 16))
    keys[:, 0, 3] *= 50  # head 0: pairs 3 and 6 (channel 14 = 6 + 8) are outliers
    keys[:, 0, 14] *= 20
    keys[:, 1, 9] *= 30  # head 1: pair 1 (channel 9 = 1 + 8)
    scales, channels = fireq.crs_channels(keys, k=2, beta=8)
    assert channels[0].nonzero()[0].tolist() == [3, 6, 11, 14]
    assert set(channels[1].nonzero()[0].tolist()) >= {1, 9} and channels[1].sum() == 4
    absmax = np.abs(keys).max(0)
    np.testing.assert_allclose((absmax * scales)[channels], 8.0, rtol=1e-6)
    assert (scales[~channels] == 1).all()
    with pytest.raises(ValueError, match="k must be"):
        fireq.crs_channels(keys, k=9)


@functools.lru_cache(maxsize=None)
def _config(qkv_bias=False, qk_norm=False):
    return ModelConfig(
        model_type="qwen3" if qk_norm else "qwen2", vocab_size=64, hidden_size=64, intermediate_size=96,
        num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, qkv_bias=qkv_bias, qk_norm=qk_norm,
    )


def _model(**kw):
    model = Transformer(_config(**kw), dtype=jnp.float32, rngs=flax.nnx.Rngs(0))
    if kw.get("qkv_bias"):  # non-zero biases, so that folding them matters
        for layer in model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj):
                proj.bias.set_value(0.3 * jax.random.normal(jax.random.key(1), proj.bias[...].shape))
    return model


def test_fold_rpn_leaves_logits_unchanged():
    model = _model(qkv_bias=True)
    ids = np.random.default_rng(4).integers(0, 64, (2, 24))
    before = np.asarray(model(jnp.asarray(ids)))
    keys = fireq_kv.collect_keys(model, ids)
    crs = [fireq.crs_channels(post, k=2)[1] for _, post in keys]
    factors = [fireq.rpn_factors(pre, alpha=8, exclude=ex) for (pre, _), ex in zip(keys, crs)]
    assert all((np.abs(np.log(f)) > 0.5).any() for f in factors)  # a real rescaling
    fireq_kv.fold_rpn(model, factors)
    np.testing.assert_allclose(np.asarray(model(jnp.asarray(ids))), before, rtol=1e-4, atol=1e-4)
    for (pre, _), ex in zip(fireq_kv.collect_keys(model, ids), crs):
        norms = np.sqrt(pre[..., :8] ** 2 + pre[..., 8:] ** 2).max(0)  # [KVH, D/2]
        np.testing.assert_allclose(norms[~ex[:, :8]], 8.0, rtol=1e-4)


def test_fold_rpn_checks():
    model = _model(qk_norm=True)
    f = np.ones((2, 16), np.float32)
    with pytest.raises(ValueError, match="q/k norms"):
        fireq_kv.fold_rpn(model, [f, f])
    fireq_kv.fold_rpn(model, [None, None])  # nothing to fold: fine
    with pytest.raises(ValueError, match="factor sets"):
        fireq_kv.fold_rpn(_model(), [f])
    with pytest.raises(ValueError, match="RPN factors must be"):
        fireq_kv.fold_rpn(_model(), [f[:1], None])


@functools.partial(jax.jit, static_argnames="scale")
def _attend(layer, q, k, v, positions, scale):
    return layer.attend(q, k, v, positions, scale=scale, window=None, softcap=None)


def _outlier_keys(seed, n=97):
    rng = np.random.default_rng(seed)
    q = rng.normal(size=(1, n, 4, 16)).astype(np.float32)
    k = rng.normal(size=(1, n, 2, 16)).astype(np.float32)
    k[..., [1, 9]] *= 30  # an outlier pair in every head
    v = rng.normal(size=(1, n, 2, 16)).astype(np.float32)
    return q, k, v


def test_crs_scores_unchanged_before_quantization_and_helps_after():
    cfg = _config()
    q, k, v = _outlier_keys(5)
    scales, _ = fireq.crs_channels(k[0], k=1)
    pos = jnp.arange(k.shape[1])[None]
    outs, errs = [], []
    for s in (None, scales):
        fmt = fireq.FireQInt4(fp8_queries=False) if s is None else fireq.FireQInt4.calibrated([s, s], fp8_queries=False)
        layer = fmt.init(cfg, 1, 128).layers[0]
        prefill, layer = _attend(layer, q[:, :-1], k[:, :-1], v[:, :-1], pos[:, :-1], 0.25)  # all full precision
        outs.append(np.asarray(prefill))
        last, _ = _attend(layer, q[:, -1:], k[:, -1:], v[:, -1:], pos[:, -1:], 0.25)
        exact, _ = _attend(fmt.init(cfg, 1, 128).layers[0], q, k, v, pos, 0.25)  # one call: no quantization
        errs.append(np.abs(np.asarray(last)[0, 0] - np.asarray(exact)[0, -1]).max())
    np.testing.assert_allclose(outs[0], outs[1], rtol=1e-4, atol=1e-5)  # float32 rounding of q / s, k * s
    assert errs[1] < 0.5 * errs[0], errs


def test_calibrated_format_checks():
    cfg = _config()
    with pytest.raises(ValueError, match="has 1 layers, the model 2"):
        fireq.FireQInt4.calibrated([np.ones((2, 16))]).init(cfg, 1, 8)
    with pytest.raises(ValueError, match="shape"):
        fireq.FireQInt4.calibrated([np.ones((2, 8)), None]).init(cfg, 1, 8)
    fmt = fireq.FireQInt4.calibrated([np.full((2, 16), 2.0), None])
    hash(fmt)  # usable as a key of generate's cache pool
    layers = fmt.init(cfg, 1, 8).layers
    assert (np.asarray(layers[0].k_scale) == 2).all() and (np.asarray(layers[1].k_scale) == 1).all()


def test_bytes_hand_computed():
    cfg = ModelConfig("llama", 16, 16, 16, 3, 32, 8, 128)
    fmt = kvcache.get("fireq-int4")
    per_token = 2 * 8 * (128 // 2 + 1)  # K and V: 64 bytes of nibbles + one FP8 scale per head
    assert per_token == 1040
    assert fmt.bytes_for(cfg, 1000) == 1000 * per_token and fmt.bytes_per_token(cfg) == per_token
    assert fmt.fixed_bytes(cfg) == 8 * 128 * 4
    assert fmt.init(cfg, 2, 1000).nbytes == 3 * (2 * 1000 * per_token + 8 * 128 * 4)


@pytest.mark.parametrize("qk_norm", [False, True])
def test_calibrate_keeps_full_precision_attention_unchanged(qk_norm):
    """RPN + CRS change only what is quantized: with FP32 storage the logits stay the same."""

    from flax import nnx

    from jaxlp.models import ModelConfig, Transformer

    cfg = ModelConfig(model_type="qwen3" if qk_norm else "llama", vocab_size=64, hidden_size=64,
                      intermediate_size=96, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, qk_norm=qk_norm)
    model = Transformer(cfg, dtype=jnp.float32, rngs=nnx.Rngs(3))
    ids = jnp.asarray(np.random.default_rng(0).integers(0, 64, (2, 24)))
    calibrated, fmt = fireq_kv.calibrate(model, ids, k=2)
    assert fmt.channel_scales is not None and len(fmt.channel_scales) == 2
    scales = np.asarray(fmt.channel_scales[0])
    assert not np.allclose(scales, 1.0)
    ref = np.asarray(model(ids))
    # Scores are unchanged before quantization: the calibrated model (RPN folded or not) over
    # an FP32 cache with the online scales and no quantization equals the original model.
    if not qk_norm:
        np.testing.assert_allclose(np.asarray(calibrated(ids)), ref, rtol=1e-4, atol=1e-4 * np.abs(ref).max())
    res = jaxlp.generate(calibrated, ids[:, :8].tolist(), max_new_tokens=4, kv_cache=fmt, stop_tokens=())
    assert res.tokens.shape == (2, 4)
