"""Decode time per token of a Qwen3-8B-shaped model (36 layers, random weights) through jaxlp.generate.

Formats: BF16; NVFP4 W4A4 (calibrated on two random token batches) and W4A16, both through
QuantizedLinear's "auto" implementation (the kernels the measured dispatch table picks per
shape and M: a CUDA GEMV at decode, the CUDA GEMM or XLA dequantize-then-dot for the prefill);
NVFP4 W4A4 with the ReSET sampler when jaxlp.sampling.reset provides it. Suffixes: ``-reset``
(the ReSET sampler), ``-pipe`` (every "regs" GEMV choice of the table replaced by the "pipe"
kernel: one launch per linear for W4A16), ``-lmhead`` (the lm_head quantized too, NVFP4 W4A16:
it stays quantized for the later runs, so these runs come last).
Batch 1 and 8, a short (128-token) and an 8K (8000-token) prompt. ``--fused``: every run with
fused q/k/v and gate/up projections (one linear each, BF16 included). ``--attention xla``: the
decode steps attend through XLA's ops instead of the Pallas decode-attention kernel.

Time per token = difference of two generation lengths divided by their difference in steps,
after a warm-up call, so that prefill and compilation cancel:

- ``--method length``: two calls with max_new_tokens N1 and N2 (two compiled programs).
- ``--method stop`` (default, one compiled program per configuration): both calls use
  max_new_tokens N2; the second stops early on stop tokens picked from the first call's output
  (each row's token at step N1; rows sample at T = 0.6, top-p 0.95 from a random model, so the
  tokens are effectively random and a row first meets one of them at about step N1). The loop
  stops when every row has finished; the step count of that call is the largest per-row token
  count it reports, so the difference is exact.

Each timing is the median of ``--repeats`` calls. Results: a table on stdout and JSON.

``--profile``: also trace both calls once more and split the GPU kernel time per token (the same
difference) by kind of kernel (NVFP4 GEMV, activation staging, cuBLAS dots, sampling, XLA
fusions ...) with the largest kernels by name; the sum is GPU busy time, not wall time.

    python scripts/bench_decode.py --out docs/bench_decode.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jaxlp  # noqa: E402
from jaxlp.evals import harness  # noqa: E402
from jaxlp.models import Transformer, from_hf_config  # noqa: E402
from jaxlp.quantization import quantize_model, quantized_layers, set_implementation  # noqa: E402
from jaxlp.quantization import nvfp4_dispatch  # noqa: E402
from jaxlp.quantization.recipes import get_recipe  # noqa: E402
from jaxlp.sampling.base import Categorical  # noqa: E402

QWEN3_8B = {  # the public Qwen/Qwen3-8B config.json
    "architectures": ["Qwen3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 151643,
    "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02,
    "intermediate_size": 12288, "max_position_embeddings": 40960, "max_window_layers": 36, "model_type": "qwen3",
    "num_attention_heads": 32, "num_hidden_layers": 36, "num_key_value_heads": 8, "rms_norm_eps": 1e-06,
    "rope_scaling": None, "rope_theta": 1000000, "sliding_window": None, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16", "use_cache": True, "use_sliding_window": False, "vocab_size": 151936,
}
CONTEXTS = {"short": 128, "8k": 8000}


def reset_sampler():
    """ReSET with the paper's Qwen3-8B preset, or None if the module is not there."""
    try:
        from jaxlp.sampling.reset import ReSETConfig, reset_preset
    except ImportError:
        return None
    p = reset_preset("Qwen3-8B")
    return ReSETConfig(t_low=p.t_low, tau0=p.tau0, top_p=0.95)


