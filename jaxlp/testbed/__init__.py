"""Reasoning testbed: generated multi-step arithmetic, its checker and tokenizer.

    from jaxlp import testbed
    problems = testbed.eval_problems(seed=0, count=256)
    prompts = [tok.encode(p.question).ids for p in problems]      # tok = testbed.make_tokenizer()
    ok = [testbed.is_correct(text, p) for text, p in zip(outputs, problems)]

See docs/testbed.md for the task design and the trained model (jaxlp/assets/reasoner).
"""

from jaxlp.testbed.checker import StepCheck, check_steps, extract_answer, is_correct
from jaxlp.testbed.problems import (
    EVAL_PERMILLE,
    WIDTH,
    Problem,
    ProblemSpec,
    Step,
    column_arithmetic,
    eval_bucket,
    eval_problems,
    packed_batch,
    reversed_digits,
    sample_problem,
    split_of,
    train_problems,
)
from jaxlp.testbed.tokenizer import (
    BOS_ID,
    EOS_ID,
    NEWLINE_ID,
    PAD_ID,
    UNK_ID,
    VOCAB_SIZE,
    encode_chars,
    make_tokenizer,
)

__all__ = [
    "BOS_ID", "EOS_ID", "EVAL_PERMILLE", "NEWLINE_ID", "PAD_ID", "UNK_ID", "VOCAB_SIZE", "WIDTH",
    "Problem", "ProblemSpec", "Step", "StepCheck", "check_steps", "column_arithmetic", "encode_chars",
    "eval_bucket", "eval_problems", "extract_answer", "is_correct", "packed_batch", "reversed_digits",
    "sample_problem", "split_of", "make_tokenizer", "train_problems",
]
