"""Multi-step arithmetic problems with digit-level scratchpad solutions, and their splits.

A problem is a start value, a bag of signed terms and an optional final single-digit
multiplier::

    Q: (52817+395-1207+56)*7

Its solution adds the terms one per step, in an order of the solver's choosing (reference
solutions shuffle blocks of ``ProblemSpec.order_window`` consecutive terms), then
multiplies; steps are separated by a blank line and the solution ends in an answer line::

    -1207: 7182500-7021000 c0000000 =0161500
    <blank line>
    +395: 0161500+5930000 c0011000 =5002500
    <blank line>
    +56: 5002500+6500000 c0100000 =1602500
    <blank line>
    *7: 1602500*7000000 c0040130 =7244630
    <blank line>
    Answer: 364427

Step format ``{op}{operand}: {A}{op}{B} c{C} ={R}``: every number is written least
significant digit first and zero-padded to ``WIDTH`` (7) digits, so digit ``i`` of A, B, the
carry row C and the result R sit at fixed distances from each other. ``C[i]`` is the carry
(addition, multiplication: 0..8) or borrow (subtraction) *into* position i (``C[0] = 0``),
so every result digit and every carry is a function of three tokens at fixed offsets:
``R[i] = (A[i] op B[i] + C[i]) mod 10`` (for ``*``: ``(A[i] * B[0] + C[i]) mod 10``) and
``C[i+1]`` from ``A[i], B[i], C[i]``. This follows the reversed-digit and detailed-scratchpad
formats of Lee et al., "Teaching Arithmetic to Small Transformers" (ICLR 2024), with which
10M-parameter models learn multi-digit addition from scratch; zero-padding to a fixed width
(also theirs) makes the offsets constant.

Tokens of two kinds result, as in the ReSET paper's analysis: the first tokens of an
addition step that opens a block choose one of the block's terms (a branching point: about
``ln k`` nats with ``k`` of its terms left, since the reference order is uniform), and the
digits that follow are determined (symbolic tokens). Intermediate values stay in
``[0, 10**6)`` whatever the order (the start is at least the sum of the subtracted terms),
so the product fits WIDTH.

Splits: a problem belongs to the evaluation split iff a hash of its question falls in the
first ``EVAL_PERMILLE`` of 1000 buckets; the training stream drops such problems and the
evaluation set keeps only them, so no evaluation question ever appears in training. The two
splits also draw from disjoint seed streams. Everything is deterministic given the seed.
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Iterator

import numpy as np

WIDTH = 7  # digits of every scratchpad number
MAX_START_DIGITS = 5
MAX_TERM_DIGITS = 5
VALUE_LIMIT = 10**6  # intermediate values of the additive phase stay below this
EVAL_PERMILLE = 50  # share of the question space (per mille) reserved for evaluation
TRAIN_STREAM, EVAL_STREAM = 0, 1  # seed-sequence keys of the two splits
ANSWER_PREFIX = "Answer: "
STEP_SEPARATOR = "\n\n"


def reversed_digits(value: int, width: int = WIDTH) -> str:
    """``value`` (>= 0) least significant digit first, zero-padded to ``width`` digits."""
    if value < 0 or value >= 10**width:
        raise ValueError(f"{value} does not fit {width} unsigned digits")
    return str(value)[::-1].ljust(width, "0")


def _digits(value: int, width: int) -> list[int]:
    return [int(ch) for ch in reversed_digits(value, width)]


def _from_digits(digits: list[int]) -> int:
    return sum(d * 10**i for i, d in enumerate(digits))


def column_arithmetic(a: int, op: str, b: int, width: int = WIDTH) -> tuple[int, tuple[int, ...]]:
    """Schoolbook ``a op b`` digit by digit: ``(result, carries)`` with ``carries[i]`` into digit i.

    ``op``: "+", "-" (needs ``a >= b``) or "*" (``b`` a single digit). Raises ValueError when
    the result does not fit ``width`` digits or is negative.
    """
    if op not in "+-*" or len(op) != 1:
        raise ValueError(f"unknown operation {op!r} (expected '+', '-' or '*')")
    if op == "*" and not 0 <= b <= 9:
        raise ValueError(f"multiplier must be a single digit, got {b}")
    xs, ys = _digits(a, width), _digits(b, width)
    carries, out, carry = [], [], 0
    for i in range(width):
        carries.append(carry)
        if op == "+":
            total = xs[i] + ys[i] + carry
            out.append(total % 10)
            carry = total // 10
        elif op == "-":
            total = xs[i] - ys[i] - carry
            out.append(total % 10)
            carry = 1 if total < 0 else 0
        else:
            total = xs[i] * ys[0] + carry
            out.append(total % 10)
            carry = total // 10
    if carry:
        raise ValueError(f"{a} {op} {b} does not fit {width} digits" if op != "-" else f"{a} - {b} is negative")
    return _from_digits(out), tuple(carries)


@dataclasses.dataclass(frozen=True)
class Step:
    """One solution step: ``before op operand = after`` with its carry row."""

    op: str
    operand: int
    before: int
    after: int
    carries: tuple[int, ...]

    @classmethod
    def compute(cls, before: int, op: str, operand: int) -> "Step":
        after, carries = column_arithmetic(before, op, operand)
        return cls(op, operand, before, after, carries)

    @property
    def text(self) -> str:
        a, b = reversed_digits(self.before), reversed_digits(self.operand)
        c = "".join(map(str, self.carries))
        return f"{self.op}{self.operand}: {a}{self.op}{b} c{c} ={reversed_digits(self.after)}"


@dataclasses.dataclass(frozen=True)
class ProblemSpec:
    """Difficulty knobs: terms per problem (uniform in [min_terms, max_terms]), digits per
    term (uniform in [1, max_digits]), digits of the start value (uniform in [1,
    start_digits]), chance of a final single-digit multiplication. ``order_window``: the
    reference solution adds the terms block by block, in question order, each block of
    ``order_window`` consecutive terms in random order: 1 is strictly left to right (no
    branching tokens), ``>= max_terms`` fully random (the solver must track which of all
    terms are left, the hardest setting at small scale); 2 (default) randomises adjacent
    pairs, so branching steps (ln 2 nats) alternate with determined ones."""

    min_terms: int = 1
    max_terms: int = 8
    max_digits: int = 4
    multiply_prob: float = 0.5
    start_digits: int = MAX_START_DIGITS
    order_window: int = 2

    def __post_init__(self):
        if not 1 <= self.min_terms <= self.max_terms:
            raise ValueError(f"need 1 <= min_terms <= max_terms, got {self.min_terms}, {self.max_terms}")
        if not 1 <= self.max_digits <= MAX_TERM_DIGITS:
            raise ValueError(f"max_digits must be in [1, {MAX_TERM_DIGITS}], got {self.max_digits}")
        if not 1 <= self.start_digits <= MAX_START_DIGITS:
            raise ValueError(f"start_digits must be in [1, {MAX_START_DIGITS}], got {self.start_digits}")
        if self.order_window < 1:
            raise ValueError(f"order_window must be >= 1, got {self.order_window}")
        if not 0.0 <= self.multiply_prob <= 1.0:
            raise ValueError(f"multiply_prob must be in [0, 1], got {self.multiply_prob}")
        if (10**self.start_digits - 1) + self.max_terms * (10**self.max_digits - 1) >= VALUE_LIMIT:
            raise ValueError(
                f"{self.max_terms} terms of {self.max_digits} digits can exceed {VALUE_LIMIT - 1}: "
                "use fewer terms or digits"
            )

    def max_question_chars(self) -> int:
        """Longest question line, newline included."""
        return len("Q: (") + self.start_digits + self.max_terms * (1 + self.max_digits) + len(")*9\n")

    def max_solution_chars(self) -> int:
        """Longest solution text (steps, separators, answer line)."""
        step = 1 + self.max_digits + len(": ") + 4 * WIDTH + len("+ c =")
        mul_step = 1 + 1 + len(": ") + 4 * WIDTH + len("* c =")
        answer = len(ANSWER_PREFIX) + WIDTH
        sep = len(STEP_SEPARATOR)
        return self.max_terms * (step + sep) + mul_step + sep + answer

    def max_tokens(self) -> int:
        """Longest tokenized problem: <bos> question solution <eos> (one token per character)."""
        return 1 + self.max_question_chars() + self.max_solution_chars() + 1


@dataclasses.dataclass(frozen=True)
class Problem:
    """``(start + sum(terms)) * multiplier``; ``order`` is the reference solution's term order."""

    start: int
    terms: tuple[int, ...]  # signed, nonzero
    multiplier: int | None
    order: tuple[int, ...]

    def __post_init__(self):
        if sorted(self.order) != list(range(len(self.terms))):
            raise ValueError(f"order {self.order} is not a permutation of {len(self.terms)} terms")
        if not self.terms or any(t == 0 for t in self.terms):
            raise ValueError("a problem needs at least one term, all nonzero")
        if self.start < 0 or self.start < sum(-t for t in self.terms if t < 0):
            raise ValueError("start must cover the subtracted terms (values never go negative)")
        if self.start + sum(t for t in self.terms if t > 0) >= VALUE_LIMIT:
            raise ValueError(f"values can reach {VALUE_LIMIT} or more")
        if self.multiplier is not None and not 2 <= self.multiplier <= 9:
            raise ValueError(f"multiplier must be in [2, 9], got {self.multiplier}")

    @property
    def sum(self) -> int:
        return self.start + sum(self.terms)

    @property
    def answer(self) -> int:
        return self.sum * (self.multiplier or 1)

    @property
    def num_steps(self) -> int:
        """Reasoning steps before the answer line."""
        return len(self.terms) + (self.multiplier is not None)

    @property
    def question(self) -> str:
        """The prompt text: ``Q: <expression>`` and a newline."""
        expr = f"{self.start}" + "".join(f"{t:+d}" for t in self.terms)
        if self.multiplier is not None:
            expr = f"({expr})*{self.multiplier}"
        return f"Q: {expr}\n"

    def steps(self, order: tuple[int, ...] | None = None) -> list[Step]:
        """The solution's steps, adding terms in ``order`` (default: the reference order)."""
        order = self.order if order is None else order
        value, steps = self.start, []
        for i in order:
            term = self.terms[i]
            steps.append(Step.compute(value, "+" if term > 0 else "-", abs(term)))
            value = steps[-1].after
        if self.multiplier is not None:
            steps.append(Step.compute(value, "*", self.multiplier))
        return steps

    @property
    def solution(self) -> str:
        """Steps separated by blank lines, then ``Answer: <n>`` (no trailing newline)."""
        return STEP_SEPARATOR.join([s.text for s in self.steps()] + [f"{ANSWER_PREFIX}{self.answer}"])

    @property
    def text(self) -> str:
        return self.question + self.solution


