"""jaxlp.evals.kvcache: teacher-forced decoding through caches on a tiny random model, against a
plain forward pass, and the files it writes."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxlp
from jaxlp import kvcache
from jaxlp.data import token_windows
from jaxlp.evals.kvcache import evaluate_caches, kvcache_table, run_kvcache_eval
from jaxlp.models import ModelConfig, Transformer
from jaxlp.models.saving import save_pretrained
from jaxlp.testbed import BOS_ID, EOS_ID, PAD_ID, VOCAB_SIZE, make_tokenizer


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    config = ModelConfig(
        model_type="qwen3", vocab_size=VOCAB_SIZE, qk_norm=True, tie_word_embeddings=True, rms_norm_eps=1e-6,
        max_position_embeddings=512, bos_token_id=BOS_ID, eos_token_ids=(EOS_ID,), pad_token_id=PAD_ID,
        hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
    )
    path = tmp_path_factory.mktemp("tiny_kv")
    save_pretrained(Transformer(config, rngs=nnx.Rngs(4)), path, make_tokenizer(), dtype=jnp.bfloat16)
    return path


def test_kvcache_eval_tiny_model(tiny_dir, tmp_path):
    out = tmp_path / "kv"
    seen = []
    rows = run_kvcache_eval(tiny_dir, str(out), caches=("bf16", "fireq-int4"), tokens=17, prefill=8, chunk=4,
                            on_result=seen.append)
    assert seen == rows and [r.cache for r in rows] == ["bf16", "fireq-int4"]
    # The BF16 cache against itself: no divergence; its perplexity is the forward pass's over
    # tokens 8 .. 15 (each predicted from all earlier ones), up to the BF16 rounding of K and V.
    model = jaxlp.from_pretrained(tiny_dir, dtype=jnp.float32)
    ids = token_windows(make_tokenizer(), 1, 17, split="evaluation")
    logp = np.asarray(jax.nn.log_softmax(model(jnp.asarray(ids))[0], axis=-1))
    nll = -np.mean([logp[t - 1, ids[0, t]] for t in range(8, 16)])
    assert rows[0].kl == pytest.approx(0.0, abs=1e-6) and rows[0].ppl == pytest.approx(np.exp(nll), rel=2e-2)
    assert rows[1].kl > 1e-6 and np.isfinite(rows[1].ppl)
    assert rows[1].bytes_per_token_per_layer == kvcache.get("fireq-int4").bytes_per_token(model.config)
    assert rows[0].bytes_per_token_per_layer > rows[1].bytes_per_token_per_layer
    data = json.loads(out.with_suffix(".json").read_text())
    assert data["meta"]["decoded"] == 8 and data["meta"]["prefill"] == 8
    assert data["rows"][1] == {"cache": "fireq-int4", "ppl": rows[1].ppl, "kl": rows[1].kl,
                               "bytes_per_token_per_layer": rows[1].bytes_per_token_per_layer}
    md = out.with_suffix(".md").read_text()
    assert f"--out {out}`" in md and kvcache_table(rows) in md and "| bf16 |" in md and "| 1.00x |" in md
    assert out.with_suffix(".png").stat().st_size > 1000
    with pytest.raises(ValueError, match="multiple of chunk"):
        evaluate_caches(model, make_tokenizer(), ids[:, :16], ("bf16",), prefill=8, chunk=4)
