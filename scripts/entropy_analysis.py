"""Token and step entropies under NVFP4 (the ReSET paper's Figures 2, 3 and 8): PNG, JSON and Markdown.

Teacher-forces reference text through the unquantized model (float32 compute) and its NVFP4
W4A4 and W4A16 versions. At every analysed position t (the model predicting token t from
tokens < t) it records, per model, the raw-logit entropy H_t (float32, full vocabulary: the
quantity ``jaxlp.sampling.token_entropy`` gives and ReSET reads, computed without its
float32 rounding floor, see :func:`distribution`), the argmax, the log-probability of the reference token,
the largest probability, and per quantized model KL(reference || quantized).

- ``--kind testbed``: held-out problems of the testbed (``<bos>`` question, reference
  solution, ``<eos>``); analysed positions are the solution tokens and ``<eos>``. W4A4
  activation scales are calibrated on training-stream rows (``packed_batch``). The problem
  spec is read from the checkpoint's ``training_log.json`` (default spec if absent).
- ``--kind text``: windows of the offline text's evaluation half (``<bos>`` prepended when
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

    python scripts/entropy_analysis.py --model jaxlp/assets/reasoner --kind testbed --out docs/entropy_testbed
    python scripts/entropy_analysis.py --model ~/.cache/jaxlp/gemma3-270m --kind text --out docs/entropy_gemma3_270m
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
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
PLOT_FLOOR = 1e-7  # entropies are drawn at max(H, PLOT_FLOOR) on log axes


class Corpus(NamedTuple):
    sequences: list[np.ndarray]  # int32 token ids, <bos> first
    first: list[int]  # first analysed position of each sequence
    calibration: np.ndarray  # int32 [N, S], other data, for W4A4 activation scales
    description: str


def testbed_corpus(model_dir, tokenizer, eos_id: int, problems: int, calibration_rows: int, seed: int) -> Corpus:
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


def run_models(reference, quantized, corpus: Corpus, batch_size: int, pad_id: int) -> dict[str, list[np.ndarray]]:
    """Per sequence, the :func:`position_stats` arrays of its analysed positions (``[M, n_i]``)."""
    width = max(len(s) for s in corpus.sequences)
    width = -(-width // 32) * 32  # one compiled shape for all batches
    per_seq = {k: [] for k in ("entropy", "argmax", "target_logprob", "max_prob", "kl")}
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
    return per_seq


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
    if len(x) < 2 or np.std(x) == 0 or np.std(y) == 0:
        return float("nan")
    return float(np.corrcoef(x, y)[0, 1])


def analyse(corpus: Corpus, per_seq, tokenizer, scheme: str, edges: np.ndarray, trajectories: int,
            min_token_count: int = 20, tokens_listed: int = 8):
    """``(report, raw)``: all numbers of the report (NumPy inside; see :func:`to_json`) and the
    per-token arrays the figure needs."""
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
    for n, (seq, h) in enumerate(zip(tokens, per_seq["entropy"])):
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
    flags = online_uncertain([h[0] for h in per_seq["entropy"]], tokens, bids)

    flat = {k: np.concatenate(v, axis=1) for k, v in per_seq.items()}
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
    raw = dict(step_vs_symbolic=sym, h=flat["entropy"], cls=cls, bins=bins, uncertain=uncertain)
    return dict(classes=list(classes), symbolic_classes=list(SYMBOLIC_CLASSES[scheme]), tokens=int(len(target)),
                sequences=len(tokens), overall=overall, by_class=by_class, frequent_tokens=frequent_tokens,
                steps=steps, shift_by_bin=shift), raw


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


def _f(x, fmt=".4g") -> str:
    return "n/a" if x is None or (isinstance(x, float) and not np.isfinite(x)) else format(x, fmt)


def markdown(report: dict, title: str, command: str) -> str:
    meta, o, steps = report["meta"], report["overall"], report["steps"]
    lines = [f"# {title}", "", f"{meta['corpus']}.", "",
             f"{report['tokens']} analysed tokens in {report['sequences']} sequences; reference = the checkpoint in "
             f"{meta['reference_dtype']} compute; W4A4 = `w4a4-nvfp4` (static activation amax), W4A16 = "
             f"`w4a16-nvfp4`. Entropies in nats of the raw logits (full vocabulary). {meta['seconds']:.0f} s on "
             f"{meta['device']} ({meta['cpu_count']} cores, 1-minute load average {meta['load_average_1min']:.1f} at "
             "the end; " + ", ".join(f"{k.replace('_', ' ')} {v:.0f} s" for k, v in meta["timing"].items()) + ").",
             "", f"Command: `{command}`", "",
             "Checkpoint: " + ", ".join(f"{k} {v}" for k, v in meta["checkpoint"].items()) + ".", "", "## Overall", "",
             "| model | mean H | median H | 80th pct H (tau0) | NLL | argmax = reference | mean dH | P(dH > 0) | "
             "argmax flips | KL |", "|---|---|---|---|---|---|---|---|---|---|"]
    for name in MODELS:
        r = o[name]
        lines.append(f"| {name} | {_f(r['mean_entropy'])} | {_f(r['median_entropy'], '.3g')} | "
                     f"{_f(r['tau0_80th_percentile'])} | {_f(r['nll'])} | {_f(r['token_accuracy'])} | "
                     f"{_f(r.get('mean_shift'), '+.3g')} | {_f(r.get('share_entropy_up'), '.3f')} | "
                     f"{_f(r.get('flip_rate'))} | {_f(r.get('mean_kl'))} |")
    lines += ["", "## Fig. 2 view: entropy by token class", "",
              "| class | tokens | share | mean H ref | mean H W4A4 | median H ref | median H W4A4 | dH W4A4 | "
              "flips W4A4 | KL W4A4 | dH W4A16 | KL W4A16 | in uncertain steps |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, r in report["by_class"].items():
        if not r["count"]:
            continue
        ref, q4, q16 = r["reference"], r["w4a4-nvfp4"], r["w4a16-nvfp4"]
        lines.append(f"| {name} | {r['count']} | {_f(r['share'], '.3f')} | {_f(ref['mean_entropy'])} | "
                     f"{_f(q4['mean_entropy'])} | {_f(ref['median'], '.3g')} | {_f(q4['median'], '.3g')} | "
                     f"{_f(q4['mean_shift'], '+.3g')} | {_f(q4['flip_rate'])} | {_f(q4['mean_kl'])} | "
                     f"{_f(q16['mean_shift'], '+.3g')} | {_f(q16['mean_kl'])} | "
                     f"{_f(r['uncertain_step_share'], '.3f')} |")
    lines += ["", f"Frequent tokens (>= {meta['min_token_count']} occurrences): those of lowest mean reference "
              "entropy (ascending), then those of highest (descending) (Fig. 2a-b; Fig. 8 right: how often W4A4 "
              "raises or lowers their entropy):", "",
              "| token | class | count | mean H ref | mean H W4A4 | mean dH | P(dH > 0) | P(dH < 0) |",
              "|---|---|---|---|---|---|---|---|"]
    for t in report["frequent_tokens"]:
        lines.append(f"| {_cell(t['text'])} | {t['token_class']} | {t['count']} | "
                     f"{_f(t['mean_entropy_reference'], '.3g')} | {_f(t['mean_entropy_w4a4'], '.3g')} | "
                     f"{_f(t['mean_shift_w4a4'], '+.3g')} | "
                     f"{_f(t['share_entropy_up_w4a4'], '.3f')} | {_f(t['share_entropy_down_w4a4'], '.3f')} |")
    sym = ", ".join(report["symbolic_classes"])
    lines += ["", "## Fig. 3 view: reasoning steps", "",
              f"- {steps['count']} steps, {_f(steps['mean_length'], '.1f')} tokens on average; "
              f"{_f(steps['uncertain_share'], '.3f')} of the steps ({_f(steps['uncertain_token_share'], '.3f')} of "
              "the tokens) are uncertain (step entropy > running mean).",
              f"- Mean step entropy: confident {_f(steps['mean_step_entropy_confident'])}, uncertain "
              f"{_f(steps['mean_step_entropy_uncertain'])} nats.",
              f"- Symbolic tokens ({sym}): mean entropy {_f(steps['symbolic_entropy_confident'])} in confident steps, "
              f"{_f(steps['symbolic_entropy_uncertain'])} in uncertain steps; Pearson r(step entropy, mean symbolic "
              f"entropy of the step) = {_f(steps['symbolic_vs_step_pearson'], '.3f')} "
              f"(log-log {_f(steps['symbolic_vs_step_pearson_log'], '.3f')}).",
              f"- The online sampler's flag (ReSET's causal step estimate vs running mean) agrees with the offline "
              f"label on {_f(steps['online_flag_agreement'], '.3f')} of the tokens (online uncertain share "
              f"{_f(steps['online_uncertain_token_share'], '.3f')}).", "",
              "## Fig. 8 view: entropy shift dH = H(W4A4) - H(ref) by reference-entropy bin", "",
              "| H ref bin | tokens conf. | tokens unc. | mean dH conf. | mean dH unc. | median dH | P(dH > 0) | "
              "flips | KL | 1-pmax ref | 1-pmax W4A4 | mean dH W4A16 | KL W4A16 |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    s = report["shift_by_bin"]
    q4, q16 = s["w4a4-nvfp4"], s["w4a16-nvfp4"]
    for b, label in enumerate(s["labels"]):
        a = q4["all"]
        if not a["count"][b]:
            continue
        lines.append(f"| {label} | {q4['confident']['count'][b]} | {q4['uncertain']['count'][b]} | "
                     f"{_f(q4['confident']['mean'][b], '+.3g')} | {_f(q4['uncertain']['mean'][b], '+.3g')} | "
                     f"{_f(a['q50'][b], '+.3g')} | {_f(a['share_entropy_up'][b], '.3f')} | {_f(a['flip_rate'][b])} | "
                     f"{_f(a['mean_kl'][b], '.3g')} | {_f(a['tail_mass_reference'][b], '.3g')} | "
                     f"{_f(a['tail_mass_quantized'][b], '.3g')} | {_f(q16['all']['mean'][b], '+.3g')} | "
                     f"{_f(q16['all']['mean_kl'][b], '.3g')} |")
    lines += ["", "Figure: the .png of the same name. All numbers (quantiles, per-split bins, step trajectories): "
              "the .json.", ""]
    return "\n".join(lines)


def _cell(text: str) -> str:
    """A token's text for a Markdown table cell: its repr, with | escaped."""
    return repr(text).replace("|", "\\|")


