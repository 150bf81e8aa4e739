"""Parity with transformers on the one real checkpoint reachable offline: Gemma 3 270M."""

import jax.numpy as jnp
import numpy as np
import pytest

import jaxlp
from jaxlp.data import offline_text
from jaxlp.models.tokenizer import load_tokenizer

torch = pytest.importorskip("torch")


@pytest.fixture(scope="module")
def checkpoint(gemma3_270m_dir):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(gemma3_270m_dir, dtype=torch.float32, attn_implementation="eager")
    return gemma3_270m_dir, hf.eval(), jaxlp.from_pretrained(gemma3_270m_dir, dtype=jnp.float32)


def test_config_is_gemma3_text(checkpoint):
    path, _, model = checkpoint
    c = model.config
    assert (c.model_type, c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim) == (
        "gemma3_text", 18, 640, 4, 1, 256)
    assert c.sliding_window == 512 and c.layer_types.count("full_attention") == 3 and c.tie_word_embeddings


def test_logits_match_across_the_sliding_window(checkpoint):
    path, hf, model = checkpoint
    ids = load_tokenizer(path).encode(offline_text()[:20000]).ids[:600]  # > 512: crosses the window
    assert len(ids) == 600 and ids[0] == 2  # <bos>
    with torch.no_grad():
        ref = hf(torch.as_tensor([ids])).logits[0].numpy()
    out = np.asarray(model(jnp.asarray([ids]))[0])
    err = np.abs(out - ref).max() / np.abs(ref).max()
    assert err <= 1e-4, err


def test_greedy_text_matches_transformers(checkpoint):
    path, hf, model = checkpoint
    tok = load_tokenizer(path)
    prompt = tok.encode("The capital of France is").ids
    ours = jaxlp.generate(model, [prompt], max_new_tokens=16, kv_cache="fp32").sequences()[0]
    with torch.no_grad():
        ref = hf.generate(torch.as_tensor([prompt]), max_new_tokens=16, do_sample=False)[0, len(prompt):].tolist()
    assert ours == ref[: len(ours)]
    assert "France" in tok.decode(ours) or len(tok.decode(ours)) > 20
