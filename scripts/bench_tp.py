"""Tensor-parallel decode: ms/token at TP = 1 and TP = N, side by side in one run (issue #22).

    python scripts/bench_tp.py --tp 1,2 --formats bf16,w4a16 --layers 36 --batch 1 --out tp.json
    python scripts/bench_tp.py --projections unfused,fused ...   # both layouts side by side
    python scripts/bench_tp.py --shape qwen3-32b --projections fused --host-weights ...

A Qwen3-8B- or Qwen3-32B-shaped model (``--shape``) with random weights (``--layers`` of them,
default all; ``--tiny``: a small model of the same family, for smoke runs on simulated CPU devices
with ``XLA_FLAGS=--xla_force_host_platform_device_count=4``; ``--host-weights``: the random BF16
model is built in host memory and each run places its own copy, so that no GPU holds two whole
copies: the 32B shape is 65.5 GB in BF16), greedy decode through ``jaxlp.generate``
(the ``length`` differencing of ``scripts/bench_decode.py``: time of n2 tokens minus n1, over
n2 - n1). Each TP degree places the same weights with :func:`jaxlp.models.shard_model` over the
first N devices; NVFP4 W4A16 is quantized once per degree (``quantize_model(mesh=...)``), kernels
``"auto"``. ``--projections``: q/k/v and gate/up as separate linears (``unfused``) and/or fused,
their rows grouped per device (``fused``: ``jaxlp.models.fuse_projections``; one column-parallel
product per group and device). Prints a table (speed-up over TP = 1 per format), compares every degree with TP = 1
(the greedy tokens, and the prompt's logits: relative error), and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import jaxlp  # noqa: E402
from bench_decode import CONTEXTS, QWEN3_8B, build_model, prompts, step_profile  # noqa: E402
from jaxlp.evals import harness  # noqa: E402
from jaxlp.models import from_hf_config, fuse_projections, shard_model  # noqa: E402
from jaxlp.progress import Reporter  # noqa: E402
from jaxlp.quantization import quantize_model, set_implementation  # noqa: E402

FORMATS = ("bf16", "w4a16")
QWEN3_32B = dict(QWEN3_8B, hidden_size=5120, intermediate_size=25600, num_hidden_layers=64, max_window_layers=64,
                 num_attention_heads=64, num_key_value_heads=8)  # the public Qwen/Qwen3-32B config.json
SHAPES = {"qwen3-8b": ("Qwen3-8B", QWEN3_8B), "qwen3-32b": ("Qwen3-32B", QWEN3_32B)}  # name, config.json
PROJECTIONS = ("unfused", "fused")


def decode_ms(model, batch: int, ctx: str, *, n1: int, n2: int, repeats: int, profile: dict | None = None):
    """(ms per token, greedy tokens of the n2-token call); with ``profile`` (a dict), also the GPU
    kernel time per token by kernel, summed over the devices (``bench_decode.step_profile``)."""
    p = prompts(batch, CONTEXTS[ctx], model.config.vocab_size, seed=batch * 31 + len(ctx))
    run = lambda n: jaxlp.generate(model, p, max_new_tokens=n, stop_tokens=(), kv_cache="bf16")  # noqa: E731
    tokens = np.asarray(run(n2).tokens)  # compiles
    run(n1)
    long = harness.time_call(lambda: run(n2).tokens, repeats=repeats)
    short = harness.time_call(lambda: run(n1).tokens, repeats=repeats)
    if profile is not None:
        profile.update(step_profile(lambda: run(n2).tokens, lambda: run(n1).tokens, n2 - n1, top=16))
    return 1e-3 * (long.median_us - short.median_us) / (n2 - n1), tokens


def prompt_logits(model, ctx: str) -> np.ndarray:
    """The prompt's logits ``[1, S, V]`` (float32) in one jitted forward pass: the comparison of a
    TP degree with TP = 1 that greedy tokens cannot give (a random model's top-2 margins sit within
    BF16 rounding, and rounding each device's partial product differs from one device's)."""
    ids = np.asarray(prompts(1, CONTEXTS[ctx], model.config.vocab_size, seed=7))
    return np.asarray(jax.jit(lambda m, x: m(x))(model, ids), np.float32)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tp", default="1,2", help="TP degrees, comma separated (1 first: the baseline)")
    ap.add_argument("--formats", default=",".join(FORMATS), help=f"of {FORMATS}")
    ap.add_argument("--projections", default="unfused", help=f"comma separated, of {PROJECTIONS}")
    ap.add_argument("--shape", default="qwen3-8b", choices=sorted(SHAPES), help="the model's shape")
    ap.add_argument("--layers", type=int, default=None, help="decoder layers (default: the shape's)")
    ap.add_argument("--host-weights", action="store_true",
                    help="build the random weights in host memory; each run places its own copy on the devices")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--context", default="short", choices=sorted(CONTEXTS))
    ap.add_argument("--n1", type=int, default=16)
    ap.add_argument("--n2", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--tiny", action="store_true", help="a small model of the same family (smoke runs)")
    ap.add_argument("--profile", action="store_true",
                    help="also split each run's GPU time per token by kernel (profiler traces, all devices summed)")
    ap.add_argument("--out", default=None, help="JSON file to write")
    args = ap.parse_args(argv)
    degrees = [int(t) for t in args.tp.split(",")]
    formats = args.formats.split(",")
    layouts = args.projections.split(",")
    if set(layouts) - set(PROJECTIONS):
        ap.error(f"unknown --projections {sorted(set(layouts) - set(PROJECTIONS))}; known: {PROJECTIONS}")
    if degrees[0] != 1 or any(t < 1 for t in degrees):
        ap.error("--tp must start with 1 (the baseline) and hold positive degrees")
    if set(formats) - set(FORMATS):
        ap.error(f"unknown formats {sorted(set(formats) - set(FORMATS))}; known: {FORMATS}")
    if max(degrees) > jax.device_count():
        ap.error(f"--tp {max(degrees)}: {jax.device_count()} devices here")

    shape_name, shape = SHAPES[args.shape]
    layers = args.layers or shape["num_hidden_layers"]
    cfg = dict(shape, num_hidden_layers=layers, max_window_layers=layers)
    if args.tiny:
        cfg.update(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                   vocab_size=2048)
    config = from_hf_config(cfg)
    host = jax.devices("cpu")[0] if args.host_weights else None
    unfused = build_model(config, device=host)
    result = {**harness.run_metadata(argv), "model": f"{shape_name} shape, {layers} layers, random "
              "weights", "host_weights": args.host_weights, "batch": args.batch, "context": args.context, "runs": []}
    tokens_at_1, logits_at_1 = {}, {}  # by (format, projections): the TP = 1 run of the same layout
    with Reporter().bar("tensor-parallel decode", len(degrees) * len(formats) * len(layouts)) as advance:
        for tp in degrees:
            # Host weights: TP = 1 runs on a mesh of one device too (shard_model places the copy there).
            mesh = Mesh(np.array(jax.devices()[:tp]), ("tp",)) if tp > 1 or args.host_weights else None
            for layout in layouts:
                model = nnx.clone(unfused) if layout == "unfused" else fuse_projections(unfused)
                on_host = model if host is not None else None  # quantized there, then placed
                model = shard_model(model, mesh) if mesh is not None and host is None else model
                for fmt in formats:
                    if on_host is not None:
                        model = None  # the previous run's copy leaves the devices first
                        model = on_host if fmt == "bf16" else quantize_model(on_host, "w4a16-nvfp4")
                        model = shard_model(nnx.clone(model), mesh)
                    elif fmt == "w4a16":
                        model = quantize_model(model, "w4a16-nvfp4", mesh=mesh)
                    if fmt == "w4a16":
                        set_implementation(model, "auto")
                    key = (fmt, layout)
                    logits = prompt_logits(model, args.context)
                    if tp == 1:
                        logits_at_1[key] = logits
                    profile = {} if args.profile else None
                    ms, tokens = decode_ms(model, args.batch, args.context, n1=args.n1, n2=args.n2,
                                           repeats=args.repeats, profile=profile)
                    if tp == 1:
                        tokens_at_1[key] = tokens
                    same = bool(np.array_equal(tokens, tokens_at_1[key]))
                    rec = dict(tp=tp, format=fmt, projections=layout, ms_per_token=ms, same_tokens_as_tp1=same,
                               equal_token_fraction=float(np.mean(tokens == tokens_at_1[key])),
                               logits_rel_to_tp1=harness.relative_error(logits, logits_at_1[key]))
                    if profile:
                        rec["step_profile"] = profile
                    result["runs"].append(rec)
                    print(json.dumps(rec), flush=True)
                    if args.out:  # after every run: a call cut at its time limit keeps what it measured
                        harness.write_json(args.out, result)
                    advance(1, description=f"tp {tp} {layout} {fmt}: {ms:.3f} ms/token")
                    jaxlp.generation.clear_cache_pool()

    base_ms = {(r["format"], r["projections"]): r["ms_per_token"] for r in result["runs"] if r["tp"] == 1}
    print(f"\n## decode ms/token, {jax.devices()[0].device_kind}, {shape_name} shape, {layers} layers, "
          f"batch {args.batch}")
    print(f"{'format':8s} {'projections':>11s} {'tp':>3s} {'ms/tok':>8s} {'x tp=1':>7s} {'tokens':>7s} "
          f"{'logits vs tp=1':>15s}")
    for r in result["runs"]:
        x = base_ms[r["format"], r["projections"]] / r["ms_per_token"]
        print(f"{r['format']:8s} {r['projections']:>11s} {r['tp']:3d} {r['ms_per_token']:8.3f} {x:6.2f}x "
              f"{'same' if r['same_tokens_as_tp1'] else 'DIFFER':>7s} {r['logits_rel_to_tp1']:15.2e}")
    return result


if __name__ == "__main__":
    main()
