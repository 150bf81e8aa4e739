"""FireQ W4A8 linears against BF16 and XLA's FP8 dot: the FFN of a Llama-3-8B-shaped layer.

Per token count M (``--ms``), side by side in one run, for gate_up (28672 x 4096) and down
(4096 x 14336) and their sum (the FFN, the paper's figure):

- ``bf16``: XLA's BF16 dot on BF16 weights (the baseline);
- ``xla_fp8``: the FireQ layer through XLA's FP8 dot (``implementation="xla_native"``: the FP8
  weight ``e4m3(q * s)`` materialized by XLA, cuBLASLt's FP8 GEMM, then the scale pass);
- ``fireq_cuda`` (M <= 32; ``fireq_cuda_u2`` / ``_u4``: its other unrolls), ``fireq_pallas`` (the
  GEMM decoding in registers), ``fireq_decoded`` (the CUDA decode, then the FP8 GEMM) and
  ``fireq_cutlass`` (CUTLASS's mixed-input GEMM, the lookup-table decode; its lookup tables built
  from the scales in the same program; ``fireq_cutlass_tables``: built beforehand, as a load-time
  layout would hold them; either with ``:CONFIG``, one of ``cutlass_gemm.FIREQ_CONFIGS``),
  ``fireq_cutlass_decoded`` (the CUDA decode, then CUTLASS's promoted FP8 GEMM; ``:CONFIG`` one of
  ``cutlass_gemm.CONFIGS``): the
  layer through jaxlp's kernels (:mod:`jaxlp.quantization.fireq_kernels`), activation
  quantization included;
  ``auto``: what ``implementation="auto"`` runs (the GEMV up to 16 tokens, then CUTLASS in the design
  of ``fireq_kernels.default_cutlass_design``).

Per row: us of device time, the ratio ``bf16 / ours`` and the floor (the larger of the stored
bytes (INT4 codes, scales, 16-bit activations in and out) / copy bandwidth and 2MNK / twice the
measured dense BF16 rate). Method: scripts/bench_nvfp4.py's (imported): weights cycled through
buffers > 4x the L2 so they stream from HBM, device time from a profiler trace.

``--e2e``: instead, a Llama-3.1-8B-shaped model (``--layers`` layers, random BF16 weights, BF16 KV
cache) end to end in BF16 and quantized with the ``w4a8-fireq`` recipe (PTS, CAS; ``lm_head`` BF16)
under ``implementation="auto"``: the prompt forward pass of each ``--prefill BxS`` (ms and tokens/s;
the issue's figure: batch 16 x 1K / 2K / 4K) and decode ms per token at ``--decode-batches`` with a
``--context``-token cache (:mod:`bench_nestedfp`'s and :mod:`bench_kvcache`'s timers).

    python scripts/bench_fireq.py --out docs/bench_fireq_h100.json --plot docs/bench_fireq_h100.png
    python scripts/bench_fireq.py --ms 1,16,2048 --variants bf16,fireq_pallas
    python scripts/bench_fireq.py --e2e --layers 8 --prefill 16x1024,16x2048,16x4096 --decode-batches 1,16
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import jax
import jax.numpy as jnp

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import bench_nvfp4 as bn  # noqa: E402

from jaxlp.ffi import cutlass_gemm, fireq as fireq_cuda  # noqa: E402
from jaxlp.formats import int4_fp8  # noqa: E402
from jaxlp.progress import Reporter  # noqa: E402
from jaxlp.quantization import fireq_kernels, linear, native_dot  # noqa: E402

FFN_SHAPES = (("gate_up", 28672, 4096), ("down", 4096, 14336))
TARGET_BYTES = 220 << 20  # BF16 weight buffers per shape: > 4x the 50 MB L2
VARIANTS = ("bf16", "xla_fp8", "fireq_cuda", "fireq_cuda_u2", "fireq_cuda_u4", "fireq_pallas", "fireq_decoded",
            "fireq_cutlass", "fireq_cutlass_tables", "fireq_cutlass_decoded", "auto")


def layer_view(w):
    """The attributes of a FireQ ``QuantizedLinear`` the product functions read."""
    return SimpleNamespace(weight=SimpleNamespace(get_value=lambda: w), activation="fireq_fp8", out_scale=1.0,
                           mode="fp16", bias=None)


def auto(layer, x):
    """What ``QuantizedLinear``'s ``"auto"`` runs: the first kernel of ``linear.KERNELS`` that takes it."""
    return next(k for k in linear.KERNELS.values() if k.auto_takes(layer, x)).matmul(layer, x)