def checkpoint_info(model_dir, max_hash_bytes: int = 200 << 20) -> dict:
    """What identifies the checkpoint: sha256 of its safetensors (if small), its training-log summary."""
    import hashlib

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


def _bin_centers(edges: np.ndarray) -> np.ndarray:
    ratio = edges[1] / edges[0] if len(edges) > 1 else 10.0
    mids = np.sqrt(edges[:-1] * edges[1:])
    return np.concatenate([[edges[0] / np.sqrt(ratio)], mids, [edges[-1] * np.sqrt(ratio)]])


def plot(report: dict, raw: dict, path: Path, title: str, min_count: int = 10) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    classes = report["classes"]
    present = [c for c in range(len(classes)) if (raw["cls"] == c).any()]
    h = np.maximum(raw["h"], PLOT_FLOOR)
    fig, ax = plt.subplots(2, 4, figsize=(22, 9.5))
    ax = ax.ravel()

    # (a) Fig. 2: entropy by class, reference vs W4A4.
    data, pos, colors = [], [], []
    for j, c in enumerate(present):
        for k, (m, col) in enumerate(((0, "tab:blue"), (1, "tab:red"))):
            data.append(h[m][raw["cls"] == c])
            pos.append(3 * j + k)
            colors.append(col)
    bp = ax[0].boxplot(data, positions=pos, widths=0.8, whis=(5, 95), showfliers=False, showmeans=True,
                       patch_artist=True, meanprops=dict(marker="o", markersize=3, markerfacecolor="k"))
    for patch, col in zip(bp["boxes"], colors):
        patch.set_facecolor(col)
        patch.set_alpha(0.45)
    ax[0].set_xticks([3 * j + 0.5 for j in range(len(present))],
                     [f"{classes[c]}\n({(raw['cls'] == c).sum()})" for c in present], fontsize=8)
    ax[0].set(yscale="log", ylabel="token entropy (nats)",
              title="(a) Fig. 2: entropy by token class\nblue: reference, red: W4A4 "
                    "(box 25-75%, whiskers 5-95%, o mean)")

    # (b) CDF of entropy, symbolic vs other tokens.
    sym = np.isin(raw["cls"], [classes.index(c) for c in report["symbolic_classes"]])
    for mask, label in ((sym, "symbolic (" + "/".join(report["symbolic_classes"]) + ")"), (~sym, "other tokens")):
        if not mask.any():
            continue
        for m, ls in ((0, "-"), (1, "--")):
            x = np.sort(h[m][mask])
            ax[1].plot(x, np.arange(1, len(x) + 1) / len(x), ls=ls, color="tab:green" if mask is sym else "tab:purple",
                       label=f"{label}, {'reference' if m == 0 else 'W4A4'}")
    ax[1].set(xscale="log", xlabel="token entropy (nats)", ylabel="fraction of tokens <= H",
              title="(b) entropy CDF: symbolic vs other tokens")
    ax[1].legend(fontsize=7)

    # (c) Fig. 3(a): step-entropy trajectories.
    steps = report["steps"]
    for j, t in enumerate(steps["trajectories"]):
        y = np.maximum(np.asarray(t["step_entropy"], float), PLOT_FLOOR)
        x = np.arange(len(y))
        unc = np.asarray(t["uncertain"], bool)
        line = ax[2].plot(x, y, lw=0.9, label=f"seq {t['sequence']}")[0]
        ax[2].plot(x, np.maximum(t["running_mean"], PLOT_FLOOR), ls=":", lw=0.8, color=line.get_color())
        ax[2].scatter(x[unc], y[unc], marker="^", s=28, color=line.get_color(), edgecolor="k", zorder=3)
        ax[2].scatter(x[~unc], y[~unc], marker="o", s=10, color=line.get_color(), zorder=3)
    ax[2].set(yscale="log", xlabel="reasoning step", ylabel="step entropy (mean token H)",
              title="(c) Fig. 3a: step entropy per step\n^ uncertain (> running mean, dotted), o confident")
    ax[2].legend(fontsize=7)

    # (d) distribution of step entropies.
    e = np.asarray(steps["step_hist_edges"], float)
    centers = _bin_centers(e)
    widths = np.diff(np.concatenate([[e[0] / (e[1] / e[0])], e, [e[-1] * e[1] / e[0]]]))
    ax[3].bar(centers, steps["step_hist_confident"], width=widths * 0.9, color="tab:blue", alpha=0.6,
              label="confident steps")
    ax[3].bar(centers, steps["step_hist_uncertain"], width=widths * 0.9, bottom=steps["step_hist_confident"],
              color="tab:orange", alpha=0.7, label="uncertain steps")
    total = np.asarray(steps["step_hist_confident"]) + np.asarray(steps["step_hist_uncertain"])
    nonzero = centers[total > 0]
    if len(nonzero):
        ax[3].set_xlim(nonzero.min() / 3, nonzero.max() * 3)
        ax[3].set_ylim(0, total.max() * 1.08)
    ax[3].set(xscale="log", xlabel=f"step entropy (nats; outer bars: < {e[0]:.0e}, >= {e[-1]:g})",
              ylabel="steps", title=f"(d) distribution of step entropies ({steps['count']} steps)")
    ax[3].legend(fontsize=7)

    # (e) Fig. 3(b): symbolic-token entropy vs step entropy.
    sv = raw["step_vs_symbolic"]
    ok = np.isfinite(sv[:, 1])
    for u, col, label in ((0, "tab:blue", "confident step"), (1, "tab:orange", "uncertain step")):
        m = ok & (sv[:, 3] == u)
        ax[4].scatter(np.maximum(sv[m, 0], PLOT_FLOOR), np.maximum(sv[m, 1], PLOT_FLOOR), s=5, alpha=0.5, color=col,
                      label=label)
    if ok.any():
        shown = np.maximum(sv[ok][:, :2], PLOT_FLOOR)
        lim = [shown.min() / 2, shown.max() * 2]
        ax[4].plot(lim, lim, color="grey", lw=0.6, ls="--")
        ax[4].set(xlim=lim, ylim=lim)
    ax[4].set(xscale="log", yscale="log", xlabel="step entropy", ylabel="mean entropy of the step's symbolic tokens",
              title=f"(e) Fig. 3b: symbolic tokens track the step\nPearson r = "
                    f"{_f(steps['symbolic_vs_step_pearson'], '.2f')} "
                    f"(log-log {_f(steps['symbolic_vs_step_pearson_log'], '.2f')})")
    ax[4].legend(fontsize=7)

    # (f)-(h) Fig. 8: shift, flips, KL by reference-entropy bin.
    s = report["shift_by_bin"]
    xc = _bin_centers(np.asarray(s["edges"], float))

    def series(model, split, key):
        """Values of the bins with at least ``min_count`` tokens of that split (NaN elsewhere)."""
        values = np.array([np.nan if v is None else v for v in s[model][split][key]], float)
        return np.where(np.asarray(s[model][split]["count"]) >= min_count, values, np.nan)

    def draw(a, x, y, **kw):  # connect the bins that have data, across empty ones
        ok = np.isfinite(y)
        return a.plot(x[ok], y[ok], **kw)

    for split, col in (("confident", "tab:blue"), ("uncertain", "tab:orange")):
        draw(ax[5], xc, series("w4a4-nvfp4", split, "mean"), marker="o", ms=3, color=col,
             label=f"W4A4, {split} steps")
        lo, hi = series("w4a4-nvfp4", split, "q25"), series("w4a4-nvfp4", split, "q75")
        ok = np.isfinite(lo)
        ax[5].fill_between(xc[ok], lo[ok], hi[ok], color=col, alpha=0.12)
        draw(ax[6], xc, series("w4a4-nvfp4", split, "flip_rate"), marker="o", ms=3, color=col, label=f"W4A4, {split}")
        draw(ax[7], xc, series("w4a4-nvfp4", split, "mean_kl"), marker="o", ms=3, color=col, label=f"W4A4, {split}")
    grey = dict(color="grey", ls="--", marker=".", label="W4A16, all")
    draw(ax[5], xc, series("w4a16-nvfp4", "all", "mean"), **grey)
    draw(ax[6], xc, series("w4a16-nvfp4", "all", "flip_rate"), **grey)
    draw(ax[7], xc, series("w4a16-nvfp4", "all", "mean_kl"), **grey)
    ax[5].axhline(0, color="k", lw=0.5)
    means = np.abs(series("w4a4-nvfp4", "all", "mean"))
    linthresh = max(np.nanmin(means[means > 0], initial=1e-4), 1e-9)
    ax[5].set_yscale("symlog", linthresh=linthresh, linscale=2)
    # decade ticks from 10 * linthresh outwards, and 0: the labels next to 0 would overlap
    ax[5].yaxis.set_major_locator(matplotlib.ticker.SymmetricalLogLocator(base=10, linthresh=10 * linthresh))
    ax[5].set(xscale="log", xlabel="reference token entropy (bin centre)", ylabel="dH = H(quantized) - H(reference)",
              title=f"(f) Fig. 8: mean entropy shift by entropy bin\n(band: 25-75% quantiles; bins with >= {min_count} "
                    "tokens)")
    ax[6].set(xscale="log", xlabel="reference token entropy (bin centre)", ylabel="argmax flip rate",
              title="(g) argmax flips vs reference, by entropy bin")
    ax[7].set(xscale="log", yscale="log", xlabel="reference token entropy (bin centre)",
              ylabel="KL(reference || quantized), nats", title="(h) KL by entropy bin")
    for a in ax[5:]:
        a.legend(fontsize=7)
    for a in ax:  # a log axis without positive data (tiny or degenerate inputs) cannot be drawn
        if a.get_xscale() == "log" and not np.isfinite(a.dataLim.minposx):
            a.set_xscale("linear")
        if a.get_yscale() == "log" and not np.isfinite(a.dataLim.minposy):
            a.set_yscale("linear")
    fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", required=True, help="checkpoint directory (config, safetensors, tokenizer.json)")
    parser.add_argument("--kind", choices=("testbed", "text"), required=True)
    parser.add_argument("--out", required=True, help="output prefix: writes PREFIX.png, PREFIX.json, PREFIX.md")
    parser.add_argument("--problems", type=int, default=128, help="testbed: held-out problems analysed")
    parser.add_argument("--sequences", type=int, default=16, help="text: windows analysed")
    parser.add_argument("--seq-len", type=int, default=512, help="text: tokens per window (with <bos>)")
    parser.add_argument("--calibration-rows", type=int, default=8, help="rows of calibration data for W4A4")
    parser.add_argument("--batch-size", type=int, default=None, help="sequences per forward (testbed 16, text 1)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", default="float32", help="compute dtype of the reference model")
    parser.add_argument("--min-token-count", type=int, default=20,
                        help="tokens listed by mean entropy must occur this often")
    parser.add_argument("--min-bin-count", type=int, default=10, help="plot only entropy bins with this many tokens")
    parser.add_argument("--bin-lo", type=float, default=1e-6, help="lowest entropy bin edge (nats)")
    parser.add_argument("--bin-hi", type=float, default=10.0, help="highest entropy bin edge (nats)")
    parser.add_argument("--bins-per-decade", type=int, default=2)
    parser.add_argument("--trajectories", type=int, default=3, help="sequences drawn in the step trajectory panel")
    args = parser.parse_args(argv)
    command = "python scripts/entropy_analysis.py " + " ".join(
        shlex.quote(a) for a in (sys.argv[1:] if argv is None else argv))

    start = time.perf_counter()
    tokenizer = load_tokenizer(args.model)
    model = jaxlp.from_pretrained(args.model, dtype=jnp.dtype(args.dtype))
    config = model.config
    pad_id = config.pad_token_id if config.pad_token_id is not None else 0
    if args.kind == "testbed":
        if not config.eos_token_ids:
            raise SystemExit("the testbed kind needs a model with an EOS token id")
        corpus = testbed_corpus(args.model, tokenizer, config.eos_token_ids[0], args.problems,
                                args.calibration_rows, args.seed)
    else:
        corpus = text_corpus(tokenizer, config.bos_token_id, args.sequences, args.seq_len, args.calibration_rows)
    edges = log_bin_edges(args.bin_lo, args.bin_hi, args.bins_per_decade)
    quantized = [jaxlp.quantization.quantize_model(model, "w4a4-nvfp4", calibration=corpus.calibration),
                 jaxlp.quantization.quantize_model(model, "w4a16-nvfp4")]
    timing = dict(load_and_quantize=time.perf_counter() - start)
    batch = args.batch_size or (16 if args.kind == "testbed" else 1)
    per_seq = run_models(model, quantized, corpus, batch, pad_id)
    timing["forward"] = time.perf_counter() - start - sum(timing.values())
    report, raw = analyse(corpus, per_seq, tokenizer, args.kind, edges, args.trajectories, args.min_token_count)
    timing["analysis"] = time.perf_counter() - start - sum(timing.values())
    name = Path(args.model.rstrip("/")).name
    report["meta"] = dict(model=str(args.model), kind=args.kind, corpus=corpus.description, command=command,
                          reference_dtype=args.dtype, seconds=time.perf_counter() - start, jax=jax.__version__,
                          device=str(jax.devices()[0]), models=list(MODELS), step_rule="ReSET: after a token "
                          "containing '\\n\\n' or after two '\\n' tokens", uncertain_rule="step entropy > running "
                          "mean of token entropies up to the step's end", min_token_count=args.min_token_count,
                          checkpoint=checkpoint_info(args.model), timing=timing,
                          load_average_1min=os.getloadavg()[0], cpu_count=os.cpu_count())
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    report = to_json(report)
    Path(f"{out}.json").write_text(json.dumps(report, indent=1))
    title = f"Token and step entropy under NVFP4: {name} ({args.kind})"
    Path(f"{out}.md").write_text(markdown(report, title, command))
    plot(report, raw, Path(f"{out}.png"), title, args.min_bin_count)
    o = report["overall"]
    print(f"{report['tokens']} tokens, {report['steps']['count']} steps, {report['meta']['seconds']:.0f} s; mean H "
          f"ref {o['reference']['mean_entropy']:.4f}, W4A4 {o['w4a4-nvfp4']['mean_entropy']:.4f} "
          f"(KL {o['w4a4-nvfp4']['mean_kl']:.4f}, flips {o['w4a4-nvfp4']['flip_rate']:.4f}) -> {out}.{{png,json,md}}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
