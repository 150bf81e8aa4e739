"""A very short training run of the tiny reasoner: the loss falls and the checkpoint round-trips."""

import importlib.util
import json
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxlp
from jaxlp.models.tokenizer import load_tokenizer

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "train_reasoner.py"


@pytest.fixture(scope="module")
def train_reasoner():
    pytest.importorskip("optax")  # the training script's one extra dependency
    spec = importlib.util.spec_from_file_location("train_reasoner", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


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


def test_tiny_training_run(train_reasoner, tmp_path):
    args = train_reasoner.parse_args([
        "--tiny", "--steps", "24", "--out", str(tmp_path / "ckpt"), "--log-every", "1", "--eval-every", "1000",
        "--eval-problems", "4", "--final-eval-problems", "4", "--seed", "3",
    ])
    log, model = train_reasoner.train(args)
    losses = np.array([row[1] for row in log["losses"]])
    assert len(losses) == 24 and np.isfinite(losses).all()
    assert losses[-4:].mean() < 0.8 * losses[:2].mean()  # ln(100) = 4.6 at the start
    assert set(log["final"]) == {"greedy", "T0.6_top_p0.95"}
    out = tmp_path / "ckpt"
    saved_log = json.loads((out / "training_log.json").read_text())
    assert saved_log["steps"] == 24 and saved_log["losses"] == log["losses"]
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
