"""Grade generated solutions: final-answer exact match and the first wrong step.

Answer extraction: the last line whose text (leading spaces ignored) starts with
``Answer:``; the rest of that line must be one integer (optional sign, leading zeros
allowed, surrounding spaces allowed), else the answer is missing (None). Lines after it
(trailing garbage) are ignored, as is everything after a literal ``<eos>``. The answer is
correct iff that integer equals the ground truth.
"""

from __future__ import annotations

import dataclasses
import re
from collections import Counter

from jaxlp.testbed.problems import ANSWER_PREFIX, STEP_SEPARATOR, WIDTH, Problem, column_arithmetic, reversed_digits

_ANSWER_LINE = re.compile(r"\s*Answer:(.*)")
_INTEGER = re.compile(r"\s*([+-]?\d+)\s*")
_STEP = re.compile(rf"([+\-*])(\d+): (\d{{{WIDTH}}})([+\-*])(\d{{{WIDTH}}}) c(\d{{{WIDTH}}}) =(\d{{{WIDTH}}})")


def extract_answer(text: str) -> int | None:
    """The integer of the last ``Answer:`` line of ``text``, or None (no such line, or malformed)."""
    text = text.split("<eos>", 1)[0]
    for line in reversed(text.split("\n")):
        m = _ANSWER_LINE.match(line)
        if m:
            number = _INTEGER.fullmatch(m.group(1))
            return int(number.group(1)) if number else None
    return None


def is_correct(text: str, answer: int | Problem) -> bool:
    """Exact match of the extracted answer with ``answer`` (an int or a problem's answer)."""
    truth = answer.answer if isinstance(answer, Problem) else int(answer)
    got = extract_answer(text)
    return got is not None and got == truth


@dataclasses.dataclass(frozen=True)
class StepCheck:
    """Verdict on one generated solution.

    correct: the final answer matches. first_error: index of the first wrong segment (the
    answer line counts as segment ``problem.num_steps``), None when every step and the
    answer are right. kind: what went wrong there -- "format" (not a step line), "term"
    (a term that is not left, or the multiplication before all terms), "copy_a" (A is not
    the running value), "copy_b" (B is not the operand), "carry", "result", "missing_step"
    (the answer line came before all steps), "extra_step", "answer" (the answer line does
    not hold the running value). steps_ok: steps right before the first error.
    """

    correct: bool
    first_error: int | None
    kind: str | None
    steps_ok: int


def check_steps(problem: Problem, text: str) -> StepCheck:
    """Check ``text`` (the generated solution, without the question) step by step."""
    correct = is_correct(text, problem)
    segments = text.split("<eos>", 1)[0].split(STEP_SEPARATOR)
    remaining = Counter(problem.terms)
    value = problem.start
    multiplied = problem.multiplier is None

    def fail(i, kind):
        return StepCheck(correct, i, kind, i)

    for i, seg in enumerate(segments):
        if seg.lstrip().startswith("Answer:"):
            if remaining or not multiplied:
                return fail(i, "missing_step")
            if extract_answer(seg) != value:
                return fail(i, "answer")
            return StepCheck(correct, None, None, i)
        m = _STEP.fullmatch(seg)
        if not m:
            return fail(i, "format")
        op, operand, a, op2, b, c, r = m.groups()
        operand = int(operand)
        if op2 != op:
            return fail(i, "format")
        if op == "*":
            if remaining:
                return fail(i, "term")  # multiplication before every term was added
            if multiplied:
                return fail(i, "extra_step")
            if operand != problem.multiplier:
                return fail(i, "term")
        else:
            term = operand if op == "+" else -operand
            if remaining[term] == 0:
                return fail(i, "term" if remaining or not multiplied else "extra_step")
        if a != reversed_digits(value):
            return fail(i, "copy_a")
        if len(str(operand)) > WIDTH or b != reversed_digits(operand):
            return fail(i, "copy_b")
        try:
            after, carries = column_arithmetic(value, op, operand)
        except ValueError:
            return fail(i, "result")
        if c != "".join(map(str, carries)):
            return fail(i, "carry")
        if r != reversed_digits(after):
            return fail(i, "result")
        if op == "*":
            multiplied = True
        else:
            remaining[term] -= 1
            if remaining[term] == 0:
                del remaining[term]
        value = after
    return fail(len(segments), "answer" if not remaining and multiplied else "missing_step")


__all__ = ["ANSWER_PREFIX", "StepCheck", "check_steps", "extract_answer", "is_correct"]
