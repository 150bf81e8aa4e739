"""Answer extraction on adversarial outputs; per-step checking of corrupted solutions."""

import numpy as np
import pytest

from jaxlp.testbed import Problem, ProblemSpec, check_steps, extract_answer, is_correct, sample_problem


@pytest.mark.parametrize(
    "text, expected",
    [
        ("+1: ...\n\nAnswer: 12345", 12345),
        ("Answer: 12345\n", 12345),
        ("no answer line at all", None),
        ("", None),
        ("Answer:", None),
        ("Answer: ", None),
        ("Answer: 12 34", None),  # two numbers
        ("Answer: 123abc", None),  # garbage on the answer line
        ("Answer: 1e5", None),
        ("Answer: 12.5", None),
        ("Answer: 7\n\nAnswer: 8", 8),  # several answer lines: the last counts
        ("Answer: 7\n\nAnswer: oops", None),  # ... even when it is malformed
        ("Answer: 42\n\nsome trailing garbage\n+3: 1", 42),  # trailing lines ignored
        ("Answer: 42<eos>Answer: 43", 42),  # nothing after a literal <eos> counts
        ("Answer: 0042", 42),  # leading zeros: the same integer
        ("Answer: 000", 0),
        ("Answer: -17", -17),
        ("Answer: +17", 17),
        ("Answer: - 17", None),
        ("  Answer:   99  ", 99),
        ("The Answer: 5", None),  # not at the start of a line
        ("answer: 5", None),  # case matters
        ("x\nAnswer: 5\r", 5),
    ],
)
def test_extract_answer(text, expected):
    assert extract_answer(text) == expected


def test_is_correct():
    p = Problem(100, (5, -20), 3, (1, 0))
    assert p.answer == 255
    assert is_correct(p.solution, p)
    assert is_correct("Answer: 255", 255)
    assert is_correct("Answer: 0255", p)
    assert not is_correct("Answer: 256", p)
    assert not is_correct("Answer: -255", p)
    assert not is_correct("255", p)
    assert is_correct("Answer: -3", -3)


def _corrupt(seg: str, where: str, rng) -> str:
    """Change one digit of a step's field: "a", "b", "c" or "r" (the 7-digit fields in order)."""
    head, rest = seg.split(": ", 1)
    fields = [rest[0:7], rest[8:15], rest[17:24], rest[26:33]]
    k = "abcr".index(where)
    i = int(rng.integers(0, 7))
    digit = str((int(fields[k][i]) + int(rng.integers(1, 10))) % 10)
    fields[k] = fields[k][:i] + digit + fields[k][i + 1 :]
    return f"{head}: {fields[0]}{rest[7]}{fields[1]} c{fields[2]} ={fields[3]}"


def test_reference_solutions_pass_in_any_order():
    rng = np.random.default_rng(11)
    for _ in range(200):
        p = sample_problem(rng, ProblemSpec())
        order = tuple(int(i) for i in rng.permutation(len(p.terms)))
        steps = p.steps(order)
        text = "\n\n".join([s.text for s in steps] + [f"Answer: {p.answer}"])
        assert check_steps(p, text) == check_steps(p, text + "\n\ngarbage")
        r = check_steps(p, text)
        assert r.correct and r.first_error is None and r.kind is None and r.steps_ok == p.num_steps


@pytest.mark.parametrize("where, kind", [("a", "copy_a"), ("b", "copy_b"), ("c", "carry"), ("r", "result")])
def test_first_wrong_step_is_found(where, kind):
    rng = np.random.default_rng(hash(where) % 2**32)
    for _ in range(100):
        p = sample_problem(rng, ProblemSpec(min_terms=2))
        segs = p.solution.split("\n\n")
        bad = int(rng.integers(0, p.num_steps))
        segs[bad] = _corrupt(segs[bad], where, rng)
        r = check_steps(p, "\n\n".join(segs))
        assert r.first_error == bad and r.kind == kind and r.steps_ok == bad
        assert r.correct  # the answer line itself was left alone


def test_structural_errors():
    p = Problem(100, (5, -20), 3, (0, 1))
    s = p.solution.split("\n\n")  # +5, -20, *3, Answer
    join = "\n\n".join
    assert check_steps(p, join([s[0], s[0]] + s[2:])).kind == "term"  # the same term twice
    twice = Problem(100, (5, 5), None, (0, 1))
    t = twice.solution.split("\n\n")
    assert check_steps(twice, join(t)).first_error is None  # a repeated term may be used as often as it occurs
    r = check_steps(p, join([s[0], s[2], s[1], s[3]]))
    assert (r.first_error, r.kind) == (1, "term")  # multiplied before all terms
    assert check_steps(p, join([s[0], s[3]])).kind == "missing_step"
    assert check_steps(p, join(s[:3])).kind == "answer"  # no answer line
    assert check_steps(p, join(s[:3] + ["Answer: 256"])).kind == "answer"
    assert check_steps(p, join(s[:3] + [s[2], s[3]])).kind == "extra_step"
    assert check_steps(p, join(["+7: 0010000+7000000 c0000000 =7010000"] + s[1:])).kind == "term"
    assert check_steps(p, join([s[0].replace(": ", ":")] + s[1:])).kind == "format"
    assert check_steps(p, join([s[0].replace("+", "-", 1)] + s[1:])).kind in ("format", "term")
    assert check_steps(p, "").kind == "format"
    wrong_mult = s[2].replace("*3", "*4", 1)
    assert check_steps(p, join(s[:2] + [wrong_mult, s[3]])).kind == "term"
    no_mult = Problem(100, (5,), None, (0,))
    extra = "*2: 5010000*2000000 c0000000 =0120000"
    assert check_steps(no_mult, join([no_mult.solution.split("\n\n")[0], extra, "Answer: 210"])).kind == "extra_step"
    # A lucky right answer after a wrong step: correct, but the step error is still reported.
    r = check_steps(p, join([_corrupt(s[0], "c", np.random.default_rng(1))] + s[1:]))
    assert r.correct and r.first_error == 0
