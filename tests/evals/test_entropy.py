"""jaxlp.evals.entropy: per-position statistics against a float64 NumPy reference, and tiny
end-to-end runs of both kinds on a random-init testbed-shaped Qwen3 model."""

import json
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxlp
from jaxlp.evals.entropy import (
    SequenceStats,
    distribution,
    run_entropy_analysis,
    run_models,
    text_windows,
)
from jaxlp.evals.entropy import testbed_corpus as build_testbed_corpus  # a test_* name would be collected
from jaxlp.models.tokenizer import load_tokenizer
from jaxlp.testbed import BOS_ID, EOS_ID, PAD_ID, eval_problems

def _reference_stats(logits, targets):
    """float64 NumPy: entropy, argmax, log p(target), max prob of logits [S, V]."""
    x = np.asarray(logits, np.float64)
    logp = x - x.max(-1, keepdims=True)
    logp = logp - np.log(np.exp(logp).sum(-1, keepdims=True))
    p = np.exp(logp)
    return -(p * logp).sum(-1), x.argmax(-1), logp[np.arange(len(targets)), targets], p.max(-1), logp


def test_distribution_is_accurate_for_peaked_rows():
    from jaxlp.sampling import token_entropy

    rng = np.random.default_rng(51)
    x = rng.normal(size=(64, 300)) * 3
    x[:32, 0] += np.linspace(5, 40, 32)  # near-certain rows: log p(top) down to ~1e-16 nats
    x[40, :2] = 50.0  # a tie at the maximum
    x[41, 5:] = -1e4  # probabilities that underflow to 0
    x = x.astype(np.float32).astype(np.float64)  # the values the float32 function sees
    top = x.argmax(-1)
    e = np.exp(x - x.max(-1, keepdims=True))
    rest = e.copy()
    rest[np.arange(64), top] = 0.0
    rest = rest.sum(-1)
    ref_top = -np.log1p(rest)  # log p(top) in float64 without the cancellation in log(1 + s)
    ref = x - x.max(-1, keepdims=True) - np.log1p(rest)[:, None]  # float64, also without that cancellation
    p = np.exp(ref)
    ref_entropy = -(p * ref).sum(-1)
    d = distribution(jnp.asarray(x, jnp.float32))
    got = np.asarray(d.logp, np.float64)
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=2e-5)
    np.testing.assert_allclose(got[np.arange(64), top], ref_top, rtol=1e-4)  # relative precision kept
    np.testing.assert_allclose(np.asarray(d.p), p, rtol=1e-4, atol=1e-7)
    np.testing.assert_array_equal(np.asarray(d.argmax), top)
    np.testing.assert_allclose(np.asarray(d.max_prob), 1 / (1 + rest), rtol=1e-6)
    # Entropy: relative precision down to tiny values, and the same quantity as token_entropy.
    np.testing.assert_allclose(np.asarray(d.entropy), ref_entropy, rtol=1e-4, atol=1e-30)
    np.testing.assert_allclose(np.asarray(d.entropy), np.asarray(token_entropy(jnp.asarray(x, jnp.float32))),
                               rtol=1e-5, atol=3e-5)  # token_entropy's rounding: ~1e-7 x |largest logit|
    assert np.isfinite(got[np.asarray(d.p) > 0]).all() and np.isfinite(np.asarray(d.entropy)).all()


def test_run_models_matches_numpy(tiny_reasoner_dir):
    tok = load_tokenizer(tiny_reasoner_dir)
    model = jaxlp.from_pretrained(tiny_reasoner_dir, dtype=jnp.float32)
    corpus = build_testbed_corpus(tiny_reasoner_dir, tok, EOS_ID, 3, 2, seed=5)
    assert [len(s) for s in corpus.sequences] != [len(corpus.sequences[0])] * 3  # padding is exercised
    quantized = [jaxlp.quantization.quantize_model(model, "w4a4-nvfp4", calibration=corpus.calibration),
                 jaxlp.quantization.quantize_model(model, "w4a16-nvfp4")]
    per_seq = run_models(model, quantized, corpus, batch_size=2, pad_id=PAD_ID)  # last batch half empty
    assert isinstance(per_seq, SequenceStats) and all(len(v) == 3 for v in per_seq)
    width = max(len(s) for s in corpus.sequences) + 3  # one row at a time, padded otherwise than run_models
    forward = nnx.jit(lambda m, ids: m(ids))
    for i, (seq, first) in enumerate(zip(corpus.sequences, corpus.first)):
        targets = seq[first:]
        ids = jnp.asarray(np.pad(seq, (0, width - len(seq)), constant_values=PAD_ID)[None])
        refs = [_reference_stats(forward(m, ids)[0, first - 1 : len(seq) - 1], targets) for m in [model, *quantized]]
        for m, (h, am, lp, pmax, _) in enumerate(refs):
            np.testing.assert_allclose(per_seq.entropy[i][m], h, rtol=2e-4, atol=2e-5)
            np.testing.assert_allclose(per_seq.target_logprob[i][m], lp, rtol=2e-4, atol=2e-5)
            np.testing.assert_allclose(per_seq.max_prob[i][m], pmax, rtol=2e-4, atol=2e-6)
            top2 = np.sort(refs[m][4], -1)[:, -2:]
            clear = top2[:, 1] - top2[:, 0] > 1e-4  # argmax is only compared where it is not a near-tie
            np.testing.assert_array_equal(per_seq.argmax[i][m][clear], am[clear])
        p_ref = np.exp(refs[0][4])
        for q in (1, 2):
            kl = (p_ref * (refs[0][4] - refs[q][4])).sum(-1)
            np.testing.assert_allclose(per_seq.kl[i][q - 1], kl, rtol=2e-3, atol=2e-5)
        assert per_seq.entropy[i].shape == (3, len(targets))


