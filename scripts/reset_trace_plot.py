"""ReSET on a real trace (the paper's Figure 3 / 4(a) views), written as PNG.

- ``--kind text`` (default; e.g. Gemma 3): the prompt is the start of an offline text
  section; tau0 calibrated on T = 0.6 generations from 5 other sections.
- ``--kind testbed`` (the testbed reasoner): the prompt is the question of held-out problem
  ``--problem``; tau0 from T = 0.6 generations on 5 training-split problems. The entropy axes
  are logarithmic, each step is labelled with its head and the title says whether the answer
  is correct.

    python scripts/reset_trace_plot.py --model ~/.cache/jaxlp/gemma3-270m --out docs/reset_trace_gemma3_270m.png
    python scripts/reset_trace_plot.py --model jaxlp/assets/reasoner --kind testbed --problem 9 --out docs/reset_trace_testbed.png

What is computed and drawn: :mod:`jaxlp.evals.traces`.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import jax.numpy as jnp

import jaxlp
from jaxlp.evals.traces import TraceMismatchError, plot_reset_trace, reset_trace, testbed_prompts, text_prompts
from jaxlp.models.tokenizer import load_tokenizer


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
    if args.kind == "testbed":
        prompts = testbed_prompts(args.model, tokenizer, args.problem, args.seed, args.max_new_tokens)
    else:
        prompts = text_prompts(tokenizer, args.prompt, args.max_new_tokens)
    try:
        trace = reset_trace(model, tokenizer, prompts, t_low=args.t_low, tau0=args.tau0, seed=args.seed)
    except TraceMismatchError as e:
        raise SystemExit(str(e)) from None
    plot_reset_trace(trace, args.out, Path(args.model.rstrip("/")).name, log_scale=args.kind == "testbed")
    print(f"{trace.summary()} -> {args.out}")
    print(trace.text[:300])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
