"""FP8 and NestedFP linears against XLA's BF16 / FP16 dots, side by side in one run.

For each weight shape ``N x K`` and token count ``M``, the time of one linear product
``x [M, K] @ W.T`` (jitted, in a ``fori_loop`` of ``--n2`` minus ``--n1`` calls whose input
depends on the previous output, so nothing is hoisted; us per call):

- ``bf16`` / ``fp16``: XLA's dot on the plain weight (the baselines);
- ``nestedfp16`` / ``nestedfp8``: the NestedFP layer in FP16 / FP8 mode, FP16 activations;
- ``w8a8`` / ``w8a16``: FP8 E4M3 per-channel weights with / without per-token FP8 activations;
- ``w4a8_fireq``: FireQ INT4 weights (E4M3 group scales) with FireQ's per-token FP8 activations;
- ``nestedfp16_pallas`` / ``nestedfp8_pallas`` / ``w8a8_pallas``: those layers forced onto the Pallas
  GEMMs (``nestedfp_pallas``, ``fp8_pallas``) whatever ``--implementation`` says;

each quantized layer with ``--implementation`` (``auto``: XLA's native FP8 / FP16 dots on a
GPU, :mod:`jaxlp.quantization.native_dot`; ``xla``: the float32 reference). Floor: the larger of
bytes / copy bandwidth and FLOPs / the measured dense BF16 rate (FP8 rows: twice that rate).

    python scripts/bench_fp8.py --out docs/bench_fp8_h100.json --plot docs/bench_fp8_h100.png
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from jaxlp.evals import harness  # noqa: E402
from jaxlp.formats import fp8, int4_fp8, nestedfp  # noqa: E402
from jaxlp.progress import Reporter  # noqa: E402
from jaxlp.quantization.linear import QuantizedLinear  # noqa: E402

SHAPES = "12288x4096,6144x4096,4096x4096,28672x4096,4096x14336"  # N x K: Llama-3.1-8B linears and the issue's
VARIANTS = ("bf16", "fp16", "nestedfp16", "nestedfp8", "w8a8", "w8a16", "w4a8_fireq", "nestedfp16_pallas",
            "nestedfp8_pallas", "w8a8_pallas")
GPU_VARIANTS = ("nestedfp16_pallas", "nestedfp8_pallas", "w8a8_pallas")  # Mosaic GPU kernels: no CPU path


def per_call_us(fn, params, x, n1: int, n2: int, repeats: int) -> float:
    """us per ``fn(params, x)`` call: ``(t(n2) - t(n1)) / (n2 - n1)`` of a jitted loop feeding each
    output back. ``params`` are arguments, not constants folded into the program, and pass an
    optimization barrier with each output, so work on the weights alone (a dequantize, a merge)
    cannot be hoisted out of the loop."""
    def body(i, carry):
        params, x, acc = carry
        y = fn(params, x + acc.astype(x.dtype))
        params, y = jax.lax.optimization_barrier((params, y))
        return params, x, (y[0, 0].astype(jnp.float32) * 1e-30)

    # n traced: one compiled while loop serves both lengths.
    loop = jax.jit(lambda params, x, n: jax.lax.fori_loop(0, n, body, (params, x, jnp.float32(0)))[2])
    times = {}
    for n in (n1, n2, n1, n2):
        samples = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            jax.block_until_ready(loop(params, x, jnp.int32(n)))
            samples.append(time.perf_counter() - t0)
        times[n] = float(np.median(samples))
    return (times[n2] - times[n1]) / (n2 - n1) * 1e6


def layers(w: np.ndarray, implementation: str) -> dict:
    """Variant -> (fn(params, x), params, activation dtype, weight bytes, FP8 tensor-core rate?)."""
    w16 = jnp.asarray(w, jnp.float16)
    wb = jnp.asarray(w, jnp.bfloat16)
    nested = nestedfp.quantize(w16)
    w8 = fp8.quantize(jnp.asarray(w), granularity="channel")
    n, k = w.shape

    def dot(weight, x):  # written in x's dtype by the GEMM itself (FP32 sums inside cuBLAS)
        return jnp.einsum("mk,nk->mn", x, weight)

    def q(weight, impl=implementation, **kw):
        graphdef, state = nnx.split(QuantizedLinear(weight, implementation=impl, **kw))
        return (lambda state, x: nnx.merge(graphdef, state)(x)), state

    return {
        "bf16": (dot, wb, jnp.bfloat16, 2 * n * k, False),
        "fp16": (dot, w16, jnp.float16, 2 * n * k, False),
        "nestedfp16": (*q(nested), jnp.float16, 2 * n * k, False),
        "nestedfp8": (*q(nested, mode="fp8"), jnp.float16, n * k, True),
        "w8a8": (*q(w8, activation="fp8_token"), jnp.bfloat16, n * k, True),
        "w8a16": (*q(w8), jnp.bfloat16, n * k, False),
        "w4a8_fireq": (*q(int4_fp8.quantize(jnp.asarray(w)), activation="fireq_fp8"), jnp.bfloat16,
                       n * k // 2 + n * k // int4_fp8.GROUP_SIZE, True),
        "nestedfp16_pallas": (*q(nested, "nestedfp_pallas"), jnp.float16, 2 * n * k, False),
        "nestedfp8_pallas": (*q(nested, "fp8_pallas", mode="fp8"), jnp.float16, n * k, True),
        "w8a8_pallas": (*q(w8, "fp8_pallas", activation="fp8_token"), jnp.bfloat16, n * k, True),
    }


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default=SHAPES, help="N x K weight shapes, comma separated")
    p.add_argument("--m", default="1,8,32,256,2048", help="token counts M")
    p.add_argument("--variants", default=None, help="comma separated (default: all; off a GPU all but the "
                                                     f"Pallas ones, {', '.join(GPU_VARIANTS)})")
    p.add_argument("--implementation", default="auto", choices=("auto", "xla", "nestedfp_cuda", "xla_native"))
    p.add_argument("--n1", type=int, default=8)
    p.add_argument("--n2", type=int, default=40)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default=None)
    p.add_argument("--plot", default=None)
    args = p.parse_args(argv)
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    ms = [int(v) for v in args.m.split(",")]
    on_gpu = jax.default_backend() == "gpu"
    variants = args.variants.split(",") if args.variants else [v for v in VARIANTS if on_gpu or v not in GPU_VARIANTS]
    unknown = sorted(set(variants) - set(VARIANTS))
    if unknown:
        p.error(f"unknown variants {unknown}; known: {', '.join(VARIANTS)}")
    if not on_gpu and set(variants) & set(GPU_VARIANTS):
        p.error(f"variants {sorted(set(variants) & set(GPU_VARIANTS))} run Mosaic GPU kernels: they need a GPU")
    rows = []
    bandwidth = rate = None
    if jax.default_backend() == "gpu":
        x = jnp.ones((1 << 28,), jnp.float32)
        bandwidth = 2 * x.nbytes / (harness.time_call(jax.jit(lambda a: a * 1.0001), x, repeats=5).median_us * 1e-6)
        a = jnp.ones((8192, 8192), jnp.bfloat16)
        rate = 2 * 8192**3 / (harness.time_call(jax.jit(lambda a: a @ a), a, repeats=5).median_us * 1e-6)
        print(f"copy {bandwidth / 1e12:.2f} TB/s, BF16 dense {rate / 1e12:.0f} TFLOP/s", flush=True)
    reporter = Reporter()
    rng = np.random.default_rng(0)
    with reporter.bar("timing linears", len(shapes) * len(ms) * len(variants)) as advance:
        for n, k in shapes:
            w = np.clip(rng.standard_normal((n, k)).astype(np.float32) * 0.02, -1.75, 1.75)
            table = layers(w, args.implementation)
            for m in ms:
                x = jnp.asarray(rng.standard_normal((m, k)), jnp.float32)
                base = {}
                for name in variants:
                    fn, params, dtype, wbytes, fp8_rate = table[name]
                    us = per_call_us(fn, params, x.astype(dtype), args.n1, args.n2, args.repeats)
                    row = dict(n=n, k=k, m=m, variant=name, us=us, implementation=args.implementation)
                    if bandwidth:
                        flop_rate = rate * (2 if fp8_rate else 1)
                        row["floor_us"] = max((wbytes + 2 * m * (k + n)) / bandwidth, 2 * m * n * k / flop_rate) * 1e6
                    base[name] = us
                    row["x_fp16"] = base["fp16"] / us if "fp16" in base else None
                    row["x_bf16"] = base["bf16"] / us if "bf16" in base else None
                    rows.append(row)
                    advance(1)
    result = dict(harness.run_metadata(argv), rows=rows)
    if args.out:
        harness.write_json(args.out, result)
    if args.plot:
        plt = harness.pyplot()
        fig, ax = plt.subplots(figsize=(8, 4))
        for name in variants:
            pts = [(r["m"], r["x_fp16"]) for r in rows if r["variant"] == name and r["n"] == shapes[0][0]
                   and r["k"] == shapes[0][1] and r["x_fp16"]]
            if pts:
                ax.plot(*zip(*pts), marker="o", label=name)
        ax.set(xscale="log", xlabel="M (tokens)", ylabel="speed vs XLA FP16 dot",
               title=f"{shapes[0][0]} x {shapes[0][1]} weight, implementation={args.implementation}")
        ax.legend()
        fig.tight_layout()
        fig.savefig(args.plot, dpi=120)
    print(f"\n{'N x K':>13} {'M':>5} " + "".join(f"{v:>14}" for v in variants) + "   (us; x FP16 in brackets)")
    for n, k in shapes:
        for m in ms:
            cells = {r["variant"]: r for r in rows if (r["n"], r["k"], r["m"]) == (n, k, m)}
            text = "".join(f"{cells[v]['us']:>7.1f}" + (f" ({cells[v]['x_fp16']:.2f})" if cells[v]["x_fp16"] else
                                                           "       ") for v in variants)
            print(f"{n:>6}x{k:<6} {m:>5} {text}")
    return result


if __name__ == "__main__":
    main()
