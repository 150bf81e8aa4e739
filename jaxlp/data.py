"""Offline text for calibration and evaluation (nothing is downloaded).

CPython ships ``pydoc_data.topics`` (~465k characters of English prose about Python): the
default calibration and evaluation text. Calibration takes the first part, evaluation the
last part, so the two never overlap.
"""

from __future__ import annotations

import numpy as np

from jaxlp.errors import check_int


def offline_text() -> str:
    """English prose that ships with CPython (pydoc's topic help), topics in sorted order."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[k] for k in sorted(topics))


def token_windows(tokenizer, num_sequences: int, seq_len: int, *, split: str = "calibration") -> np.ndarray:
    """``[num_sequences, seq_len]`` token ids cut from the offline text.

    ``split="calibration"`` reads from the start of the text, ``"evaluation"`` from the end.
    """
    if split not in ("calibration", "evaluation"):
        raise ValueError(f"split must be 'calibration' or 'evaluation', got {split!r}")
    check_int("token_windows", "num_sequences", num_sequences, low=1)
    check_int("token_windows", "seq_len", seq_len, low=1)
    text = offline_text()
    half = len(text) // 2
    part = text[:half] if split == "calibration" else text[half:]
    ids = tokenizer.encode(part).ids
    need = num_sequences * seq_len
    if len(ids) < need:
        raise ValueError(f"the offline text has {len(ids)} tokens in its {split} half; {need} were asked for")
    return np.asarray(ids[:need], np.int32).reshape(num_sequences, seq_len)
