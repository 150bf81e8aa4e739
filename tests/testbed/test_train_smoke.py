"""jaxlp.testbed.training: the schedule, the settings, and a very short training run of the tiny
reasoner (the loss falls and the checkpoint round-trips)."""

import dataclasses
import json
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxlp
from jaxlp.models.tokenizer import load_tokenizer


@pytest.fixture(scope="module")
def train_reasoner():
    pytest.importorskip("optax")  # training's one extra dependency
    from jaxlp.testbed import training

    return training


def test_testbed_does_not_import_training():
    code = "import sys, jaxlp, jaxlp.testbed; assert 'jaxlp.testbed.training' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_learning_rate_schedule(train_reasoner):
    lr = train_reasoner.learning_rate
    assert lr(0, 100, 1.0, 10) == pytest.approx(0.1)
    assert lr(9, 100, 1.0, 10) == pytest.approx(1.0)
    assert lr(10, 100, 1.0, 10) == pytest.approx(1.0)
    assert lr(55, 100, 1.0, 10) == pytest.approx(0.55)  # cosine midpoint between 1 and 0.1
    assert lr(100, 100, 1.0, 10) == pytest.approx(0.1)
    values = [lr(s, 100, 1.0, 10) for s in range(10, 101)]
    assert all(a >= b for a, b in zip(values, values[1:]))


def test_model_configs(train_reasoner):
    full = train_reasoner.model_config()
    assert full.model_type == "qwen3" and full.qk_norm and full.tie_word_embeddings
    assert 10e6 <= full.num_params <= 30e6 and full.num_params * 2 <= 25e6  # bf16 checkpoint <= 25 MB
    assert train_reasoner.FULL_SPEC.max_tokens() <= 512 + 1  # the longest problem fits a training row
    assert train_reasoner.FULL_SPEC.max_tokens() + 64 <= full.max_position_embeddings


def test_settings(train_reasoner):
    tiny = train_reasoner.TrainSettings(tiny=True, steps="24", snapshots="30, 10,30", ship_min_accuracy=0.9)
    assert (tiny.steps, tiny.snapshots, tiny.batch_size, tiny.seq_len, tiny.lr, tiny.workers) == (
        24, [10, 30], 16, 192, 3e-3, 0)
    full = train_reasoner.TrainSettings(out="x", batch_size=64, max_terms=6)
    assert full.steps == "auto" and full.batch_size == 64 and full.seq_len == 512 and full.eval_problems == 256
    assert str(full.out) == "x" and full.spec() == dataclasses.replace(train_reasoner.FULL_SPEC, max_terms=6)
    for bad, message in ((dict(steps="many"), "--steps must be an integer or 'auto'"), (dict(steps=0), ">= 1"),
                         (dict(snapshots="1,x"), "comma-separated integers"),
                         (dict(ship_min_accuracy=0.5), "needs --snapshots")):
        with pytest.raises(ValueError, match=message):
            train_reasoner.TrainSettings(**bad)


def test_tiny_training_run(train_reasoner, tmp_path):
    args = train_reasoner.TrainSettings(
        tiny=True, steps=24, out=tmp_path / "ckpt", log_every=1, eval_every=1000, eval_problems=4,
        final_eval_problems=4, seed=3,
    )
    log, model = train_reasoner.train(args)
    losses = np.array([row[1] for row in log["losses"]])
    assert len(losses) == 24 and np.isfinite(losses).all()
    assert losses[-4:].mean() < 0.8 * losses[:2].mean()  # ln(100) = 4.6 at the start
    assert set(log["final"]) == {"greedy", "T0.6_top_p0.95"}
    out = tmp_path / "ckpt"
    saved_log = json.loads((out / "training_log.json").read_text())
    assert saved_log["steps"] == 24 and saved_log["losses"] == log["losses"]
    assert saved_log["args"]["steps"] == "24" and saved_log["args"]["snapshots"] == "[]" and list(
        saved_log["args"])[:3] == ["out", "seed", "tiny"]
    # The checkpoint loads back with bit-identical bf16 parameters, and its tokenizer works.
    loaded = jaxlp.from_pretrained(out, dtype=jnp.bfloat16)
    a = nnx.to_flat_state(nnx.state(model))
    b = dict(nnx.to_flat_state(nnx.state(loaded)))
    for path, var in a:
        assert np.array_equal(np.asarray(var.get_value()), np.asarray(b[path].get_value())), path
    tok = load_tokenizer(out)
    prompt = tok.encode("Q: 12+3\n").ids
    result = jaxlp.generate(loaded, [prompt], max_new_tokens=4)
    assert result.tokens.shape == (1, 4)