def build_model(config, seed=0, std=0.02, dtype=jnp.bfloat16, device=None):
    """Random weights of ``dtype`` (normal * std, norms 1) filled leaf by leaf: one small jit per
    shape instead of one huge initialisation program. ``device``: each leaf, drawn on the default
    device, moves there at once (host memory for models larger than a GPU holds twice)."""
    abstract = nnx.eval_shape(lambda: Transformer(config, dtype=dtype, rngs=nnx.Rngs(seed)))
    graphdef, state = nnx.split(abstract)
    fill = jax.jit(lambda key, shape, dtype: (jax.random.normal(key, shape, jnp.float32) * std).astype(dtype),
                   static_argnums=(1, 2))
    flat = nnx.to_flat_state(state) if hasattr(nnx, "to_flat_state") else state.flat_state()
    key = jax.random.key(seed)
    values = {}
    for i, (path, var) in enumerate(flat):
        leaf = var.get_value() if hasattr(var, "get_value") else var.value
        if "norm" in "/".join(map(str, path)):
            values[path] = jnp.ones(leaf.shape, leaf.dtype)
        else:
            values[path] = fill(jax.random.fold_in(key, i), tuple(leaf.shape), jnp.dtype(leaf.dtype))
        if device is not None:
            values[path] = jax.device_put(values[path], device)
    new_state = jax.tree_util.tree_map_with_path(
        lambda p, leaf: values[tuple(_key(k) for k in p)], nnx.to_pure_dict(state))
    nnx.replace_by_pure_dict(state, new_state)
    model = nnx.merge(graphdef, state)
    jax.block_until_ready(nnx.state(model))
    return model


def _key(k):
    return getattr(k, "key", getattr(k, "idx", getattr(k, "name", k)))


def pipe_table(table: dict) -> dict:
    """The dispatch table with every "regs" GEMV choice replaced by the "pipe" kernel (P2C1 up to
    M = 4, P2C2 above): a decode-time comparison of one launch per linear (pipe, W4A16) against
    two (regs: staging + GEMV)."""
    out = json.loads(json.dumps(table))
    for e in out["shapes"]:
        for mode in ("w4a16", "w4a4"):
            for pair in e.get(mode, []):
                m, c = pair
                if c != "xla" and c.get("kernel", "regs") == "regs":
                    pair[1] = {"kernel": "pipe", "rows_per_warp": 2, "split": 1 if m <= 4 else 2}
    return out


def _fixed(table, original):
    def load_table(path=None):
        return table
    load_table.original = original
    load_table.cache_clear = lambda: None
    return load_table


def prompts(batch, length, vocab, seed):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, length).tolist() for _ in range(batch)]


KERNEL_KINDS = (  # (kind, substrings of the kernel name), first match wins
    ("NCCL collectives", ("nccl",)),
    ("nvfp4 GEMV", ("gemv_kernel", "pipe_kernel")),
    ("nvfp4 activation staging", ("stage_a4_kernel", "stage_a16_kernel")),
    ("nvfp4 GEMM", ("gemm_kernel",)),
    ("sampling kernels", ("entropy_max_kernel", "sample_kernel")),
    ("cuBLAS / cuDNN", ("gemm", "gemv", "nvjet", "xmma", "cutlass", "cublas", "cudnn", "flash")),
    ("memcpy / memset", ("memcpy", "memset", "Memcpy", "Memset")),
)


def kernel_times(run) -> tuple[dict[str, float], dict[str, int]]:
    """GPU kernel time (us) and launch count per kernel name in a profiler trace of one call of ``run``."""
    import gzip
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        with jax.profiler.trace(d, create_perfetto_trace=True):
            jax.block_until_ready(run())
        trace = json.load(gzip.open(next(Path(d).rglob("*perfetto_trace.json.gz"))))
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    gpu = {e["pid"] for e in events
           if e.get("ph") == "M" and e.get("name") == "process_name" and "GPU" in str(e.get("args", {}).get("name"))}
    out: dict[str, float] = {}
    count: dict[str, int] = {}
    for e in events:
        if e.get("ph") == "X" and e.get("pid") in gpu:
            out[e["name"]] = out.get(e["name"], 0.0) + float(e["dur"])
            count[e["name"]] = count.get(e["name"], 0) + 1
    return out, count