def test_testbed_corpus_layout(tiny_reasoner_dir, tiny_reasoner_spec):
    tok = load_tokenizer(tiny_reasoner_dir)
    corpus = build_testbed_corpus(tiny_reasoner_dir, tok, EOS_ID, 4, 2, seed=9)
    problems = eval_problems(9, 4, tiny_reasoner_spec)
    for seq, first, p in zip(corpus.sequences, corpus.first, problems):
        assert tok.decode(seq[:first].tolist()) == p.question and seq[0] == BOS_ID
        assert tok.decode(seq[first:-1].tolist()) == p.solution and seq[-1] == EOS_ID
    assert corpus.calibration.shape == (2, 512)
    calibration_text = "".join(tok.decode(row.tolist()) for row in corpus.calibration)
    assert calibration_text.count("Q: ") > 10  # training-stream problems ...
    assert not any(p.question in calibration_text for p in problems)  # ... none of them held out


def test_text_windows(tiny_reasoner_dir):
    tok = load_tokenizer(tiny_reasoner_dir)
    windows = text_windows(tok, BOS_ID, 3, 20, "evaluation")
    assert windows.shape == (3, 20) and windows.dtype == np.int32
    assert (windows[:, 0] == BOS_ID).all() and not (windows[:, 1:] == BOS_ID).any()  # one <bos> per window
    from jaxlp.data import offline_text

    text = offline_text()
    evaluation = text[len(text) // 2:]
    assert evaluation.startswith(tok.decode(np.concatenate([w[1:] for w in windows]).tolist()))  # consecutive
    calibration = text_windows(tok, None, 2, 20, "calibration")
    assert calibration.shape == (2, 20)  # no <bos> added (only the tokenizer's own, at the start of the text)
    assert text[: len(text) // 2].startswith(tok.decode(calibration.reshape(-1).tolist()))


def test_end_to_end_testbed(tiny_reasoner_dir, tiny_reasoner_spec, tmp_path):
    out = tmp_path / "tb"
    command = f"python scripts/entropy_analysis.py --model {tiny_reasoner_dir} --kind testbed"
    returned = run_entropy_analysis(str(tiny_reasoner_dir), "testbed", out, problems=6, calibration_rows=2, batch_size=4,
                                    seed=3, command=command)
    report = json.loads(Path(f"{out}.json").read_text())
    assert returned == report
    problems = eval_problems(3, 6, tiny_reasoner_spec)
    assert report["tokens"] == sum(len(p.solution) + 1 for p in problems)  # solution characters and <eos>
    by_class = report["by_class"]
    assert sum(r["count"] for r in by_class.values()) == report["tokens"]
    assert by_class["digit"]["count"] == sum(c.isdigit() for p in problems for c in p.solution)
    assert by_class["boundary"]["count"] == sum(p.solution.count("\n") + 1 for p in problems)
    assert report["steps"]["count"] == sum(p.num_steps + 1 for p in problems)
    shift = report["shift_by_bin"]
    assert len(shift["labels"]) == len(shift["edges"]) + 1
    for split in ("confident", "uncertain"):
        assert len(shift["w4a4-nvfp4"][split]["count"]) == len(shift["labels"])
    counts = np.array(shift["w4a4-nvfp4"]["confident"]["count"]) + np.array(shift["w4a4-nvfp4"]["uncertain"]["count"])
    assert counts.tolist() == shift["w4a4-nvfp4"]["all"]["count"] and counts.sum() == report["tokens"]
    o = report["overall"]
    assert o["w4a4-nvfp4"]["mean_kl"] > 0 and 0 <= o["w4a4-nvfp4"]["flip_rate"] <= 1
    md = Path(f"{out}.md").read_text()
    assert f"Command: `{command}`" in md and "| digit |" in md
    assert Path(f"{out}.png").stat().st_size > 10_000


def test_end_to_end_text(tiny_reasoner_dir, tmp_path):
    out = tmp_path / "text.v1"  # a dot in the prefix is kept
    run_entropy_analysis(tiny_reasoner_dir, "text", out, sequences=2, seq_len=48, calibration_rows=2, trajectories=1)
    report = json.loads(Path(f"{out}.json").read_text())
    assert report["tokens"] == 2 * 47 and report["sequences"] == 2
    assert set(report["classes"]) == {"number", "operator", "punctuation", "word", "whitespace", "other"}
    assert sum(r["count"] for r in report["by_class"].values()) == 2 * 47
    assert len(report["steps"]["trajectories"]) == 1
    assert Path(f"{out}.md").is_file() and Path(f"{out}.png").is_file()


def test_unknown_kind_is_refused(tiny_reasoner_dir, tmp_path):
    with pytest.raises(ValueError, match="unknown kind 'code'"):
        run_entropy_analysis(tiny_reasoner_dir, "code", tmp_path / "x")
