"""Accuracy of the testbed reasoner across weight formats x samplers x KV caches (ReSET Tables 1, 2, 5).

    python scripts/eval_reasoner.py --out docs/eval_reasoner               # GPU: full run (256 problems x 8 seeds)
    python scripts/eval_reasoner.py --quick --out /tmp/eval_quick           # CPU smoke run (< 3 min)
    python scripts/eval_reasoner.py --list                                  # planned configs and compiles

The evaluation (tables, statistics, row-group programs) is :mod:`jaxlp.evals.reasoner`.
"""

from __future__ import annotations

import time

T_START = time.monotonic()

import argparse  # noqa: E402
import shlex  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

from jaxlp import sampling  # noqa: E402
from jaxlp.evals.reasoner import run_evaluation  # noqa: E402
from jaxlp.evals.reasoner_plan import (  # noqa: E402
    DEFAULT_CACHES, DEFAULT_FORMATS, DEFAULT_MODEL, DEFAULT_SAMPLERS, QUANT_WEIGHTS, REFERENCE_WEIGHTS, WEIGHTS,
    describe_plan, resolve_eval_settings,
)


def parse_args(argv=None):
    """The command line as :class:`jaxlp.evals.reasoner_plan.EvalSettings`, and whether to only list."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", type=Path, default=DEFAULT_MODEL,
                    help="checkpoint directory (default: the embedded reasoner)")
    ap.add_argument("--out", type=Path, default=None, help="output prefix: writes PREFIX.md, PREFIX.json, PREFIX.png")
    ap.add_argument("--problems", type=int, default=None, help="held-out problems (default 256; quick 4)")
    ap.add_argument("--seeds", type=int, default=None, help="samples per problem (default 8; quick 2)")
    ap.add_argument("--eval-seed", type=int, default=0, help="seed of eval_problems")
    ap.add_argument("--seed", type=int, default=0, help="sampling seed of the first generate call of each program")
    ap.add_argument("--calib-seed", type=int, default=1, help="training-stream seed of all calibration data")
    ap.add_argument("--tables", default="1,2,5", help="comma-separated: 1 (formats), 2 (samplers), 5 (KV caches)")
    ap.add_argument("--formats", default=None, help=f"Table 1 weights (default {','.join(DEFAULT_FORMATS)}; "
                    f"known: {','.join(WEIGHTS)})")
    ap.add_argument("--samplers", default=None, help="Table 2 samplers (default: all of "
                    f"{','.join(DEFAULT_SAMPLERS)})")
    ap.add_argument("--caches", default=None, help=f"Table 5 KV caches (default {','.join(DEFAULT_CACHES)})")
    ap.add_argument("--sampler-weights", default=None, help=f"weights of Table 2 (default {REFERENCE_WEIGHTS},"
                    f"{QUANT_WEIGHTS})")
    ap.add_argument("--cache-weights", default=None, help=f"weights of Table 5 (default {REFERENCE_WEIGHTS},"
                    f"{QUANT_WEIGHTS}; quick {REFERENCE_WEIGHTS})")
    ap.add_argument("--t-low", type=float, default=0.1, help="entropy samplers: temperature of confident tokens")
    ap.add_argument("--t-high", type=float, default=1.0, help="entropy samplers: temperature of uncertain tokens")
    ap.add_argument("--window", type=int, default=32, help="entropy samplers: window w")
    ap.add_argument("--tau0-percentile", type=float, default=sampling.TAU0_PERCENTILE,
                    help="tau0 = this percentile of the calibration entropies (the paper: 80)")
    ap.add_argument("--calibration-rows", type=int, default=None,
                    help="512-token training rows for static activation scales and FireQ KV (default 8; quick 2)")
    ap.add_argument("--max-rows", type=int, default=4096, help="rows per generate call (all groups together)")
    ap.add_argument("--max-cache-groups", type=int, default=3, help="KV caches per compiled program (Table 5)")
    ap.add_argument("--workers", type=int, default=None, help="programs run concurrently (default 6 on GPU, 1 on CPU)")
    ap.add_argument("--time-limit", type=float, default=None,
                    help="seconds from the start after which no generate call starts (what finished is written)")
    ap.add_argument("--bootstrap", type=int, default=2000, help="resamples of the problem bootstrap")
    ap.add_argument("--quick", action="store_true", help="CPU smoke run: 4 problems x 2 seeds, few configs")
    ap.add_argument("--list", action="store_true", help="print the planned programs and exit")
    options = vars(ap.parse_args(argv))
    list_only = options.pop("list")
    try:
        return resolve_eval_settings(**options), list_only
    except ValueError as e:
        ap.error(str(e))


def main(argv=None) -> int:
    settings, list_only = parse_args(argv)
    if list_only:
        print("\n".join(describe_plan(settings)))
        return 0
    if settings.out is None:
        raise SystemExit("eval_reasoner: --out PREFIX is required (or --list)")
    command = shlex.join(["python", "scripts/eval_reasoner.py"] + list(sys.argv[1:] if argv is None else argv))
    evaluation = run_evaluation(settings, command=command, start=T_START)
    print(settings.out.with_name(settings.out.name + ".md").read_text())
    print(f"total wall time {evaluation.meta['wall_s']:.1f} s ({len(evaluation.reports)} configs, "
          f"{len(evaluation.skipped)} programs not run)")
    return 0 if not evaluation.skipped else 1


if __name__ == "__main__":
    raise SystemExit(main())
