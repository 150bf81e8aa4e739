"""jaxlp.evals.quality: perplexity, KL, weight errors and bytes of recipes on a tiny random model."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxlp
from jaxlp.data import token_windows
from jaxlp.evals.quality import REFERENCE, evaluate_recipes, linear_bytes, quality_table, run_quality_report
from jaxlp.models import ModelConfig, Transformer
from jaxlp.models.saving import save_pretrained
from jaxlp.testbed import BOS_ID, EOS_ID, PAD_ID, VOCAB_SIZE, make_tokenizer


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    config = ModelConfig(
        model_type="qwen3", vocab_size=VOCAB_SIZE, qk_norm=True, tie_word_embeddings=True, rms_norm_eps=1e-6,
        max_position_embeddings=512, bos_token_id=BOS_ID, eos_token_ids=(EOS_ID,), pad_token_id=PAD_ID,
        hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
    )
    path = tmp_path_factory.mktemp("tiny_quality")
    save_pretrained(Transformer(config, rngs=nnx.Rngs(5)), path, make_tokenizer(), dtype=jnp.bfloat16)
    return path


def test_quality_report_tiny_model(tiny_dir, tmp_path):
    out = tmp_path / "q"
    results = run_quality_report(tiny_dir, str(out), recipes=("w8a16-fp8", "w4a16-nvfp4"), eval_sequences=2,
                                 seq_len=32, calibration_sequences=2)
    assert [r.recipe for r in results] == [REFERENCE, "w8a16-fp8", "w4a16-nvfp4"]
    model = jaxlp.from_pretrained(tiny_dir, dtype=jnp.float32)
    ids = token_windows(make_tokenizer(), 2, 32, split="evaluation")
    logp = np.asarray(jax.nn.log_softmax(model(jnp.asarray(ids))[:, :-1], axis=-1), np.float64)
    nll = -np.take_along_axis(logp, ids[:, 1:, None], axis=-1).mean()
    ref, fp8, fp4 = results
    assert ref.ppl == pytest.approx(np.exp(nll), rel=1e-4) and ref.kl == 0.0 and ref.layer_errors == {}
    assert ref.bytes == linear_bytes(model) == 4 * 2 * (2 * 64 * 64 + 2 * 64 * 32 + 3 * 64 * 128)  # f32, 2 layers
    assert 0 < fp8.kl < fp4.kl and fp8.bytes < ref.bytes / 3 and fp4.bytes < fp8.bytes
    assert len(fp8.layer_errors) == 14 and all(0 < e < max(fp4.layer_errors.values()) for e in
                                               fp8.layer_errors.values())
    data = json.loads(out.with_suffix(".json").read_text())
    assert "kept" not in data["results"][0] and data["results"][1] == fp8.as_dict() | {"kept": fp8.kept}
    assert data["meta"]["eval_tokens"] == 2 * 31
    md = out.with_suffix(".md").read_text()
    assert f"--out {out}`" in md and quality_table(results) in md and "| w4a16-nvfp4 |" in md
    assert out.with_suffix(".png").stat().st_size > 1000
    with pytest.raises(ValueError, match="unknown recipe 'fp3'"):
        evaluate_recipes(model, ids, ids, ("w8a16-fp8", "fp3:x"))
