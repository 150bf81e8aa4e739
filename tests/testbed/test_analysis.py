"""Token classes, step segmentation, step statistics and entropy bins of jaxlp.testbed.analysis."""

import json

import numpy as np
import pytest

from jaxlp.sampling import boundary_ids
from jaxlp.testbed import NEWLINE_ID, ProblemSpec, eval_problems, make_tokenizer
from jaxlp.testbed.analysis import (
    SCHEMES,
    TESTBED_CLASSES,
    TEXT_CLASSES,
    bin_index,
    bin_labels,
    checkpoint_spec,
    class_table,
    classify_token,
    group_summary,
    log_bin_edges,
    step_index,
    step_starts,
    step_statistics,
)

# ---------------------------------------------------------------- token classes


@pytest.mark.parametrize("text, expected", [
    *[(d, "digit") for d in "0123456789"],
    *[(o, "operator") for o in "+-*="],
    ("c", "letter"), ("A", "letter"), ("Q", "letter"), ("r", "letter"),
    ("\n", "boundary"), ("<eos>", "boundary"), ("<pad>", "boundary"),
    (" ", "format"), (":", "format"), ("(", "format"), (")", "format"), ("<", "format"), (">", "format"),
    ("/", "format"), ("~", "format"),
])
def test_testbed_classes(text, expected):
    assert classify_token(text, "testbed") == expected


@pytest.mark.parametrize("text, expected", [
    ("7", "number"), (" 42", "number"), ("3.14", "number"), ("1,000", "number"), ("1.2.3", "other"),
    ("+", "operator"), (" =", "operator"), ("==", "operator"), ("<=", "operator"), ("-", "operator"), ("%", "operator"),
    ("**", "operator"),
    (".", "punctuation"), (",", "punctuation"), (" (", "punctuation"), ("):", "punctuation"), ('"', "punctuation"),
    ("...", "punctuation"), ("_", "punctuation"), ("----------------", "punctuation"), ("===", "punctuation"),
    (" the", "word"), ("Python", "word"), ("über", "word"),
    ("", "whitespace"), (" ", "whitespace"), ("\n", "whitespace"), ("\n\n", "whitespace"), ("\t", "whitespace"),
    ("x2", "other"), ("__init", "other"), ("'s", "other"), ("+=1", "other"), ("a.b", "other"),
])
def test_text_classes(text, expected):
    assert classify_token(text, "text") == expected


def test_classification_errors():
    with pytest.raises(ValueError, match="scheme"):
        classify_token("a", "words")
    with pytest.raises(ValueError, match="str"):
        classify_token(5, "text")
    with pytest.raises(ValueError, match="scheme"):
        class_table({0: "a"}, "nope")


def test_testbed_class_counts_on_problem_text():
    """Character counts of the solution text, computed without the classifier, match its classes."""
    tok = make_tokenizer()
    texts = {i: tok.decode([i], skip_special_tokens=False) for i in range(tok.get_vocab_size())}
    table = class_table(texts, "testbed")
    assert set(table.values()) <= set(range(len(TESTBED_CLASSES)))
    for p in eval_problems(31, 20):
        ids = tok.encode(p.solution).ids[1:]
        counts = np.bincount([table[i] for i in ids], minlength=len(TESTBED_CLASSES))
        s = p.solution
        expect = dict(digit=sum(c.isdigit() for c in s), operator=sum(c in "+-*=" for c in s),
                      letter=sum(c.isalpha() for c in s), boundary=s.count("\n"))
        expect["format"] = len(s) - sum(expect.values())
        assert dict(zip(TESTBED_CLASSES, counts.tolist())) == expect


def test_schemes_are_disjoint_names():
    assert SCHEMES == {"testbed": TESTBED_CLASSES, "text": TEXT_CLASSES}
    assert len(set(TESTBED_CLASSES)) == len(TESTBED_CLASSES) and len(set(TEXT_CLASSES)) == len(TEXT_CLASSES)


# ---------------------------------------------------------------- steps


def _reference_starts(tokens, double, single):
    """ReSET's boundary rule, one position at a time."""
    out = []
    for t in range(len(tokens)):
        two_newlines = t >= 2 and tokens[t - 2] in single and tokens[t - 1] in single
        out.append(t == 0 or tokens[t - 1] in double or two_newlines)
    return np.array(out, bool)


