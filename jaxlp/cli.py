"""Command line: ``jaxlp generate``, ``jaxlp info``, ``jaxlp demo``.

User errors (missing or corrupt files, unsupported architectures, bad prompts) print one
line ``jaxlp: error: ...`` and exit with status 2; no traceback.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

SAMPLERS = ("greedy", "temperature", "top-k", "top-p", "min-p")


class UserError(Exception):
    """An error in what the user asked for: reported in one line."""


def _console():
    from rich.console import Console

    return Console(stderr=True)


def make_sampler(args):
    from jaxlp.sampling.base import Categorical, Greedy

    name = args.sampler
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
    prompt_ids = tokenizer.encode(args.prompt).ids
    sampler = make_sampler(args)
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


def cmd_info(args) -> int:
    from jaxlp.models.loading import read_config

    path = Path(args.model)
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


def cmd_demo(args) -> int:
    from jaxlp import demo

    demo.run(max_new_tokens=args.max_new_tokens, seed=args.seed)
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
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32", "float16"))
    g.add_argument("--kv-cache", default="bf16")
    g.set_defaults(func=cmd_generate)

    i = sub.add_parser("info", help="describe a checkpoint: architecture, parameters, bytes")
    i.add_argument("--model", required=True)
    i.set_defaults(func=cmd_info)

    d = sub.add_parser("demo", help="run generation on the built-in model (no downloads)")
    d.add_argument("--max-new-tokens", type=int, default=48)
    d.add_argument("--seed", type=int, default=0)
    d.set_defaults(func=cmd_demo)
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    from jaxlp.models.config import UnsupportedConfigError
    from jaxlp.models.loading import CheckpointFormatError

    try:
        return args.func(args)
    except (UserError, CheckpointFormatError, UnsupportedConfigError, ValueError, FileNotFoundError) as e:
        print(f"jaxlp: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
