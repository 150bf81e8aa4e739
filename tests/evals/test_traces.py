"""jaxlp.evals.traces: a ReSET trace of a random-init testbed-shaped Qwen3 model, its replay and plot."""


import jax.numpy as jnp
import numpy as np
import pytest

import jaxlp
from jaxlp.evals.traces import CALIBRATION_PROMPTS, plot_reset_trace, reset_trace, text_prompts
from jaxlp.evals.traces import testbed_prompts as held_out_prompts  # a test_* name would be collected
from jaxlp.models.tokenizer import load_tokenizer
from jaxlp.testbed import check_steps, eval_problems, make_tokenizer

def test_reset_trace_testbed(tiny_reasoner_dir, tiny_reasoner_spec, tmp_path):
    """Held-out prompt, tau0 from training problems, the replay, the verdict and the PNG."""
    tokenizer = load_tokenizer(tiny_reasoner_dir)
    model = jaxlp.from_pretrained(tiny_reasoner_dir, dtype=jnp.float32)
    prompts = held_out_prompts(tiny_reasoner_dir, tokenizer, 2, max_new_tokens=48)
    problem = eval_problems(0, 3, tiny_reasoner_spec)[2]
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
    plot_reset_trace(trace, out, tiny_reasoner_dir.name, log_scale=True)
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