def eval_bucket(question: str) -> bool:
    """True iff ``question`` lies in the evaluation part of the question space."""
    digest = hashlib.blake2b(question.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % 1000 < EVAL_PERMILLE


def split_of(problem: Problem) -> str:
    return "eval" if eval_bucket(problem.question) else "train"


def _uniform_digits(rng: np.random.Generator, digits: int) -> int:
    low = 10 ** (digits - 1) if digits > 1 else 1
    return int(rng.integers(low, 10**digits))


def sample_problem(rng: np.random.Generator, spec: ProblemSpec = ProblemSpec()) -> Problem:
    """One problem of ``spec`` from ``rng`` (any split)."""
    k = int(rng.integers(spec.min_terms, spec.max_terms + 1))
    mags = [_uniform_digits(rng, int(d)) for d in rng.integers(1, spec.max_digits + 1, size=k)]
    neg = list(rng.random(k) < 0.5)
    start = _uniform_digits(rng, int(rng.integers(1, spec.start_digits + 1)))
    # Turn subtractions into additions, in random order, until the start covers the rest.
    for i in rng.permutation(k):
        if sum(m for m, n in zip(mags, neg) if n) <= start:
            break
        neg[i] = False
    terms = tuple(-m if n else m for m, n in zip(mags, neg))
    multiplier = int(rng.integers(2, 10)) if rng.random() < spec.multiply_prob else None
    w = spec.order_window
    order = [i + int(j) for i in range(0, k, w) for j in rng.permutation(min(w, k - i))]
    return Problem(start, terms, multiplier, tuple(int(i) for i in order))


def _rng(seed: int, stream: int, index: int = 0) -> np.random.Generator:
    if seed < 0 or index < 0:
        raise ValueError(f"seed and index must be >= 0, got {seed}, {index}")
    return np.random.default_rng(np.random.SeedSequence([seed, stream, index]))


def train_problems(seed: int, spec: ProblemSpec = ProblemSpec(), index: int = 0) -> Iterator[Problem]:
    """Endless training problems of chunk ``index`` of the stream ``seed`` (eval bucket excluded)."""
    rng = _rng(seed, TRAIN_STREAM, index)
    while True:
        p = sample_problem(rng, spec)
        if not eval_bucket(p.question):
            yield p


def eval_problems(seed: int, count: int, spec: ProblemSpec = ProblemSpec()) -> list[Problem]:
    """``count`` distinct held-out problems (eval bucket only, seed stream disjoint from training)."""
    if count < 0:
        raise ValueError(f"count must be >= 0, got {count}")
    rng = _rng(seed, EVAL_STREAM)
    out, seen = [], set()
    draws = 0
    while len(out) < count:
        draws += 1
        if draws > 200 * count + 10_000:
            raise ValueError(
                f"found only {len(out)} distinct held-out problems of {spec} in {draws - 1} draws: "
                f"the question space is too small for {count}"
            )
        p = sample_problem(rng, spec)
        if eval_bucket(p.question) and p.question not in seen:
            seen.add(p.question)
            out.append(p)
    return out


def packed_batch(
    seed: int, index: int, batch_size: int, seq_len: int, spec: ProblemSpec = ProblemSpec()
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Batch ``index`` of the training stream: problems packed back to back into rows.

    Each problem is ``<bos> question solution <eos>``. Returns ``inputs, targets`` int32
    ``[batch_size, seq_len]`` (targets = inputs shifted by one) and ``loss_mask`` float32,
    1 where the target is a solution token or the <eos> (question digits are random, so
    they carry no loss). Rows are filled with whole problems; the last one is cut at the
    row's end. Depends only on (seed, index, shapes, spec).
    """
    from jaxlp.testbed.tokenizer import BOS_ID, EOS_ID, PAD_ID, encode_chars

    if batch_size < 1 or seq_len < 2:
        raise ValueError(f"need batch_size >= 1 and seq_len >= 2, got {batch_size}, {seq_len}")
    if spec.max_tokens() > seq_len + 1:
        raise ValueError(f"seq_len {seq_len} is shorter than the longest problem ({spec.max_tokens()} tokens)")
    problems = train_problems(seed, spec, index)
    row_len = seq_len + 1
    tokens = np.full((batch_size, row_len), PAD_ID, np.int32)
    solution = np.zeros((batch_size, row_len), bool)
    for r in range(batch_size):
        pos = 0
        while pos < row_len:
            p = next(problems)
            q, s = encode_chars(p.question), encode_chars(p.solution)
            seq = np.concatenate([[BOS_ID], q, s, [EOS_ID]]).astype(np.int32)
            is_sol = np.zeros(len(seq), bool)
            is_sol[1 + len(q):] = True
            n = min(len(seq), row_len - pos)
            tokens[r, pos : pos + n] = seq[:n]
            solution[r, pos : pos + n] = is_sol[:n]
            pos += n
    return tokens[:, :-1], tokens[:, 1:], solution[:, 1:].astype(np.float32)
