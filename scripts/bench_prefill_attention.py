"""Prompt (prefill) attention: every implementation of jaxlp.attention.prefill, and the reference.

Times causal self-attention of full-length prompts (``lengths = S``) under jit, for each batch
and sequence length: ``xla`` (blockwise flash in pure JAX), ``cudnn``, ``mosaic`` (jax's Pallas
Mosaic GPU FA3-style kernel), ``fp8`` (:func:`jaxlp.pallas.fp8_attention.fp8_attention`, FireQ's
FP8 attention, its per-head quantization of q, k, v included; floor at twice the dense rate;
``fp8_promoted``: the same with each key block's PV promoted to FP32, ``AttentionConfig(promote_pv=True)``) and
``reference`` (``causal_attention``, which materialises the float32 scores; skipped where they
would not fit in half the device memory). Warm-up calls,
then the median of ``--repeats`` calls (``jax.block_until_ready``). Each row has the FLOP floor:
the causal FLOPs ``4 * B * H * S * S * D / 2`` over the device's dense rate (``--peak-tflops``,
default measured with a large bf16 matmul; ~700 TFLOP/s dense bf16 on an H100), and the max
absolute difference from ``xla``. Prints a table last and writes JSON (device, versions, rows).

    python scripts/bench_prefill_attention.py --out docs/bench_prefill_attention.json
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np

from jaxlp.attention.prefill import prefill_attention
from jaxlp.attention.reference import causal_attention
from jaxlp.evals.harness import run_metadata, time_call, write_json
from jaxlp.pallas.fp8_attention import AttentionConfig, fp8_attention

IMPLS = ("xla", "cudnn", "mosaic", "fp8", "fp8_promoted", "reference")
FP8_IMPLS = {"fp8": AttentionConfig(), "fp8_promoted": AttentionConfig(promote_pv=True)}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    p.add_argument("--seq", type=int, nargs="+", default=[1024, 4096, 8192, 32768])
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--window", type=int, default=None, help="sliding window (mosaic: skipped)")
    p.add_argument("--implementations", nargs="+", choices=IMPLS, default=list(IMPLS))
    p.add_argument("--block-q", type=int, default=None, help="xla/mosaic query block")
    p.add_argument("--block-k", type=int, default=None, help="xla/mosaic key block")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--peak-tflops", type=float, default=None, help="dense bf16 rate (default: measured)")
    p.add_argument("--out", default="bench_prefill_attention.json")
    args = p.parse_args(argv)
    args.argv = argv
    return args


def dense_tflops() -> float:
    """Measured dense bf16 matmul rate (8192^3 on a GPU, 256^3 elsewhere)."""
    n = 8192 if jax.default_backend() == "gpu" else 256
    a = jnp.ones((n, n), jnp.bfloat16)
    mm = jax.jit(lambda x, y: jnp.dot(x, y, preferred_element_type=jnp.float32).astype(jnp.bfloat16))
    return 2 * n**3 / time_call(mm, a, a, warmup=2, repeats=10).median_us / 1e6


def device_bytes() -> float:
    stats = jax.devices()[0].memory_stats() or {}
    return float(stats.get("bytes_limit", 8e9))


def attention_fn(impl, args, scale):
    if impl == "reference":
        def ref(q, k, v, n):
            pos = jnp.broadcast_to(jnp.arange(q.shape[1]), q.shape[:2])
            return causal_attention(q, k, v, pos, pos, scale=scale, window=args.window)
        return jax.jit(ref)
    if impl in FP8_IMPLS:
        return jax.jit(lambda q, k, v, n: fp8_attention(q, k, v, scale=scale, config=FP8_IMPLS[impl]))
    return jax.jit(lambda q, k, v, n: prefill_attention(q, k, v, n, scale=scale, window=args.window, implementation=impl,
                                                        block_q=args.block_q, block_k=args.block_k))


def main(args) -> list[dict]:
    h, kvh, d = args.heads, args.kv_heads, args.head_dim
    peak = args.peak_tflops or dense_tflops()
    scale, rows = d**-0.5, []
    for b in args.batch:
        for s in args.seq:
            keys = jax.random.split(jax.random.key(b * 100003 + s), 3)
            q = jax.random.normal(keys[0], (b, s, h, d), jnp.bfloat16)
            k, v = (jax.random.normal(key, (b, s, kvh, d), jnp.bfloat16) for key in keys[1:])
            lengths = jnp.full((b,), s, jnp.int32)
            flops = 4 * b * h * s * s * d / 2
            baseline = None
            for impl in args.implementations:
                rate = peak * (2 if impl in FP8_IMPLS else 1)  # FP8 tensor cores: twice the BF16 rate
                row = dict(batch=b, seq=s, heads=h, kv_heads=kvh, head_dim=d, window=args.window, implementation=impl,
                           causal_tflop=flops / 1e12, flop_floor_ms=flops / (rate * 1e12) * 1e3)
                rows.append(row)
                if impl == "reference" and 3 * b * h * s * s * 4 > device_bytes() / 2:
                    row["skipped"] = "scores do not fit in memory"
                    continue
                if impl in ("mosaic", *FP8_IMPLS) and args.window is not None and args.window < s:
                    row["skipped"] = "no sliding window"
                    continue
                try:
                    t = time_call(attention_fn(impl, args, scale), q, k, v, lengths, warmup=args.warmup,
                                  repeats=args.repeats)
                except Exception as e:  # noqa: BLE001 (an implementation this device or shape lacks)
                    row["skipped"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
                    continue
                row.update(median_ms=t.median_us / 1e3, min_ms=t.min_us / 1e3, tflops=flops / t.median_us / 1e6)
                row["of_floor"] = row["flop_floor_ms"] / row["median_ms"]
                if impl == "xla":
                    baseline = t.output
                if baseline is not None:
                    diff = jnp.max(jnp.abs(t.output.astype(jnp.float32) - baseline.astype(jnp.float32)))
                    row["max_abs_diff_vs_xla"] = float(diff)
                del t
            del q, k, v, baseline
    meta = run_metadata(args.argv)
    write_json(args.out, dict(meta, jax_version=jax.__version__, peak_tflops=peak, rows=rows))
    print(f"{meta['device']}  jax {jax.__version__}  dense bf16 {peak:.0f} TFLOP/s  -> {args.out}")
    print(f"{'B':>2} {'S':>6} {'impl':>9} {'ms':>10} {'floor ms':>9} {'TFLOP/s':>8} {'of floor':>8} {'diff':>8}  note")
    for r in rows:
        ms, tf, of, diff = (r.get(x, np.nan) for x in ("median_ms", "tflops", "of_floor", "max_abs_diff_vs_xla"))
        print(f"{r['batch']:>2} {r['seq']:>6} {r['implementation']:>9} {ms:>10.3f} {r['flop_floor_ms']:>9.3f} "
              f"{tf:>8.1f} {of:>8.1%} {diff:>8.4f}  {r.get('skipped', '')}")
    return rows


if __name__ == "__main__":
    main(parse_args())
