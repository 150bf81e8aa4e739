"""Testbed tokenizer: round trips, the fast encoder, special tokens, step boundaries, saving."""

import numpy as np
import pytest

from jaxlp.models.tokenizer import load_tokenizer
from jaxlp.sampling import ReSETConfig, boundary_ids
from jaxlp.testbed import ProblemSpec, eval_problems, sample_problem
from jaxlp.testbed.tokenizer import (
    BOS_ID,
    CHARACTERS,
    EOS_ID,
    NEWLINE_ID,
    PAD_ID,
    UNK_ID,
    VOCAB_SIZE,
    encode_chars,
    make_tokenizer,
)


def test_vocabulary():
    tok = make_tokenizer()
    assert VOCAB_SIZE == 100 == tok.get_vocab_size(with_added_tokens=True)
    assert [tok.id_to_token(i) for i in (PAD_ID, BOS_ID, EOS_ID, UNK_ID, NEWLINE_ID)] == [
        "<pad>", "<bos>", "<eos>", "<unk>", "\n"]
    assert set(CHARACTERS) >= set("0123456789+-*(): =cQAnswer\n")


def test_round_trip_on_problem_text():
    tok = make_tokenizer()
    rng = np.random.default_rng(21)
    for _ in range(200):
        text = sample_problem(rng, ProblemSpec()).text
        enc = tok.encode(text)
        assert enc.ids[0] == BOS_ID and len(enc.ids) == len(text) + 1  # one token per character
        assert enc.ids[1:] == encode_chars(text).tolist()
        assert tok.decode(enc.ids) == text
        assert "".join(enc.tokens[1:]) == text


def test_round_trip_on_random_printable_text():
    tok = make_tokenizer()
    rng = np.random.default_rng(22)
    for _ in range(200):
        text = "".join(rng.choice(list(CHARACTERS), size=int(rng.integers(1, 80))))
        assert tok.decode(tok.encode(text).ids) == text
        assert tok.encode(text).ids[1:] == encode_chars(text).tolist()


def test_blank_line_is_two_newline_tokens():
    tok = make_tokenizer()
    p = eval_problems(0, 1)[0]
    ids = tok.encode(p.solution).ids
    text_pairs = ["".join(tok.decode([a]) + tok.decode([b])) for a, b in zip(ids, ids[1:])]
    assert text_pairs.count("\n\n") == p.num_steps  # one blank line before each step after the first, and the answer
    assert tok.encode("a\n\nb").ids == [BOS_ID, tok.token_to_id("a"), NEWLINE_ID, NEWLINE_ID, tok.token_to_id("b")]
    ids = boundary_ids(tok)
    assert ids.newline_ids == (NEWLINE_ID,) and ids.double_newline_ids == ()
    cfg = ReSETConfig.from_tokenizer(tok, t_low=0.3, tau0=0.5)
    assert cfg.newline_ids == (NEWLINE_ID,)


def test_special_tokens_and_unknown_characters():
    tok = make_tokenizer()
    assert tok.decode([BOS_ID, tok.token_to_id("7"), EOS_ID, PAD_ID]) == "7"
    assert tok.decode([BOS_ID, tok.token_to_id("7"), EOS_ID], skip_special_tokens=False) == "<bos>7<eos>"
    assert tok.encode("1<eos>").ids == [BOS_ID, tok.token_to_id("1"), EOS_ID]
    assert tok.encode("é\t").ids == [BOS_ID, UNK_ID, UNK_ID]
    with pytest.raises(ValueError, match="non-ASCII"):
        encode_chars("é")
    with pytest.raises(ValueError, match="not in the testbed vocabulary"):
        encode_chars("a\tb")
    assert encode_chars("").shape == (0,)


def test_saves_and_loads(tmp_path):
    tok = make_tokenizer()
    tok.save(str(tmp_path / "tokenizer.json"))
    loaded = load_tokenizer(tmp_path)
    text = eval_problems(1, 1)[0].text
    assert loaded.encode(text).ids == tok.encode(text).ids
    assert loaded.decode(loaded.encode(text).ids) == text
