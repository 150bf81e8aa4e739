"""Problem generator: arithmetic against Python ints, step format, splits, determinism."""

import re

import numpy as np
import pytest

from jaxlp.testbed import problems as pb
from jaxlp.testbed.problems import Problem, ProblemSpec, Step, column_arithmetic, reversed_digits

STEP_RE = re.compile(r"([+\-*])(\d+): (\d{7})([+\-*])(\d{7}) c(\d{7}) =(\d{7})")


def _unreverse(s: str) -> int:
    return int(s[::-1])


def test_column_arithmetic_matches_python_ints():
    rng = np.random.default_rng(101)
    for _ in range(3000):
        a = int(rng.integers(0, 10**6))
        b = int(rng.integers(0, 10**int(rng.integers(1, 7))))
        r, c = column_arithmetic(a, "+", b)
        assert r == a + b and c[0] == 0 and len(c) == 7
        lo, hi = sorted((a, b))
        r, c = column_arithmetic(hi, "-", lo)
        assert r == hi - lo and c[0] == 0
        d = int(rng.integers(0, 10))
        r, c = column_arithmetic(a, "*", d)
        assert r == a * d
        # Carries: each is what schoolbook arithmetic carries into that digit.
        assert all(c[i] == (a % 10**i) * d // 10**i for i in range(7))


def test_column_arithmetic_edges_and_errors():
    assert column_arithmetic(0, "+", 0) == (0, (0,) * 7)
    assert column_arithmetic(999999, "+", 1) == (1000000, (0, 1, 1, 1, 1, 1, 1))
    assert column_arithmetic(1000000, "-", 1) == (999999, (0, 1, 1, 1, 1, 1, 1))
    assert column_arithmetic(1111111, "*", 9)[0] == 9999999
    with pytest.raises(ValueError, match="negative"):
        column_arithmetic(5, "-", 6)
    with pytest.raises(ValueError, match="does not fit"):
        column_arithmetic(9999999, "+", 1)
    with pytest.raises(ValueError, match="does not fit"):
        column_arithmetic(2000000, "*", 5)
    with pytest.raises(ValueError, match="single digit"):
        column_arithmetic(5, "*", 12)
    with pytest.raises(ValueError, match="unknown operation"):
        column_arithmetic(5, "/", 1)
    with pytest.raises(ValueError, match="does not fit"):
        reversed_digits(10**7)
    with pytest.raises(ValueError, match="does not fit"):
        reversed_digits(-1)
    assert reversed_digits(120) == "0210000"


@pytest.mark.parametrize("spec", [ProblemSpec(), ProblemSpec(1, 2, 2, 0.3, 2), ProblemSpec(9, 9, 5, 1.0, 5)])
def test_generated_problems_are_right(spec):
    rng = np.random.default_rng(202 + spec.max_terms)
    for _ in range(400):
        p = pb.sample_problem(rng, spec)
        assert spec.min_terms <= len(p.terms) <= spec.max_terms
        assert all(1 <= abs(t) < 10**spec.max_digits for t in p.terms)
        assert 1 <= p.start < 10**spec.start_digits
        # Ground truth from Python ints, independently of the digit-wise steps.
        expected = (p.start + sum(p.terms)) * (p.multiplier or 1)
        assert p.answer == expected
        # Parse the text back and recompute every step with Python ints.
        question, solution = p.text.split("\n", 1)
        expr = question.removeprefix("Q: ")
        assert eval(expr) == expected  # noqa: S307 - the expression is ours: digits, + - * ( )
        segments = solution.split("\n\n")
        assert len(segments) == p.num_steps + 1
        assert segments[-1] == f"Answer: {expected}"
        value, used = p.start, []
        for seg in segments[:-1]:
            m = STEP_RE.fullmatch(seg)
            assert m, seg
            op, operand, a, op2, b, c, r = m.groups()
            assert op == op2 and _unreverse(a) == value and _unreverse(b) == int(operand)
            value = {"+": value + int(operand), "-": value - int(operand), "*": value * int(operand)}[op]
            assert 0 <= value < 10**7 and _unreverse(r) == value
            used.append(op + operand)
        terms = sorted(f"{t:+d}" for t in p.terms)
        assert sorted(u for u in used if u[0] != "*") == terms
        if p.multiplier is not None:
            assert used[-1] == f"*{p.multiplier}"
        assert value == expected
        assert len(p.text) + 2 <= spec.max_tokens()


def test_values_never_negative_in_any_order():
    rng = np.random.default_rng(303)
    for _ in range(300):
        p = pb.sample_problem(rng, ProblemSpec(max_terms=6))
        for _ in range(3):
            order = tuple(int(i) for i in rng.permutation(len(p.terms)))
            steps = p.steps(order)  # raises if a value went negative
            assert steps[-1].after == p.answer


def test_step_text_format():
    s = Step.compute(52817, "+", 395)
    assert s.text == "+395: 7182500+5930000 c0111000 =2123500"
    s = Step.compute(53212, "-", 1207)
    assert s.text == "-1207: 2123500-7021000 c0100000 =5002500"
    assert Step.compute(44035, "*", 5).text == "*5: 5304400*5000000 c0210220 =5710220"
    p = Problem(100, (5, -20), 3, (1, 0))
    assert p.question == "Q: (100+5-20)*3\n"
    assert p.solution == (
        "-20: 0010000-0200000 c0010000 =0800000\n\n"
        "+5: 0800000+5000000 c0000000 =5800000\n\n"
        "*3: 5800000*3000000 c0120000 =5520000\n\n"
        "Answer: 255"
    )
    assert Problem(7, (2,), None, (0,)).question == "Q: 7+2\n"


def test_problem_validation():
    with pytest.raises(ValueError, match="permutation"):
        Problem(10, (1, 2), None, (0, 0))
    with pytest.raises(ValueError, match="cover"):
        Problem(10, (-11,), None, (0,))
    with pytest.raises(ValueError, match="nonzero"):
        Problem(10, (0,), None, (0,))
    with pytest.raises(ValueError, match="multiplier"):
        Problem(10, (1,), 1, (0,))
    with pytest.raises(ValueError, match="can reach"):
        Problem(999_999, (1,), None, (0,))
    with pytest.raises(ValueError, match="min_terms"):
        ProblemSpec(min_terms=3, max_terms=2)
    with pytest.raises(ValueError, match="exceed"):
        ProblemSpec(max_terms=10, max_digits=5)
    with pytest.raises(ValueError, match="max_digits"):
        ProblemSpec(max_digits=6)


def test_deterministic_given_seed():
    a = [p.text for p in pb.eval_problems(7, 50)]
    assert a == [p.text for p in pb.eval_problems(7, 50)]
    assert a != [p.text for p in pb.eval_problems(8, 50)]
    it1, it2 = pb.train_problems(7, index=3), pb.train_problems(7, index=3)
    assert [next(it1).text for _ in range(50)] == [next(it2).text for _ in range(50)]
    x = pb.packed_batch(5, 2, 4, 512)
    y = pb.packed_batch(5, 2, 4, 512)
    assert all(np.array_equal(u, v) for u, v in zip(x, y))
    assert not np.array_equal(x[0], pb.packed_batch(5, 3, 4, 512)[0])


@pytest.mark.parametrize("spec", [ProblemSpec(), ProblemSpec(1, 2, 1, 0.5, 2)])
def test_splits_are_disjoint(spec):
    seed = 11
    held_out = pb.eval_problems(seed, 200, spec)
    assert len({p.question for p in held_out}) == 200
    assert all(pb.split_of(p) == "eval" for p in held_out)
    train = set()
    for index in range(3):
        it = pb.train_problems(seed, spec, index)
        for _ in range(4000):
            p = next(it)
            assert pb.split_of(p) == "train"
            train.add(p.question)
    assert not train & {p.question for p in held_out}
    # The bucket really does separate: raw draws fall in both buckets at about the set rate.
    rng = np.random.default_rng(404)
    share = np.mean([pb.eval_bucket(pb.sample_problem(rng, ProblemSpec()).question) for _ in range(4000)])
    assert abs(share - pb.EVAL_PERMILLE / 1000) < 0.015


def test_small_question_spaces():
    # A small space repeats quickly: without the hash bucket, train and eval would share questions.
    spec = ProblemSpec(1, 1, 1, 0.0, 1)
    rng = np.random.default_rng(505)
    raw = [pb.sample_problem(rng, spec).question for _ in range(2000)]
    assert len(set(raw)) < 300
    # Asking for more distinct held-out problems than the space has fails instead of looping.
    with pytest.raises(ValueError, match="too small"):
        pb.eval_problems(0, 100, spec)


def test_packed_batch_layout():
    from jaxlp.testbed.tokenizer import BOS_ID, EOS_ID, make_tokenizer

    tok = make_tokenizer()
    inputs, targets, mask = pb.packed_batch(3, 0, 3, 512)
    assert inputs.shape == targets.shape == mask.shape == (3, 512)
    assert inputs.dtype == targets.dtype == np.int32 and mask.dtype == np.float32
    np.testing.assert_array_equal(inputs[:, 1:], targets[:, :-1])
    it = pb.train_problems(3, ProblemSpec(), 0)
    row = np.concatenate([inputs[0], targets[0, -1:]])
    pos = 0
    while pos < len(row):
        p = next(it)
        want = tok.encode(p.question + p.solution).ids + [EOS_ID]
        got = row[pos : pos + len(want)].tolist()
        assert got == want[: len(got)]
        # Loss on solution tokens and <eos> only (targets are inputs shifted by one).
        n_q = 1 + len(p.question)
        seg = mask[0, pos : pos + len(want) - 1]
        assert seg[: n_q - 1].sum() == 0 and (seg[n_q - 1 :] == 1).all()
        pos += len(want)
    assert row[0] == BOS_ID
    with pytest.raises(ValueError, match="longest problem"):
        pb.packed_batch(0, 0, 2, 100)


@pytest.mark.parametrize("window", [1, 2, 3, 8])
def test_order_window(window):
    rng = np.random.default_rng(606 + window)
    spec = ProblemSpec(min_terms=5, order_window=window)
    seen = set()
    for _ in range(200):
        p = pb.sample_problem(rng, spec)
        k = len(p.terms)
        for start in range(0, k, window):  # each block is a permutation of its own indices
            assert sorted(p.order[start : start + window]) == list(range(start, min(k, start + window)))
        seen.add(p.order[:window])
    # Every order of the first block occurs (window 8 and up to 8 terms: many).
    assert len(seen) == (1 if window == 1 else 2 if window == 2 else 6 if window == 3 else len(seen))
    if window == 8:
        assert len(seen) > 50
    with pytest.raises(ValueError, match="order_window"):
        ProblemSpec(order_window=0)


def test_docstring_example():
    p = Problem(52817, (395, -1207, 56), 7, (1, 0, 2))
    body = pb.__doc__.split("Q: (52817+395-1207+56)*7", 1)[1].split("Step format", 1)[0]
    lines = [ln.strip() for ln in body.splitlines() if ln.strip() and "solution adds" not in ln]
    doc_steps = [ln for ln in lines if ln[0] in "+-*" or ln.startswith("Answer")]
    assert doc_steps == p.solution.replace("\n\n", "\n").split("\n")
