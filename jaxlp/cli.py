"""Command line: ``jaxlp generate``, ``jaxlp quantize``, ``jaxlp info``, ``jaxlp demo``.

User errors (missing or corrupt files, unsupported architectures, bad prompts) print one
line ``jaxlp: error: ...`` and exit with status 2; no traceback.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

SAMPLERS = ("greedy", "temperature", "top-k", "top-p", "min-p", "reset", "fixed-threshold", "sliding-window",
            "within-step-mean", "ema", "uniform-confident-low")


class UserError(Exception):
    """An error in what the user asked for: reported in one line."""


def _console():
    from rich.console import Console

    return Console(stderr=True)


def make_sampler(args, tokenizer=None):
    from jaxlp import sampling
    from jaxlp.sampling.base import Categorical, Greedy

    name = args.sampler
    entropy_samplers = {"reset": sampling.ReSETConfig, "fixed-threshold": sampling.FixedThreshold,
                        "sliding-window": sampling.SlidingWindowEstimate,
                        "within-step-mean": sampling.WithinStepMeanEstimate, "ema": sampling.EMAEstimate,
                        "uniform-confident-low": sampling.UniformConfidentLow}
    if name in entropy_samplers:
        t_low, tau0 = args.t_low, args.tau0
        if args.preset:
            preset = sampling.reset_preset(args.preset)
            t_low = preset.t_low if t_low is None else t_low
            tau0 = preset.tau0 if tau0 is None else tau0
        if t_low is None or tau0 is None:
            raise UserError(f"sampler {name!r} needs --t-low and --tau0 (or --preset; calibrate with jaxlp calibrate-tau0)")
        return entropy_samplers[name].from_tokenizer(tokenizer, t_low, tau0, t_high=args.t_high, top_p=args.top_p)
    if name == "greedy":
        return Greedy()
    if name == "temperature":
        return Categorical(temperature=args.temperature)
    if name == "top-k":
        return Categorical(temperature=args.temperature, top_k=args.top_k)
    if name == "top-p":
        return Categorical(temperature=args.temperature, top_p=args.top_p)
    if name == "min-p":
        return Categorical(temperature=args.temperature, min_p=args.min_p)
    raise UserError(f"unknown sampler {name!r}; choose from {', '.join(SAMPLERS)}")


def cmd_generate(args) -> int:
    import jax.numpy as jnp

    import jaxlp
    from jaxlp.models.tokenizer import load_tokenizer

    if not args.prompt.strip():
        raise UserError("the prompt is empty")
    console = _console()
    with console.status(f"loading {args.model}"):
        model = jaxlp.from_pretrained(args.model, dtype=jnp.dtype(args.dtype))
        tokenizer = load_tokenizer(args.model)
    if args.fuse_projections:
        model = _fused(model)
    if args.nestedfp_mode != "fp16":
        from jaxlp.quantization import set_mode

        set_mode(model, args.nestedfp_mode)
    prompt_ids = tokenizer.encode(args.prompt).ids
    sampler = make_sampler(args, tokenizer)
    start = time.perf_counter()
    with console.status(f"compiling and generating up to {args.max_new_tokens} tokens"):
        result = jaxlp.generate(
            model, [prompt_ids], max_new_tokens=args.max_new_tokens, sampler=sampler, seed=args.seed,
            kv_cache=args.kv_cache,
        )
    seconds = time.perf_counter() - start
    tokens = result.sequences()[0]
    print(tokenizer.decode(tokens, skip_special_tokens=True))
    console.print(f"[dim]{len(tokens)} tokens in {seconds:.2f} s (compilation included)[/dim]")
    return 0


def _checkpoint_tensors(path: Path) -> tuple[int, int, dict[str, int]]:
    """(parameter count, bytes, bytes per dtype) read from the safetensors headers."""
    import math

    from safetensors import safe_open

    from jaxlp.models.loading import safetensors_files

    count, nbytes, per_dtype = 0, 0, {}
    sizes = {"F64": 8, "F32": 4, "I32": 4, "F16": 2, "BF16": 2, "I16": 2, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1}
    for f in safetensors_files(path):
        with safe_open(str(f), framework="numpy") as h:
            for name in h.keys():
                sl = h.get_slice(name)
                n = math.prod(sl.get_shape())
                b = n * sizes.get(sl.get_dtype(), 4)
                count, nbytes = count + n, nbytes + b
                per_dtype[sl.get_dtype()] = per_dtype.get(sl.get_dtype(), 0) + b
    return count, nbytes, per_dtype


def _info_quantized(path: Path) -> int:
    import jax
    from flax import nnx

    from jaxlp.formats import QuantizedArray
    from jaxlp.quantization.saving import load_quantized

    model = load_quantized(path)
    leaves = jax.tree.leaves(nnx.state(model), is_leaf=lambda x: isinstance(x, QuantizedArray))
    quantized = sum(x.nbytes for x in leaves if isinstance(x, QuantizedArray))
    other = sum(x.nbytes for x in leaves if not isinstance(x, QuantizedArray))
    c, report = model.config, model.quantization
    print(f"architecture  {c.model_type}, {c.num_layers} layers, hidden {c.hidden_size}, vocab {c.vocab_size}")
    print(f"recipe        {report.recipe}: {len(report.quantized)} layers quantized, {len(report.kept)} kept")
    print(f"bytes         {quantized + other:,} ({quantized:,} in quantized layers, {other:,} high precision)")
    return 0


def cmd_info(args) -> int:
    from jaxlp.models.loading import read_config

    path = Path(args.model)
    from jaxlp.quantization.saving import is_quantized_checkpoint

    if is_quantized_checkpoint(path):
        return _info_quantized(path)
    c = read_config(path)
    count, nbytes, per_dtype = _checkpoint_tensors(path)
    rows = [
        ("architecture", c.model_type),
        ("layers", c.num_layers),
        ("hidden / intermediate", f"{c.hidden_size} / {c.intermediate_size}"),
        ("heads (query / kv) x head_dim", f"{c.num_heads} / {c.num_kv_heads} x {c.head_dim}"),
        ("vocabulary", c.vocab_size),
        ("sliding window", f"{c.sliding_window} on {c.layer_types.count('sliding_attention')} layers"
         if c.sliding_window else "none"),
        ("tied embeddings", c.tie_word_embeddings),
        ("parameters", f"{count:,} (config: {c.num_params:,})"),
        ("bytes on disk", f"{nbytes:,} ({', '.join(f'{k}: {v:,}' for k, v in sorted(per_dtype.items()))})"),
    ]
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{width}}  {v}")
    return 0


def _fused(model):
    from jaxlp.models import fuse_projections

    try:
        return fuse_projections(model, inplace=True)
    except ValueError as e:
        raise UserError(f"cannot fuse the projections of this checkpoint: {e}") from None


def cmd_quantize(args) -> int:
    import jax.numpy as jnp

    import jaxlp
    from jaxlp.data import token_windows
    from jaxlp.models.tokenizer import load_tokenizer
    from jaxlp.quantization import get_recipe, save_quantized

    recipe = get_recipe(args.recipe)
    out = Path(args.out)
    if out.exists() and any(out.iterdir()) and not args.overwrite:
        raise UserError(f"{out} exists and is not empty (pass --overwrite)")
    console = _console()
    with console.status(f"loading {args.model}"):
        model = jaxlp.from_pretrained(args.model, dtype=jnp.dtype(args.dtype))
        tokenizer = load_tokenizer(args.model)
    calibration = None
    if recipe.activation in ("nvfp4",):
        calibration = token_windows(tokenizer, args.calibration_sequences, args.calibration_length)
        console.print(f"calibrating on {calibration.shape[0]} x {calibration.shape[1]} tokens of offline text")
    if args.fuse_projections:
        model = _fused(model)
    quantized = jaxlp.quantize_model(model, recipe, calibration=calibration)
    with console.status(f"saving to {out}"):
        save_quantized(quantized, out, tokenizer_from=args.model, overwrite=args.overwrite)
    report = quantized.quantization
    print(f"{recipe.name}: {len(report.quantized)} layers quantized, {len(report.kept)} kept high precision -> {out}")
    for path, why in report.kept:
        print(f"  kept {path}: {why}")
    return 0


def cmd_calibrate_tau0(args) -> int:
    import jax.numpy as jnp

    import jaxlp
    from jaxlp.data import token_windows
    from jaxlp.models.tokenizer import load_tokenizer
    from jaxlp.generation import tau0_from_generation

    console = _console()
    with console.status(f"loading {args.model}"):
        model = jaxlp.from_pretrained(args.model, dtype=jnp.dtype(args.dtype))
        tokenizer = load_tokenizer(args.model)
    if args.prompts_file:
        lines = [l for l in Path(args.prompts_file).read_text().split("\n\n") if l.strip()][: args.num_prompts]
        prompts = [tokenizer.encode(l).ids for l in lines]
    else:
        prompts = token_windows(tokenizer, args.num_prompts, args.prompt_length).tolist()
    with console.status(f"generating {args.max_new_tokens} tokens for {len(prompts)} calibration prompts"):
        tau0, entropies = tau0_from_generation(model, prompts, max_new_tokens=args.max_new_tokens, seed=args.seed)
    print(f"tau0 = {tau0:.4f}  (80th percentile of {entropies.size} raw-logit token entropies, "
          f"generated at T=0.6, top-p 0.95)")
    return 0


def cmd_demo(args) -> int:
    from jaxlp import demo

    demo.run(num_problems=args.problems, seed=args.seed, model_dir=args.model)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="jaxlp", description="Low-precision LLM inference in JAX.")
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate text from a prompt")
    g.add_argument("--model", required=True, help="checkpoint directory (config.json, *.safetensors, tokenizer.json)")
    g.add_argument("--prompt", required=True)
    g.add_argument("--max-new-tokens", type=int, default=64)
    g.add_argument("--sampler", default="greedy", choices=SAMPLERS)
    g.add_argument("--temperature", type=float, default=0.6)
    g.add_argument("--top-k", type=int, default=50)
    g.add_argument("--top-p", type=float, default=0.95)
    g.add_argument("--min-p", type=float, default=0.05)
    g.add_argument("--t-low", type=float, default=None, help="entropy samplers: temperature of confident tokens")
    g.add_argument("--t-high", type=float, default=1.0, help="entropy samplers: temperature of uncertain tokens")
    g.add_argument("--tau0", type=float, default=None, help="entropy samplers: token-entropy threshold (nats)")
    g.add_argument("--preset", default=None, help="entropy samplers: the paper's (t_low, tau0) for a model, "
                   "e.g. Qwen3-8B")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32", "float16"))
    g.add_argument("--kv-cache", default="bf16")
    g.add_argument("--fuse-projections", action="store_true",
                   help="one q/k/v and one gate/up linear per layer (faster decode; see jaxlp.models.fuse_projections)")
    g.add_argument("--nestedfp-mode", default="fp16", choices=("fp16", "fp8"),
                   help="for NestedFP checkpoints: compute with the FP16 or the FP8 model")
    g.set_defaults(func=cmd_generate)

    i = sub.add_parser("info", help="describe a checkpoint: architecture, parameters, bytes")
    i.add_argument("--model", required=True)
    i.set_defaults(func=cmd_info)

    q = sub.add_parser("quantize", help="quantize a checkpoint with a recipe and save it")
    q.add_argument("--model", required=True, help="Hugging Face checkpoint directory")
    q.add_argument("--recipe", required=True, help="e.g. w4a4-nvfp4, w4a16-nvfp4, w8a8-fp8, w4a8-fireq, nestedfp")
    q.add_argument("--out", required=True, help="output directory (loadable by jaxlp generate --model)")
    q.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32", "float16"))
    q.add_argument("--calibration-sequences", type=int, default=8)
    q.add_argument("--calibration-length", type=int, default=512)
    q.add_argument("--overwrite", action="store_true")
    q.add_argument("--fuse-projections", action="store_true",
                   help="fuse q/k/v and gate/up before quantizing: one linear and one NVFP4 tensor scale each "
                        "(as ModelOpt exports them); the checkpoint keeps the fused layout")
    q.set_defaults(func=cmd_quantize)

    c = sub.add_parser("calibrate-tau0", help="ReSET's tau0: 80th percentile of token entropies on calibration prompts")
    c.add_argument("--model", required=True)
    c.add_argument("--prompts-file", default=None, help="text file of prompts separated by blank lines "
                   "(default: windows of offline text)")
    c.add_argument("--num-prompts", type=int, default=5)
    c.add_argument("--prompt-length", type=int, default=64)
    c.add_argument("--max-new-tokens", type=int, default=256)
    c.add_argument("--seed", type=int, default=0)
    c.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32", "float16"))
    c.set_defaults(func=cmd_calibrate_tau0)

    d = sub.add_parser("demo", help="the embedded reasoner on held-out problems: BF16, NVFP4 W4A4, W4A4 + ReSET")
    d.add_argument("--problems", type=int, default=8, help="held-out problems to solve")
    d.add_argument("--model", default=None, help="a reasoner checkpoint (default: the embedded one)")
    d.add_argument("--seed", type=int, default=0)
    d.set_defaults(func=cmd_demo)
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    from jaxlp.errors import CheckpointFormatError, UnsupportedConfigError

    try:
        return args.func(args)
    except (UserError, CheckpointFormatError, UnsupportedConfigError, ValueError, FileNotFoundError, FileExistsError) as e:
        print(f"jaxlp: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
