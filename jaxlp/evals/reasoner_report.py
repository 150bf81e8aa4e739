"""The reasoner evaluation's outputs: Markdown tables (paper Table 1, 2 and 5 layouts), the
first-error table, a bar chart, and PREFIX.json / .md / .png.

Accuracies are shown in % as ``mean ± half-width`` of the 95% t-interval over the seeds; Δ is
the mean per-seed difference to the reference row with its t-interval
(:func:`jaxlp.evals.stats.paired_delta`).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Sequence

import numpy as np

from jaxlp import sampling, testbed
from jaxlp.evals.harness import pyplot
from jaxlp.evals.reasoner_plan import (
    BASE_SAMPLER,
    ENTROPY_SAMPLERS,
    REFERENCE_WEIGHTS,
    WEIGHTS,
    Config,
    EvalSettings,
    sampler_label,
    sampler_params,
)
from jaxlp.evals.stats import paired_delta


def fmt_acc(rep: dict | None) -> str:
    """``97.3 ± 0.8`` (percent; the half-width of the t-interval), ``-`` when missing."""
    if rep is None:
        return "-"
    half = rep["half_width"]
    return f"{100 * rep['accuracy']:.1f}" + ("" if not np.isfinite(half) else f" ± {100 * half:.1f}")


def fmt_delta(rep: dict | None, ref: dict | None) -> str:
    """``+1.2 ± 0.5``: the paired per-seed difference to ``ref`` in percent (empty for the reference)."""
    if rep is None or ref is None or rep is ref:
        return ""
    d = paired_delta(decode_correct(rep), decode_correct(ref))
    half = "" if not np.isfinite(d.half_width) else f" ± {100 * d.half_width:.1f}"
    return f"{100 * d.delta:+.1f}{half}"


def decode_correct(rep: dict) -> np.ndarray:
    """The ``[seeds, problems]`` bool array of a report's ``correct`` strings."""
    return np.array([[ch == "1" for ch in row] for row in rep["correct"]], bool)


def term_buckets(spec) -> list[tuple[int, int]]:
    """Columns of Table 1: terms in pairs, ``[(1, 2), (3, 4), ...]`` over the spec's range."""
    return [(a, min(a + 1, spec.max_terms)) for a in range(spec.min_terms, spec.max_terms + 1, 2)]


