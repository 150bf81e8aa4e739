"""Train the testbed reasoner: a small Qwen3-architecture model on generated multi-step arithmetic.

    python scripts/train_reasoner.py                            # GPU: auto step count within --time-budget
    python scripts/train_reasoner.py --tiny --steps 200         # CPU smoke test (tiny model, easy problems)

The training (schedule, automatic step count, evaluations, checkpoint) is :mod:`jaxlp.testbed.training`;
``--time-budget`` counts from the script's start.
"""

from __future__ import annotations

import time

T_START = time.monotonic()

import argparse  # noqa: E402
from pathlib import Path  # noqa: E402

from jaxlp.testbed.training import DEFAULT_OUT, TrainSettings, train  # noqa: E402


def parse_args(argv=None) -> TrainSettings:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT, help="checkpoint directory (default jaxlp/assets/reasoner)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tiny", action="store_true", help="tiny model and easy problems (CPU smoke test)")
    ap.add_argument("--steps", default="auto", help="number of steps, or 'auto' (fit --time-budget)")
    ap.add_argument("--time-budget", type=float, default=540.0, help="seconds from start to checkpoint written")
    ap.add_argument("--max-steps", type=int, default=20000, help="cap on the automatic step count")
    ap.add_argument("--probe-steps", type=int, default=30, help="steps timed before fixing the automatic step count")
    ap.add_argument("--batch-size", type=int, default=None, help="rows per step (default 128; tiny 16)")
    ap.add_argument("--seq-len", type=int, default=None, help="tokens per row (default 512; tiny 192)")
    ap.add_argument("--lr", type=float, default=None, help="peak learning rate (default 1e-3; tiny 3e-3)")
    ap.add_argument("--warmup", type=int, default=None, help="warmup steps (default 200; tiny 20)")
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--compute-dtype", choices=("auto", "bf16", "f32"), default="auto",
                    help="auto: bf16 on GPU, f32 on CPU (master weights are always f32)")
    ap.add_argument("--eval-every", type=int, default=None, help="steps between evaluations (default 1000; tiny 100)")
    ap.add_argument("--eval-problems", type=int, default=None,
                    help="held-out problems per evaluation (default 256; tiny 32)")
    ap.add_argument("--final-eval-problems", type=int, default=None,
                    help="held-out problems of the final evaluation (default 1024; tiny 64)")
    ap.add_argument("--workers", type=int, default=None, help="data worker processes (default min(4, cpus-1); tiny 0)")
    ap.add_argument("--shard-mb", type=float, default=12.0, help="max safetensors shard size in MB")
    ap.add_argument("--log-every", type=int, default=50, help="steps per row of the loss log")
    for knob in ("min_terms", "max_terms", "max_digits", "start_digits"):
        ap.add_argument("--" + knob.replace("_", "-"), type=int, default=None, help=f"problem {knob} (default: the spec's)")
    ap.add_argument("--multiply-prob", type=float, default=None, help="chance of a final multiplication")
    ap.add_argument("--snapshots", default="",
                    help="comma-separated steps at which the bf16 parameters are kept and evaluated at T = 0.6 "
                         "in BF16 and NVFP4 W4A4 (--snapshot-problems held-out problems)")
    ap.add_argument("--snapshot-problems", type=int, default=512)
    ap.add_argument("--ship-min-accuracy", type=float, default=None,
                    help="save the first snapshot whose BF16 T = 0.6 accuracy reaches this instead of the final "
                         "parameters (the last snapshot if none does)")
    ap.add_argument("--order-window", type=int, default=None,
                    help="terms are added in random order within blocks of this many (1: left to right; "
                         ">= max terms: fully random; default 2)")
    try:
        return TrainSettings(**vars(ap.parse_args(argv)))
    except ValueError as e:
        ap.error(str(e))


def main(argv=None):
    train(parse_args(argv), start=T_START)


if __name__ == "__main__":
    main()