def product(name: str):
    name, _, config = name.partition(":")
    if name == "bf16":
        return lambda x, w: jnp.dot(x, w.T)
    if name == "fireq_cutlass_decoded":  # config: one of cutlass_gemm.CONFIGS (the FP8 GEMM's)
        return lambda x, w: fireq_kernels.matmul_cutlass(layer_view(w), x, design="decoded", config=config or None)
    if name.startswith("fireq_cutlass"):  # w: (weight, tables) for _tables
        pre = name == "fireq_cutlass_tables"
        return lambda x, w: fireq_kernels.matmul_cutlass(layer_view(w[0] if pre else w), x, design="mixed",
                                                         config=config or None, tables=w[1] if pre else None)
    fn = {"xla_fp8": native_dot.matmul, "fireq_cuda": fireq_kernels.matmul_gemv,
          "fireq_cuda_u2": functools.partial(fireq_kernels.matmul_gemv, unroll=2),
          "fireq_cuda_u4": functools.partial(fireq_kernels.matmul_gemv, unroll=4), "auto": auto,
          "fireq_pallas": lambda layer, x: fireq_kernels.matmul_gemm(layer, x, design="in_kernel"),
          "fireq_decoded": lambda layer, x: fireq_kernels.matmul_gemm(layer, x, design="decoded")}[name]
    return lambda x, w: fn(layer_view(w), x)


def known_variant(name: str) -> bool:
    base, sep, config = name.partition(":")
    if base == "fireq_cutlass_decoded":
        return not sep or config in cutlass_gemm.CONFIGS
    return base in VARIANTS and (not sep or (base.startswith("fireq_cutlass") and config in cutlass_gemm.FIREQ_CONFIGS))


