"""Benchmark the Pallas NVFP4 matmul (WGMMA, in-register FP4 decode) at large M against XLA and the
CUDA "gemm" kernel, on the Qwen3-8B projection shapes.

Columns per (shape, M): XLA BF16 dot, XLA dequantize-then-dot (``nvfp4_dispatch.dequantize_dot``),
the CUDA ``mma.sync`` GEMM (best of ``GemvConfig(kernel="gemm", block_m, block_n, split)``) and the
Pallas kernel (best of a small :class:`~jaxlp.pallas.nvfp4_matmul.MatmulConfig` sweep), in
microseconds of device time and TFLOP/s; a correctness spot check per shape (relative error of the
Pallas kernel and the CUDA GEMM against XLA dequantize-then-dot on FP32 activations).

Method: scripts/bench_nvfp4.py's (imported, not copied): each timed function makes one call per
weight buffer inside one jit (buffers together > 4x the 50 MB L2, so weights stream from HBM),
every call with its own activations; device time = union of the call's GPU kernel intervals from a
profiler trace, per call (``bench_nvfp4.Jobs``).

    python scripts/bench_nvfp4_pallas.py --out docs/bench_nvfp4_pallas_h100.json

Small-M mode (``--small-m``, issue #5: is the Pallas kernel a competitive NVFP4 GEMV?): M = 1 and 8
on Qwen3-8B and Qwen3-32B gate_up and down (W4A16), columns XLA BF16 dot, the CUDA GEMVs' named
configurations (``--gemv``) and Pallas small-M configurations (``tile_m = 8``, split-K chosen by
``nvfp4_matmul.gemv_config``; weights in the kernel layout prepared ahead, and the first one also
with the per-call layout ops, "+layout"); a table of us, % of copy bandwidth on the NVFP4 bytes and
x BF16; JSON with --out.

    python scripts/bench_nvfp4_pallas.py --small-m --out /tmp/small_m.json
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import bench_nvfp4 as bn  # noqa: E402

from jaxlp.evals import harness  # noqa: E402
from jaxlp.ffi import nvfp4 as ffi_nvfp4  # noqa: E402
from jaxlp.pallas import nvfp4_matmul as nm  # noqa: E402
from jaxlp.quantization import nvfp4_dispatch as dispatch  # noqa: E402

MS = (128, 512, 2048, 8192)
C = ffi_nvfp4.GemvConfig
GEMM = [C(kernel="gemm", block_m=bm, block_n=bn_, split=s) for bm in (64, 128) for bn_ in (64, 128) for s in (1, 2)]
P = nm.MatmulConfig
PALLAS = {  # name -> config; the sweep
    c.name: c for c in (
        P(tile_n=64, tile_m=128, tile_k=64, stages=4),
        P(tile_n=64, tile_m=256, tile_k=64, stages=4),
        P(tile_n=128, tile_m=128, tile_k=64, stages=4),
        P(tile_n=64, tile_m=128, tile_k=128, stages=3),
        P(tile_n=128, tile_m=64, tile_k=128, stages=3, wg_split="m"),
        P(tile_n=64, tile_m=256, tile_k=64, stages=4, grid_minor="n"),
    )
}


SMALL_MS = (1, 8)
SMALL_SHAPES = ("Qwen3-8B gate_up", "Qwen3-8B down", "Qwen3-32B gate_up", "Qwen3-32B down")
GEMV_BEST = "R1KS8A2,R2KS8,P2C1,H1C2S2,H2C1S2"


def within_budget(ms, start: float, budget_s: float, name: str):
    """The Ms to time, announcing those skipped once ``budget_s`` seconds have passed since ``start``."""
    for m in ms:
        if time.time() - start > budget_s:
            print(f"# budget reached: skipping {name} M={m}", flush=True)
            continue
        yield m


def bf16_jobs(reps: int, sh, m: int, k: int):
    """A ``bench_nvfp4.Jobs`` holding XLA's BF16 dot (the reference column)."""
    jobs = bn.Jobs(reps)
    jobs.add(("bf16",), lambda x, w: x @ w.T, sh.w, m, k)
    return jobs


def print_check(title: str, check: dict) -> None:
    print(f"# check {title}: " + ", ".join(f"{kk} {v:.2e}" if isinstance(v, float) else f"{kk} {v}"
                                          for kk, v in check.items() if kk not in ("shape", "m")), flush=True)


