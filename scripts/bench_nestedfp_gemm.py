"""The NestedFP16 and FP8 GEMMs (Pallas, CUTLASS, CUDA) against XLA's dots on the NestedFP paper's GEMM sweep.

The paper's 14 (N, K) linear shapes of Llama 3.1 8B, Mistral Nemo, Phi-4 and Mistral Small (qkv,
o, gate_up, down; two of Mistral Small's repeat Nemo's) x M = 32..2048 step 32 (``--ms``), side by
side in one run, by ``--mode``:

- ``fp16``: XLA's FP16 dot on the FP16 weights (the baseline) against
  :func:`jaxlp.pallas.nestedfp_matmul` on the NestedFP byte planes of the same weights;
- ``fp8``: the FP16 dot against NestedFP's FP8 mode, activation quantization included (per-token
  scales), through the ``fp8_pallas`` layer product (:mod:`jaxlp.quantization.fp8_gemm`: the CUDA
  quantizer, then :func:`jaxlp.pallas.fp8_matmul`);
- ``w8a8``: XLA's BF16 dot against W8A8-FP8 (per-channel weights, per-token activations quantized
  in the call) through the same layer product.

``--configs``: the Pallas kernel's tilings (``default``: the kernel's default of M, or
``MatmulConfig`` names), ``xla``: the same layer through XLA's own dots
(:mod:`jaxlp.quantization.native_dot`: merge-then-dot in FP16 mode, the FP8 dot then a scale pass),
``cutlass-fp16[:<tiles>]`` (``fp16`` mode): CUTLASS's own FP16 GEMM on the FP16 weights, a second
baseline (not one of "ours"); ``cutlass`` / ``cutlass:<name>[:<promote_k>]``: CUTLASS's kernels (:mod:`jaxlp.ffi.cutlass_gemm`;
the default of M or a ``NESTEDFP_CONFIGS`` name in ``fp16`` mode, a ``CONFIGS`` name and K per
promoted sum through the layer product in ``fp8`` and ``w8a8`` modes),
and the CUDA kernels of :mod:`jaxlp.ffi.nestedfp` through the layer product
(:mod:`jaxlp.quantization.nestedfp_dispatch`): ``gemv[U<unroll>][S<splits>]`` the GEMV (1..8 tokens,
FP16 mode 1..16), ``skinny[S<splits>]`` FP16 mode's skinny GEMM (1..64); unset: the defaults.
Per GEMM: us of device time, the ratio ``baseline / best`` (> 1: faster than the baseline) and
the floor of ours (the larger of its bytes (stored weight, 16-bit activations in and out) / copy
bandwidth and 2MNK / the measured dense BF16 rate, FP8 modes twice that rate). Summary: the mean and worst gap per shape and over all
GEMMs (FP16 mode's goal: within 3% on average, never more than 10% behind).

Method: scripts/bench_nvfp4.py's (imported): each timed function calls the GEMM once per weight
buffer inside one jit (buffers together > 4x the 50 MB L2, so weights stream from HBM, as the paper
flushes caches), every call with its own activations; device time from a profiler trace.

    python scripts/bench_nestedfp_gemm.py --out docs/bench_nestedfp_gemm_h100.json --plot docs/bench_nestedfp_gemm_h100.png
    python scripts/bench_nestedfp_gemm.py --mode fp8 --shapes 12288x4096 --ms 256,2048 --configs default,xla
    python scripts/bench_nestedfp_gemm.py --shapes 12288x4096 --ms 128,512,2048 \\
        --configs default,N64M128K64S4nm8s,N64M256K64S3nm8   # a tile sweep
    python scripts/bench_nestedfp_gemm.py --mode fp8 --shapes 28672x4096 --ms 1,8 --configs gemv,gemvU1S1,gemvU2S0
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import bench_nvfp4 as bn  # noqa: E402

from jaxlp.ffi import cutlass_gemm  # noqa: E402
from jaxlp.ffi import nestedfp as cuda_nestedfp  # noqa: E402
from jaxlp.formats import fp8, nestedfp  # noqa: E402
from jaxlp.pallas import fp8_matmul as fm  # noqa: E402
from jaxlp.pallas import nestedfp_matmul as nm  # noqa: E402
from jaxlp.progress import Reporter  # noqa: E402
from jaxlp.quantization import fp8_gemm, native_dot, nestedfp_dispatch  # noqa: E402

# (model, layer, N, K): each model's qkv, o, gate_up, down.
PAPER_SHAPES = (
    ("llama3.1-8b", "qkv", 6144, 4096), ("llama3.1-8b", "o", 4096, 4096),
    ("llama3.1-8b", "gate_up", 28672, 4096), ("llama3.1-8b", "down", 4096, 14336),
    ("mistral-nemo", "qkv", 6144, 5120), ("mistral-nemo", "o", 5120, 4096),
    ("mistral-nemo", "gate_up", 28672, 5120), ("mistral-nemo", "down", 5120, 14336),
    ("phi-4", "qkv", 7680, 5120), ("phi-4", "o", 5120, 5120),
    ("phi-4", "gate_up", 35840, 5120), ("phi-4", "down", 5120, 17920),
    ("mistral-small", "gate_up", 65536, 5120), ("mistral-small", "down", 5120, 32768),
)
TARGET_BYTES = 220 << 20  # weight buffers per shape: > 4x the 50 MB L2


MODES = ("fp16", "fp8", "w8a8")


def parse_config(name: str, mode: str = "fp16"):
    """``default`` (None: the kernel's default of M), ``xla`` (XLA's dots), ``gemv[U<u>S<s>]`` (the
    GEMV's keywords) or a kernel config name:
    :attr:`nestedfp_matmul.MatmulConfig.name` in FP16 mode (``N64M256K64S3nm8``, ``...s`` for the
    weight tile through shared memory, ``...-jnp`` for the array-op merge), else
    :attr:`fp8_matmul.MatmulConfig.name` (``N64M128K128S5nm8p``, ``p``: step sums promoted)."""
    if name in ("default", "xla"):
        return None
    if fp16 := re.fullmatch(r"cutlass-fp16(?::(\w+))?", name):
        if mode != "fp16":
            raise ValueError("cutlass-fp16 (CUTLASS's FP16 GEMM on the FP16 weights) takes --mode fp16")
        return dict(config=fp16.group(1) or cutlass_gemm.FP16_CONFIGS[0])
    if cutlass := re.fullmatch(r"cutlass(?::([a-z0-9]+))?(?::(\d+))?", name):
        config, promote_k = cutlass.groups()
        known = cutlass_gemm.NESTEDFP_CONFIGS if mode == "fp16" else cutlass_gemm.CONFIGS
        if config and config not in known:
            raise ValueError(f"unknown CUTLASS config {config!r} for --mode {mode}; known: {sorted(known)}")
        if mode == "fp16":
            if promote_k:
                raise ValueError("the NestedFP16 CUTLASS kernels take no promote_k")
            return dict(config=config)
        return dict(config=config, promote_k=int(promote_k or cutlass_gemm.PROMOTE_K))
    if gemv := re.fullmatch(r"(gemv|skinny)(?:U([124]))?(?:S(\d+))?", name):
        if mode == "w8a8":
            raise ValueError("the NestedFP GEMV configs take --mode fp16 or fp8")
        design, unroll, splits = gemv.groups()
        return dict(design=design, unroll=int(unroll) if unroll else None, splits=int(splits or 0) or None)
    m = re.fullmatch(r"N(\d+)M(\d+)K(\d+)S(\d+)([nm])([nm])(\d+)([sp]?)(?:-(\w+))?", name)
    if not m:
        raise ValueError(f"config {name!r} is not 'default', 'xla' or a MatmulConfig name like N64M128K64S4nm8")
    tn, tm, tk, st, split, minor, width, suffix, merge = m.groups()
    tiles = dict(tile_n=int(tn), tile_m=int(tm), tile_k=int(tk), stages=int(st), wg_split=split, grid_minor=minor,
                 grid_tile_width=int(width))
    if mode != "fp16":
        return fm.MatmulConfig(**tiles, promote=suffix == "p")
    return nm.MatmulConfig(**tiles, a_operand="smem" if suffix == "s" else "registers", merge=merge or "ptx")


def layer_view(w, mode: str):
    """The attributes of a ``QuantizedLinear`` the product functions read."""
    from types import SimpleNamespace

    return SimpleNamespace(weight=SimpleNamespace(get_value=lambda: w), mode="fp8" if mode == "fp8" else "fp16",
                           activation="fp8_token" if mode == "w8a8" else None, out_scale=1.0, bias=None)


def product(mode: str, name: str, cfg):
    """``fn(x, w)`` of one variant."""
    if name == "xla":
        return lambda x, w: native_dot.matmul(layer_view(w, mode), x)
    if name.startswith(("gemv", "skinny")):
        return lambda x, w: nestedfp_dispatch.matmul(layer_view(w, mode), x, **cfg)
    if name.startswith("cutlass") and mode == "fp16":
        return lambda x, w: cutlass_gemm.nestedfp16_matmul(x, w, **cfg)
    if name.startswith("cutlass"):
        return lambda x, w: fp8_gemm.matmul_cutlass(layer_view(w, mode), x, **cfg)
    if mode == "fp16":
        return lambda x, w: nm.nestedfp_matmul(x, w, config=cfg)
    return lambda x, w: fp8_gemm.matmul(layer_view(w, mode), x, config=cfg)  # quantizer + FP8 GEMM


def parse_ms(spec: str) -> list[int]:
    """``32:2048:32`` (start:stop:step, stop included) or a comma list."""
    if ":" in spec:
        a, b, s = map(int, spec.split(":"))
        return list(range(a, b + 1, s))
    return [int(v) for v in spec.split(",")]


def shapes_from(spec: str):
    if spec == "paper":
        return PAPER_SHAPES
    return tuple(("custom", nk, *map(int, nk.split("x"))) for nk in spec.split(","))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mode", default="fp16", choices=MODES)
    ap.add_argument("--shapes", default="paper", help="'paper' (the 14 shapes) or NxK,NxK")
    ap.add_argument("--ms", default="32:2048:32", help="token counts: start:stop:step or a comma list")
    ap.add_argument("--configs", default="default",
                    help="comma-separated: 'default', 'xla', 'cutlass[:name]', 'gemv[U<unroll>S<splits>]' and/or "
                         "MatmulConfig names")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--budget-s", type=float, default=1e9, help="stop starting new shapes after this many seconds")
    ap.add_argument("--out", default=None, help="JSON file")
    ap.add_argument("--plot", default=None, help="PNG: ratio to the FP16 dot per shape over M")
    args = ap.parse_args(argv)

    start = time.time()
    ms = parse_ms(args.ms)
    mode = args.mode
    configs = [(name, parse_config(name, mode)) for name in args.configs.split(",")]
    base_dtype = jnp.bfloat16 if mode == "w8a8" else jnp.float16
    shapes = shapes_from(args.shapes)
    dev = jax.devices()[0]
    result = dict(mode=mode, device=dev.device_kind, date=time.strftime("%Y-%m-%d"), argv=sys.argv[1:] if argv is None else argv,
                  method="device time = union of GPU kernel intervals per call from a profiler trace",
                  bandwidth=bn.copy_bandwidth(), rows=[])
    result["fp16_tflops"] = bn.bf16_peak()
    print(f"# {dev.device_kind}: copy {result['bandwidth']['copy_TBps']:.2f} TB/s, dense BF16 "
          f"{result['fp16_tflops']:.0f} TFLOP/s", flush=True)

    def save():
        result["elapsed_s"] = time.time() - start
        if args.out:
            Path(args.out).write_text(json.dumps(result, indent=1))

    with Reporter().bar("GEMMs", len(shapes) * len(ms)) as advance:
        for model, layer, n, k in shapes:
            if time.time() - start > args.budget_s:
                print(f"# budget: skipping {model} {layer} and later shapes", flush=True)
                break
            count = max(2, min(16, -(-TARGET_BYTES // (2 * n * k))))
            key = jax.random.key(n * 7 + k)
            make = jax.jit(lambda kk: (jax.random.normal(kk, (n, k), jnp.float32) * 0.02).astype(base_dtype))
            w16 = [make(jax.random.fold_in(key, i)) for i in range(count)]
            if mode == "w8a8":
                ours = [jax.jit(lambda w: fp8.quantize(w.astype(jnp.float32), granularity="channel"))(w) for w in w16]
            else:
                ours = [jax.jit(nestedfp.quantize)(w) for w in w16]
            for m in ms:
                jobs = bn.Jobs(args.reps)
                jobs.add("base", lambda x, w: jnp.dot(x, w.T),  # 16-bit out (FP32 sums inside cuBLAS)
                         w16, m, k, base_dtype)
                for name, cfg in configs:
                    if name.startswith(("gemv", "skinny")) and m > cuda_nestedfp.max_tokens(mode, cfg["design"]):
                        continue
                    if name.startswith("cutlass-fp16"):  # a second baseline, on the FP16 weights
                        jobs.add(name, lambda x, w, c=cfg: cutlass_gemm.fp16_matmul(x, w, **c), w16, m, k, base_dtype)
                        continue
                    jobs.add(name, product(mode, name, cfg), ours, m, k, base_dtype)
                times = {kk: bn._pick(t) for kk, t in jobs.run().items()}
                rate = result["fp16_tflops"] * (1 if mode == "fp16" else 2)
                weight_bytes = n * k * (2 if mode == "fp16" else 1)  # the stored weight ours reads
                floor = max((weight_bytes + 2 * (m * k + m * n)) / (result["bandwidth"]["copy_TBps"] * 1e12),
                            2 * m * n * k / (rate * 1e12))
                row = dict(model=model, layer=layer, n=n, k=k, m=m, floor_us=floor * 1e6,
                           base_us=bn._us(times.get("base")),
                           ours_us={name: bn._us(times.get(name)) for name, _ in configs})
                timed = [(v, c) for c, v in row["ours_us"].items()
                         if v is not None and c != "xla" and not c.startswith("cutlass-fp16")]
                row["best_us"], row["best_config"] = min(timed) if timed else (None, None)
                row["ratio"] = row["base_us"] / row["best_us"] if row["best_us"] and row["base_us"] else None
                result["rows"].append(row)
                advance(1)
            del w16, ours
            save()
    save()
    summary(result)
    if args.plot:
        plot(result, args.plot)


NAMES = {"fp16": ("XLA FP16 dot", "NestedFP16 (best config)"), "fp8": ("XLA FP16 dot", "NestedFP8 (best config)"),
         "w8a8": ("XLA BF16 dot", "W8A8-FP8 (best config)")}


def summary(result):
    rows = [r for r in result["rows"] if r.get("ratio")]
    base, ours = NAMES[result.get("mode", "fp16")]
    print(f"\n## {result['device']} ({result['date']}): {base} vs {ours}, us of device time; "
          f"speedup = baseline / ours (best config), gap = ours / baseline - 1")
    print(f"{'shape':28s} {'GEMMs':>5s} {'mean gap':>8s} {'worst':>7s} {'at M':>5s} {'speedup':>12s}  M: base/ours/xla")
    by_shape = {}
    for r in rows:
        by_shape.setdefault((r["model"], r["layer"], r["n"], r["k"]), []).append(r)
    for (model, layer, n, k), rs in by_shape.items():
        gaps = [1 / r["ratio"] - 1 for r in rs]
        worst = int(np.argmax(gaps))
        ratios = [r["ratio"] for r in rs]
        ends = "  ".join(f"{r['m']}: {r['base_us']:.1f}/{r['best_us']:.1f}"
                         + (f"/{r['ours_us']['xla']:.1f}" if r["ours_us"].get("xla") else "")
                         for r in (rs[0], rs[-1]))
        print(f"{model + ' ' + layer + f' {n}x{k}':28s} {len(rs):5d} {np.mean(gaps):+8.1%} {gaps[worst]:+7.1%} "
              f"{rs[worst]['m']:5d} {min(ratios):5.2f}-{max(ratios):4.2f}x  {ends}")
    if rows:
        gaps = [1 / r["ratio"] - 1 for r in rows]
        print(f"{'all':28s} {len(rows):5d} {np.mean(gaps):+8.1%} {max(gaps):+7.1%}")
        configs = {}
        for r in rows:
            configs[r["best_config"]] = configs.get(r["best_config"], 0) + 1
        print("best config counts:", ", ".join(f"{c}: {v}" for c, v in sorted(configs.items(), key=lambda x: -x[1])))


def plot(result, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 5))
    by_shape = {}
    for r in result["rows"]:
        if r.get("ratio"):
            by_shape.setdefault(f"{r['model']} {r['layer']} {r['n']}x{r['k']}", []).append((r["m"], r["ratio"]))
    for label, pts in by_shape.items():
        ax.plot(*zip(*pts), marker=".", lw=1, label=label)
    ax.axhline(1.0, color="k", lw=0.8)
    base, ours = NAMES[result.get("mode", "fp16")]
    if result.get("mode", "fp16") == "fp16":
        ax.axhline(1 / 1.1, color="r", lw=0.8, ls="--", label="10% behind")
    ax.set_xlabel("M (tokens)")
    ax.set_ylabel(f"{base} time / {ours} time")
    ax.set_title(f"{ours} vs {base}, {result['device']}")
    ax.legend(fontsize=6, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot: {path}")


if __name__ == "__main__":
    main()
