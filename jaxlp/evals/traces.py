"""ReSET on a real trace (the paper's Figure 3 / 4(a) views).

Generates with the ReSET sampler inside ``jaxlp.generate`` (per-step entropies and
temperatures recorded on device), replays the trace through
``jaxlp.sampling.reset_temperatures_from_entropies`` to recover the step estimate, the
running mean and the step type, and checks that the replay chose the same temperatures as
the loop. :func:`plot_reset_trace` draws token entropy per position with step starts, the
step estimate against the running mean (uncertain steps shaded), tau0, and the temperature.

Prompts (:class:`TracePrompts`):

- text (e.g. Gemma 3): the start of an offline text section; tau0 = 80th percentile of
  raw-logit entropies of T = 0.6 generations from 5 other sections.
- testbed (the testbed reasoner): the question of a held-out problem (an index into
  ``eval_problems(seed, ...)`` of the spec in the checkpoint's training log); tau0 from
  T = 0.6 generations on 5 training-split problems; the answer is checked
  (``jaxlp.testbed.check_steps``).
"""

from __future__ import annotations

import dataclasses
import itertools
from pathlib import Path
from typing import NamedTuple

import numpy as np

import jaxlp
from jaxlp.data import offline_text
from jaxlp.evals.harness import pyplot
from jaxlp.sampling import ReSETConfig, base_decoding, calibrate_tau0, reset_temperatures_from_entropies
from jaxlp.testbed import Problem, check_steps, eval_problems, train_problems
from jaxlp.testbed.analysis import checkpoint_spec, step_starts

CALIBRATION_PROMPTS = 5


class TraceMismatchError(RuntimeError):
    """The replay of a trace chose other temperatures than the sampler in the generation loop."""


def calibrated_tau0(model, prompts, max_new_tokens: int, seed: int) -> float:
    """The paper's rule: 80th percentile of raw-logit entropies of T = 0.6 / top-p 0.95 generations."""
    stats = jaxlp.generate(model, prompts, max_new_tokens=max_new_tokens, sampler=base_decoding(), seed=seed,
                           return_stats=True)
    return calibrate_tau0(stats.entropy[np.isfinite(stats.entropy)])


class TracePrompts(NamedTuple):
    """The traced prompt, the prompts tau0 is calibrated on, and the generation lengths."""

    prompt: str
    calibration: list[list[int]]
    calibration_tokens: int  # new tokens per calibration prompt
    max_new_tokens: int
    problem: Problem | None = None  # testbed: the held-out problem of the prompt


def testbed_prompts(model_dir, tokenizer, problem: int, seed: int = 0,
                    max_new_tokens: int | None = None) -> TracePrompts:
    """Held-out problem ``problem`` of the checkpoint's spec; calibration on training problems.
    Default length: the longest solution of the spec + ``<eos>``."""
    if problem < 0:
        raise ValueError(f"problem must be >= 0, got {problem}")
    spec = checkpoint_spec(model_dir)
    max_new = max_new_tokens or spec.max_solution_chars() + 1  # + <eos>
    calib = [tokenizer.encode(p.question).ids for p in itertools.islice(train_problems(seed, spec),
                                                                         CALIBRATION_PROMPTS)]
    chosen = eval_problems(seed, problem + 1, spec)[problem]
    return TracePrompts(chosen.question, calib, max_new, max_new, chosen)


def text_prompts(tokenizer, prompt: str | None = None, max_new_tokens: int | None = None) -> TracePrompts:
    """``prompt`` (default: the start of an offline text section), 400 new tokens by default;
    calibration on 5 other sections, 128 tokens each."""
    sections = [s for s in offline_text().split("\n\n") if len(s) > 200]
    calib = [tokenizer.encode(s[:300]).ids for s in sections[:CALIBRATION_PROMPTS]]
    return TracePrompts(prompt or sections[7][:400], calib, 128, max_new_tokens or 400)


@dataclasses.dataclass(frozen=True)
class ResetTrace:
    """One ReSET generation and its replay (arrays over the generated positions)."""

    tokens: np.ndarray
    entropy: np.ndarray  # raw-logit token entropy (nats)
    temperature: np.ndarray  # the temperature the sampler chose
    step_estimate: np.ndarray
    running_mean: np.ndarray
    uncertain: np.ndarray  # bool: the position's step is uncertain
    step_starts: np.ndarray  # positions where a step starts (after the first step)
    tau0: float
    t_low: float
    text: str
    problem: Problem | None = None
    verdict: str = ""  # testbed: "correct" or "wrong (kind at segment i)"

    def summary(self) -> str:
        """Tokens, tau0, step boundaries, share in uncertain steps and at T_high, the verdict."""
        share = float(np.mean(self.temperature >= 1.0))
        return (f"{len(self.tokens)} tokens, tau0 {self.tau0:.4g}, {len(self.step_starts)} step boundaries, "
                f"{self.uncertain.mean():.1%} in uncertain steps, {share:.1%} at T_high"
                f"{', ' + self.verdict if self.verdict else ''}")


