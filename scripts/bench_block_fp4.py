"""MXFP4 and DialectFP4 linears against NVFP4 and XLA's BF16 dot: the FP4 GEMV family in one table.

Per (shape, M), side by side in one run, device time per call (scripts/bench_nvfp4.py's method:
one call per weight buffer inside one jit, buffers together > 4x the L2, a profiler trace):

- ``bf16``: XLA's BF16 dot on BF16 weights (the baseline);
- ``nvfp4``: NVFP4 W4A16 through ``implementation="auto"`` (its measured dispatch table);
- ``mxfp4`` / ``dialect``: W4A16 through ``"auto"`` (:mod:`jaxlp.quantization.block_fp4_dispatch`);
  ``mxfp4-a4`` / ``dialect-a4``: W4A4 (the weight's own activation quantizer);
  ``mxfp4-xla`` / ``dialect-xla`` (and ``-a4-xla``): the pure-JAX reference path, for the "before";
  ``mxfp4-dot`` / ``dialect-dot``: the exact BF16 dequantize-then-dot that ``"auto"`` takes past 32 tokens;
  ``mxfp4:P2C1`` / ``dialect:G128x64S2`` etc.: a launch (:meth:`jaxlp.ffi.block_fp4.Config.from_name`;
  the GEMV ``P`` at M <= 32 only).

Per row: us, x over BF16, the floor (the stored weight's bytes + BF16 activations in and out at the
measured copy bandwidth) and % of copy bandwidth on those bytes. JSON (``--out``) and a plot of
x over BF16 against M per shape (``--plot``).

    python scripts/bench_block_fp4.py --out docs/bench_block_fp4_h100.json --plot docs/bench_block_fp4_h100.png
    python scripts/bench_block_fp4.py --shapes "Qwen3-8B o" --ms 1,8,32 \\
        --methods bf16,mxfp4:P1C1,mxfp4:P1C2,mxfp4:P2C1,mxfp4:P2C2,mxfp4:P1C4,mxfp4:P2C4
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import bench_nvfp4 as bn  # noqa: E402

from jaxlp.ffi import block_fp4  # noqa: E402
from jaxlp.formats import dialect_fp4, mxfp4, nvfp4  # noqa: E402
from jaxlp.progress import Reporter  # noqa: E402
from jaxlp.quantization import QuantizedLinear  # noqa: E402
from jaxlp.quantization import block_fp4_dispatch  # noqa: E402

DEFAULT_SHAPES = ("Qwen3-8B qkv", "Qwen3-8B o", "Qwen3-8B gate_up", "Qwen3-8B down", "Qwen3-8B gate_up fused")
DEFAULT_METHODS = "bf16,nvfp4,mxfp4,dialect,mxfp4-a4,dialect-a4"
FORMATS = {"nvfp4": nvfp4, "mxfp4": mxfp4, "dialect": dialect_fp4}
TARGET_BYTES = 200 << 20


def stored_bytes(fmt: str, n: int, k: int) -> int:
    """Bytes of the stored weight: codes, then the block scales (and DialectFP4's dialect ids)."""
    return n * k // 2 + {"nvfp4": n * k // 16 + 4, "mxfp4": n * k // 32, "dialect": n * k // 32 + n * k // 64}[fmt]


def product(method: str):
    """``fn(x, w)`` of a method name (module doc) on its format's weight."""
    fmt, _, launch = method.partition(":")
    if launch:
        cfg = block_fp4.Config.from_name(launch)
        return lambda x, w: block_fp4.matmul(x, w, config=cfg)
    base = fmt.split("-")[0]
    if fmt.endswith("-dot"):
        return lambda x, w: block_fp4_dispatch.dequantize_dot(x, w).astype(x.dtype)
    act = {"mxfp4": "mxfp4", "dialect": "dialect_fp4"}.get(base) if "-a4" in fmt else None
    impl = "xla" if fmt.endswith("-xla") else "auto"

    def fn(x, w):
        return QuantizedLinear(w, activation=act, implementation=impl)(x)

    return fn


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default=",".join(DEFAULT_SHAPES), help="names from bench_nvfp4.qwen3_shapes()")
    ap.add_argument("--ms", default="1,2,4,8,16,32,64,128,512,2048")
    ap.add_argument("--methods", default=DEFAULT_METHODS)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", default=None)
    ap.add_argument("--plot", default=None)
    args = ap.parse_args(argv)

    shapes = {name: (n, k) for name, n, k in bn.qwen3_shapes()}
    chosen = [s.strip() for s in args.shapes.split(",")]
    unknown = [s for s in chosen if s not in shapes]
    if unknown:
        raise SystemExit(f"unknown shapes {unknown}; known: {list(shapes)}")
    methods = [m.strip() for m in args.methods.split(",")]
    ms = [int(m) for m in args.ms.split(",")]
    start = time.time()
    dev = jax.devices()[0]
    result = dict(device=dev.device_kind, date=time.strftime("%Y-%m-%d"),
                  argv=sys.argv[1:] if argv is None else argv, bandwidth=bn.copy_bandwidth(), rows=[],
                  method="device time = union of GPU kernel intervals per call from a profiler trace")
    bw = result["bandwidth"]["copy_TBps"] * 1e12
    print(f"# {dev.device_kind}: copy {bw / 1e12:.2f} TB/s", flush=True)
    with Reporter().bar("shapes x M", len(chosen) * len(ms)) as advance:
        for name in chosen:
            n, k = shapes[name]
            key = jax.random.key(n + 3 * k)
            count = max(2, min(24, -(-TARGET_BYTES // (n * k // 2))))
            weights = {"bf16": [jax.random.normal(jax.random.fold_in(key, 100 + i), (n, k), jnp.bfloat16) * 0.02
                                for i in range(max(2, min(24, -(-TARGET_BYTES // (2 * n * k)))))]}
            for fmt, mod in FORMATS.items():
                if any(m.split(":")[0].split("-")[0] == fmt for m in methods):
                    quant = jax.jit(lambda kk, mod=mod: mod.quantize(jax.random.normal(kk, (n, k), jnp.float32) * 0.02))
                    weights[fmt] = [quant(jax.random.fold_in(key, i)) for i in range(count)]
            jax.block_until_ready(weights)
            for m in ms:
                jobs = bn.Jobs(args.reps)
                for method in methods:
                    fmt = method.split(":")[0].split("-")[0]
                    if ":" in method and method.split(":")[1].startswith("P") and m > block_fp4.MAX_M:
                        continue
                    fn = (lambda x, w: jnp.dot(x, w.T)) if method == "bf16" else product(method)
                    jobs.add(method, fn, weights[fmt], m, k)
                times = {kk: bn._pick(t) for kk, t in jobs.run().items()}
                base = times.get("bf16")
                for method, t in times.items():
                    fmt = method.split(":")[0].split("-")[0]
                    nbytes = (2 * n * k if fmt == "bf16" else stored_bytes(fmt, n, k)) + 2 * m * (k + n)
                    row = dict(shape=name, n=n, k=k, m=m, method=method, us=bn._us(t),
                               floor_us=1e6 * nbytes / bw, x_bf16=(base / t) if base and t else None)
                    row["copy_pct"] = 100 * row["floor_us"] / row["us"] if row["us"] else None
                    if method.startswith(("mxfp4", "dialect")) and ":" not in method and "xla" not in method:
                        cfg = block_fp4_dispatch.default_config(m, n, k)
                        row["path"] = "xla-bf16-dot" if cfg is None or method.endswith("-dot") else cfg.name
                    result["rows"].append(row)
                advance(1)
            del weights
            if args.out:
                Path(args.out).write_text(json.dumps(result, indent=1))
    result["elapsed_s"] = time.time() - start
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    print_table(result, methods, ms)
    if args.plot:
        plot(result, args.plot)


def print_table(result, methods, ms):
    rows = {(r["shape"], r["m"], r["method"]): r for r in result["rows"]}
    print("\n| shape | M | " + " | ".join(methods) + " |")
    print("|---|---|" + "---|" * len(methods))
    for shape in dict.fromkeys(r["shape"] for r in result["rows"]):
        for m in ms:
            cells = []
            for method in methods:
                r = rows.get((shape, m, method))
                if r is None or r["us"] is None:
                    cells.append("-")
                elif method == "bf16":
                    cells.append(f"{r['us']:.1f}")
                else:
                    cells.append(f"{r['us']:.1f} ({r['x_bf16']:.2f}x, {r['copy_pct']:.0f}%)")
            print(f"| {shape} | {m} | " + " | ".join(cells) + " |")


def plot(result, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shapes = list(dict.fromkeys(r["shape"] for r in result["rows"]))
    fig, axes = plt.subplots(1, len(shapes), figsize=(4.2 * len(shapes), 3.6), squeeze=False)
    for ax, shape in zip(axes[0], shapes):
        rows = [r for r in result["rows"] if r["shape"] == shape and r["method"] != "bf16" and r["x_bf16"]]
        for method in dict.fromkeys(r["method"] for r in rows):
            pts = sorted((r["m"], r["x_bf16"]) for r in rows if r["method"] == method)
            ax.plot(*zip(*pts), marker="o", label=method)
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set_xscale("log", base=2)
        ax.set_title(shape, fontsize=9)
        ax.set_xlabel("tokens M")
    axes[0][0].set_ylabel("x over XLA BF16 dot")
    axes[0][-1].legend(fontsize=7)
    fig.suptitle(f"FP4 formats on {result['device']} ({result['date']})", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