def kernel_kind(name: str) -> str:
    for kind, keys in KERNEL_KINDS:
        if any(k in name for k in keys):
            return kind
    return "XLA fusions and other"


def step_profile(run_long, run_short, steps: int, top: int = 12) -> dict:
    """Per-token GPU kernel time (us) by kind and by kernel, and kernel launches per token:
    (long call - short call) / steps."""
    (long, long_n), (short, short_n) = kernel_times(run_long), kernel_times(run_short)
    per_name = {n: (long.get(n, 0.0) - short.get(n, 0.0)) / steps for n in set(long) | set(short)}
    launches = sum(long_n.values()) - sum(short_n.values())
    kinds: dict[str, float] = {}
    for n, t in per_name.items():
        kinds[kernel_kind(n)] = kinds.get(kernel_kind(n), 0.0) + t
    biggest = sorted(per_name.items(), key=lambda kv: -kv[1])[:top]
    return {"gpu_us_per_token": sum(per_name.values()), "launches_per_token": launches / steps,
            "by_kind_us": dict(sorted(kinds.items(), key=lambda kv: -kv[1])),
            "top_kernels_us": [[n[:160], t] for n, t in biggest]}


def per_token(model, batch, ctx, sampler, *, n1, n2, method, repeats, profile=False, profile_top=12,
              attention="auto", on_nonfinite="raise"):
    p = prompts(batch, CONTEXTS[ctx], model.config.vocab_size, seed=batch * 31 + len(ctx))
    common = dict(sampler=sampler, seed=1, kv_cache=jaxlp.kvcache.get("bf16", attention=attention),
                  on_nonfinite=on_nonfinite)
    t_c = time.perf_counter()
    first = jaxlp.generate(model, p, max_new_tokens=n2, stop_tokens=(), **common)  # warm-up (compiles)
    compile_s = time.perf_counter() - t_c
    timing = harness.time_call(lambda: jaxlp.generate(model, p, max_new_tokens=n2, stop_tokens=(), **common),
                               warmup=0, repeats=repeats)  # warmed up by the first call
    t2, full = timing.median_us * 1e-6, timing.output
    steps2 = int(full.num_tokens.max())
    if method == "length":
        short = harness.time_call(lambda: jaxlp.generate(model, p, max_new_tokens=n1, stop_tokens=(), **common),
                                  warmup=1, repeats=repeats)
        t1, steps1 = short.median_us * 1e-6, int(short.output.num_tokens.max())
    else:
        stops = sorted({int(t) for t in first.tokens[:, n1 - 1]})
        short = harness.time_call(lambda: jaxlp.generate(model, p, max_new_tokens=n2, stop_tokens=stops, **common),
                                  warmup=1, repeats=repeats)
        t1, steps1 = short.median_us * 1e-6, int(short.output.num_tokens.max())
    if steps2 - steps1 < n2 // 4:
        raise RuntimeError(f"generation lengths too close to difference ({steps1} vs {steps2} steps)")
    rec = {"ms_per_token": 1e3 * (t2 - t1) / (steps2 - steps1), "steps": [steps1, steps2], "t_s": [t1, t2],
           "warmup_s": compile_s, "deterministic_prefix": bool((first.tokens == full.tokens).all())}
    if profile and method == "stop":
        rec["profile"] = step_profile(
            lambda: jaxlp.generate(model, p, max_new_tokens=n2, stop_tokens=(), **common).tokens,
            lambda: jaxlp.generate(model, p, max_new_tokens=n2, stop_tokens=stops, **common).tokens,
            steps2 - steps1, top=profile_top)
    return rec


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="docs/bench_decode.json")
    ap.add_argument("--method", choices=("stop", "length"), default="stop")
    ap.add_argument("--n1", type=int, default=32)
    ap.add_argument("--n2", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--layers", type=int, default=36)
    ap.add_argument("--runs", default="bf16:1:short,bf16:8:short,bf16:1:8k,w4a4:1:short,w4a16:1:short,w4a4:8:short,"
                    "w4a16:8:short,w4a4-reset:1:short,w4a16:1:8k,w4a4:1:8k,w4a4-reset:8:short",
                    help="format:batch:context in this order; every bf16 run first (the model is then quantized "
                         "in place; W4A4 and W4A16 alternate freely on the same NVFP4 weights)")
    ap.add_argument("--budget-s", type=float, default=1e9, help="skip runs that start after this many seconds")
    ap.add_argument("--tiny", action="store_true", help="a small model of the same family (smoke tests)")
    ap.add_argument("--profile", action="store_true", help="split the GPU time per token by kernel (stop method)")
    ap.add_argument("--profile-top", type=int, default=12, help="kernels listed by name per profiled run")
    ap.add_argument("--on-nonfinite", choices=("raise", "ignore"), default="raise",
                    help="generate's non-finite-logits check ('ignore' compiles it out: its cost is the difference)")
    ap.add_argument("--attention", choices=("auto", "xla"), default="auto",
                    help="decode attention of the BF16 cache: the Pallas kernel on a GPU (auto) or XLA's ops")
    ap.add_argument("--fused", action="store_true",
                    help="fused q/k/v and gate/up projections (jaxlp.models.fuse_projections) in every run")
    args = ap.parse_args(argv)

    start = time.time()
    cfg_dict = dict(QWEN3_8B, num_hidden_layers=args.layers, max_window_layers=args.layers)
    if args.tiny:
        cfg_dict.update(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2,
                        head_dim=64, vocab_size=2048)
    config = dataclasses.replace(from_hf_config(cfg_dict), fused_projections=args.fused)
    dev = jax.devices()[0]
    result = {**harness.run_metadata(argv), "xla_flags": os.environ.get("XLA_FLAGS", ""),
              "model": f"Qwen3-8B shape, {args.layers} layers, random weights"
                       + (", fused q/k/v and gate/up projections" if args.fused else ""),
              "fused_projections": args.fused, "attention": args.attention, "method": args.method,
              "n1": args.n1, "n2": args.n2, "runs": []}
    base_sampler = Categorical(temperature=0.6, top_p=0.95)
    rs = reset_sampler()
    runs = [r.split(":") for r in args.runs.split(",")]

    model = build_model(config)
    fmt_now = "bf16"
    table_now = "table"
    lm_head_quantized = False
    print(f"# model built in {time.time() - start:.1f}s", flush=True)
    for fmt, batch, ctx in runs:
        if time.time() - start > args.budget_s:
            print(f"# budget reached: skipping {fmt}:{batch}:{ctx}", flush=True)
            result["runs"].append({"format": fmt, "batch": int(batch), "context": ctx, "skipped": "time budget"})
            continue
        base = fmt.split("-")[0]
        if base != fmt_now:
            t0 = time.time()
            if fmt_now == "bf16":  # quantize once (W4A4 with calibrated activation scales)
                if base not in ("w4a4", "w4a16"):
                    raise SystemExit(f"unknown format {fmt}")
                ids = np.random.default_rng(5).integers(0, config.vocab_size, (2, 256))
                quantize_model(model, "w4a4-nvfp4", calibration=ids, calibration_batch_size=1, inplace=True)
                set_implementation(model, "auto")
            elif base == "bf16":
                raise SystemExit(f"--runs must put every bf16 run before the NVFP4 ones; got {fmt} after {fmt_now}")
            # W4A16 and W4A4 share the NVFP4 weights; W4A16 ignores the calibrated activation scale.
            for path, layer in quantized_layers(model):
                layer.activation = "nvfp4" if base == "w4a4" and path != "lm_head" else None
            fmt_now = base
            print(f"# switched to {base} in {time.time() - t0:.1f}s", flush=True)
        flags = set(fmt.split("-")[1:])
        unknown = flags - {"reset", "pipe", "lmhead"}
        if unknown or (flags and base == "bf16"):
            raise SystemExit(f"unknown run {fmt}: suffixes -reset, -pipe, -lmhead apply to w4a4 / w4a16")
        if "lmhead" in flags and not lm_head_quantized:
            t0 = time.time()
            quantize_model(model, get_recipe("w4a16-nvfp4").replace(include="lm_head"), inplace=True)
            set_implementation(model, "auto")
            lm_head_quantized = True
            print(f"# lm_head quantized (NVFP4 W4A16) in {time.time() - t0:.1f}s", flush=True)
        elif lm_head_quantized and "lmhead" not in flags:
            raise SystemExit(f"--runs must put every -lmhead run after the others; got {fmt} after one")
        sampler = rs if "reset" in flags else base_sampler
        want = "pipe" if "pipe" in flags else "table"
        if base != "bf16" and want != table_now:  # another GEMV for M <= 32: re-trace
            nvfp4_dispatch.load_table.cache_clear()
            if want == "pipe":
                table = pipe_table(nvfp4_dispatch.load_table())
                nvfp4_dispatch.load_table.cache_clear()
                nvfp4_dispatch.load_table = _fixed(table, nvfp4_dispatch.load_table)
            else:
                nvfp4_dispatch.load_table = getattr(nvfp4_dispatch.load_table, "original", nvfp4_dispatch.load_table)
            jax.clear_caches()
            table_now = want
        if sampler is None:
            result["runs"].append({"format": fmt, "batch": int(batch), "context": ctx, "skipped": "no ReSET sampler"})
            continue
        rec = {"format": fmt, "batch": int(batch), "context": ctx, "prompt": CONTEXTS[ctx]}
        try:
            rec.update(per_token(model, int(batch), ctx, sampler, n1=args.n1, n2=args.n2, method=args.method,
                                 repeats=args.repeats, profile=args.profile, profile_top=args.profile_top,
                                 attention=args.attention, on_nonfinite=args.on_nonfinite))
        except Exception as e:  # noqa: BLE001 - record and go on (e.g. out of memory at 8K)
            rec["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        jaxlp.generation.clear_cache_pool()
        result["runs"].append(rec)
        print(json.dumps(rec), flush=True)
        result["elapsed_s"] = time.time() - start
        harness.write_json(args.out, result)

    bf16 = {(r["batch"], r["context"]): r["ms_per_token"] for r in result["runs"]
            if r["format"] == "bf16" and "ms_per_token" in r}
    print(f"\n## decode ms/token, {dev.device_kind}, {args.layers} layers ({args.method} differencing)")
    print(f"{'format':12s} {'batch':>5s} {'ctx':>6s} {'ms/tok':>8s} {'vs bf16':>8s}")
    for r in result["runs"]:
        if "ms_per_token" not in r:
            print(f"{r['format']:12s} {r['batch']:5d} {r['context']:>6s} {r.get('error', r.get('skipped', ''))[:60]}")
            continue
        ref = bf16.get((r["batch"], r["context"]))
        sp = f"{ref / r['ms_per_token']:.2f}x" if ref else "-"
        print(f"{r['format']:12s} {r['batch']:5d} {r['context']:>6s} {r['ms_per_token']:8.3f} {sp:>8s}")
    profiled = [r for r in result["runs"] if "profile" in r]
    if profiled:
        kinds = sorted({k for r in profiled for k in r["profile"]["by_kind_us"]},
                       key=lambda k: -max(r["profile"]["by_kind_us"].get(k, 0.0) for r in profiled))
        print("\n## GPU kernel time per token (us) by kind")
        print(f"{'run':22s} {'total':>7s} {'launches':>8s} " + " ".join(f"{k[:14]:>14s}" for k in kinds))
        for r in profiled:
            pr = r["profile"]
            name = f"{r['format']}:{r['batch']}:{r['context']}"
            print(f"{name:22s} {pr['gpu_us_per_token']:7.0f} {pr['launches_per_token']:8.0f} "
                  + " ".join(f"{pr['by_kind_us'].get(k, 0.0):14.0f}" for k in kinds))
    return result


if __name__ == "__main__":
    main()