def test_step_starts_by_hand():
    n = 4
    tokens = [10, 11, n, n, 12, 13, n, 14, n, n, n, 15]
    starts = step_starts(tokens, (), (n,))
    assert np.flatnonzero(starts).tolist() == [0, 4, 10, 11]
    assert step_index(starts).tolist() == [0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 2, 3]
    assert np.flatnonzero(step_starts([5, 9, 6, 9], (9,), ())).tolist() == [0, 2]
    assert np.flatnonzero(step_starts([9, 9, 9], (9,), (9,))).tolist() == [0, 1, 2]
    assert step_starts([], (9,), (4,)).shape == (0,)
    assert np.flatnonzero(step_starts([n, n], (), (n,))).tolist() == [0]  # nothing follows the blank line


def test_step_starts_match_reference_on_random_tokens():
    rng = np.random.default_rng(41)
    for _ in range(50):
        tokens = rng.integers(0, 6, size=int(rng.integers(1, 60)))
        double, single = (5,), (3, 4)
        np.testing.assert_array_equal(step_starts(tokens, double, single), _reference_starts(tokens, double, single))


def test_steps_of_testbed_solutions():
    tok = make_tokenizer()
    ids = boundary_ids(tok)
    for p in eval_problems(42, 10):
        sol = np.array(tok.encode(p.solution).ids[1:])
        starts = step_starts(sol, ids.double_newline_ids, ids.newline_ids)
        assert starts.sum() == p.num_steps + 1  # the steps, then the answer line
        heads = [tok.decode(sol[i:i + 1].tolist()) for i in np.flatnonzero(starts)]
        assert all(h in "+-*" for h in heads[:-1]) and heads[-1] == "A"
        assert ids.newline_ids == (NEWLINE_ID,)


def test_step_input_errors():
    with pytest.raises(ValueError, match=r"\[T\]"):
        step_starts(np.zeros((2, 3), int), (), (4,))
    with pytest.raises(ValueError, match="integer"):
        step_starts(np.zeros(3), (), (4,))
    with pytest.raises(ValueError, match="starts\\[0\\]"):
        step_index(np.array([False, True]))
    with pytest.raises(ValueError, match="bool"):
        step_index(np.array([1, 0]))


def _reference_statistics(values, steps):
    k = steps.max() + 1
    mean = np.array([values[steps == i].mean() for i in range(k)])
    length = np.array([(steps == i).sum() for i in range(k)])
    end = np.array([np.flatnonzero(steps == i).max() for i in range(k)])
    running = np.array([values[: e + 1].mean() for e in end])
    return mean, length, running


def test_step_statistics_by_hand():
    st = step_statistics([1.0, 1.0, 3.0, 3.0, 0.5], [0, 0, 1, 1, 2])
    np.testing.assert_allclose(st.mean, [1, 3, 0.5])
    np.testing.assert_array_equal(st.length, [2, 2, 1])
    np.testing.assert_allclose(st.running_mean, [1, 2, 8.5 / 5])
    assert st.uncertain.tolist() == [False, True, False]
    equal = step_statistics([2.0, 2.0, 2.0], [0, 1, 2])  # equal to the running mean: not uncertain (strict)
    assert not equal.uncertain.any()
    empty = step_statistics([], np.zeros(0, int))
    assert empty.mean.shape == (0,) and empty.uncertain.shape == (0,)


def test_step_statistics_match_reference():
    rng = np.random.default_rng(43)
    for _ in range(30):
        n = int(rng.integers(1, 200))
        values = rng.exponential(size=n) * rng.choice([1e-6, 1e-2, 1.0], size=n)
        steps = step_index((rng.random(n) < 0.1) | (np.arange(n) == 0))
        st = step_statistics(values, steps)
        mean, length, running = _reference_statistics(values, steps)
        np.testing.assert_allclose(st.mean, mean, rtol=1e-12)
        np.testing.assert_array_equal(st.length, length)
        np.testing.assert_allclose(st.running_mean, running, rtol=1e-12)
        np.testing.assert_array_equal(st.uncertain, st.mean > st.running_mean)
        assert not st.uncertain[0]  # the first step equals its own running mean


