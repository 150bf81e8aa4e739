"""Step-boundary id sets from small tokenizers built in the test (byte-level BPE, SentencePiece-style)."""

from __future__ import annotations

import numpy as np
import pytest
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers

from jaxlp.sampling.boundaries import BoundaryIds, boundary_ids, decoded_vocab
from jaxlp.sampling.reset import ReSETConfig, reset_temperatures_from_entropies


def byte_level_bpe(with_decoder=True):
    """GPT-2 / Qwen style: bytes mapped to printable symbols, "Ċ" is the newline byte."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {c: i for i, c in enumerate(alphabet)}
    merges = [("Ċ", "Ċ"), (".", "ĊĊ"), ("ĊĊ", "Ċ"), ("Ġ", "Ċ"), ("č", "Ċ"), ("Ċ", "ĠĊ"),
              ("h", "e"), ("l", "l"), ("he", "ll"), ("hell", "o"), ("Ġ", "w")]
    for a, b in merges:
        vocab[a + b] = len(vocab)
    tok = Tokenizer(models.BPE(vocab, merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    if with_decoder:
        tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<|im_end|>"])
    return tok, vocab


def sentencepiece_style():
    """Llama / Gemma style: "▁" for spaces, byte-fallback tokens "<0x0A>", some literal newline pieces."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    for piece in ["▁", "a", "b", ".", "\n", "▁a", "▁b", "ab", "\n\n", ".\n\n", "▁\n\n", "\n▁\n"]:
        vocab[piece] = len(vocab)
    merges = [("▁", "a"), ("▁", "b"), ("a", "b"), ("\n", "\n"), (".", "\n\n"), ("▁", "\n\n"),
              ("\n", "▁"), ("\n▁", "\n")]
    tok = Tokenizer(models.BPE(vocab, merges[:6], byte_fallback=True, unk_token="<unk>"))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    tok.add_special_tokens(["<s>", "</s>"])
    return tok, vocab


def test_byte_level_bpe():
    tok, vocab = byte_level_bpe()
    ids = boundary_ids(tok)
    assert isinstance(ids, BoundaryIds)
    assert ids.newline_ids == (vocab["Ċ"],)
    # "\n\n", ".\n\n", "\n\n\n" -- not " \n", "\r\n", "\n \n"
    assert ids.double_newline_ids == tuple(sorted([vocab["ĊĊ"], vocab[".ĊĊ"], vocab["ĊĊĊ"]]))
    texts = decoded_vocab(tok)
    assert texts[vocab["ĊĠĊ"]] == "\n \n" and texts[vocab["čĊ"]] == "\r\n"
    assert len(texts) == tok.get_vocab_size(with_added_tokens=True)
    # the encoder really produces these ids for text with blank lines
    enc = tok.encode("hello\n\n\nworld \nhello")
    assert set(enc.ids) & set(ids.double_newline_ids)


def test_sentencepiece_byte_fallback():
    tok, vocab = sentencepiece_style()
    ids = boundary_ids(tok)
    assert ids.newline_ids == tuple(sorted([vocab["<0x0A>"], vocab["\n"]]))
    assert ids.double_newline_ids == tuple(sorted([vocab["\n\n"], vocab[".\n\n"], vocab["▁\n\n"]]))
    assert vocab["\n▁\n"] not in ids.double_newline_ids + ids.newline_ids  # "\n \n"
    assert decoded_vocab(tok)[vocab["<0x0D>"]] == "\r"


def test_transformers_fast_tokenizer_is_unwrapped():
    transformers = pytest.importorskip("transformers")
    tok, _ = byte_level_bpe()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok)
    assert boundary_ids(fast) == boundary_ids(tok)


def test_missing_decoder_or_wrong_object_raises():
    tok, _ = byte_level_bpe(with_decoder=False)
    with pytest.raises(ValueError, match="decoder"):
        boundary_ids(tok)
    with pytest.raises(ValueError, match="tokenizers.Tokenizer"):
        boundary_ids(object())


def test_from_tokenizer_and_preset_drive_boundaries():
    tok, vocab = byte_level_bpe()
    cfg = ReSETConfig.from_tokenizer(tok, 0.1, 0.5, window=1)
    ids = boundary_ids(tok)
    assert (cfg.t_low, cfg.tau0, cfg.t_high, cfg.window) == (0.1, 0.5, 1.0, 1)
    assert (cfg.double_newline_ids, cfg.newline_ids) == ids
    preset = ReSETConfig.from_preset("Qwen/Qwen3-14B", tok)
    assert (preset.t_low, preset.tau0, preset.window, preset.newline_ids) == (0.3, 0.4863, 32, ids.newline_ids)
    # With window 1 the estimate after a boundary is the last entropy; without one it is the
    # step mean: the encoded "\n\n" must start a new step.
    text_ids = tok.encode("hello hello\n\n\nhello hello hello").ids
    k = next(i for i, t in enumerate(text_ids) if t in ids.double_newline_ids) + 1
    assert 3 <= k <= len(text_ids) - 3
    h = np.arange(1, len(text_ids) + 1, dtype=np.float32) ** 2
    stats = reset_temperatures_from_entropies(h, np.asarray(text_ids), cfg, return_stats=True)
    est = np.asarray(stats.step_estimate)
    assert est[k - 1] == pytest.approx(h[: k - 1].mean(), rel=3e-7)  # step so far: everything
    assert est[k] == h[k - 1]  # boundary: empty step, window of 1
    assert est[k + 2] == pytest.approx(h[k : k + 2].mean(), rel=3e-7)  # the new step only


def test_real_gemma3_tokenizer(gemma3_270m_dir):
    """A real SentencePiece vocabulary (262144 ids): "\\n" exists as a piece and as <0x0A>."""
    tok = Tokenizer.from_file(str(gemma3_270m_dir / "tokenizer.json"))
    ids = boundary_ids(tok)
    vocab = tok.get_vocab()
    assert set(ids.newline_ids) == {vocab["\n"], vocab["<0x0A>"]}
    assert vocab["\n\n"] in ids.double_newline_ids and vocab["\n\n\n"] in ids.double_newline_ids
    enc = tok.encode("Step 1: add.\n\nStep 2: multiply\n\n\nDone\n", add_special_tokens=False).ids
    texts = decoded_vocab(tok)
    assert [i for i in enc if i in ids.double_newline_ids] == [vocab["\n\n"], vocab["\n\n\n"]]
    assert all(("\n\n" in texts[i]) == (i in ids.double_newline_ids) for i in enc)
