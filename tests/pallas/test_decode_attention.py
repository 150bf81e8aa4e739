"""Decode attention (Pallas, Triton): interpret mode and CUDA lowering on the CPU, the kernel on a GPU,
against float64 NumPy and the pure-JAX reference."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxlp
from jaxlp import kvcache
from jaxlp.models import ModelConfig, Transformer
from jaxlp.pallas.decode_attention import DecodeConfig, decode_attention, default_config, reference

ON_GPU = jax.devices()[0].platform == "gpu"


def exact(q, k, v, lengths, starts, scale, softcap=None):
    """float64 attention of one query per row over slots [start, length) (zeros for an empty range)."""
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    b, h, d = q.shape
    g = h // k.shape[2]
    out = np.zeros((b, h, d))
    for r in range(b):
        lo, hi = int(starts[r]), int(lengths[r])
        if hi <= lo:
            continue
        for head in range(h):
            s = k[r, lo:hi, head // g] @ q[r, head] * scale
            if softcap is not None:
                s = np.tanh(s / softcap) * softcap
            p = np.exp(s - s.max())
            out[r, head] = (p / p.sum()) @ v[r, lo:hi, head // g]
    return out


def case(seed, b=3, length=100, kvh=2, g=4, d=32, dtype=jnp.bfloat16):
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.standard_normal((b, kvh * g, d)), dtype)
    k = jnp.asarray(rng.standard_normal((b, length, kvh, d)), dtype)
    v = jnp.asarray(rng.standard_normal((b, length, kvh, d)), dtype)
    return q, k, v


def rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@pytest.mark.parametrize("g", [1, 4, 6, 20])  # 20: two blocks of 16 query heads
@pytest.mark.parametrize("config", [DecodeConfig(block_k=16), DecodeConfig(block_k=32, splits=3)])
@pytest.mark.parametrize("softcap", [None, 5.0])
def test_interpret_matches_float64(g, config, softcap):
    q, k, v = case(g, g=g)
    lengths, starts = jnp.asarray([1, 57, 100]), jnp.asarray([0, 20, 0])  # one slot, a window, the full cache
    out = decode_attention(q, k, v, lengths, starts, scale=0.3, softcap=softcap, config=config, interpret=True)
    assert out.shape == q.shape and out.dtype == q.dtype
    want = exact(q, k, v, lengths, starts, 0.3, softcap)
    assert rel(out, want) < 4e-3  # the BF16 probabilities and output
    ref = reference(q, k, v, lengths, starts, scale=0.3, softcap=softcap)
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref, np.float32), atol=1.6e-2)


@jax.default_matmul_precision("highest")  # interpret mode on a GPU: float32 dots would be TF32
def test_edge_cases():
    q, k, v = case(1, b=2, length=40, dtype=jnp.float32)
    k = k.at[1].set(0.0)  # all-zero keys: uniform weights
    lengths, starts = jnp.asarray([0, 40]), jnp.asarray([0, 0])
    out = decode_attention(q, k, v, lengths, starts, scale=1.0, config=DecodeConfig(16, 2), interpret=True)
    assert np.all(np.asarray(out[0]) == 0.0)  # an empty range gives zeros
    np.testing.assert_allclose(np.asarray(out[1]), np.broadcast_to(np.asarray(v[1]).mean(0).repeat(4, 0), (8, 32)),
                               rtol=1e-5, atol=1e-6)
    big = q * 1e4  # large scores: the online softmax must not overflow
    out = decode_attention(big, k, v, jnp.asarray([40, 40]), starts, scale=1.0, config=DecodeConfig(16, 3),
                           interpret=True)
    assert np.all(np.isfinite(np.asarray(out)))
    assert rel(out, exact(big, k, v, [40, 40], [0, 0], 1.0)) < 1e-5


def test_bad_input_is_refused():
    q, k, v = case(2)
    with pytest.raises(ValueError, match="multiple of KV heads"):
        decode_attention(q[:, :7], k, v, jnp.asarray([1, 2, 3]), scale=1.0, interpret=True)
    with pytest.raises(ValueError, match="lengths and starts must be"):
        decode_attention(q, k, v, jnp.asarray([1, 2]), scale=1.0, interpret=True)
    with pytest.raises(ValueError, match="power of two"):
        decode_attention(q, k, v, jnp.asarray([1, 2, 3]), scale=1.0, config=DecodeConfig(block_k=48), interpret=True)


def test_fp16_queries_over_a_bf16_cache_take_the_kernel(monkeypatch):
    """An FP16 model's queries over a BF16 cache (the default cache): the kernel runs them cast to
    BF16 and returns FP16 (the XLA path would cast the whole cache to FP16 at every step). The
    dispatch on a GPU (the backend faked: only the choice is asked), and the cast path in
    interpret mode against float64 of the BF16-rounded query and of the FP16 one."""
    from jaxlp.attention import decode

    q, k, v = case(7, g=4)
    q16 = jnp.asarray(np.random.default_rng(8).standard_normal(q.shape), jnp.float16)  # off the BF16 grid
    monkeypatch.setattr(decode.jax, "default_backend", lambda: "gpu")
    assert decode.choose(q16, k, "auto") == "pallas"
    assert decode.choose(q16.astype(jnp.float32), k, "auto") == "xla"  # a float32 model keeps the reference
    assert decode.choose(q16, k.astype(jnp.float32), "auto") == "xla"
    monkeypatch.undo()

    lengths, starts = jnp.asarray([1, 57, 100]), jnp.asarray([0, 20, 0])
    out = decode.decode_attention(q16, k, v, lengths, starts, scale=0.3, implementation="interpret")
    assert out.dtype == jnp.float16 and out.shape == q16.shape
    rounded = q16.astype(jnp.bfloat16)
    assert not np.array_equal(np.asarray(rounded, np.float32), np.asarray(q16, np.float32))  # the cast rounds
    assert rel(out, exact(rounded, k, v, lengths, starts, 0.3)) < 4e-3  # the kernel's own BF16 error
    assert rel(out, exact(q16, k, v, lengths, starts, 0.3)) < 8e-3  # plus the query's BF16 rounding
    same = decode_attention(rounded, k, v, lengths, starts, scale=0.3, interpret=True)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(same.astype(jnp.float16)))


def test_unknown_attention_implementation_is_refused():
    with pytest.raises(ValueError, match="attention implementation must be one of"):
        kvcache.Dense(attention="triton")


@pytest.mark.skipif(ON_GPU, reason="checks the error without a GPU")
def test_pallas_without_a_gpu_says_why():
    model = Transformer(ModelConfig(model_type="llama", vocab_size=16, hidden_size=16, intermediate_size=32,
                                    num_layers=1, num_heads=2, num_kv_heads=1, head_dim=8), rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="needs a GPU"):
        jaxlp.generate(model, [[1, 2]], max_new_tokens=2, stop_tokens=[], kv_cache=kvcache.Dense(attention="pallas"))


def test_default_config_fills_the_gpu():
    assert default_config(1, 8, 8448) == DecodeConfig(block_k=64, splits=33)  # 264 programs
    assert default_config(1, 8, 384).splits == 1  # short caches: no split shorter than 256 slots
    assert default_config(64, 8, 8448).splits == 1


def test_generation_through_the_kernel_gives_the_same_tokens(monkeypatch):
    """The dense cache's one-token steps on the kernel (interpret mode): sliding windows and GQA."""
    config = ModelConfig(model_type="qwen3", vocab_size=97, hidden_size=64, intermediate_size=96, num_layers=2,
                         num_heads=4, num_kv_heads=2, head_dim=16, qk_norm=True,
                         layer_types=("sliding_attention", "full_attention"), sliding_window=5)
    model = Transformer(config, dtype=jnp.float32, rngs=nnx.Rngs(0))
    prompts = [[3, 4, 5, 6, 7, 8, 9], [10, 11]]
    from jaxlp.pallas import decode_attention as module

    calls = []
    kernel = module.decode_attention
    monkeypatch.setattr(module, "decode_attention", lambda *a, **k: calls.append(k) or kernel(*a, **k))
    want = jaxlp.generate(model, prompts, max_new_tokens=8, stop_tokens=[], kv_cache=kvcache.Dense(attention="xla")).tokens
    assert not calls
    # The implementation is a static field of the cache: a new value traces a new program (no cache clearing).
    got = jaxlp.generate(model, prompts, max_new_tokens=8, stop_tokens=[],
                         kv_cache=kvcache.Dense(attention="interpret")).tokens
    assert len(calls) == 2 and all(k["interpret"] for k in calls)  # both layers' decode steps (traced once)
    assert calls[0]["softcap"] is None
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_lowers_to_one_triton_call_for_cuda(monkeypatch):
    """The Triton lowering runs on the CPU too (given an H100 as the target): the kernel's language is valid."""
    from jax._src.pallas.triton import gpu_info, pallas_call_registration

    h100 = gpu_info.get_gpu_info_from_version(gpu_info.GpuVersion.H100)
    monkeypatch.setattr(pallas_call_registration.gpu_info_lib, "get_gpu_info", lambda: h100)
    q = jax.ShapeDtypeStruct((2, 32, 128), jnp.bfloat16)
    k = jax.ShapeDtypeStruct((2, 8448, 8, 128), jnp.bfloat16)
    n = jax.ShapeDtypeStruct((2,), jnp.int32)
    for softcap in (None, 30.0):
        f = jax.jit(lambda q, k, v, a, b: decode_attention(q, k, v, a, b, scale=0.088, softcap=softcap))
        text = f.trace(q, k, k, n, n).lower(lowering_platforms=("cuda",)).as_text()
        assert text.count("xla.gpu.triton") == 1 and "stablehlo.transpose" not in text  # no copy of the cache


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize("b,length,splits,g", [(1, 200, None, 4), (2, 8448, None, 4), (3, 1000, 4, 4), (8, 300, 1, 4),
                                               (2, 500, 2, 20)])  # 20: two blocks of query heads
