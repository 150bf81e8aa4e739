"""jaxlp.evals.traces: a ReSET trace of a random-init testbed-shaped Qwen3 model, its replay and plot."""

import json

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxlp
from jaxlp.evals.traces import CALIBRATION_PROMPTS, plot_reset_trace, reset_trace, text_prompts
from jaxlp.evals.traces import testbed_prompts as held_out_prompts  # a test_* name would be collected
from jaxlp.models import ModelConfig, Transformer
from jaxlp.models.saving import save_pretrained
from jaxlp.models.tokenizer import load_tokenizer
from jaxlp.testbed import BOS_ID, EOS_ID, PAD_ID, VOCAB_SIZE, ProblemSpec, check_steps, eval_problems, make_tokenizer

SPEC = ProblemSpec(min_terms=1, max_terms=2, max_digits=2, multiply_prob=0.3, start_digits=2)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    """A random 1-layer Qwen3 with the testbed tokenizer and a training log naming a small spec
    (embeddings scaled up so that the logits are far from uniform)."""
    config = ModelConfig(
        model_type="qwen3", vocab_size=VOCAB_SIZE, qk_norm=True, tie_word_embeddings=True, rms_norm_eps=1e-6,
        max_position_embeddings=1024, bos_token_id=BOS_ID, eos_token_ids=(EOS_ID,), pad_token_id=PAD_ID,
        hidden_size=64, intermediate_size=192, num_layers=1, num_heads=4, num_kv_heads=2, head_dim=16,
    )
    model = Transformer(config, rngs=nnx.Rngs(7))
    model.embed_tokens.weight.set_value(model.embed_tokens.weight.get_value() * 15.0)
    path = tmp_path_factory.mktemp("tiny_reasoner")
    save_pretrained(model, path, make_tokenizer(), dtype=jnp.bfloat16)
    (path / "training_log.json").write_text(json.dumps({"spec": SPEC.__dict__}))
    return path


def test_reset_trace_testbed(tiny_dir, tmp_path):
    """Held-out prompt, tau0 from training problems, the replay, the verdict and the PNG."""
    tokenizer = load_tokenizer(tiny_dir)
    model = jaxlp.from_pretrained(tiny_dir, dtype=jnp.float32)
    prompts = held_out_prompts(tiny_dir, tokenizer, 2, max_new_tokens=48)
    problem = eval_problems(0, 3, SPEC)[2]
    assert prompts.problem == problem and prompts.prompt == problem.question
    assert len(prompts.calibration) == CALIBRATION_PROMPTS and prompts.max_new_tokens == 48
    trace = reset_trace(model, tokenizer, prompts, t_low=0.1)
    n = len(trace.tokens)
    assert 0 < n <= 48 and trace.tau0 > 0
    for x in (trace.entropy, trace.temperature, trace.step_estimate, trace.running_mean, trace.uncertain):
        assert len(x) == n
    assert np.all(np.isclose(trace.temperature, 0.1) | np.isclose(trace.temperature, 1.0))  # T_low or T_high
    assert trace.text == tokenizer.decode(trace.tokens.tolist())
    check = check_steps(problem, trace.text)
    assert trace.verdict == "correct" if check.correct else trace.verdict.startswith(f"wrong ({check.kind} ")
    summary = trace.summary()
    assert "tau0" in summary and ("correct" in summary or "wrong" in summary)
    out = tmp_path / "sub" / "trace.png"
    plot_reset_trace(trace, out, tiny_dir.name, log_scale=True)
    assert out.stat().st_size > 10_000
    fixed = reset_trace(model, tokenizer, prompts, t_low=0.1, tau0=0.25)  # tau0 given: no calibration
    assert fixed.tau0 == 0.25


def test_trace_prompts():
    tokenizer = make_tokenizer()
    text = text_prompts(tokenizer)
    assert (len(text.calibration), text.calibration_tokens, text.max_new_tokens) == (CALIBRATION_PROMPTS, 128, 400)
    assert len(text.prompt) == 400 and text.problem is None
    given = text_prompts(tokenizer, "Q: 1+1", 7)
    assert (given.prompt, given.max_new_tokens) == ("Q: 1+1", 7)
    with pytest.raises(ValueError, match="problem must be >= 0"):
        held_out_prompts(None, tokenizer, -1)