def reset_trace(model, tokenizer, prompts: TracePrompts, *, t_low: float = 0.1, tau0: float | None = None,
                seed: int = 0) -> ResetTrace:
    """Generate from ``prompts.prompt`` with ReSET (tau0 calibrated on ``prompts.calibration``
    unless given) and replay the trace; raises :class:`TraceMismatchError` if the replay's
    temperatures differ from the loop's."""
    if tau0 is None:
        tau0 = calibrated_tau0(model, prompts.calibration, prompts.calibration_tokens, seed)
    config = ReSETConfig.from_tokenizer(tokenizer, t_low, tau0)
    result = jaxlp.generate(model, [tokenizer.encode(prompts.prompt).ids], max_new_tokens=prompts.max_new_tokens,
                            sampler=config, seed=seed, return_stats=True)
    n = int(result.num_tokens[0])
    tokens, entropy, temperature = result.tokens[0, :n], result.entropy[0, :n], result.temperature[0, :n]
    replay = reset_temperatures_from_entropies(entropy, tokens, config, return_stats=True)
    if not np.array_equal(np.asarray(replay.temperature), temperature):
        raise TraceMismatchError("the trace function disagrees with the in-loop sampler")
    text = tokenizer.decode(tokens.tolist())
    verdict = ""
    if prompts.problem is not None:
        check = check_steps(prompts.problem, text)
        verdict = "correct" if check.correct else f"wrong ({check.kind} at segment {check.first_error})"
    starts = np.flatnonzero(step_starts(tokens, config.double_newline_ids, config.newline_ids))[1:]
    return ResetTrace(tokens, entropy, temperature, np.asarray(replay.step_estimate), np.asarray(replay.running_mean),
                      np.asarray(replay.uncertain), starts, float(tau0), t_low, text, prompts.problem, verdict)


def plot_reset_trace(trace: ResetTrace, path: str | Path, model_name: str, *, log_scale: bool = False) -> None:
    """Three panels over the generated positions: token entropy with tau0 and step starts (each
    step labelled with its head for a testbed problem), step estimate vs running mean with the
    uncertain steps shaded, and the temperature. ``log_scale``: logarithmic entropy axes."""
    plt = pyplot()
    pos = np.arange(len(trace.tokens))
    floor = 1e-8  # entropies drawn at max(H, floor) on the log axes
    show = (lambda x: np.maximum(np.asarray(x, np.float64), floor)) if log_scale else (lambda x: np.asarray(x))
    fig, axes = plt.subplots(3, 1, figsize=(13, 8), sharex=True)
    axes[0].plot(pos, show(trace.entropy), lw=0.7, label="token entropy H (raw logits)")
    axes[0].axhline(trace.tau0, color="r", ls="--", lw=0.8, label=f"tau0 = {trace.tau0:.3g}")
    for b in trace.step_starts:
        axes[0].axvline(b, color="grey", lw=0.4)
    title = f"ReSET trace ({model_name}, T_low={trace.t_low}); grey: step starts"
    if trace.problem is not None:
        title += f"\n{trace.problem.question.strip()} -> {trace.verdict}"
        for b in np.concatenate([[0], trace.step_starts]):  # label each step with its head: "+6618", "*5", "Answer"
            head = trace.text[b:].split("\n", 1)[0].split(":", 1)[0][:8]
            axes[0].annotate(head, (b, 1.0), xycoords=("data", "axes fraction"), fontsize=6, rotation=90,
                             va="top", ha="left", xytext=(1, -2), textcoords="offset points")
    axes[0].set(ylabel="nats", title=title, yscale="log" if log_scale else "linear")
    axes[0].legend(fontsize=8, loc="lower right" if log_scale else "best")
    axes[1].plot(pos, show(trace.step_estimate), label="step estimate", lw=0.9)
    axes[1].plot(pos, show(trace.running_mean), label="running mean Hbar", lw=0.9)
    axes[1].fill_between(pos, 0, 1, where=trace.uncertain, transform=axes[1].get_xaxis_transform(), alpha=0.15,
                         color="orange", label="uncertain step")
    axes[1].set(ylabel="nats", yscale="log" if log_scale else "linear")
    axes[1].legend(fontsize=8)
    axes[2].step(pos, trace.temperature, where="mid", lw=0.8)
    axes[2].set(xlabel="generated position", ylabel="temperature", yticks=[0, trace.t_low, 1.0])
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
