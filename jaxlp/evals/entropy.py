"""Token and step entropies under NVFP4 (the ReSET paper's Figures 2, 3 and 8): PNG, JSON and Markdown.

Teacher-forces reference text through the unquantized model (float32 compute) and its NVFP4
W4A4 and W4A16 versions. At every analysed position t (the model predicting token t from
tokens < t) it records, per model, the raw-logit entropy H_t (float32, full vocabulary: the
quantity ``jaxlp.sampling.token_entropy`` gives and ReSET reads, computed without its
float32 rounding floor, see :func:`distribution`), the argmax, the log-probability of the reference token,
the largest probability, and per quantized model KL(reference || quantized).

- kind ``testbed``: held-out problems of the testbed (``<bos>`` question, reference
  solution, ``<eos>``); analysed positions are the solution tokens and ``<eos>``. W4A4
  activation scales are calibrated on training-stream rows (``packed_batch``). The problem
  spec is read from the checkpoint's ``training_log.json`` (default spec if absent).
- kind ``text``: windows of the offline text's evaluation half (``<bos>`` prepended when
  the model has one); every position after ``<bos>`` is analysed. Calibration: the text's
  calibration half.

Views (one figure with panels; numbers in the JSON):

- Fig. 2: entropy distribution by token class (``jaxlp.testbed.analysis``), reference vs W4A4.
- Fig. 3: reasoning steps by ReSET's rule (a "\\n\\n" token or two "\\n" tokens,
  ``jaxlp.sampling.boundary_ids``); step entropy = mean token entropy of the step; a step is
  uncertain when its entropy exceeds the running mean of token entropies up to its end.
  Trajectories of a few sequences, the distribution of step entropies, and the mean
  entropy of symbolic tokens (digits/numbers, operators) in a step against the step entropy.
  The online sampler's own "uncertain" flag (``reset_temperatures_from_entropies``) is
  compared with the offline label per token.
- Fig. 8: entropy shift dH = H(quantized) - H(reference) per token, by reference-entropy bin
  (log-spaced) and by step type: mean, quantiles, share of tokens whose entropy rises, argmax
  flip rate, KL and the probability mass outside the argmax.

Steps and classes are computed on the reference model's entropies (the same tokens in all
three models, as the text is teacher-forced).

The Markdown and the figure: :mod:`jaxlp.evals.entropy_report`.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tqdm.auto import tqdm

import jaxlp
from jaxlp.data import token_windows
from jaxlp.evals.entropy_report import PLOT_FLOOR, markdown, plot
from jaxlp.models.tokenizer import load_tokenizer
from jaxlp.sampling import ReSETConfig, boundary_ids, reset_temperatures_from_entropies
from jaxlp.testbed import eval_problems, packed_batch
from jaxlp.testbed.analysis import (
    SCHEMES,
    SYMBOLIC_CLASSES,
    bin_index,
    bin_labels,
    checkpoint_spec,
    classify_token,
    group_summary,
    log_bin_edges,
    step_index,
    step_starts,
    step_statistics,
)

QUANTIZED = ("w4a4-nvfp4", "w4a16-nvfp4")
MODELS = ("reference",) + QUANTIZED
SPLITS = ("all", "confident", "uncertain")
QUANTILES = (0.1, 0.25, 0.5, 0.75, 0.9)


class Corpus(NamedTuple):
    """Token sequences to teacher-force, where each one's analysed positions start, and the
    W4A4 calibration rows."""

    sequences: list[np.ndarray]  # int32 token ids, <bos> first
    first: list[int]  # first analysed position of each sequence
    calibration: np.ndarray  # int32 [N, S], other data, for W4A4 activation scales
    description: str


def testbed_corpus(model_dir, tokenizer, eos_id: int, problems: int, calibration_rows: int, seed: int) -> Corpus:
    """``problems`` held-out problems (question, solution, ``<eos>``; solution tokens and ``<eos>``
    analysed) of the checkpoint's spec; calibration: training-stream rows."""
    spec = checkpoint_spec(model_dir)
    chosen = eval_problems(seed, problems, spec)
    sequences, first = [], []
    for p in chosen:
        question = tokenizer.encode(p.question).ids
        ids = tokenizer.encode(p.text).ids + [eos_id]
        if ids[: len(question)] != question:
            raise ValueError("the tokenizer does not split question + solution at the question's end")
        sequences.append(np.asarray(ids, np.int32))
        first.append(len(question))
    seq_len = max(512, spec.max_tokens())
    calibration = packed_batch(seed, 0, calibration_rows, seq_len, spec)[0]
    desc = (f"{problems} held-out testbed problems (eval split, seed {seed}, {spec}); analysed: solution tokens "
            f"and <eos>; W4A4 calibration: {calibration_rows} x {seq_len} training-stream tokens")
    return Corpus(sequences, first, np.asarray(calibration, np.int32), desc)


