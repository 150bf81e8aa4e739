"""jaxlp.generate: batching, determinism, stop tokens, statistics, compilation, errors."""

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxlp
from jaxlp import generation
from jaxlp.models import ModelConfig, Transformer
from jaxlp.sampling.base import Categorical, Greedy, token_entropy


@pytest.fixture(scope="module")
def model():
    config = ModelConfig(
        model_type="qwen3", vocab_size=97, hidden_size=48, intermediate_size=64, num_layers=2, num_heads=4,
        num_kv_heads=2, head_dim=16, qk_norm=True, max_position_embeddings=256, eos_token_ids=(3,),
    )
    m = Transformer(config, dtype=jnp.float32, rngs=nnx.Rngs(7))
    # Larger random weights than the init so that sampled continuations vary.
    state = nnx.state(m, nnx.Param)
    nnx.update(m, __import__("jax").tree.map(lambda x: x * 4.0 if x.ndim == 2 else x, state))
    return m


@nnx.jit
def _logits_at(model, ids, index):
    """Logits at ``index`` of one sequence right-padded to 32 tokens (one compilation)."""
    return model(ids[None])[0, index]


def next_logits(model, seq):
    padded = jnp.zeros(32, jnp.int32).at[: len(seq)].set(jnp.asarray(seq))
    return _logits_at(model, padded, len(seq) - 1)


def _prompts(seed, lengths, vocab=97):
    rng = np.random.default_rng(seed)
    return [rng.integers(4, vocab, size=n).tolist() for n in lengths]


def test_greedy_equals_step_by_step_full_recompute(model):
    prompts = _prompts(0, [3, 9, 17])
    result = jaxlp.generate(model, prompts, max_new_tokens=10, kv_cache="fp32", stop_tokens=())
    for prompt, out in zip(prompts, result.sequences()):
        seq = list(prompt)
        for _ in range(10):
            seq.append(int(jnp.argmax(next_logits(model, seq))))
        assert out == seq[len(prompt):]


def test_rows_are_independent_of_the_batch(model):
    prompts = _prompts(1, [4, 11, 6, 15])
    sampler = Categorical(temperature=1.0, top_p=0.9)
    batch = jaxlp.generate(model, prompts, max_new_tokens=12, sampler=sampler, seed=3, stop_tokens=())
    # Row keys are folded with the row index: a row at the same index gives the same tokens
    # whatever the other rows hold (other lengths, other tokens).
    swapped = [prompts[0], _prompts(9, [13])[0], prompts[2], _prompts(10, [3])[0]]
    other = jaxlp.generate(model, swapped, max_new_tokens=12, sampler=sampler, seed=3, stop_tokens=())
    assert other.sequences()[0] == batch.sequences()[0]
    assert other.sequences()[2] == batch.sequences()[2]
    assert other.sequences()[1] != batch.sequences()[1]
    # Greedy rows equal the same prompts generated alone.
    greedy = jaxlp.generate(model, prompts, max_new_tokens=12, stop_tokens=())
    alone = jaxlp.generate(model, [prompts[3]], max_new_tokens=12, stop_tokens=())
    assert alone.sequences()[0] == greedy.sequences()[3]


def test_same_seed_same_tokens_and_seeds_differ(model):
    prompts = _prompts(2, [5, 8])
    sampler = Categorical(temperature=1.5)
    a = jaxlp.generate(model, prompts, max_new_tokens=16, sampler=sampler, seed=11, stop_tokens=())
    b = jaxlp.generate(model, prompts, max_new_tokens=16, sampler=sampler, seed=11, stop_tokens=())
    c = jaxlp.generate(model, prompts, max_new_tokens=16, sampler=sampler, seed=12, stop_tokens=())
    np.testing.assert_array_equal(a.tokens, b.tokens)
    assert not np.array_equal(a.tokens, c.tokens)


