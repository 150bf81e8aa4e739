"""ReSET on a real trace (the paper's Figure 3 / 4(a) views), written as PNG.

Generates with the ReSET sampler inside ``jaxlp.generate`` (per-step entropies and
temperatures recorded on device), replays the trace through
``jaxlp.sampling.reset_temperatures_from_entropies`` to recover the step estimate, the
running mean and the step type, checks that the replay chose the same temperatures as the
loop, and plots: token entropy per position with step boundaries, the step estimate against
the running mean (uncertain steps shaded), tau0, and the temperature chosen.

    python scripts/reset_trace_plot.py --model ~/.cache/jaxlp/gemma3-270m --out docs/reset_trace_gemma3_270m.png
"""

from __future__ import annotations

import argparse
from pathlib import Path

import jax.numpy as jnp
import numpy as np

import jaxlp
from jaxlp.data import offline_text
from jaxlp.models.tokenizer import load_tokenizer
from jaxlp.sampling import ReSETConfig, base_decoding, calibrate_tau0, reset_temperatures_from_entropies


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--out", default="docs/reset_trace.png")
    parser.add_argument("--prompt", default=None, help="default: the start of an offline text section")
    parser.add_argument("--max-new-tokens", type=int, default=400)
    parser.add_argument("--t-low", type=float, default=0.1)
    parser.add_argument("--tau0", type=float, default=None, help="default: calibrated on 5 offline prompts")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", default="float32")
    args = parser.parse_args(argv)

    tokenizer = load_tokenizer(args.model)
    model = jaxlp.from_pretrained(args.model, dtype=jnp.dtype(args.dtype))
    sections = [s for s in offline_text().split("\n\n") if len(s) > 200]
    tau0 = args.tau0
    if tau0 is None:  # the paper's rule: 80th percentile of raw-logit entropies at T = 0.6
        calib = [tokenizer.encode(s[:300]).ids for s in sections[:5]]
        stats = jaxlp.generate(model, calib, max_new_tokens=128, sampler=base_decoding(), seed=args.seed,
                               return_stats=True)
        tau0 = calibrate_tau0(stats.entropy[np.isfinite(stats.entropy)])
    config = ReSETConfig.from_tokenizer(tokenizer, args.t_low, tau0)
    prompt = args.prompt or sections[7][:400]
    result = jaxlp.generate(model, [tokenizer.encode(prompt).ids], max_new_tokens=args.max_new_tokens,
                            sampler=config, seed=args.seed, return_stats=True)
    n = int(result.num_tokens[0])
    tokens, entropy, temperature = result.tokens[0, :n], result.entropy[0, :n], result.temperature[0, :n]
    replay = reset_temperatures_from_entropies(entropy, tokens, config, return_stats=True)
    if not np.array_equal(np.asarray(replay.temperature), temperature):
        raise SystemExit("the trace function disagrees with the in-loop sampler")

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pos = np.arange(n)
    boundary = np.isin(tokens, config.double_newline_ids)
    fig, axes = plt.subplots(3, 1, figsize=(13, 8), sharex=True)
    axes[0].plot(pos, entropy, lw=0.7, label="token entropy H (raw logits)")
    axes[0].axhline(tau0, color="r", ls="--", lw=0.8, label=f"tau0 = {tau0:.3f}")
    for b in pos[boundary]:
        axes[0].axvline(b, color="grey", lw=0.4)
    axes[0].set(ylabel="nats", title=f"ReSET trace ({Path(args.model).name}, T_low={args.t_low}); grey: step "
                "boundaries")
    axes[0].legend(fontsize=8)
    axes[1].plot(pos, np.asarray(replay.step_estimate), label="step estimate", lw=0.9)
    axes[1].plot(pos, np.asarray(replay.running_mean), label="running mean Hbar", lw=0.9)
    uncertain = np.asarray(replay.uncertain)
    axes[1].fill_between(pos, 0, 1, where=uncertain, transform=axes[1].get_xaxis_transform(), alpha=0.15,
                         color="orange", label="uncertain step")
    axes[1].set(ylabel="nats")
    axes[1].legend(fontsize=8)
    axes[2].step(pos, temperature, where="mid", lw=0.8)
    axes[2].set(xlabel="generated position", ylabel="temperature", yticks=[0, args.t_low, 1.0])
    fig.tight_layout()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=110)
    share = float(np.mean(temperature >= 1.0))
    print(f"{n} tokens, tau0 {tau0:.4f}, {boundary.sum()} step boundaries, {uncertain.mean():.1%} in uncertain "
          f"steps, {share:.1%} at T_high -> {args.out}")
    print(tokenizer.decode(tokens.tolist())[:300])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
