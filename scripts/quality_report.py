"""Quality of every quantization recipe on the real Gemma 3 270M checkpoint and offline English text.

For each recipe: perplexity on held-out text, mean KL divergence KL(reference || quantized)
per token against the unquantized model, the relative weight error of every quantized layer,
and the bytes of the decoder linear weights (:mod:`jaxlp.evals.quality`). Prints a table,
writes JSON, a Markdown table and a plot.

    python scripts/quality_report.py --model ~/.cache/jaxlp/gemma3-270m --out docs/quality

Caveat: the checkpoint's weights were already 4-bit (GGUF Q4_K_M) before dequantization, so
the errors measured here are a lower bound of what a full-precision checkpoint would show.
"""

from __future__ import annotations

import argparse

from jaxlp.evals.quality import DEFAULT_RECIPES, quality_table, run_quality_report
from jaxlp.quantization import RECIPES


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--out", default="docs/quality")
    parser.add_argument("--recipes", default=",".join(DEFAULT_RECIPES))
    parser.add_argument("--eval-sequences", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--calibration-sequences", type=int, default=8)
    args = parser.parse_args(argv)
    recipes = args.recipes.split(",")
    for spec in recipes:
        if spec.partition(":")[0] not in RECIPES:
            raise SystemExit(f"unknown recipe {spec.partition(':')[0]!r}")
    results = run_quality_report(args.model, args.out, recipes=recipes, eval_sequences=args.eval_sequences,
                                 seq_len=args.seq_len, calibration_sequences=args.calibration_sequences)
    print(quality_table(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
