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


def test_latency_target_predicts_the_fp16_step_from_fp8_ones():
    """FP8 once an FP16 step misses the target; back to FP16 only once the FP16 step predicted
    from an FP8 one (its time x mean FP16 / mean FP8, exponential averages) is under recover x
    target: an FP8 step that meets the target is not enough when FP16 runs twice as slow."""
    slo = LatencyTarget(target_ms=10.0, recover=0.9, smoothing=0.5)
    assert slo.update(8.0) is False  # FP16 under the target; mean FP16 8
    assert slo.update(12.0) is True  # FP16 misses; mean FP16 10
    assert slo.update(5.0) is True  # FP8; mean FP8 5; predicted FP16 5 x 10 / 5 = 10 >= 9
    assert slo.update(3.0) is False  # mean FP8 4; predicted 3 x 10 / 4 = 7.5 < 9
    assert slo.update(9.5) is False  # FP16 under the target; mean FP16 9.75
    assert slo.update(10.5) is True  # mean FP16 10.125
    assert slo.update(4.4, fp8=True) is True  # mean FP8 4.2; predicted 4.4 x 10.125 / 4.2 = 10.6
    assert slo.update(2.0, fp8=False) is False  # a late-read FP16 step (overlapped calls) counts as FP16
    assert slo.mean_ms == {"fp16": 6.0625, "fp8": 4.2} and slo.stall_ms == 0.0
    slo.update(11.0)
    slo.update(20.0, prefill=True)
    slo.reset()
    assert slo.fp8 is False and slo.mean_ms == {} and slo.stall_ms == 0.0
    # No FP16 step measured yet: the FP8 step stands for it.
    cold = LatencyTarget(target_ms=10.0)
    assert cold.update(9.5, fp8=True) is True and cold.update(8.0, fp8=True) is False


def test_latency_target_adds_the_prefill_stalls_to_the_decode_step():
    """A step that waited for a prefill adds its excess over its mode's mean decode step to the
    stall average (every step weighs in: decode-only ones with 0) and leaves the mean alone; the
    FP16 prediction is the decode step plus that average, so frequent prefills push a decode step
    that alone meets the target over it, and rare ones fade."""
    slo = LatencyTarget(target_ms=10.0, recover=0.9, smoothing=0.5)
    assert slo.update(30.0, fp8=False, prefill=True) is True  # no mean yet: the whole 30 ms stands
    assert slo.mean_ms == {} and slo.stall_ms == 0.0
    assert slo.update(4.0, fp8=True) is False  # no FP16 mean: predicted 4 (mean FP8 4)
    assert slo.update(8.0, fp8=False) is False  # decode 8, stall 0
    assert slo.update(12.0, fp8=False, prefill=True) is False  # stall 0.5 x 4 = 2: 8 + 2 = 10, not over
    assert slo.mean_ms == {"fp16": 8.0, "fp8": 4.0} and slo.stall_ms == 2.0
    assert slo.update(14.0, fp8=False, prefill=True) is True  # stall 1 + 3 = 4: predicted 12 > 10
    assert slo.update(5.0, fp8=True, prefill=True) is True  # FP8 mean 4: stall 2 + 0.5 = 2.5; 8 + 2.5 >= 9
    assert slo.stall_ms == 2.5 and slo.mean_ms == {"fp16": 8.0, "fp8": 4.0}
    assert slo.update(4.0, fp8=True) is True  # stall 1.25: 4 x 2 + 1.25 = 9.25 >= 9
    assert slo.update(4.0, fp8=True) is False  # stall 0.625: 8.625 < 9
    # Decode-only FP16 steps that meet the target keep FP16 whatever a lone stall did before.
    assert slo.update(8.5, fp8=False) is False
    with pytest.raises(ValueError, match="smoothing"):
        LatencyTarget(10.0, smoothing=0.0)
