"""Tokenizer of a checkpoint directory (``tokenizer.json``, Hugging Face ``tokenizers``)."""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer

from jaxlp.errors import CheckpointFormatError


def load_tokenizer(path: str | Path) -> Tokenizer:
    """The ``tokenizers.Tokenizer`` saved in a model directory.

    ``encode(text).ids`` applies the tokenizer's post-processor, so models whose tokenizer
    adds a BOS token (Llama, Gemma) get it as in transformers.
    """
    file = Path(path) / "tokenizer.json"
    if not file.is_file():
        raise CheckpointFormatError(f"{path}: no tokenizer.json")
    try:
        return Tokenizer.from_file(str(file))
    except Exception as e:  # the tokenizers library raises a bare Exception on bad JSON
        raise CheckpointFormatError(f"{file}: cannot read tokenizer ({e})") from None