def test_gpu_matches_float64(b, length, splits, g):
    q, k, v = case(b + length, b=b, length=length, kvh=8 if g == 4 else 2, g=g, d=128)
    rng = np.random.default_rng(length)
    lengths = jnp.asarray(rng.integers(1, length + 1, b))
    starts = jnp.asarray([0] * (b - 1) + [max(0, int(lengths[-1]) - 64)])
    config = None if splits is None else DecodeConfig(splits=splits)
    out = decode_attention(q, k, v, lengths, starts, scale=128**-0.5, config=config)
    assert rel(out, exact(q, k, v, np.asarray(lengths), np.asarray(starts), 128**-0.5)) < 4e-3


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
def test_gpu_fp16_queries_over_a_bf16_cache():
    """``"auto"`` on a GPU: FP16 queries over a BF16 cache run the kernel (cast to BF16), FP16 out."""
    from jaxlp.attention import decode

    q, k, v = case(11, b=2, length=1000, kvh=8, g=4, d=128)
    q16 = jnp.asarray(np.random.default_rng(12).standard_normal(q.shape), jnp.float16)
    lengths, starts = jnp.asarray([1000, 377]), jnp.asarray([0, 0])
    assert decode.choose(q16, k, "auto") == "pallas"
    out = decode.decode_attention(q16, k, v, lengths, starts, scale=128**-0.5)
    assert out.dtype == jnp.float16
    assert rel(out, exact(q16.astype(jnp.bfloat16), k, v, np.asarray(lengths), np.asarray(starts), 128**-0.5)) < 4e-3