def test_step_statistics_errors():
    with pytest.raises(ValueError, match="shape"):
        step_statistics([1.0, 2.0], [0])
    with pytest.raises(ValueError, match="finite"):
        step_statistics([1.0, np.nan], [0, 0])
    with pytest.raises(ValueError, match="start at 0"):
        step_statistics([1.0, 2.0], [1, 1])
    with pytest.raises(ValueError, match="start at 0"):
        step_statistics([1.0, 2.0, 3.0], [0, 2, 2])
    with pytest.raises(ValueError, match="start at 0"):
        step_statistics([1.0, 2.0, 3.0], [0, 1, 0])


# ---------------------------------------------------------------- bins


def test_log_bin_edges():
    e = log_bin_edges(1e-4, 10.0, 2)
    assert len(e) == 11 and e[0] == 1e-4
    np.testing.assert_allclose(e[-1], 10.0, rtol=1e-12)
    np.testing.assert_allclose(e[1:] / e[:-1], np.sqrt(10.0), rtol=1e-12)
    np.testing.assert_allclose(log_bin_edges(1e-3, 5.0, 1), [1e-3, 1e-2, 1e-1, 1.0, 10.0], rtol=1e-12)
    for bad in (dict(lo=0.0), dict(lo=2.0, hi=1.0), dict(hi=np.inf), dict(per_decade=0), dict(per_decade=1.5)):
        with pytest.raises(ValueError):
            log_bin_edges(**{"lo": 1e-4, "hi": 10.0, "per_decade": 2, **bad})


def test_bin_index_by_hand():
    edges = [1.0, 10.0]
    assert bin_index([0.0, -0.0, 0.5, 1.0, 5.0, 10.0, 100.0, np.inf], edges).tolist() == [0, 0, 0, 1, 1, 2, 2, 2]
    assert bin_labels(edges) == ["<1", "[1,10)", ">=10"]
    assert len(bin_labels(log_bin_edges())) == len(log_bin_edges()) + 1


def test_bin_index_matches_reference():
    rng = np.random.default_rng(44)
    edges = log_bin_edges(1e-6, 10.0, 3)
    values = np.concatenate([10 ** rng.uniform(-8, 2, size=500), edges, [0.0]])
    expect = np.array([sum(v >= e for e in edges) for v in values])
    np.testing.assert_array_equal(bin_index(values, edges), expect)


def test_bin_index_errors():
    with pytest.raises(ValueError, match="NaN"):
        bin_index([1.0, np.nan], [1.0])
    for edges in ([], [2.0, 1.0], [1.0, 1.0], [[1.0]], [1.0, np.inf]):
        with pytest.raises(ValueError, match="edges"):
            bin_index([1.0], edges)


def test_group_summary_matches_reference():
    rng = np.random.default_rng(45)
    values = rng.normal(size=300)
    groups = rng.integers(0, 5, size=300)
    groups[groups == 3] = 4  # group 3 empty
    out = group_summary(values, groups, 6, quantiles=(0.1, 0.5, 0.9))
    assert set(out) == {"count", "mean", "q10", "q50", "q90"}
    for g in range(6):
        v = values[groups == g]
        assert out["count"][g] == len(v)
        if len(v):
            np.testing.assert_allclose(out["mean"][g], v.mean(), rtol=1e-12)
            for q in (0.1, 0.5, 0.9):
                np.testing.assert_allclose(out[f"q{100 * q:g}"][g], np.quantile(v, q), rtol=1e-12)
        else:
            assert np.isnan(out["mean"][g]) and np.isnan(out["q50"][g])


def test_group_summary_errors():
    with pytest.raises(ValueError, match="shape"):
        group_summary([1.0, 2.0], [0], 2)
    with pytest.raises(ValueError, match="groups must lie"):
        group_summary([1.0, 2.0], [0, 2], 2)
    out = group_summary([], np.zeros(0, int), 2)
    assert out["count"].tolist() == [0, 0] and np.isnan(out["mean"]).all()


# ---------------------------------------------------------------- checkpoint spec


def test_checkpoint_spec(tmp_path):
    assert checkpoint_spec(tmp_path) == ProblemSpec()  # no training log: the default spec
    spec = ProblemSpec(min_terms=2, max_terms=3, max_digits=2, multiply_prob=0.25, start_digits=3, order_window=1)
    (tmp_path / "training_log.json").write_text(json.dumps({"steps": 5, "spec": spec.__dict__}))
    assert checkpoint_spec(tmp_path) == spec
    (tmp_path / "training_log.json").write_text(json.dumps({"steps": 5}))
    with pytest.raises(ValueError, match="spec"):
        checkpoint_spec(tmp_path)
