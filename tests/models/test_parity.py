"""Float32 logits and greedy generation match transformers' PyTorch models."""

import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")

import jaxlp  # noqa: E402
from conftest import TINY_CONFIGS  # noqa: E402

FAMILIES = sorted(TINY_CONFIGS)


@pytest.mark.parametrize("name", FAMILIES)
def test_logits_match_transformers(hf_checkpoint, name):
    hf_model, path = hf_checkpoint(name)
    model = jaxlp.from_pretrained(path, dtype=jnp.float32)
    rng = np.random.default_rng(abs(hash(name)) % 2**32)
    ids = rng.integers(3, 256, size=(2, 23))  # longer than every sliding window above
    with torch.no_grad():
        ref = hf_model(torch.as_tensor(ids)).logits.numpy()
    out = np.asarray(model(jnp.asarray(ids)))
    assert out.shape == ref.shape
    assert np.abs(out - ref).max() / np.abs(ref).max() <= 1e-4


@pytest.mark.parametrize("name", FAMILIES)
def test_greedy_generation_matches_transformers(hf_checkpoint, name):
    hf_model, path = hf_checkpoint(name)
    model = jaxlp.from_pretrained(path, dtype=jnp.float32)
    rng = np.random.default_rng(1 + abs(hash(name)) % 2**32)
    prompts = [rng.integers(3, 256, size=n).tolist() for n in (5, 12, 9)]
    result = jaxlp.generate(model, prompts, max_new_tokens=14, kv_cache="fp32", stop_tokens=())
    for prompt, ours in zip(prompts, result.sequences()):
        with torch.no_grad():
            ref = hf_model.generate(
                torch.as_tensor([prompt]), max_new_tokens=14, do_sample=False, eos_token_id=None,
                pad_token_id=0, attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            )[0, len(prompt):].tolist()
        assert ours == ref