def floor_us(m, n, k, bandwidth_tbps, tflops) -> float:
    nbytes = n * k // 2 + n * k // int4_fp8.GROUP_SIZE + 2 * (m * k + m * n)
    return max(nbytes / (bandwidth_tbps * 1e12), 2 * m * n * k / (2 * tflops * 1e12)) * 1e6


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ms", default="1,4,16,32,64,256,2048", help="token counts, comma-separated")
    ap.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated of {VARIANTS}")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", default=None, help="JSON file")
    ap.add_argument("--plot", default=None, help="PNG: FFN speed-up over BF16 per M")
    ap.add_argument("--e2e", action="store_true", help="the model end to end instead of the FFN GEMMs (module doc)")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--prefill", default="16x1024,16x2048,16x4096", help="BxS list (--e2e)")
    ap.add_argument("--decode-batches", default="1,16", help="comma list (--e2e)")
    ap.add_argument("--context", type=int, default=1024, help="decode cache tokens (--e2e)")
    ap.add_argument("--tiny", action="store_true", help="a small model of the same family (CPU smoke runs)")
    args = ap.parse_args(argv)
    if args.e2e:
        return end_to_end(args, argv)
    ms = [int(v) for v in args.ms.split(",")]
    variants = args.variants.split(",")
    if unknown := sorted(v for v in variants if not known_variant(v)):
        ap.error(f"unknown variants {unknown}; choose from {VARIANTS} (fireq_cutlass*: with :CONFIG, one of "
                 f"{sorted(cutlass_gemm.FIREQ_CONFIGS)})")
    if "bf16" not in variants:
        variants.insert(0, "bf16")

    dev = jax.devices()[0]
    result = dict(device=dev.device_kind, date=time.strftime("%Y-%m-%d"), argv=sys.argv[1:] if argv is None else argv,
                  method="device time = union of GPU kernel intervals per call from a profiler trace",
                  bandwidth=bn.copy_bandwidth(), bf16_tflops=bn.bf16_peak(), rows=[])
    bw, tflops = result["bandwidth"]["copy_TBps"], result["bf16_tflops"]
    print(f"# {dev.device_kind}: copy {bw:.2f} TB/s, dense BF16 {tflops:.0f} TFLOP/s", flush=True)
    per_layer = {}
    with Reporter().bar("FireQ GEMMs", len(FFN_SHAPES) * len(ms)) as advance:
        for layer, n, k in FFN_SHAPES:
            count = max(2, min(16, -(-TARGET_BYTES // (2 * n * k))))
            make = jax.jit(lambda kk: jax.random.normal(kk, (n, k), jnp.float32) * 0.02)
            w32 = [make(jax.random.key(7 * n + k + i)) for i in range(count)]
            weights = {"bf16": [w.astype(jnp.bfloat16) for w in w32]}
            weights["fireq"] = [int4_fp8.quantize(w) for w in w32]
            if any(v.startswith("fireq_cutlass_tables") for v in variants):
                weights["fireq_tables"] = [(w, jax.jit(cutlass_gemm.fireq_tables)(w)) for w in weights["fireq"]]
            del w32
            for m in ms:
                jobs = bn.Jobs(args.reps)
                for name in variants:
                    if name.startswith("fireq_cuda") and m > (16 if name != "fireq_cuda" else fireq_cuda.MAX_TOKENS):
                        continue
                    kind = ("bf16" if name == "bf16" else "fireq_tables"
                            if name.startswith("fireq_cutlass_tables") else "fireq")
                    jobs.add(name, product(name), weights[kind], m, k, jnp.bfloat16)
                times = {key: bn._us(bn._pick(t)) for key, t in jobs.run().items()}
                per_layer[(layer, m)] = times
                row = dict(layer=layer, n=n, k=k, m=m, floor_us=floor_us(m, n, k, bw, tflops), us=times)
                result["rows"].append(row)
                advance(1)
            del weights
    for m in ms:  # the FFN: gate_up + down
        parts = [per_layer.get((layer, m), {}) for layer, _, _ in FFN_SHAPES]
        names = set.intersection(*(set(p) for p in parts)) if parts else set()
        us = {name: sum(p[name] for p in parts) for name in names if all(p[name] is not None for p in parts)}
        result["rows"].append(dict(layer="ffn", m=m, us=us,
                                   floor_us=sum(floor_us(m, n, k, bw, tflops) for _, n, k in FFN_SHAPES)))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    table(result)
    if args.plot:
        plot(result, args.plot)


def end_to_end(args, argv):
    """``--e2e``: rows of prefill and decode times, BF16 then W4A8-FireQ (module doc)."""
    import types

    from bench_decode import build_model
    from bench_kvcache import decode_ms
    from bench_nestedfp import LLAMA_31_8B, TINY, prefill_ms

    from jaxlp import kvcache
    from jaxlp.evals import harness
    from jaxlp.models import from_hf_config
    from jaxlp.quantization import quantize_model, set_implementation

    try:
        prefills = [tuple(int(v) for v in bs.split("x")) for bs in args.prefill.split(",") if bs]
        batches = [int(b) for b in args.decode_batches.split(",") if b]
    except ValueError:
        raise ValueError(f"--prefill must be BxS,BxS and --decode-batches a comma list, got {args.prefill!r} and "
                         f"{args.decode_batches!r}") from None
    config = from_hf_config(dict(LLAMA_31_8B, num_hidden_layers=args.layers, **(TINY if args.tiny else {})))
    timing = types.SimpleNamespace(n1=8, n2=24, repeats=args.reps, compiler_options=None)
    cache = kvcache.get("bf16")
    model = build_model(config, dtype=jnp.bfloat16)
    rows = []

    def measure(variant):
        for batch, length in prefills:
            ms = prefill_ms(model, cache, batch, length, args.reps)
            rows.append(dict(variant=variant, part="prefill", batch=batch, tokens=length, ms=ms,
                             tokens_per_s=batch * length / ms * 1e3))
            print(rows[-1], flush=True)
        for batch in batches:
            ms = decode_ms(model, cache, batch, args.context, timing)
            rows.append(dict(variant=variant, part="decode", batch=batch, tokens=args.context, ms=ms,
                             tokens_per_s=batch / ms * 1e3))
            print(rows[-1], flush=True)

    measure("bf16")
    quantize_model(model, "w4a8-fireq", inplace=True)
    set_implementation(model, "auto")
    measure("w4a8-fireq")
    base = {(r["part"], r["batch"], r["tokens"]): r["ms"] for r in rows if r["variant"] == "bf16"}
    print(f"\n## {jax.devices()[0].device_kind}, Llama-3.1-8B shape, {args.layers} layers (prefill: ms per prompt "
          f"batch; decode: ms per token, {args.context}-token cache)")
    print("| variant | part | batch | tokens | ms | tokens/s | x BF16 |\n|---|---|---|---|---|---|---|")
    for r in rows:
        r["x_bf16"] = base[r["part"], r["batch"], r["tokens"]] / r["ms"]
        print(f"| {r['variant']} | {r['part']} | {r['batch']} | {r['tokens']} | {r['ms']:.3f} | "
              f"{r['tokens_per_s']:.0f} | {r['x_bf16']:.2f} |")
    if args.out:
        harness.write_json(args.out, dict(harness.run_metadata(argv), model=f"Llama-3.1-8B shape, {args.layers} "
                                          "layers, random BF16 weights", rows=rows))
    return rows


def table(result):
    names = list(dict.fromkeys(v for row in result["rows"] for v in row["us"]))  # the run's variants, in order
    print("| layer | M | floor | " + " | ".join(names) + " | auto x BF16 | auto x XLA FP8 |")
    print("|---|---|---|" + "---|" * (len(names) + 2))
    for row in result["rows"]:
        us = row["us"]
        cells = [f"{us[v]:.1f}" if us.get(v) is not None else "" for v in names]
        best = us.get("auto")
        x_bf16 = f"{us['bf16'] / best:.2f}" if best and us.get("bf16") else ""
        x_fp8 = f"{us['xla_fp8'] / best:.2f}" if best and us.get("xla_fp8") else ""
        print(f"| {row['layer']} | {row['m']} | {row['floor_us']:.1f} | " + " | ".join(cells)
              + f" | {x_bf16} | {x_fp8} |")


def plot(result, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in result["rows"] if r["layer"] == "ffn" and r["us"].get("bf16")]
    fig, ax = plt.subplots(figsize=(6, 4))
    labels = {"auto": "FireQ W4A8 (jaxlp kernels)", "xla_fp8": "W4A8, XLA FP8 dot"}
    for name, label in labels.items():
        pts = [(r["m"], r["us"]["bf16"] / r["us"][name]) for r in rows if r["us"].get(name)]
        if pts:
            ax.plot(*zip(*pts), marker="o", label=label)
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("tokens (M)")
    ax.set_ylabel("FFN speed-up over BF16")
    ax.set_title(f"Llama-3-8B FFN, {result['device']}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
