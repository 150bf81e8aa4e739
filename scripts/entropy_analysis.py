"""Token and step entropies under NVFP4 (the ReSET paper's Figures 2, 3 and 8): PNG, JSON and Markdown.

    python scripts/entropy_analysis.py --model jaxlp/assets/reasoner --kind testbed --out docs/entropy_testbed
    python scripts/entropy_analysis.py --model ~/.cache/jaxlp/gemma3-270m --kind text --out docs/entropy_gemma3_270m

What is computed: :mod:`jaxlp.evals.entropy`.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

from jaxlp.evals.entropy import run_entropy_analysis


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
    options = vars(args)
    model, kind, out = options.pop("model"), options.pop("kind"), options.pop("out")
    report = run_entropy_analysis(model, kind, out, command=command, **options)
    o = report["overall"]
    print(f"{report['tokens']} tokens, {report['steps']['count']} steps, {report['meta']['seconds']:.0f} s; mean H "
          f"ref {o['reference']['mean_entropy']:.4f}, W4A4 {o['w4a4-nvfp4']['mean_entropy']:.4f} "
          f"(KL {o['w4a4-nvfp4']['mean_kl']:.4f}, flips {o['w4a4-nvfp4']['flip_rate']:.4f}) "
          f"-> {Path(out)}.{{png,json,md}}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