def test_stop_tokens_finish_rows_and_pad(model):
    prompts = _prompts(3, [6, 10])
    free = jaxlp.generate(model, prompts, max_new_tokens=12, stop_tokens=())
    stop = free.tokens[0, 4]  # row 0 stops at step 4 (or earlier if that token came before)
    first = int(np.flatnonzero(free.tokens[0] == stop)[0])
    res = jaxlp.generate(model, prompts, max_new_tokens=12, stop_tokens=(int(stop),), pad_id=-1)
    assert res.finished[0] and res.num_tokens[0] == first + 1
    assert res.sequences()[0] == free.tokens[0, : first + 1].tolist()
    assert (res.tokens[0, first + 1:] == -1).all()
    row1_hits = np.flatnonzero(free.tokens[1] == stop)
    expected1 = row1_hits[0] + 1 if row1_hits.size else 12
    assert res.num_tokens[1] == expected1


def test_stats_entropy_and_temperature(model):
    prompts = _prompts(4, [7])
    res = jaxlp.generate(model, prompts, max_new_tokens=5, sampler=Categorical(temperature=0.7), stop_tokens=(),
                         return_stats=True)
    seq = list(prompts[0])
    for t in range(5):
        logits = next_logits(model, seq)
        np.testing.assert_allclose(res.entropy[0, t], float(token_entropy(logits)), rtol=1e-4)
        seq.append(int(res.tokens[0, t]))
    np.testing.assert_allclose(res.temperature[0], 0.7)
    greedy = jaxlp.generate(model, prompts, max_new_tokens=5, stop_tokens=(), return_stats=True)
    assert (greedy.temperature == 0).all()


def test_one_compilation_per_bucket(model):
    generation._generate_jit.clear_cache()
    for lengths in ([3, 5], [9, 16], [2, 14]):  # all in the 16-token bucket
        for temperature in (0.5, 0.9):  # a traced hyper-parameter
            jaxlp.generate(model, _prompts(5, lengths), max_new_tokens=4, seed=temperature > 0.6,
                           sampler=Categorical(temperature=temperature), stop_tokens=(1, 2))
    assert generation._generate_jit._cache_size() == 1
    jaxlp.generate(model, _prompts(5, [20, 3]), max_new_tokens=4, sampler=Categorical(temperature=0.5))
    assert generation._generate_jit._cache_size() == 2


def test_bad_input_raises_clear_errors(model):
    with pytest.raises(ValueError, match="empty"):
        jaxlp.generate(model, [[5, 6], []], max_new_tokens=3)
    with pytest.raises(ValueError, match="context length"):
        jaxlp.generate(model, [[5] * 250], max_new_tokens=10)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        jaxlp.generate(model, [[5, 97]], max_new_tokens=3)
    with pytest.raises(ValueError, match="max_new_tokens"):
        jaxlp.generate(model, [[5]], max_new_tokens=0)
    with pytest.raises(ValueError, match="unknown KV cache"):
        jaxlp.generate(model, [[5]], max_new_tokens=2, kv_cache="int3")


def test_prompt_bucket():
    assert [generation.prompt_bucket(n) for n in (1, 16, 17, 100, 128, 129)] == [16, 16, 32, 128, 128, 256]