def bucket_accuracy(rep: dict, lo: int, hi: int) -> str:
    """Accuracy (%) over the problems of ``lo`` to ``hi`` terms, ``-`` if there are none."""
    acc = [(v["accuracy"], v["problems"]) for k, v in rep["by_terms"].items() if lo <= int(k) <= hi]
    n = sum(p for _, p in acc)
    return "-" if n == 0 else f"{100 * sum(a * p for a, p in acc) / n:.1f}"


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A GitHub Markdown table (``|`` in cells escaped)."""
    if any(len(r) != len(header) for r in rows):
        raise ValueError("every row needs one cell per header column")
    esc = lambda s: str(s).replace("|", "\\|")  # noqa: E731
    lines = ["| " + " | ".join(map(esc, header)) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(map(esc, r)) + " |" for r in rows]
    return "\n".join(lines)


def table1(reports: dict, spec, rows: Sequence[Config]) -> str:
    """Paper Table 1 layout: weights as rows; columns by number of terms (the paper's models), then all."""
    buckets = term_buckets(spec)
    ref = reports.get(Config(REFERENCE_WEIGHTS, BASE_SAMPLER, "bf16").key)
    header = ["Weights"] + [f"{a}-{b} terms" if a != b else f"{a} terms" for a, b in buckets] + \
        ["All (± 95% CI)", "Δ vs BF16"]
    out = []
    for cfg in rows:
        rep = reports.get(cfg.key)
        if rep is not None:
            out.append([WEIGHTS[cfg.weights][0]] + [bucket_accuracy(rep, a, b) for a, b in buckets]
                       + [fmt_acc(rep), fmt_delta(rep, ref)])
    return markdown_table(header, out)


def table2(reports: dict, samplers: Sequence[str], weights: Sequence[str], t_low: float, t_high: float) -> str:
    """Paper Tables 2 and 5 layout: method, T, top-p, min-p, then accuracy per weight format."""
    header = ["Method", "T", "Top-p", "Min-p"]
    for w in weights:
        header += [WEIGHTS[w][0], f"Δ vs base ({WEIGHTS[w][0]})"]
    out, last_label = [], None
    for s in samplers:
        if s in ENTROPY_SAMPLERS:
            cells = [sampler_label(s), f"{t_low:g} / {t_high:g}", f"{sampling.BASE_TOP_P:g}", "0.0"]
        else:
            p = sampler_params(s)
            cells = [sampler_label(s), f"{p['T']:g}", "1.0" if p["top_p"] is None else f"{p['top_p']:g}",
                     "0.0" if p["min_p"] is None else f"{p['min_p']:g}"]
        reps = [reports.get(Config(w, s, "bf16").key) for w in weights]
        for w, rep in zip(weights, reps):
            cells += [fmt_acc(rep), fmt_delta(rep, reports.get(Config(w, BASE_SAMPLER, "bf16").key))]
        if any(r is not None for r in reps):
            label, cells[0] = cells[0], "" if cells[0] == last_label else cells[0]  # sweeps: label once
            last_label = label
            out.append(cells)
    return markdown_table(header, out)


def table5(reports: dict, caches: Sequence[str], weights: Sequence[str], cache_bytes: dict) -> str:
    """KV caches as rows, with their size; accuracy per weight format."""
    header = ["KV cache", "bytes/token/layer"]
    for w in weights:
        header += [f"{WEIGHTS[w][0]} weights", "Δ vs BF16 cache"]
    out = []
    for c in caches:
        cells = [c, f"{cache_bytes[c]:.0f}" if c in cache_bytes else "-"]
        reps = [reports.get(Config(w, BASE_SAMPLER, c).key) for w in weights]
        for w, rep in zip(weights, reps):
            cells += [fmt_acc(rep), fmt_delta(rep, reports.get(Config(w, BASE_SAMPLER, "bf16").key))]
        if any(r is not None for r in reps):
            out.append(cells)
    return markdown_table(header, out)


def error_table(reports: Sequence[dict]) -> str:
    """First-error kinds (check_steps) of the wrong samples, per config."""
    kinds = sorted({k for r in reports for k in r["error_kinds"]})
    header = ["Weights / sampler / KV cache", "wrong"] + kinds + ["right answer, wrong step"]
    out = []
    for r in reports:
        out.append([f"{r['weights_label']} / {r['sampler']} / {r['cache']}", str(sum(r["error_kinds"].values()))]
                   + [str(r["error_kinds"].get(k, 0)) for k in kinds] + [str(r["correct_answer_step_error"])])
    return markdown_table(header, out)


def plot(reports: dict, path: Path, settings: EvalSettings) -> None:
    """One horizontal bar chart per table, error bars = the 95% t-intervals."""
    plt = pyplot()
    s = settings
    get = lambda w, smp, c: reports.get(Config(w, smp, c).key)  # noqa: E731
    panels = []
    if "1" in s.tables:
        panels.append(("Table 1: weights (T 0.6, top-p 0.95)", ["all problems"],
                       [(WEIGHTS[w][0], [get(w, BASE_SAMPLER, "bf16")]) for w in s.formats]))
    if "2" in s.tables:
        panels.append(("Table 2: samplers", [WEIGHTS[w][0] for w in s.sampler_weights],
                       [(smp if smp not in ENTROPY_SAMPLERS else sampler_label(smp),
                         [get(w, smp, "bf16") for w in s.sampler_weights]) for smp in s.samplers]))
    if "5" in s.tables:
        panels.append(("Table 5: KV caches (T 0.6, top-p 0.95)",
                       [f"{WEIGHTS[w][0]} weights" for w in s.cache_weights],
                       [(c, [get(w, BASE_SAMPLER, c) for w in s.cache_weights]) for c in s.caches]))
    panels = [(t, legend, [(name, reps) for name, reps in rows if any(r is not None for r in reps)])
              for t, legend, rows in panels]
    panels = [p for p in panels if p[2]]
    if not panels:
        return
    tallest = max(len(p[2]) * len(p[1]) for p in panels)
    fig, axes = plt.subplots(1, len(panels), figsize=(6.0 * len(panels), 1.8 + 0.28 * tallest), squeeze=False)
    for ax, (title, legend, rows) in zip(axes[0], panels):
        k = len(legend)
        height = 0.8 / k
        y = np.arange(len(rows))
        for j in range(k):
            reps = [r[j] for _, r in rows]
            acc = np.array([100 * r["accuracy"] if r is not None else np.nan for r in reps])
            err = np.array([100 * r["half_width"] if r is not None and np.isfinite(r["half_width"]) else 0.0
                            for r in reps])
            ax.barh(y + (j - (k - 1) / 2) * height, acc, height=height, xerr=err, capsize=2, label=legend[j])
        ax.set_yticks(y, [name for name, _ in rows], fontsize=8)
        ax.invert_yaxis()
        finite = [100 * r["accuracy"] for _, reps in rows for r in reps if r is not None]
        ax.set_xlim(max(0.0, min(finite) - 5.0) if finite else 0.0, 100.5)
        ax.set_xlabel("exact-match accuracy (%), 95% t-interval over seeds")
        ax.set_title(title, fontsize=10)
        if k > 1:
            ax.legend(fontsize=8, loc="lower left")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def render_markdown(meta: dict, reports: dict, rows: dict[str, list[Config]], skipped: Sequence[str],
                    settings: EvalSettings) -> str:
    """PREFIX.md: the run's description, the selected tables, the first-error table, what did not run."""
    s = settings
    spec = testbed.ProblemSpec(**meta["spec"])
    lines = [
        "# Testbed reasoner: accuracy across weight formats, samplers and KV caches", "",
        f"Command: `{meta['command']}`  ",
        f"Device: {meta['device']} ({meta['backend']}), jax {meta['jax']}; {meta['date']}; wall time "
        f"{meta['wall_s']:.0f} s.", "",
        f"Model: `{meta['model']}` ({meta['num_params']:,} parameters). Held-out problems: {meta['problems']} "
        f"(`eval_problems(seed={meta['eval_seed']})`, spec {meta['spec']}), {meta['seeds']} sample(s) each; at most "
        f"{meta['max_new_tokens']} new tokens.", "",
        f"Accuracy: exact match of the final answer, in %, mean over the {meta['seeds']} sampling seed(s). "
        f"{meta['ci_method']}", "",
    ]
    if "1" in rows:
        lines += ["## Table 1: weight formats (T 0.6, top-p 0.95, BF16 KV cache)", "",
                  "Columns: problems by number of terms (where the paper has models), then all problems.", "",
                  table1(reports, spec, rows["1"]), ""]
    if "2" in rows:
        tau = ", ".join(f"{WEIGHTS[w][0]} {v['tau0']:.3g}" for w, v in meta["tau0"].items())
        lines += ["## Table 2: samplers (BF16 KV cache)", "",
                  f"Entropy samplers: T_low / T_high = {s.t_low:g} / {s.t_high:g}, window {s.window}, "
                  f"top-p {sampling.BASE_TOP_P:g}; tau0 per weights: {tau or '-'} ({s.tau0_percentile:g}th "
                  "percentile of the raw-logit entropies of base decoding on training-split problems, on the same "
                  "weights). Top-p 1.0 is no top-p filter.", "",
                  table2(reports, s.samplers, s.sampler_weights, s.t_low, s.t_high), ""]
    if "5" in rows:
        lines += ["## Table 5: KV caches (T 0.6, top-p 0.95)", "",
                  "Bytes per token per layer at a 4096-token context, as the format counts them.", "",
                  table5(reports, s.caches, s.cache_weights, meta["cache_bytes"]), ""]
    if reports:
        lines += ["## First-error kinds of the wrong samples (`check_steps`)", "",
                  error_table(list(reports.values())), ""]
    if skipped:
        lines += ["## Not run", ""] + [f"- {x}" for x in skipped] + [""]
    return "\n".join(lines)


def write_outputs(prefix: Path, meta: dict, reports: dict, rows, skipped: list, settings: EvalSettings,
                  final: bool) -> None:
    """PREFIX.json (after every program), PREFIX.md and PREFIX.png (at the end)."""
    prefix.parent.mkdir(parents=True, exist_ok=True)
    data = dict(meta=meta, configs=list(reports.values()), skipped=skipped)
    prefix.with_name(prefix.name + ".json").write_text(json.dumps(data, indent=1))
    if final:
        prefix.with_name(prefix.name + ".md").write_text(render_markdown(meta, reports, rows, skipped, settings))
        try:
            plot(reports, prefix.with_name(prefix.name + ".png"), settings)
        except ImportError as e:  # no matplotlib: the tables are still written
            print(f"eval_reasoner: no plot ({e})", file=sys.stderr)
