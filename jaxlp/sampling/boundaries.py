"""Reasoning-step boundary token ids, derived once from a tokenizer's vocabulary.

ReSET starts a new reasoning step after a generated token whose text contains "\\n\\n", or
after two consecutive generated tokens whose text is exactly "\\n". Each id is decoded on
its own with the tokenizer's decoder (``decode([i])``), which turns byte-level BPE symbols
("Ċ" -> "\\n", "ĊĊ" -> "\\n\\n") and SentencePiece byte-fallback tokens ("<0x0A>" -> "\\n",
"▁" -> " ") into text; the tokenizer must therefore carry its decoder (``tokenizer.json``
files do).
"""

from __future__ import annotations

from typing import NamedTuple


class BoundaryIds(NamedTuple):
    double_newline_ids: tuple[int, ...]  # ids whose decoded text contains "\n\n"
    newline_ids: tuple[int, ...]  # ids whose decoded text is exactly "\n"


def _backend(tokenizer):
    """A ``tokenizers.Tokenizer``; a transformers fast tokenizer is unwrapped."""
    backend = getattr(tokenizer, "backend_tokenizer", tokenizer)
    for method in ("decode_batch", "get_vocab"):
        if not callable(getattr(backend, method, None)):
            raise ValueError(
                f"expected a tokenizers.Tokenizer (or a transformers fast tokenizer), got "
                f"{type(tokenizer).__name__} without {method}()"
            )
    return backend


def decoded_vocab(tokenizer) -> dict[int, str]:
    """id -> text of that id decoded alone (special tokens included), for every vocabulary id."""
    backend = _backend(tokenizer)
    ids = sorted(set(backend.get_vocab(with_added_tokens=True).values()))
    texts = backend.decode_batch([[i] for i in ids], skip_special_tokens=False)
    return dict(zip(ids, texts))


def boundary_ids(tokenizer) -> BoundaryIds:
    """The step-boundary id sets of ``tokenizer`` (sorted tuples, as ReSETConfig takes them).

    Raises ValueError when no token decodes to text containing "\\n" (a tokenizer without
    a decoder, or without newlines, cannot delimit steps).
    """
    texts = decoded_vocab(tokenizer)
    if not any("\n" in text for text in texts.values()):
        raise ValueError(
            "no token of this tokenizer decodes to text containing a newline: is its decoder "
            "set (e.g. ByteLevel / ByteFallback)? Step boundaries cannot be derived."
        )
    double = tuple(i for i, text in texts.items() if "\n\n" in text)
    single = tuple(i for i, text in texts.items() if text == "\n")
    return BoundaryIds(double, single)
