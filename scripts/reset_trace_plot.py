"""ReSET on a real trace (the paper's Figure 3 / 4(a) views), written as PNG.

Generates with the ReSET sampler inside ``jaxlp.generate`` (per-step entropies and
temperatures recorded on device), replays the trace through
``jaxlp.sampling.reset_temperatures_from_entropies`` to recover the step estimate, the
running mean and the step type, checks that the replay chose the same temperatures as the
loop, and plots: token entropy per position with step starts, the step estimate against
the running mean (uncertain steps shaded), tau0, and the temperature chosen.

- ``--kind text`` (default; e.g. Gemma 3): the prompt is the start of an offline text
  section; tau0 = 80th percentile of raw-logit entropies of T = 0.6 generations from 5
  other sections.
- ``--kind testbed`` (the testbed reasoner): the prompt is the question of a held-out
  problem (``--problem``, an index into ``eval_problems(seed, ...)`` of the spec in the
  checkpoint's training log); tau0 from T = 0.6 generations on 5 training-split problems.
  The entropy axes are logarithmic (the reasoner's entropies span 1e-7 .. ln 2), each step
  is labelled with its head (``+6618``, ``*5``, ``Answer``) and the title says whether the
  answer is correct (``jaxlp.testbed.check_steps``).

    python scripts/reset_trace_plot.py --model ~/.cache/jaxlp/gemma3-270m --out docs/reset_trace_gemma3_270m.png
    python scripts/reset_trace_plot.py --model jaxlp/assets/reasoner --kind testbed --problem 9 --out docs/reset_trace_testbed.png
"""

from __future__ import annotations

import argparse
import itertools
from pathlib import Path

import jax.numpy as jnp
import numpy as np

import jaxlp
from jaxlp.data import offline_text
from jaxlp.models.tokenizer import load_tokenizer
from jaxlp.sampling import ReSETConfig, base_decoding, calibrate_tau0, reset_temperatures_from_entropies
from jaxlp.testbed import check_steps, eval_problems, train_problems
from jaxlp.testbed.analysis import checkpoint_spec, step_starts

CALIBRATION_PROMPTS = 5


