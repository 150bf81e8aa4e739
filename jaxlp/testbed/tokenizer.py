"""The testbed's character-level tokenizer (a ``tokenizers.Tokenizer``, saved as tokenizer.json).

Vocabulary (100 ids): ``<pad>`` 0, ``<bos>`` 1, ``<eos>`` 2, ``<unk>`` 3, ``"\\n"`` 4, then the
95 printable ASCII characters ``" "`` .. ``"~"`` (ids 5..99). One token per character, so a
blank line between reasoning steps is two consecutive ``"\\n"`` tokens: ReSET's step-boundary
rule "two consecutive tokens that are exactly \\n" fires on it. ``encode(text).ids`` prepends
``<bos>`` (post-processor); ``decode(ids)`` concatenates characters and drops special tokens.
"""

from __future__ import annotations

import numpy as np
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors

SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>", "<unk>")
PAD_ID, BOS_ID, EOS_ID, UNK_ID = range(4)
CHARACTERS = "\n" + "".join(chr(c) for c in range(32, 127))
VOCAB = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + tuple(CHARACTERS))}
VOCAB_SIZE = len(VOCAB)
NEWLINE_ID = VOCAB["\n"]

_LOOKUP = np.full(256, -1, np.int32)
for _ch in CHARACTERS:
    _LOOKUP[ord(_ch)] = VOCAB[_ch]


def make_tokenizer() -> Tokenizer:
    """A fresh instance of the testbed tokenizer."""
    tok = Tokenizer(models.WordLevel(VOCAB, unk_token="<unk>"))
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), "isolated")  # every character
    tok.decoder = decoders.Fuse()
    tok.post_processor = processors.TemplateProcessing(
        single="<bos> $A", pair="<bos> $A $B", special_tokens=[("<bos>", BOS_ID)]
    )
    return tok


def encode_chars(text: str) -> np.ndarray:
    """Token ids ``int32 [len(text)]`` of ``text`` (no <bos>), by table lookup.

    Equal to ``make_tokenizer().encode(text).ids[1:]`` for text made of vocabulary
    characters; raises ValueError on any other character (the fast path used to build
    training batches never emits <unk>).
    """
    try:
        raw = np.frombuffer(text.encode("ascii"), np.uint8)
    except UnicodeEncodeError:
        raise ValueError("text holds a non-ASCII character, outside the testbed vocabulary") from None
    ids = _LOOKUP[raw]
    if (ids < 0).any():
        bad = text[int(np.argmax(ids < 0))]
        raise ValueError(f"character {bad!r} is not in the testbed vocabulary")
    return ids