def text_windows(tokenizer, bos: int | None, count: int, seq_len: int, split: str) -> np.ndarray:
    """``[count, seq_len]`` consecutive windows of the offline text's ``split`` half, each starting
    with ``bos`` when the model has one (the tokenizer's own leading ``<bos>`` is not repeated)."""
    body = seq_len - (bos is not None)
    ids = token_windows(tokenizer, 1, count * body + 1, split=split)[0]
    if bos is not None and ids[0] == bos:
        ids = ids[1:]
    windows = ids[: count * body].reshape(count, body)
    if bos is not None:
        windows = np.concatenate([np.full((count, 1), bos, windows.dtype), windows], axis=1)
    return windows.astype(np.int32)


def text_corpus(tokenizer, bos: int | None, sequences: int, seq_len: int, calibration_rows: int) -> Corpus:
    """``sequences`` windows of the offline text's evaluation half (all positions after the
    first analysed); calibration: windows of its calibration half."""
    windows = text_windows(tokenizer, bos, sequences, seq_len, "evaluation")
    calibration = text_windows(tokenizer, bos, calibration_rows, seq_len, "calibration")
    desc = (f"{sequences} windows of {seq_len} tokens from the offline text's evaluation half"
            f"{' (each starting with <bos>)' if bos is not None else ''}; W4A4 calibration: {calibration_rows} x "
            f"{seq_len} tokens of its calibration half")
    return Corpus(list(windows), [1] * sequences, calibration, desc)


LOGITS_CHUNK_ELEMENTS = 1 << 25  # logits held at once per model: 128 MB of float32


class Distribution(NamedTuple):
    """softmax of one row of raw logits (leading dims ``[...]``, vocabulary last)."""

    logp: jax.Array  # f32 [..., V]: log-probabilities
    p: jax.Array  # f32 [..., V]: probabilities
    entropy: jax.Array  # f32 [...]: -sum p log p, nats
    argmax: jax.Array  # int32 [...]
    max_prob: jax.Array  # f32 [...]


def distribution(logits: jax.Array) -> Distribution:
    """softmax of raw logits in float32, accurate for near-certain rows too.

    A plain float32 log-softmax has an absolute error of order 1e-7 times the largest |logit|
    in every log-probability (``x - logsumexp(x)`` rounds at the scale of the logits, and
    ``log(1 + s)`` rounds ``1 + s``): up to ~1e-5 nats of entropy for logits near 40, as much
    as the whole entropy of a confident token of the testbed reasoner. Here ``z = x - max(x)``
    and ``log1p(s)``, with ``s`` the sum of ``exp(z)`` over all but the (first) argmax, so log p
    of the top token, the entropy and KL values of near-certain rows keep their relative
    precision. The entropy is the quantity ``jaxlp.sampling.token_entropy`` gives (what ReSET
    reads), equal to it up to that rounding.
    """
    x = logits.astype(jnp.float32)
    top = jnp.argmax(x, axis=-1)
    z = x - jnp.max(x, axis=-1, keepdims=True)
    e = jnp.exp(z)
    rest = jnp.sum(jnp.where(jnp.arange(x.shape[-1]) == top[..., None], 0.0, e), axis=-1, keepdims=True)
    logp = z - jnp.log1p(rest)
    p = e / (1.0 + rest)
    entropy = -jnp.sum(jnp.where(p > 0, p * logp, 0.0), axis=-1)
    return Distribution(logp, p, entropy, top.astype(jnp.int32), 1.0 / (1.0 + rest[..., 0]))