def _calibrated_tau0(model, prompts, max_new_tokens: int, seed: int) -> float:
    """The paper's rule: 80th percentile of raw-logit entropies of T = 0.6 / top-p 0.95 generations."""
    stats = jaxlp.generate(model, prompts, max_new_tokens=max_new_tokens, sampler=base_decoding(), seed=seed,
                           return_stats=True)
    return calibrate_tau0(stats.entropy[np.isfinite(stats.entropy)])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--kind", choices=("text", "testbed"), default="text")
    parser.add_argument("--out", default="docs/reset_trace.png")
    parser.add_argument("--prompt", default=None, help="text: default the start of an offline text section")
    parser.add_argument("--problem", type=int, default=0, help="testbed: index of the held-out problem")
    parser.add_argument("--max-new-tokens", type=int, default=None,
                        help="default: 400 (text), the longest solution of the spec (testbed)")
    parser.add_argument("--t-low", type=float, default=0.1)
    parser.add_argument("--tau0", type=float, default=None, help="default: calibrated on 5 other prompts")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", default="float32")
    args = parser.parse_args(argv)
    if args.problem < 0:
        raise SystemExit(f"--problem must be >= 0, got {args.problem}")

    tokenizer = load_tokenizer(args.model)
    model = jaxlp.from_pretrained(args.model, dtype=jnp.dtype(args.dtype))
    problem = None
    if args.kind == "testbed":
        spec = checkpoint_spec(args.model)
        max_new = args.max_new_tokens or spec.max_solution_chars() + 1  # + <eos>
        calib = [tokenizer.encode(p.question).ids for p in itertools.islice(train_problems(args.seed, spec),
                                                                             CALIBRATION_PROMPTS)]
        problem = eval_problems(args.seed, args.problem + 1, spec)[args.problem]
        prompt = problem.question
        calib_tokens = max_new
    else:
        max_new = args.max_new_tokens or 400
        sections = [s for s in offline_text().split("\n\n") if len(s) > 200]
        calib = [tokenizer.encode(s[:300]).ids for s in sections[:CALIBRATION_PROMPTS]]
        prompt = args.prompt or sections[7][:400]
        calib_tokens = 128
    tau0 = args.tau0 if args.tau0 is not None else _calibrated_tau0(model, calib, calib_tokens, args.seed)
    config = ReSETConfig.from_tokenizer(tokenizer, args.t_low, tau0)
    result = jaxlp.generate(model, [tokenizer.encode(prompt).ids], max_new_tokens=max_new, sampler=config,
                            seed=args.seed, return_stats=True)
    n = int(result.num_tokens[0])
    tokens, entropy, temperature = result.tokens[0, :n], result.entropy[0, :n], result.temperature[0, :n]
    replay = reset_temperatures_from_entropies(entropy, tokens, config, return_stats=True)
    if not np.array_equal(np.asarray(replay.temperature), temperature):
        raise SystemExit("the trace function disagrees with the in-loop sampler")
    text = tokenizer.decode(tokens.tolist())
    verdict = ""
    if problem is not None:
        check = check_steps(problem, text)
        verdict = "correct" if check.correct else f"wrong ({check.kind} at segment {check.first_error})"

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pos = np.arange(n)
    starts = np.flatnonzero(step_starts(tokens, config.double_newline_ids, config.newline_ids))[1:]
    log_scale = args.kind == "testbed"
    floor = 1e-8  # entropies drawn at max(H, floor) on the log axes
    show = (lambda x: np.maximum(np.asarray(x, np.float64), floor)) if log_scale else (lambda x: np.asarray(x))
    fig, axes = plt.subplots(3, 1, figsize=(13, 8), sharex=True)
    axes[0].plot(pos, show(entropy), lw=0.7, label="token entropy H (raw logits)")
    axes[0].axhline(tau0, color="r", ls="--", lw=0.8, label=f"tau0 = {tau0:.3g}")
    for b in starts:
        axes[0].axvline(b, color="grey", lw=0.4)
    title = f"ReSET trace ({Path(args.model.rstrip('/')).name}, T_low={args.t_low}); grey: step starts"
    if problem is not None:
        title += f"\n{problem.question.strip()} -> {verdict}"
        for b in np.concatenate([[0], starts]):  # label each step with its head: "+6618", "*5", "Answer"
            head = text[b:].split("\n", 1)[0].split(":", 1)[0][:8]
            axes[0].annotate(head, (b, 1.0), xycoords=("data", "axes fraction"), fontsize=6, rotation=90,
                             va="top", ha="left", xytext=(1, -2), textcoords="offset points")
    axes[0].set(ylabel="nats", title=title, yscale="log" if log_scale else "linear")
    axes[0].legend(fontsize=8, loc="lower right" if log_scale else "best")
    axes[1].plot(pos, show(replay.step_estimate), label="step estimate", lw=0.9)
    axes[1].plot(pos, show(replay.running_mean), label="running mean Hbar", lw=0.9)
    uncertain = np.asarray(replay.uncertain)
    axes[1].fill_between(pos, 0, 1, where=uncertain, transform=axes[1].get_xaxis_transform(), alpha=0.15,
                         color="orange", label="uncertain step")
    axes[1].set(ylabel="nats", yscale="log" if log_scale else "linear")
    axes[1].legend(fontsize=8)
    axes[2].step(pos, temperature, where="mid", lw=0.8)
    axes[2].set(xlabel="generated position", ylabel="temperature", yticks=[0, args.t_low, 1.0])
    fig.tight_layout()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=110)
    plt.close(fig)
    share = float(np.mean(temperature >= 1.0))
    print(f"{n} tokens, tau0 {tau0:.4g}, {len(starts)} step boundaries, {uncertain.mean():.1%} in uncertain "
          f"steps, {share:.1%} at T_high{', ' + verdict if verdict else ''} -> {args.out}")
    print(text[:300])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