def small_m_pallas(n, k, spec):
    """Pallas candidates for an [N, K] GEMV: 'auto' = gemv_config with tile_k 256, 128 and a lower
    per-item overhead (more splits), deduplicated; or comma-separated MatmulConfig-like names
    'tk:stages:split' (tile_m 8, tile_n 64)."""
    if spec == "auto":
        cands = [nm.gemv_config(n, k, tile_k=256), nm.gemv_config(n, k, tile_k=256, item_overhead_steps=0.5),
                 nm.gemv_config(n, k, tile_k=128)]
    else:
        cands = []
        for item in spec.split(","):
            tk, st, sp = (int(v) for v in item.split(":"))
            cands.append(P(tile_n=64, tile_m=8, tile_k=tk, stages=st, split_k=sp))
    return list({c.name: c for c in cands if (k // c.tile_k) % c.split_k == 0 or c.split_k == 1}.values())


def main_small_m(args, argv):
    start = time.time()
    dev = jax.devices()[0]
    ms = [int(v) for v in args.ms.split(",")] if args.ms != ",".join(map(str, MS)) else list(SMALL_MS)
    allshapes = {s[0]: s for s in bn.qwen3_shapes()}
    names = SMALL_SHAPES if args.shapes == "all" else [SMALL_SHAPES[int(i)] for i in args.shapes.split(",")]
    gemv = [] if args.gemv == "none" else [C.from_name(v) for v in args.gemv.split(",")]
    if gemv:
        try:
            t0 = time.time()
            ffi_nvfp4.load()
            print(f"# CUDA kernels built/loaded in {time.time() - t0:.0f}s", flush=True)
        except Exception as e:  # noqa: BLE001
            print(f"!! CUDA kernels unavailable: {type(e).__name__}: {str(e)[:500]}", flush=True)
            gemv = []
    bw = bn.copy_bandwidth()
    result = {
        **harness.run_metadata(argv),
        "method": "bench_nvfp4.Jobs: one call per weight buffer (> 4x L2) per jit, distinct activations; "
                  "device time = union of GPU kernel intervals per call from a profiler trace",
        "copy_bandwidth": bw, "gemv_configs": [c.name for c in gemv], "rows": [], "checks": [],
    }
    print(f"# {dev.device_kind}: copy {bw['copy_TBps']:.2f} TB/s, read {bw['read_TBps']:.2f} TB/s", flush=True)

    def save():
        result["elapsed_s"] = time.time() - start
        harness.write_json(args.out, result)

    for si, name in enumerate(names):
        _, n, k = allshapes[name]
        if time.time() - start > args.budget_s:
            print(f"# budget reached: skipping {name}", flush=True)
            continue
        sh = bn.Shape(n, k, si, target_bytes=4 * bn.L2_BYTES)
        pallas = small_m_pallas(n, k, args.pallas_small)
        ops = {}  # padded shape -> per-buffer operands (the kernel layout, prepared once)
        for cfg in pallas:
            _, n_pad, k_pad = nm.padded_shape(cfg, 8, n, k)
            if (n_pad, k_pad) not in ops:
                prep = jax.jit(lambda w, n_pad=n_pad, k_pad=k_pad: nm.kernel_operands(w, n_pad, k_pad))
                ops[n_pad, k_pad] = [prep(q) for q in sh.q]
        # Correctness spot check (M = 8) against float64 of the dequantized weights.
        x = jax.random.normal(jax.random.key(7), (8, k), jnp.bfloat16)
        ref = np.asarray(x, np.float64) @ np.asarray(sh.q[0].dequantize(jnp.float32), np.float64).T
        check = {"shape": name, "m": 8}
        for cfg in pallas:
            try:
                y = jax.jit(lambda x, q, cfg=cfg: nm.nvfp4_matmul(x, q, config=cfg))(x, sh.q[0])
                check[f"pallas_{cfg.name}"] = harness.relative_error(np.asarray(y.astype(jnp.float32)), ref)
            except Exception as e:  # noqa: BLE001
                check[f"pallas_{cfg.name}"] = f"{type(e).__name__}: {str(e)[:300]}"
        for cfg in gemv[:1]:
            y = ffi_nvfp4.nvfp4_gemv(x, sh.q[0], config=cfg)
            check[f"gemv_{cfg.name}"] = harness.relative_error(np.asarray(y.astype(jnp.float32)), ref)
        result["checks"].append(check)
        print_check(f"{name} (M = 8, rel. err. vs float64)", check)
        nbytes = bn.nvfp4_bytes(n, k)
        for m in within_budget(ms, start, args.budget_s, name):
            jobs = bf16_jobs(args.reps, sh, m, k)
            for cfg in gemv:
                if cfg.unsupported(m, k, jnp.bfloat16, False) is None:
                    jobs.add(("gemv", cfg.name), lambda x, q, cfg=cfg: ffi_nvfp4.nvfp4_gemv(x, q, config=cfg), sh.q, m, k)
            for i, cfg in enumerate(pallas):
                _, n_pad, k_pad = nm.padded_shape(cfg, m, n, k)
                wo = list(zip(sh.q, ops[n_pad, k_pad]))
                jobs.add(("pallas", cfg.name),
                         lambda x, qo, cfg=cfg: nm.nvfp4_matmul(x, qo[0], config=cfg, operands=qo[1]), wo, m, k)
                if i == 0:
                    jobs.add(("pallas", cfg.name + "+layout"),
                             lambda x, q, cfg=cfg: nm.nvfp4_matmul(x, q, config=cfg), sh.q, m, k)
            t = jobs.run()
            rec = {"shape": name, "n": n, "k": k, "m": m, "nvfp4_bytes": nbytes}
            for key, (dev_s, wall_s) in t.items():
                rec["_".join(key) + "_us"] = bn._us(dev_s if dev_s is not None else wall_s)
                rec["_".join(key) + "_wall_us"] = bn._us(wall_s)
            for fam in ("gemv", "pallas"):
                cands = {key[1]: rec[f"{fam}_{key[1]}_us"] for key in t if key[0] == fam and "+" not in key[1]}
                if cands:
                    best = min(cands, key=cands.get)
                    rec[f"{fam}_us"], rec[f"{fam}_config"] = cands[best], best
            for col in ("gemv", "pallas"):
                if f"{col}_us" in rec:
                    rec[f"{col}_pct_copy"] = 100 * nbytes / (rec[f"{col}_us"] * 1e-6) / (bw["copy_TBps"] * 1e12)
                    if "bf16_us" in rec:
                        rec[f"{col}_x_bf16"] = rec["bf16_us"] / rec[f"{col}_us"]
            result["rows"].append(rec)
            print(f"{name:18s} M={m} " + "  ".join(f"{kk[:-3]} {v:.1f}" for kk, v in rec.items()
                                                    if kk.endswith("_us") and not kk.endswith("wall_us")
                                                    and kk not in ("gemv_us", "pallas_us")), flush=True)
            save()
        sh.free()
        del ops
    save()
    summary_small_m(result)
    return result


def summary_small_m(result):
    bw = result["copy_bandwidth"]["copy_TBps"]
    print(f"\n## {result['device']} ({result['date']}), device us per call; % copy = NVFP4 bytes / time / "
          f"copy bandwidth ({bw:.2f} TB/s); x BF16 = BF16 dot time / time")
    print(f"{'shape':18s} {'M':>2s} {'bf16':>7s} {'cuda gemv (cfg)':>24s} {'%copy':>6s} {'xbf16':>6s}"
          f" {'pallas (cfg)':>30s} {'%copy':>6s} {'xbf16':>6s} {'pallas+layout':>14s}")
    for r in result["rows"]:
        lay = [v for kk, v in r.items() if kk.endswith("+layout_us")]
        g = f"{r['gemv_us']:6.1f} ({r['gemv_config']})" if "gemv_us" in r else "-"
        p = f"{r['pallas_us']:6.1f} ({r['pallas_config']})" if "pallas_us" in r else "-"
        print(f"{r['shape']:18s} {r['m']:2d} {r.get('bf16_us', float('nan')):7.1f} {g:>24s} "
              f"{r.get('gemv_pct_copy', float('nan')):6.1f} {r.get('gemv_x_bf16', float('nan')):6.2f} {p:>30s} "
              f"{r.get('pallas_pct_copy', float('nan')):6.1f} {r.get('pallas_x_bf16', float('nan')):6.2f} "
              f"{(lay[0] if lay else float('nan')):14.1f}")
    print("\nall Pallas configs (us): " + "; ".join(
        f"{r['shape']} M={r['m']}: " + ", ".join(f"{kk[7:-3]} {v:.1f}" for kk, v in r.items()
                                               if kk.startswith("pallas_N") and kk.endswith("_us") and "wall" not in kk)
        for r in result["rows"]))
    print("all CUDA GEMV configs (us): " + "; ".join(
        f"{r['shape']} M={r['m']}: " + ", ".join(f"{kk[5:-3]} {v:.1f}" for kk, v in r.items()
                                               if kk.startswith("gemv_") and kk.endswith("_us") and "wall" not in kk
                                               and kk != "gemv_us")
        for r in result["rows"]))


def shapes_8b():
    return [s for s in bn.qwen3_shapes() if s[0].startswith("Qwen3-8B") and not s[0].endswith("fused")]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="docs/bench_nvfp4_pallas.json")
    ap.add_argument("--ms", default=",".join(map(str, MS)))
    ap.add_argument("--shapes", default="all", help="comma-separated indices into the Qwen3-8B shapes, or 'all'")
    ap.add_argument("--pallas", default="all",
                    help="comma-separated MatmulConfig names, 'all', or 'auto' (one per M: nvfp4_matmul.default_config)")
    ap.add_argument("--gemm", default="all", help="comma-separated GemvConfig names, 'all' or 'none'")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--budget-s", type=float, default=1e9, help="stop starting new (shape, M) after this many seconds")
    ap.add_argument("--small-m", action="store_true", help="the small-M (GEMV) comparison, see the module doc")
    ap.add_argument("--gemv", default=GEMV_BEST, help="--small-m: CUDA GemvConfig names, or 'none'")
    ap.add_argument("--pallas-small", default="auto", help="--small-m: 'auto' or 'tile_k:stages:split_k,...'")
    args = ap.parse_args(argv)
    if args.small_m:
        if jax.devices()[0].platform != "gpu":
            sys.exit("bench_nvfp4_pallas needs a GPU")
        return main_small_m(args, argv)

    start = time.time()
    dev = jax.devices()[0]
    if dev.platform != "gpu":
        sys.exit("bench_nvfp4_pallas needs a GPU")
    ms = [int(v) for v in args.ms.split(",")]
    shapes = shapes_8b() if args.shapes == "all" else [shapes_8b()[int(i)] for i in args.shapes.split(",")]
    if args.pallas == "auto":
        pallas = list({nm.default_config(m).name: nm.default_config(m) for m in MS}.values())
    else:
        pallas = list(PALLAS.values()) if args.pallas == "all" else [PALLAS[n] for n in args.pallas.split(",")]
    gemm = [] if args.gemm == "none" else GEMM if args.gemm == "all" else [C.from_name(n) for n in args.gemm.split(",")]
    if gemm:
        try:
            t0 = time.time()
            ffi_nvfp4.load()
            print(f"# CUDA kernels built/loaded in {time.time() - t0:.0f}s", flush=True)
        except Exception as e:  # noqa: BLE001 - the other columns still run
            print(f"!! CUDA kernels unavailable: {type(e).__name__}: {str(e)[:500]}", flush=True)
            gemm = []

    result = {
        **harness.run_metadata(argv),
        "method": "bench_nvfp4.Jobs: one call per weight buffer (> 4x L2) per jit, distinct activations; "
                  "device time = union of GPU kernel intervals per call from a profiler trace",
        "pallas_configs": [c.name for c in pallas], "gemm_configs": [c.name for c in gemm], "rows": [], "checks": [],
    }
    result["bf16_matmul_TFLOPs"] = bn.bf16_peak()
    print(f"# {dev.device_kind}: BF16 matmul {result['bf16_matmul_TFLOPs']:.0f} TFLOP/s", flush=True)

    def save():
        result["elapsed_s"] = time.time() - start
        harness.write_json(args.out, result)

    for si, (name, n, k) in enumerate(shapes):
        sh = bn.Shape(n, k, si, target_bytes=4 * bn.L2_BYTES)
        # Correctness spot check against XLA dequantize-then-dot on FP32 activations.
        x = jax.random.normal(jax.random.key(7), (256, k), jnp.bfloat16)
        ref = jax.jit(dispatch.dequantize_dot)(x.astype(jnp.float32), sh.q[0])
        check = {"shape": name, "m": 256}
        for cfg in pallas:
            try:
                y = jax.jit(lambda x, q, cfg=cfg: nm.nvfp4_matmul(x, q, config=cfg))(x, sh.q[0])
                check[f"pallas_{cfg.name}"] = harness.relative_error(y.astype(jnp.float32), ref)
            except Exception as e:  # noqa: BLE001
                check[f"pallas_{cfg.name}"] = f"{type(e).__name__}: {str(e)[:200]}"
        if gemm:
            y = ffi_nvfp4.nvfp4_gemv(x, sh.q[0], config=gemm[0])
            check[f"gemm_{gemm[0].name}"] = harness.relative_error(y.astype(jnp.float32), ref)
        result["checks"].append(check)
        print_check(name, check)

        for m in within_budget(ms, start, args.budget_s, name):
            jobs = bf16_jobs(args.reps, sh, m, k)
            jobs.add(("xla_dq",), lambda x, q: dispatch.dequantize_dot(x, q), sh.q, m, k)
            for cfg in gemm:
                if cfg.unsupported(m, k, jnp.bfloat16, False) is None:
                    jobs.add(("gemm", cfg.name), lambda x, q, cfg=cfg: ffi_nvfp4.nvfp4_gemv(x, q, config=cfg), sh.q, m, k)
            for cfg in ([nm.default_config(m)] if args.pallas == "auto" else pallas):
                jobs.add(("pallas", cfg.name), lambda x, q, cfg=cfg: nm.nvfp4_matmul(x, q, config=cfg), sh.q, m, k)
            t = jobs.run()
            flops = 2 * m * n * k
            rec = {"shape": name, "n": n, "k": k, "m": m}
            for key, (dev_s, wall_s) in t.items():
                label = "_".join(key)
                rec[f"{label}_us"] = bn._us(dev_s if dev_s is not None else wall_s)
            for fam in ("gemm", "pallas"):
                cands = {key[1]: rec[f"{fam}_{key[1]}_us"] for key in t if key[0] == fam}
                if cands:
                    best = min(cands, key=cands.get)
                    rec[f"{fam}_us"], rec[f"{fam}_config"] = cands[best], best
            for col in ("bf16", "xla_dq", "gemm", "pallas"):
                if f"{col}_us" in rec:
                    rec[f"{col}_TFLOPs"] = flops / (rec[f"{col}_us"] * 1e-6) / 1e12
            result["rows"].append(rec)
            print(f"{name:18s} M={m:5d} " + "  ".join(
                f"{col} {rec[col + '_us']:9.1f}us {rec[col + '_TFLOPs']:5.0f}TF" for col in ("bf16", "xla_dq", "gemm", "pallas")
                if col + "_us" in rec) + f"  [{rec.get('gemm_config', '-')}, {rec.get('pallas_config', '-')}]", flush=True)
            save()
        sh.free()
    save()
    summary(result)
    return result


def summary(result):
    print(f"\n## {result['device']} ({result['date']}), device us (TFLOP/s); BF16 matmul peak "
          f"{result['bf16_matmul_TFLOPs']:.0f} TFLOP/s")
    print(f"{'shape':18s} {'M':>5s} {'bf16':>14s} {'xla-dq':>14s} {'cuda-gemm':>14s} {'pallas':>14s}  pallas/dq  configs")
    for r in result["rows"]:
        cells = []
        for col in ("bf16", "xla_dq", "gemm", "pallas"):
            cells.append(f"{r[col + '_us']:7.1f} ({r[col + '_TFLOPs']:4.0f})" if col + "_us" in r else f"{'-':>14s}")
        ratio = r["xla_dq_us"] / r["pallas_us"] if "pallas_us" in r else float("nan")
        print(f"{r['shape']:18s} {r['m']:5d} " + " ".join(cells) + f"  {ratio:9.2f}  {r.get('gemm_config', '-')} "
              f"{r.get('pallas_config', '-')}")


if __name__ == "__main__":
    main()