@nnx.jit
def position_stats(reference, quantized, ids):
    """Per target position (ids ``[B, S]`` -> arrays ``[M, B, S-1]``, M = 1 + len(quantized)).

    ``entropy``, ``argmax``, ``target_logprob`` (of ids[:, 1:]), ``max_prob`` for every model;
    ``kl`` ``[M-1, B, S-1]``: KL(reference || quantized) in nats. The logits are formed in
    chunks of positions (``lax.map``), so a 262k vocabulary never holds ``[B, S, V]`` at once.
    """
    models = (reference, *quantized)
    b, s = ids.shape
    n = s - 1
    chunk = max(1, min(n, LOGITS_CHUNK_ELEMENTS // (b * reference.config.vocab_size)))
    num_chunks = -(-n // chunk)

    def split(x):  # [B, n, ...] -> [num_chunks, B, chunk, ...]
        x = jnp.pad(x, [(0, 0), (0, num_chunks * chunk - n)] + [(0, 0)] * (x.ndim - 2))
        return jnp.moveaxis(x.reshape(b, num_chunks, chunk, *x.shape[2:]), 1, 0)

    hidden = [split(m.forward(ids)[0][:, :-1]) for m in models]

    def one_chunk(xs):
        hs, targets = xs
        out = {k: [] for k in ("entropy", "argmax", "target_logprob", "max_prob", "kl")}
        ref = None
        for model, h in zip(models, hs):
            d = distribution(model.logits(h))
            out["entropy"].append(d.entropy)
            out["argmax"].append(d.argmax)
            out["target_logprob"].append(jnp.take_along_axis(d.logp, targets[..., None], axis=-1)[..., 0])
            out["max_prob"].append(d.max_prob)
            if ref is None:
                ref = d
            else:
                out["kl"].append(jnp.sum(jnp.where(ref.p > 0, ref.p * (ref.logp - d.logp), 0.0), axis=-1))
        return {k: jnp.stack(v) for k, v in out.items()}

    stats = jax.lax.map(one_chunk, (hidden, split(ids[:, 1:])))  # leaves [num_chunks, M, B, chunk]
    return {k: jnp.moveaxis(v, 0, 2).reshape(v.shape[1], b, num_chunks * chunk)[..., :n] for k, v in stats.items()}


class SequenceStats(NamedTuple):
    """Per sequence, the :func:`position_stats` arrays of its analysed positions: ``[M, n_i]``
    (``kl``: ``[M - 1, n_i]``), M = the reference and the quantized models."""

    entropy: list[np.ndarray]
    argmax: list[np.ndarray]
    target_logprob: list[np.ndarray]
    max_prob: list[np.ndarray]
    kl: list[np.ndarray]


def run_models(reference, quantized, corpus: Corpus, batch_size: int, pad_id: int) -> SequenceStats:
    """The :class:`SequenceStats` of ``corpus`` under the reference and the quantized models."""
    width = max(len(s) for s in corpus.sequences)
    width = -(-width // 32) * 32  # one compiled shape for all batches
    per_seq = {k: [] for k in SequenceStats._fields}
    order = range(0, len(corpus.sequences), batch_size)
    for start in tqdm(order, desc="forward (reference, W4A4, W4A16)", unit="batch"):
        rows = list(range(start, min(start + batch_size, len(corpus.sequences))))
        ids = np.full((batch_size, width), pad_id, np.int32)
        for r, i in enumerate(rows):
            ids[r, : len(corpus.sequences[i])] = corpus.sequences[i]
        for r in range(len(rows), batch_size):  # fill the last batch with a copy of its first row
            ids[r] = ids[0]
        stats = jax.device_get(position_stats(reference, tuple(quantized), jnp.asarray(ids)))
        for r, i in enumerate(rows):
            lo, hi = corpus.first[i] - 1, len(corpus.sequences[i]) - 1  # output j predicts token j + 1
            for k in per_seq:
                per_seq[k].append(np.asarray(stats[k][:, r, lo:hi]))
    return SequenceStats(**per_seq)


def online_uncertain(entropies: list[np.ndarray], tokens: list[np.ndarray], bids) -> list[np.ndarray]:
    """The ReSET sampler's own per-token "uncertain step" flag (independent of tau0 and T_low)."""
    config = ReSETConfig(t_low=0.1, tau0=1.0, double_newline_ids=bids.double_newline_ids,
                         newline_ids=bids.newline_ids)
    length = max(len(e) for e in entropies)
    flags = []
    for h, t in zip(entropies, tokens):
        pad = length - len(h)  # trailing padding cannot change earlier positions: one compiled shape
        stats = reset_temperatures_from_entropies(np.pad(h, (0, pad)), np.pad(t, (0, pad)), config, return_stats=True)
        flags.append(np.asarray(stats.uncertain)[: len(h)])
    return flags


def _pearson(x, y) -> float:
    """Pearson correlation of ``x`` and ``y`` (NaN for fewer than 2 points or a constant)."""
    if len(x) < 2 or np.std(x) == 0 or np.std(y) == 0:
        return float("nan")
    return float(np.corrcoef(x, y)[0, 1])


class TokenArrays(NamedTuple):
    """Per-token arrays the figure needs (all analysed tokens, concatenated)."""

    step_vs_symbolic: np.ndarray  # [steps, 4]: step entropy, mean symbolic / other token entropy, uncertain
    h: np.ndarray  # [M, T]: token entropy per model
    cls: np.ndarray  # [T]: token class index
    bins: np.ndarray  # [T]: reference-entropy bin
    uncertain: np.ndarray  # [T]: the token's step is uncertain


class Analysis(NamedTuple):
    """All numbers of the report (NumPy inside; see :func:`to_json`) and the figure's arrays."""

    report: dict
    raw: TokenArrays


def analyse(corpus: Corpus, per_seq: SequenceStats, tokenizer, scheme: str, edges: np.ndarray, trajectories: int,
            min_token_count: int = 20, tokens_listed: int = 8) -> Analysis:
    """Overall, per-class, per-step and per-entropy-bin statistics of ``per_seq`` (see the module doc)."""
    classes = SCHEMES[scheme]
    symbolic = [classes.index(c) for c in SYMBOLIC_CLASSES[scheme]]
    tokens = [s[f:] for s, f in zip(corpus.sequences, corpus.first)]
    bids = boundary_ids(tokenizer)
    vocab = {}
    for i in sorted({int(t) for seq in tokens for t in seq}):
        vocab[i] = tokenizer.decode([i], skip_special_tokens=False)
    class_of = {i: classes.index(classify_token(t, scheme)) for i, t in vocab.items()}

    step_rows, trajectories_out, symbolic_rows = [], [], []
    token_uncertain, token_step_entropy = [], []
    for n, (seq, h) in enumerate(zip(tokens, per_seq.entropy)):
        steps = step_index(step_starts(seq, bids.double_newline_ids, bids.newline_ids))
        st = step_statistics(h[0], steps)
        sq = step_statistics(h[1], steps)
        token_uncertain.append(st.uncertain[steps])
        token_step_entropy.append(st.mean[steps])
        cls = np.array([class_of[int(t)] for t in seq])
        for k in range(len(st.mean)):
            in_step = steps == k
            sym = in_step & np.isin(cls, symbolic)
            rest = in_step & ~np.isin(cls, symbolic)
            symbolic_rows.append((st.mean[k], h[0][sym].mean() if sym.any() else np.nan,
                                  h[0][rest].mean() if rest.any() else np.nan, st.uncertain[k]))
        step_rows.append((n, st, sq))
    flags = online_uncertain([h[0] for h in per_seq.entropy], tokens, bids)

    flat = {k: np.concatenate(v, axis=1) for k, v in per_seq._asdict().items()}
    target = np.concatenate(tokens)
    cls = np.array([class_of[int(t)] for t in target])
    uncertain = np.concatenate(token_uncertain)
    online = np.concatenate(flags)
    h_ref = flat["entropy"][0]
    bins = bin_index(h_ref, edges)
    nbins = len(edges) + 1

    overall = {}
    for m, name in enumerate(MODELS):
        h = flat["entropy"][m]
        row = dict(mean_entropy=h.mean(), median_entropy=np.median(h), tau0_80th_percentile=np.percentile(h, 80),
                   nll=-flat["target_logprob"][m].mean(), token_accuracy=(flat["argmax"][m] == target).mean(),
                   tail_mass=(1 - flat["max_prob"][m]).mean())
        if m:
            row.update(mean_shift=(h - h_ref).mean(), flip_rate=(flat["argmax"][m] != flat["argmax"][0]).mean(),
                       mean_kl=flat["kl"][m - 1].mean(), share_entropy_up=(h > h_ref).mean())
        overall[name] = row

    by_class = {}
    for c, name in enumerate(classes):
        mask = cls == c
        if not mask.any():
            by_class[name] = dict(count=0)
            continue
        row = dict(count=int(mask.sum()), share=mask.mean())
        for m, model in enumerate(MODELS):
            h = flat["entropy"][m][mask]
            row[model] = dict(mean_entropy=h.mean(), q10=np.quantile(h, 0.1), median=np.median(h),
                              q90=np.quantile(h, 0.9), token_accuracy=(flat["argmax"][m][mask] == target[mask]).mean())
            if m:
                row[model].update(mean_shift=(h - h_ref[mask]).mean(),
                                  flip_rate=(flat["argmax"][m][mask] != flat["argmax"][0][mask]).mean(),
                                  mean_kl=flat["kl"][m - 1][mask].mean())
        row["uncertain_step_share"] = uncertain[mask].mean()
        by_class[name] = row

    shift = {"edges": edges, "labels": bin_labels(edges)}
    for m, model in enumerate(MODELS[1:], start=1):
        dh = flat["entropy"][m] - h_ref
        flip = (flat["argmax"][m] != flat["argmax"][0]).astype(np.float64)
        shift[model] = {}
        for split in SPLITS:
            mask = np.ones_like(uncertain) if split == "all" else (uncertain == (split == "uncertain"))
            b = bins[mask]
            row = group_summary(dh[mask], b, nbins, QUANTILES)
            row["share_entropy_up"] = group_summary((dh[mask] > 0).astype(float), b, nbins, ())["mean"]
            row["flip_rate"] = group_summary(flip[mask], b, nbins, ())["mean"]
            row["mean_kl"] = group_summary(flat["kl"][m - 1][mask], b, nbins, ())["mean"]
            row["tail_mass_reference"] = group_summary(1 - flat["max_prob"][0][mask], b, nbins, ())["mean"]
            row["tail_mass_quantized"] = group_summary(1 - flat["max_prob"][m][mask], b, nbins, ())["mean"]
            shift[model][split] = row

    # Fig. 2(a-b) / Fig. 8 (right): the frequent tokens of lowest and highest mean entropy.
    ids, inverse = np.unique(target, return_inverse=True)
    dh4 = flat["entropy"][1] - h_ref
    ref_mean = group_summary(h_ref, inverse, len(ids), ())
    q_mean = group_summary(flat["entropy"][1], inverse, len(ids), ())["mean"]
    up = group_summary((dh4 > 0).astype(float), inverse, len(ids), ())["mean"]
    down = group_summary((dh4 < 0).astype(float), inverse, len(ids), ())["mean"]
    frequent = np.flatnonzero(ref_mean["count"] >= min_token_count)
    frequent = frequent[np.argsort(ref_mean["mean"][frequent], kind="stable")]
    lowest = list(frequent[:tokens_listed])
    picked = lowest + [i for i in frequent[::-1][:tokens_listed] if i not in lowest]
    frequent_tokens = [dict(text=vocab[int(ids[i])], token_id=int(ids[i]), token_class=classes[class_of[int(ids[i])]],
                            count=ref_mean["count"][i], mean_entropy_reference=ref_mean["mean"][i],
                            mean_entropy_w4a4=q_mean[i], mean_shift_w4a4=q_mean[i] - ref_mean["mean"][i],
                            share_entropy_up_w4a4=up[i], share_entropy_down_w4a4=down[i]) for i in picked]

    all_steps = np.concatenate([st.mean for _, st, _ in step_rows])
    all_unc = np.concatenate([st.uncertain for _, st, _ in step_rows])
    all_len = np.concatenate([st.length for _, st, _ in step_rows])
    sym = np.array(symbolic_rows, dtype=np.float64)
    has_sym = np.isfinite(sym[:, 1])
    step_edges = log_bin_edges(edges[0], edges[-1], 4)
    hist = [np.bincount(bin_index(all_steps[all_unc == u], step_edges), minlength=len(step_edges) + 1)
            for u in (False, True)]
    longest = sorted(step_rows, key=lambda r: (-len(r[1].mean), r[0]))[:trajectories]
    for n, st, sq in sorted(longest, key=lambda r: r[0]):
        trajectories_out.append(dict(sequence=n, step_entropy=st.mean, step_entropy_w4a4=sq.mean,
                                     running_mean=st.running_mean, uncertain=st.uncertain, length=st.length,
                                     text=tokenizer.decode(tokens[n].tolist())[:160]))
    steps = dict(
        count=len(all_steps), mean_length=all_len.mean(), uncertain_share=all_unc.mean(),
        uncertain_token_share=uncertain.mean(), mean_step_entropy=all_steps.mean(),
        mean_step_entropy_confident=all_steps[~all_unc].mean() if (~all_unc).any() else np.nan,
        mean_step_entropy_uncertain=all_steps[all_unc].mean() if all_unc.any() else np.nan,
        online_flag_agreement=(online == uncertain).mean(), online_uncertain_token_share=online.mean(),
        symbolic_entropy_confident=np.nanmean(sym[has_sym & (sym[:, 3] == 0), 1]) if (has_sym & (sym[:, 3] == 0)).any()
        else np.nan,
        symbolic_entropy_uncertain=np.nanmean(sym[has_sym & (sym[:, 3] == 1), 1]) if (has_sym & (sym[:, 3] == 1)).any()
        else np.nan,
        symbolic_vs_step_pearson=_pearson(sym[has_sym, 0], sym[has_sym, 1]),
        symbolic_vs_step_pearson_log=_pearson(np.log10(np.maximum(sym[has_sym, 0], PLOT_FLOOR)),
                                              np.log10(np.maximum(sym[has_sym, 1], PLOT_FLOOR))),
        step_hist_edges=step_edges, step_hist_confident=hist[0], step_hist_uncertain=hist[1],
        trajectories=trajectories_out,
    )
    raw = TokenArrays(step_vs_symbolic=sym, h=flat["entropy"], cls=cls, bins=bins, uncertain=uncertain)
    return Analysis(dict(classes=list(classes), symbolic_classes=list(SYMBOLIC_CLASSES[scheme]),
                         tokens=int(len(target)), sequences=len(tokens), overall=overall, by_class=by_class,
                         frequent_tokens=frequent_tokens, steps=steps, shift_by_bin=shift), raw)


def to_json(x):
    """NumPy -> JSON-ready Python (NaN/inf -> None, floats to 6 significant digits)."""
    if isinstance(x, dict):
        return {str(k): to_json(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [to_json(v) for v in x]
    if isinstance(x, np.ndarray):
        return to_json(x.tolist())
    if isinstance(x, (bool, np.bool_)):
        return bool(x)
    if isinstance(x, (int, np.integer)):
        return int(x)
    if isinstance(x, (float, np.floating)):
        return float(f"{float(x):.6g}") if np.isfinite(x) else None
    return x



def checkpoint_info(model_dir, max_hash_bytes: int = 200 << 20) -> dict:
    """What identifies the checkpoint: sha256 of its safetensors (if small), its training-log summary."""
    path = Path(model_dir)
    files = sorted(path.glob("*.safetensors"))
    info = dict(weight_bytes=sum(f.stat().st_size for f in files))
    if files and info["weight_bytes"] <= max_hash_bytes:
        digest = hashlib.sha256()
        for f in files:
            digest.update(f.read_bytes())
        info["weights_sha256"] = digest.hexdigest()[:16]
    log = path / "training_log.json"
    if log.is_file():
        data = json.loads(log.read_text())
        info["training_steps"] = data.get("steps")
        greedy = (data.get("final") or {}).get("greedy") or {}
        info["held_out_greedy_accuracy"] = greedy.get("accuracy")
    return info




def run_entropy_analysis(model_dir: str | Path, kind: str, out: str | Path, *, problems: int = 128,
                         sequences: int = 16, seq_len: int = 512, calibration_rows: int = 8,
                         batch_size: int | None = None, seed: int = 0, dtype: str = "float32",
                         min_token_count: int = 20, min_bin_count: int = 10, bin_lo: float = 1e-6,
                         bin_hi: float = 10.0, bins_per_decade: int = 2, trajectories: int = 3,
                         command: str = "jaxlp.evals.run_entropy_analysis") -> dict:
    """Analyse the checkpoint at ``model_dir`` against its NVFP4 W4A4 and W4A16 versions; write
    OUT.json (the report), OUT.md and OUT.png; return the report as written to the JSON.

    ``kind``: ``testbed`` (``problems`` held-out problems) or ``text`` (``sequences`` windows of
    ``seq_len`` tokens); ``batch_size``: sequences per forward (default 16 testbed, 1 text).
    """
    if kind not in ("testbed", "text"):
        raise ValueError(f"unknown kind {kind!r}; choose testbed or text")
    start = time.perf_counter()
    tokenizer = load_tokenizer(model_dir)
    model = jaxlp.from_pretrained(model_dir, dtype=jnp.dtype(dtype))
    config = model.config
    pad_id = config.pad_token_id if config.pad_token_id is not None else 0
    if kind == "testbed":
        if not config.eos_token_ids:
            raise ValueError("the testbed kind needs a model with an EOS token id")
        corpus = testbed_corpus(model_dir, tokenizer, config.eos_token_ids[0], problems, calibration_rows, seed)
    else:
        corpus = text_corpus(tokenizer, config.bos_token_id, sequences, seq_len, calibration_rows)
    edges = log_bin_edges(bin_lo, bin_hi, bins_per_decade)
    quantized = [jaxlp.quantization.quantize_model(model, "w4a4-nvfp4", calibration=corpus.calibration),
                 jaxlp.quantization.quantize_model(model, "w4a16-nvfp4")]
    timing = dict(load_and_quantize=time.perf_counter() - start)
    batch = batch_size or (16 if kind == "testbed" else 1)
    per_seq = run_models(model, quantized, corpus, batch, pad_id)
    timing["forward"] = time.perf_counter() - start - sum(timing.values())
    report, raw = analyse(corpus, per_seq, tokenizer, kind, edges, trajectories, min_token_count)
    timing["analysis"] = time.perf_counter() - start - sum(timing.values())
    name = Path(str(model_dir).rstrip("/")).name
    report["meta"] = dict(model=str(model_dir), kind=kind, corpus=corpus.description, command=command,
                          reference_dtype=dtype, seconds=time.perf_counter() - start, jax=jax.__version__,
                          device=str(jax.devices()[0]), models=list(MODELS), step_rule="ReSET: after a token "
                          "containing '\\n\\n' or after two '\\n' tokens", uncertain_rule="step entropy > running "
                          "mean of token entropies up to the step's end", min_token_count=min_token_count,
                          checkpoint=checkpoint_info(model_dir), timing=timing,
                          load_average_1min=os.getloadavg()[0], cpu_count=os.cpu_count())
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    report = to_json(report)
    Path(f"{out}.json").write_text(json.dumps(report, indent=1))
    title = f"Token and step entropy under NVFP4: {name} ({kind})"
    Path(f"{out}.md").write_text(markdown(report, title, command))
    plot(report, raw, Path(f"{out}.png"), title, min_bin_count)
    return report
