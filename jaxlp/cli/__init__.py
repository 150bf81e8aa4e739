"""Command line: ``jaxlp generate``, ``quantize``, ``info``, ``calibrate-tau0``, ``demo``, ``serve``.

No command prints a traceback on any input (``docs/errors.md`` lists what each bad input gets):

- Bad input (a setting out of range, a missing or damaged file, an unsupported architecture,
  an output that would clobber something) prints one line ``jaxlp: error: ...`` on stderr
  and exits with status 2. Usage errors (an unknown option, a malformed number) print one
  such line too, with a pointer to ``--help``. Settings are checked by the same code as the
  Python API (the sampler dataclasses, ``generate``, ``quantize_model``), before any weights
  are loaded, so they fail fast and with the API's message.
- Anything else is a bug: one line ``jaxlp: error: unexpected ...`` and a hint to rerun with
  ``--debug`` (which shows the traceback); exit status 1.
- Ctrl-C prints ``interrupted`` and exits with status 130. Every output is complete or
  absent: files and directories are written under a temporary name and renamed into place.

Status lines and progress bars go to stderr (:mod:`jaxlp.progress`); ``--quiet`` silences them.

Prompts: every prompt ends in exactly one newline, the way the embedded reasoner's questions
(``Q: ...\\n``) end: ``--prompt "Q: 1+2"`` and ``--prompt $'Q: 1+2\\n'`` are the same prompt,
and so is the line ``Q: 1+2`` of a ``--prompts-file`` (prompts separated by blank lines).
``--no-prompt-newline`` takes prompts exactly as written (a file's prompts without their
final newline).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path


def _unshadow() -> None:
    """``python -m jaxlp.cli`` from a directory holding a folder named ``jaxlp`` (such as the
    clone's parent) imports that folder as the package (a namespace package, cwd coming first
    on sys.path): put this file's package in its place."""
    import importlib.util

    pkg = sys.modules.get("jaxlp")
    here = Path(__file__).resolve().parent.parent
    if pkg is not None and getattr(pkg, "__file__", None) is not None:
        return
    spec = importlib.util.spec_from_file_location("jaxlp", here / "__init__.py", submodule_search_locations=[str(here)])
    module = importlib.util.module_from_spec(spec)
    sys.modules["jaxlp"] = module
    spec.loader.exec_module(module)


_unshadow()

from jaxlp.cli.checkpoints import cmd_info, cmd_quantize  # noqa: E402  (after _unshadow)
from jaxlp.cli.common import DTYPES, SAMPLERS, UserError, check_interrupt, normalize_prompt  # noqa: E402
from jaxlp.cli.generate import cmd_calibrate_tau0, cmd_demo, cmd_generate  # noqa: E402
from jaxlp.cli.serve import cmd_serve  # noqa: E402

__all__ = ["UserError", "build_parser", "main", "normalize_prompt"]


# ----------------------------------------------------------------------------- parser


class _Parser(argparse.ArgumentParser):
    """Usage errors in one line, pointing to --help (exit status 2)."""

    def error(self, message):
        self.exit(2, f"jaxlp: error: {message} (see '{self.prog} --help')\n")


class _Formatter(argparse.HelpFormatter):
    def __init__(self, prog):
        super().__init__(prog, max_help_position=34, width=min(110, max(80, _terminal_width())))


def _terminal_width() -> int:
    import shutil

    return shutil.get_terminal_size((100, 24)).columns


def _d(text: str) -> str:
    """Help text with the option's default."""
    return f"{text} (default: %(default)s)"


