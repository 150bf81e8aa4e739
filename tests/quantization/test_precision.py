"""NestedFP precision per step: ``generate(..., precision=...)`` against the fixed-mode models,
the LoadThreshold rule checked step by step, no recompilation, and the LatencyTarget rule."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxlp
from jaxlp import generation
from jaxlp.models import ModelConfig, Transformer
from jaxlp.quantization import LatencyTarget, LoadThreshold, quantize_model, set_mode

PROMPTS = [[5, 9, 2, 7], [11, 4], [8, 8, 1, 30, 2, 6], [17]]
NEW = 12


@pytest.fixture(scope="module")
def models():
    config = ModelConfig(model_type="qwen3", vocab_size=61, hidden_size=64, intermediate_size=96, num_layers=2,
                         num_heads=4, num_kv_heads=2, head_dim=16, qk_norm=True, max_position_embeddings=128,
                         eos_token_ids=(3,))
    m = Transformer(config, dtype=jnp.float32, rngs=nnx.Rngs(3))
    nnx.update(m, jax.tree.map(lambda x: x * 3.0 if x.ndim == 2 else x, nnx.state(m, nnx.Param)))
    fp16 = quantize_model(m, "nestedfp")
    fp8 = set_mode(quantize_model(m, "nestedfp"), "fp8")
    return m, fp16, fp8


def run(model, **kw):
    return jaxlp.generate(model, PROMPTS, max_new_tokens=NEW, stop_tokens=kw.pop("stop", ()), **kw)


def test_fixed_precisions_match_the_fixed_mode_models(models):
    _, fp16, fp8 = models
    a16, a8 = run(fp16), run(fp8)
    assert not np.array_equal(a16.tokens, a8.tokens)  # the two models differ on this input
    np.testing.assert_array_equal(run(fp16, precision="fp8").tokens, a8.tokens)
    np.testing.assert_array_equal(run(fp8, precision="fp16").tokens, a16.tokens)
    assert fp8.layers[0].mlp.up_proj.mode == "fp8"  # the model's own modes are left as they were


def test_threshold_extremes_are_the_fixed_models(models):
    _, fp16, fp8 = models
    always = run(fp16, precision=LoadThreshold(0.0))
    never = run(fp16, precision=LoadThreshold(1.0, max_tokens=10_000))  # the prefill's tokens too
    np.testing.assert_array_equal(always.tokens, run(fp8).tokens)
    np.testing.assert_array_equal(never.tokens, run(fp16).tokens)
    assert always.fp8[:, 0].all() and not never.fp8.any()


def test_threshold_switches_per_step_by_the_rows_still_running(models):
    _, fp16, fp8 = models
    # Stop tokens that end rows at different steps: make the batch shrink below half mid-run.
    ref = run(fp8)
    stop = tuple(sorted({int(ref.tokens[r, s]) for r, s in ((0, 2), (1, 4))}))
    result = run(fp16, precision=LoadThreshold(0.5), stop=stop)
    b = len(PROMPTS)
    assert result.fp8[:, 0].all()  # the prefill schedules every prompt token
    for step in range(1, NEW):
        # The logits of `step` come from the forward after step - 1: the rows that go on.
        going_on = int(np.sum(result.num_tokens > step))
        if going_on == 0:
            break
        assert bool(result.fp8[0, step]) == (going_on > 0.5 * b), (step, going_on, result.fp8[0])
    assert (result.fp8 == result.fp8[:1]).all()
    assert result.fp8.any() and not result.fp8[:, 1:].all(), result.fp8[0]


def stepwise_reference(fp16, fp8, stop, fraction):
    """Greedy decoding step by step on the host, each forward through the FP8 model where more
    than ``fraction`` of the rows go on after it (the prefill through FP8, as in the test above),
    on one shared BF16 cache: ``[B, NEW]`` tokens (0 after a row's stop token)."""
    ids, lengths = generation.pad_prompts(PROMPTS)
    b, s = ids.shape
    cache = jaxlp.kvcache.get("bf16").init(fp16.config, b, s + NEW)
    pos = np.where(np.arange(s) < lengths[:, None], np.arange(s), s + NEW)
    hidden, cache = fp8.forward(jnp.asarray(ids), jnp.asarray(pos, jnp.int32), cache, fresh=True)
    logits = fp8.logits(hidden[np.arange(b), lengths - 1])
    out, done = np.zeros((b, NEW), np.int32), np.zeros(b, bool)
    for step in range(NEW):
        token = np.asarray(jnp.argmax(logits, axis=-1), np.int32)
        out[:, step] = np.where(done, 0, token)
        done |= np.isin(token, stop)
        model = fp8 if np.sum(~done) > fraction * b else fp16
        hidden, cache = model.forward(jnp.asarray(token)[:, None], jnp.asarray(lengths + step, jnp.int32)[:, None],
                                      cache)
        logits = model.logits(hidden[:, 0])
    return out


def test_threshold_tokens_match_a_stepwise_reference(models):
    """The tokens of a run that switches from FP8 to FP16 mid-way (two loops in the program) are
    those of a host loop choosing the model before every forward."""
    _, fp16, fp8 = models
    ref = run(fp8)
    stop = tuple(sorted({int(ref.tokens[r, s]) for r, s in ((0, 2), (1, 4))}))
    result = run(fp16, precision=LoadThreshold(0.5), stop=stop)
    assert result.fp8.any() and not result.fp8[:, 1:].all()  # it switched
    np.testing.assert_array_equal(result.tokens, stepwise_reference(fp16, fp8, stop, 0.5))


def test_switching_and_new_thresholds_compile_nothing(models):
    _, fp16, _ = models
    run(fp16, precision=LoadThreshold(0.25))
    size = generation._generate_jit._cache_size()
    run(fp16, precision=LoadThreshold(0.75))
    run(fp16, precision=LoadThreshold(0.5, max_tokens=2))
    assert generation._generate_jit._cache_size() == size


def test_bad_precision_settings(models):
    plain, fp16, _ = models
    with pytest.raises(ValueError, match="precision"):
        run(fp16, precision="fp4")
    with pytest.raises(ValueError, match="NestedFP layers"):
        run(plain, precision="fp8")
    with pytest.raises(ValueError, match="fraction"):
        LoadThreshold(1.5)
    with pytest.raises(ValueError, match="max_tokens"):
        LoadThreshold(0.5, max_tokens=0)
    with pytest.raises(ValueError, match="target_ms"):
        LatencyTarget(0.0)


def test_latency_target_has_hysteresis():
    slo = LatencyTarget(target_ms=10.0, recover=0.6)
    assert [slo.update(t) for t in (8.0, 11.0, 9.0, 7.0, 5.9, 7.0, 10.5)] == [
        False, True, True, True, False, False, True]
