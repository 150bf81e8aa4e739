"""Shared fixtures of the evals tests: a tiny random reasoner checkpoint on the testbed tokenizer."""

import json

import jax.numpy as jnp
import pytest
from flax import nnx

from jaxlp.models import ModelConfig, Transformer
from jaxlp.models.saving import save_pretrained
from jaxlp.testbed import BOS_ID, EOS_ID, PAD_ID, VOCAB_SIZE, ProblemSpec, make_tokenizer

SPEC = ProblemSpec(min_terms=1, max_terms=2, max_digits=2, multiply_prob=0.3, start_digits=2)


@pytest.fixture
def tiny_spec():
    """The problem spec the tiny checkpoint's training log names."""
    return SPEC


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    """A random 1-layer Qwen3 with the testbed tokenizer and a training log naming a small spec.

    The embeddings are scaled up so the logits are far from uniform (entropies spread over
    several bins instead of all sitting at ln 100).
    """
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