def build_parser() -> argparse.ArgumentParser:
    from jaxlp import __version__, kvcache
    from jaxlp.quantization.recipes import RECIPES
    from jaxlp.sampling.reset import RESET_PRESETS

    recipes = tuple(RECIPES)
    cache_formats = kvcache.formats()

    common = _Parser(add_help=False)
    common.add_argument("--quiet", action="store_true", help="no status lines or progress bars on stderr")
    common.add_argument("--debug", action="store_true", help="show the traceback of an unexpected error")

    def model_options(p, *, required=True, help_model="checkpoint directory: a Hugging Face one (config.json, "
                      "*.safetensors, tokenizer.json) or one written by jaxlp quantize"):
        p.add_argument("--model", required=required, metavar="DIR", help=help_model)
        p.add_argument("--dtype", default="bfloat16", choices=DTYPES,
                       help=_d("parameter dtype of a Hugging Face checkpoint (quantized ones keep theirs)"))
        p.add_argument("--no-check", action="store_true",
                       help="skip the NaN / Inf check of the weights at load (one pass over them; for huge models)")

    def prompt_newline(p):
        p.add_argument("--prompt-newline", action=argparse.BooleanOptionalAction, default=True,
                       help=_d("end every prompt in exactly one newline, as the reasoner's questions do "
                               "(--no-prompt-newline: prompts exactly as written)"))

    parser = _Parser(prog="jaxlp", description="Low-precision LLM inference in JAX. Errors print one line "
                     "'jaxlp: error: ...' (exit status 2; 1 for an unexpected error, 130 for Ctrl-C); "
                     "docs/errors.md lists them.", formatter_class=_Formatter)
    parser.add_argument("--version", action="version", version=f"jaxlp {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=_Parser)

    g = sub.add_parser("generate", parents=[common], formatter_class=_Formatter,
                       help="generate text from a prompt or a file of prompts",
                       description="Generate text. Every prompt ends in exactly one newline (added if missing) "
                                   "unless --no-prompt-newline; the embedded reasoner was trained that way.")
    model_options(g)
    which = g.add_mutually_exclusive_group(required=True)
    which.add_argument("--prompt", metavar="TEXT", help="the prompt text")
    which.add_argument("--prompts-file", metavar="FILE", help="a UTF-8 text file of prompts separated by blank lines")
    prompt_newline(g)
    g.add_argument("--max-new-tokens", type=int, metavar="N", default=64,
                   help=_d("tokens to generate per prompt (prompt plus these must fit the context length)"))
    g.add_argument("--batch-size", type=_positive_int, metavar="N", default=8, help=_d("prompts per generation call"))
    g.add_argument("--sampler", default="greedy", choices=SAMPLERS, metavar="NAME",
                   help=_d(f"decoding policy, one of {', '.join(SAMPLERS)}"))
    g.add_argument("--temperature", type=float, metavar="X", default=None,
                   help="temperature, > 0, or 0 for greedy (samplers temperature, top-k, top-p, min-p; default: 0.6)")
    g.add_argument("--top-k", type=int, metavar="N", default=None, help="keep the k most likely tokens, k >= 1 (default: 50)")
    g.add_argument("--top-p", type=float, metavar="X", default=None,
                   help="nucleus mass, 0 < p <= 1 (sampler top-p and the entropy samplers; default: 0.95)")
    g.add_argument("--min-p", type=float, metavar="X", default=None,
                   help="keep tokens with probability >= min-p x the top one, 0 <= min-p < 1 (default: 0.05)")
    g.add_argument("--t-low", type=float, metavar="X", default=None,
                   help="entropy samplers: temperature of confident tokens, >= 0 (default: from --preset)")
    g.add_argument("--t-high", type=float, metavar="X", default=None,
                   help="entropy samplers: temperature of uncertain tokens, >= 0 (default: 1.0)")
    g.add_argument("--tau0", type=float, metavar="X", default=None,
                   help="entropy samplers: token-entropy threshold in nats, >= 0 (default: from --preset)")
    g.add_argument("--preset", default=None,
                   help=f"entropy samplers: the paper's (t_low, tau0) for a model, one of {', '.join(RESET_PRESETS)} "
                        "(default: none)")
    g.add_argument("--seed", type=int, metavar="N", default=0, help=_d("random seed (the same seed gives the same text)"))
    g.add_argument("--kv-cache", default="bf16", choices=cache_formats, metavar="FORMAT",
                   help=_d(f"KV cache format, one of {', '.join(cache_formats)}"))
    g.add_argument("--fuse-projections", action="store_true",
                   help="one q/k/v and one gate/up linear per layer (faster decode; see jaxlp.models.fuse_projections)")
    g.add_argument("--tp", type=int, default=1, metavar="N",
                   help="tensor parallelism over the first N local devices (heads and MLP columns split, one "
                        "all-reduce per row-parallel layer; quantized kernels run on each device's shard) (default: 1)")
    g.add_argument("--precision", default=None, choices=("fp16", "fp8", "auto"),
                   help="NestedFP checkpoints: compute with the FP16 or the FP8 model, or auto: FP8 in the steps "
                        "that schedule more than half the batch's tokens (the prefill, and decode steps while "
                        "more than half the rows run; one compiled program) (default: the checkpoint's mode, FP16)")
    g.add_argument("--out", default=None, metavar="FILE", help="also write the completions to this JSON-lines file (written "
                   "complete or not at all; default: none)")
    g.add_argument("--overwrite", action="store_true", help="replace an existing --out file")
    g.set_defaults(func=cmd_generate)

    i = sub.add_parser("info", parents=[common], formatter_class=_Formatter,
                       help="describe a checkpoint: architecture, context length, recipe, cache formats, bytes",
                       description="Describe a checkpoint (a Hugging Face one from its headers, without loading "
                                   "the weights; a quantized one loaded).")
    i.add_argument("--model", required=True, metavar="DIR", help="checkpoint directory (Hugging Face or jaxlp quantize output)")
    i.set_defaults(func=cmd_info)

    q = sub.add_parser("quantize", parents=[common], formatter_class=_Formatter,
                       help="quantize a checkpoint with a recipe and save it",
                       description="Quantize a Hugging Face checkpoint and save it (written to a temporary "
                                   "directory and renamed: an error or Ctrl-C leaves --out as it was).")
    model_options(q, help_model="Hugging Face checkpoint directory")
    q.add_argument("--recipe", required=True, choices=recipes, metavar="RECIPE",
                   help=f"one of {', '.join(recipes)} (jaxlp.quantization.RECIPES)")
    q.add_argument("--out", required=True, metavar="DIR", help="output directory (loadable by jaxlp generate --model); "
                   "not the source, not an existing file")
    q.add_argument("--calibration-sequences", type=int, metavar="N", default=8,
                   help=_d("sequences of offline text for static activation scales (W4A4 recipes), >= 1"))
    q.add_argument("--calibration-length", type=int, metavar="N", default=512,
                   help=_d("tokens per calibration sequence, 1 to the model's context length"))
    q.add_argument("--lm-head", action="store_true",
                   help="quantize the output projection too, weight-only, in the recipe's format (not for "
                        "checkpoints that tie it to the embeddings)")
    q.add_argument("--overwrite", action="store_true", help="replace an existing jaxlp quantized checkpoint at --out")
    q.add_argument("--fuse-projections", action="store_true",
                   help="fuse q/k/v and gate/up before quantizing: one linear and one NVFP4 tensor scale each "
                        "(as ModelOpt exports them); the checkpoint keeps the fused layout")
    q.set_defaults(func=cmd_quantize)

    c = sub.add_parser("calibrate-tau0", parents=[common], formatter_class=_Formatter,
                       help="ReSET's tau0: 80th percentile of token entropies on calibration prompts",
                       description="Calibrate ReSET's tau0 on generations at T=0.6, top-p 0.95.")
    model_options(c)
    c.add_argument("--prompts-file", default=None, metavar="FILE",
                   help="text file of prompts separated by blank lines (default: see --source)")
    c.add_argument("--source", default="auto", choices=("auto", "testbed", "text"),
                   help=_d("prompts without --prompts-file: testbed problems (what the embedded reasoner solves), "
                           "windows of offline text, or auto: testbed for a testbed reasoner (a training_log.json "
                           "in --model), else text"))
    prompt_newline(c)
    c.add_argument("--num-prompts", type=int, metavar="N", default=5, help=_d("calibration prompts, >= 1"))
    c.add_argument("--prompt-length", type=int, metavar="N", default=64, help=_d("tokens per offline-text prompt"))
    c.add_argument("--max-new-tokens", type=int, metavar="N", default=256, help=_d("tokens generated per prompt"))
    c.add_argument("--batch-size", type=_positive_int, metavar="N", default=8, help=_d("prompts per generation call"))
    c.add_argument("--seed", type=int, metavar="N", default=0, help=_d("random seed"))
    c.set_defaults(func=cmd_calibrate_tau0)

    v = sub.add_parser("serve", parents=[common], formatter_class=_Formatter,
                       help="an OpenAI-compatible server (continuous batching) on a checkpoint",
                       description="Serve /v1/completions, /v1/chat/completions (streaming too), /v1/models, "
                                   "/health and /metrics (Prometheus) with FastAPI + uvicorn until Ctrl-C. "
                                   "Prompts are taken verbatim.")
    model_options(v)
    v.add_argument("--recipe", default=None, choices=recipes, metavar="RECIPE",
                   help="quantize the weights at load with this recipe (weight-only or dynamic-activation ones; "
                        "default: serve the checkpoint as it is)")
    v.add_argument("--kv-cache", default="bf16", choices=cache_formats, metavar="FORMAT",
                   help=_d(f"KV cache format, one of {', '.join(cache_formats)}"))
    v.add_argument("--host", default="127.0.0.1", help=_d("address to bind (0.0.0.0 exposes the server)"))
    v.add_argument("--port", type=int, default=8000, metavar="N", help=_d("TCP port"))
    v.add_argument("--model-id", default=None, metavar="NAME", help="model name the API reports (default: the "
                   "checkpoint directory's name)")
    v.add_argument("--max-len", type=int, default=None, metavar="N",
                   help="positions per request, prompt plus completion (default: the model's context length)")
    v.add_argument("--slots", type=_positive_int, default=None, metavar="N",
                   help="concurrent requests (default: 8, or what --cache-gib fits)")
    v.add_argument("--cache-gib", type=float, default=None, metavar="X",
                   help="KV cache memory in GiB (in all, over the --tp devices): the slot count is what the cache "
                        "format fits (capped by --slots)")
    v.add_argument("--tp", type=int, default=1, metavar="N",
                   help="tensor parallelism over the first N local devices (heads, MLP columns and the cache's "
                        "heads split; quantized kernels run on each device's shard) (default: 1)")
    v.add_argument("--fuse-projections", action="store_true",
                   help="one q/k/v and one gate/up linear per layer, rows grouped per --tp device (faster decode; "
                        "before --recipe quantizes)")
    v.add_argument("--steps-per-call", type=_positive_int, default=4, metavar="N",
                   help=_d("decode steps per device call (streaming granularity)"))
    v.add_argument("--max-waiting", type=int, default=256, metavar="N",
                   help=_d("requests that may wait for a slot; beyond, 503"))
    v.add_argument("--precision", default=None, choices=("fp16", "fp8", "auto"),
                   help="NestedFP models: the FP16 or the FP8 model, or auto: FP8 while running plus waiting "
                        "requests exceed half the slots (default: the checkpoint's mode, FP16)")
    v.add_argument("--slo-tpot-ms", type=float, default=None, metavar="X",
                   help="NestedFP models: a target time per output token; FP8 while the FP16 mode's predicted "
                        "time per step (its decode step at the current load plus the mean prefill stall) exceeds "
                        "it, FP16 again once that is under 0.9 of it (default: none)")
    v.set_defaults(func=cmd_serve)

    d = sub.add_parser("demo", parents=[common], formatter_class=_Formatter,
                       help="the embedded reasoner on held-out problems: BF16, NVFP4 W4A4, W4A4 + ReSET")
    d.add_argument("--problems", type=int, metavar="N", default=8, help=_d("held-out problems to solve, >= 1"))
    d.add_argument("--model", default=None, metavar="DIR", help="a reasoner checkpoint (default: the embedded one)")
    d.add_argument("--seed", type=int, metavar="N", default=0, help=_d("random seed"))
    d.add_argument("--no-check", action="store_true", help="skip the NaN / Inf check of the weights at load")
    d.set_defaults(func=cmd_demo)
    return parser


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid int value: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {value}")
    return value


# ----------------------------------------------------------------------------- entry point


def _known_errors() -> tuple[type[BaseException], ...]:
    return (UserError, ValueError, OSError)  # jaxlp.errors' classes are ValueErrors


def _describe(e: BaseException) -> str:
    from jaxlp.errors import one_line

    if isinstance(e, OSError) and e.strerror and e.filename is not None:
        return one_line(f"{e.filename}: {e.strerror}")
    return one_line(e)


def _interrupted(e: BaseException) -> bool:
    """An interrupt, or an error raised while one was unwinding (a library's cleanup failing on
    the state the interrupt left) or swallowed on the way (see jaxlp.progress.Interrupts)."""
    from jaxlp.progress import Interrupts

    seen = set()
    while e is not None and id(e) not in seen:
        if isinstance(e, KeyboardInterrupt):
            return True
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    return Interrupts.pending


def main(argv=None) -> int:
    """The command line; returns the exit status. Run as the program (``argv`` None), an
    interrupt ends the process at once after ``interrupted`` (every writer has cleaned up by
    then): no waiting for computations already queued on the device, no shutdown noise."""
    as_program = argv is None
    argv = sys.argv[1:] if argv is None else list(argv)
    if as_program:
        from jaxlp.progress import Interrupts

        Interrupts.install()
    debug = "--debug" in argv
    if argv == ["--version"]:  # without importing jax (the full parser lists the registries)
        from jaxlp import __version__

        print(f"jaxlp {__version__}")
        return 0
    try:
        args = build_parser().parse_args(argv)
        debug = args.debug
        status = args.func(args)
        check_interrupt()  # one swallowed on the way (see jaxlp.progress.Interrupts)
        return status
    except SystemExit as e:  # argparse: --help, --version (0) and usage errors (2)
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 2)
    except BaseException as e:  # noqa: BLE001  (every outcome is one line; see the module docstring)
        if _interrupted(e):
            print("interrupted", file=sys.stderr, flush=True)
            if as_program:
                try:
                    sys.stdout.flush()
                except (OSError, ValueError):
                    pass
                os._exit(130)
            return 130
        if isinstance(e, BrokenPipeError):  # the reader of stdout went away (`jaxlp generate ... | head -1`)
            try:
                os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            except (OSError, ValueError):
                pass
            return 1
        if debug or not isinstance(e, Exception):
            raise
        from jaxlp.errors import one_line

        if isinstance(e, _known_errors()):
            print(f"jaxlp: error: {_describe(e)}", file=sys.stderr, flush=True)
            return 2
        print(f"jaxlp: error: unexpected {type(e).__name__}: {one_line(e, 300)} (rerun with --debug for the "
              "traceback)", file=sys.stderr, flush=True)
        return 1


if __name__ == "__main__":
    sys.exit(main())