def test_cache_budget_splits_the_batch_without_changing_tokens(model):
    from jaxlp import kvcache

    prompts = _prompts(6, [3, 7, 5, 9, 4])
    whole = jaxlp.generate(model, prompts, max_new_tokens=6, stop_tokens=())
    one_row = kvcache.cache_bytes(kvcache.get("bf16"), model.config, 1, 16 + 6)
    split = jaxlp.generate(model, prompts, max_new_tokens=6, stop_tokens=(), cache_budget_bytes=2 * one_row)
    np.testing.assert_array_equal(split.tokens, whole.tokens)
    with pytest.raises(ValueError, match="does not fit"):
        jaxlp.generate(model, prompts, max_new_tokens=6, cache_budget_bytes=one_row // 2)


@pytest.mark.parametrize("cache", ["bf16", "kitty"])
def test_repeated_calls_do_not_see_earlier_calls(model, cache):
    """A second call with the same shapes (reusing a donated buffer for dense caches) gives
    the same tokens as a fresh call, even after a call that wrote longer rows."""
    long = _prompts(8, [15, 14])
    short = _prompts(9, [3, 2])
    generation.clear_cache_pool()
    fresh = jaxlp.generate(model, short, max_new_tokens=8, kv_cache=cache, stop_tokens=())
    jaxlp.generate(model, long, max_new_tokens=8, kv_cache=cache, stop_tokens=())
    again = jaxlp.generate(model, short, max_new_tokens=8, kv_cache=cache, stop_tokens=())
    np.testing.assert_array_equal(again.tokens, fresh.tokens)


def test_stats_entropy_from_a_sampler_that_computes_it(model):
    from jaxlp.sampling import ReSETConfig

    prompt = _prompts(10, [6])
    sampler = ReSETConfig(t_low=0.1, tau0=1.0, newline_ids=(5,))
    res = jaxlp.generate(model, prompt, max_new_tokens=4, sampler=sampler, stop_tokens=(), return_stats=True)
    seq = list(prompt[0])
    for t in range(4):
        np.testing.assert_allclose(res.entropy[0, t], float(token_entropy(next_logits(model, seq))), rtol=1e-4)
        seq.append(int(res.tokens[0, t]))


def _with_nan_embedding(model, token):
    """A copy of ``model`` whose embedding of ``token`` is NaN (any row feeding it gets NaN logits)."""
    bad = nnx.clone(model)
    bad.embed_tokens.weight.set_value(bad.embed_tokens.weight[...].at[token].set(jnp.nan))
    return bad


def test_nonfinite_logits_are_reported_with_step_and_row(model):
    from jaxlp.errors import NonFiniteLogitsError

    prompts = _prompts(11, [5, 7, 6])
    kwargs = dict(max_new_tokens=8, stop_tokens=(), sampler=Categorical(temperature=1.0), seed=2)
    clean = jaxlp.generate(model, prompts, **kwargs)
    assert (clean.nonfinite_step == -1).all()
    # The NaN embedding of a token row 1 generates at step 2: a row's logits turn NaN at the
    # step after it first feeds that token in (step 0 if its prompt holds it); until then the
    # rows compute exactly what the clean model computes.
    token = int(clean.tokens[1, 2])

    def first_bad(r):
        if token in prompts[r]:
            return 0
        hits = np.flatnonzero(clean.tokens[r] == token)
        return int(hits[0]) + 1 if hits.size and hits[0] + 1 < 8 else -1

    expected = np.array([first_bad(r) for r in range(3)])
    assert 1 <= expected[1] <= 3
    step = int(expected[expected >= 0].min())
    row = int(np.flatnonzero(expected == step)[0])
    bad = _with_nan_embedding(model, token)
    with pytest.raises(NonFiniteLogitsError, match=f"decode step {step} of prompt {row}") as raised:
        jaxlp.generate(bad, prompts, **kwargs)
    assert (raised.value.step, raised.value.row) == (step, row)
    result = jaxlp.generate(bad, prompts, **kwargs, on_nonfinite="return")
    np.testing.assert_array_equal(result.nonfinite_step, expected)
    unchecked = jaxlp.generate(bad, prompts, **kwargs, on_nonfinite="ignore")  # no check compiled in
    assert (unchecked.nonfinite_step == -1).all() and (unchecked.num_tokens == 8).all()
    for r in range(3):
        n = expected[r] if expected[r] >= 0 else 8
        assert result.num_tokens[r] == n  # a row stops at its first non-finite step
        np.testing.assert_array_equal(result.tokens[r, :n], clean.tokens[r, :n])
        assert (result.tokens[r, n:] == 0).all()


@pytest.mark.parametrize("kwargs, match", [
    (dict(max_new_tokens=2.0), "max_new_tokens must be an integer"),
    (dict(max_new_tokens=300), r"max_new_tokens must be an integer in \[1, 255\]"),
    (dict(max_new_tokens=4, max_length=1000), r"max_length must be an integer in \[1, 256\]"),
    (dict(max_new_tokens=4, seed="x"), "seed must be a 64-bit integer"),
    (dict(max_new_tokens=4, cache_budget_bytes=0), "cache_budget_bytes must be an integer >= 1"),
    (dict(max_new_tokens=4, on_nonfinite="skip"), "on_nonfinite must be one of raise, return, ignore"),
    (dict(max_new_tokens=4, sampler="greedy"), "sampler must be a jaxlp.sampling sampler"),
])
def test_generate_settings_are_checked(model, kwargs, match):
    with pytest.raises(ValueError, match=match):
        jaxlp.generate(model, [[5, 6]], **kwargs)
