"""Compile time of a program with many call sites of the Pallas NVFP4 matmul (a model's prefill).

A stack of ``--layers`` layers of seven NVFP4 linears (Qwen3-8B q, k, v, o, gate, up, down shapes)
at M = 128 tokens, jitted as one program: time to lower, to compile, the first and a second run.
``--variant jit`` calls ``jaxlp.pallas.nvfp4_matmul.nvfp4_matmul`` (one jit per shapes and config:
the call sites share one lowered kernel); ``--variant nojit`` its unjitted body (every call site
lowers its own copy of the Mosaic GPU kernel), for comparison.

    python scripts/bench_pallas_compile.py --variant jit --layers 36
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from jaxlp.evals import harness  # noqa: E402
from jaxlp.formats import nvfp4  # noqa: E402
from jaxlp.pallas import nvfp4_matmul as nm  # noqa: E402

SHAPES = [(4096, 4096), (1024, 4096), (1024, 4096), (4096, 4096), (12288, 4096), (12288, 4096), (4096, 12288)]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variant", choices=("jit", "nojit"), default="jit")
    ap.add_argument("--layers", type=int, default=36)
    ap.add_argument("--m", type=int, default=128)
    args = ap.parse_args(argv)
    if jax.devices()[0].platform != "gpu":
        sys.exit("bench_pallas_compile needs a GPU")
    f = nm.nvfp4_matmul if args.variant == "jit" else nm.nvfp4_matmul.__wrapped__
    ws = [nvfp4.quantize(jax.random.normal(jax.random.key(i), s) * 0.02) for i, s in enumerate(SHAPES)]
    x = jax.random.normal(jax.random.key(9), (args.m, 4096), jnp.bfloat16)

    def model(x, ws):
        h = x
        for _ in range(args.layers):
            q, k, v = f(h, ws[0]), f(h, ws[1]), f(h, ws[2])
            o = f(q + jnp.tile(k + v, (1, 4)), ws[3])
            d = f(jax.nn.silu(f(o, ws[4])) * f(o, ws[5]), ws[6])
            h = (h + d * 0.01).astype(jnp.bfloat16)
        return h

    t0 = time.time()
    low = jax.jit(model).trace(x, ws).lower()
    t1 = time.time()
    exe = low.compile()
    t2 = time.time()
    jax.block_until_ready(exe(x, ws))
    t3 = time.time()
    second = harness.time_call(exe, x, ws, warmup=0, repeats=1)  # the first run was the warm-up
    print(f"{args.variant}: {7 * args.layers} call sites, lower {t1 - t0:.1f} s, compile {t2 - t1:.1f} s, "
          f"first run {t3 - t2:.1f} s, second run {second.median_us / 1e3:.1f} ms, "
          f"StableHLO {len(low.as_text()) / 1e6:.2f} MB")


if __name__ == "__main__":
    main()
