"""The entropy analysis's outputs: the Markdown report and the figure (Fig. 2, 3 and 8 views).

Both read the JSON-ready report of :func:`jaxlp.evals.entropy.analyse` (after ``to_json``);
the figure also the per-token arrays (:class:`jaxlp.evals.entropy.TokenArrays`).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from jaxlp.evals.harness import pyplot

PLOT_FLOOR = 1e-7  # entropies are drawn at max(H, PLOT_FLOOR) on log axes


def _f(x, fmt=".4g") -> str:
    """``x`` formatted, ``n/a`` for None or a non-finite float."""
    return "n/a" if x is None or (isinstance(x, float) and not np.isfinite(x)) else format(x, fmt)


def markdown(report: dict, title: str, command: str) -> str:
    """The report as Markdown: overall, by token class, frequent tokens, steps, shift by entropy bin."""
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
    for name in meta["models"]:
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


def _bin_centers(edges: np.ndarray) -> np.ndarray:
    """Geometric centres of log-spaced bins, the outer two one bin width beyond the edges."""
    ratio = edges[1] / edges[0] if len(edges) > 1 else 10.0
    mids = np.sqrt(edges[:-1] * edges[1:])
    return np.concatenate([[edges[0] / np.sqrt(ratio)], mids, [edges[-1] * np.sqrt(ratio)]])


def plot(report: dict, raw, path: Path, title: str, min_count: int = 10) -> None:
    """Eight panels: entropy by class, entropy CDFs, step trajectories, step-entropy histogram,
    symbolic vs step entropy, and entropy shift, argmax flips and KL by reference-entropy bin
    (``raw``: :class:`jaxlp.evals.entropy.TokenArrays`)."""
    plt = pyplot()
    import matplotlib.ticker

    classes = report["classes"]
    present = [c for c in range(len(classes)) if (raw.cls == c).any()]
    h = np.maximum(raw.h, PLOT_FLOOR)
    fig, ax = plt.subplots(2, 4, figsize=(22, 9.5))
    ax = ax.ravel()

    # (a) Fig. 2: entropy by class, reference vs W4A4.
    data, pos, colors = [], [], []
    for j, c in enumerate(present):
        for k, (m, col) in enumerate(((0, "tab:blue"), (1, "tab:red"))):
            data.append(h[m][raw.cls == c])
            pos.append(3 * j + k)
            colors.append(col)
    bp = ax[0].boxplot(data, positions=pos, widths=0.8, whis=(5, 95), showfliers=False, showmeans=True,
                       patch_artist=True, meanprops=dict(marker="o", markersize=3, markerfacecolor="k"))
    for patch, col in zip(bp["boxes"], colors):
        patch.set_facecolor(col)
        patch.set_alpha(0.45)
    ax[0].set_xticks([3 * j + 0.5 for j in range(len(present))],
                     [f"{classes[c]}\n({(raw.cls == c).sum()})" for c in present], fontsize=8)
    ax[0].set(yscale="log", ylabel="token entropy (nats)",
              title="(a) Fig. 2: entropy by token class\nblue: reference, red: W4A4 "
                    "(box 25-75%, whiskers 5-95%, o mean)")

    # (b) CDF of entropy, symbolic vs other tokens.
    sym = np.isin(raw.cls, [classes.index(c) for c in report["symbolic_classes"]])
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
    sv = raw.step_vs_symbolic
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

