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
import json
import os
import sys
import time
from pathlib import Path


def _unshadow() -> None:
    """``python -m jaxlp.cli`` from a directory holding a folder named ``jaxlp`` (such as the
    clone's parent) imports that folder as the package (a namespace package, cwd coming first
    on sys.path): put this file's package in its place."""
    import importlib.util

    pkg = sys.modules.get("jaxlp")
    here = Path(__file__).resolve().parent
    if pkg is not None and getattr(pkg, "__file__", None) is not None:
        return
    spec = importlib.util.spec_from_file_location("jaxlp", here / "__init__.py", submodule_search_locations=[str(here)])
    module = importlib.util.module_from_spec(spec)
    sys.modules["jaxlp"] = module
    spec.loader.exec_module(module)


_unshadow()

SAMPLERS = ("greedy", "temperature", "top-k", "top-p", "min-p", "reset", "fixed-threshold", "sliding-window",
            "within-step-mean", "ema", "uniform-confident-low")
ENTROPY_SAMPLERS = ("reset", "fixed-threshold", "sliding-window", "within-step-mean", "ema", "uniform-confident-low")
DTYPES = ("bfloat16", "float32", "float16")
# Defaults of the sampler options (None in argparse, so that an option given to a sampler
# that ignores it can be pointed out).
SAMPLER_DEFAULTS = dict(temperature=0.6, top_k=50, top_p=0.95, min_p=0.05, t_high=1.0)
SAMPLER_OPTIONS = {  # which sampler reads which option
    "temperature": ("temperature", "top-k", "top-p", "min-p"),
    "top_k": ("top-k",),
    "top_p": ("top-p", *ENTROPY_SAMPLERS),
    "min_p": ("min-p",),
    "t_low": ENTROPY_SAMPLERS,
    "t_high": ENTROPY_SAMPLERS,
    "tau0": ENTROPY_SAMPLERS,
    "preset": ENTROPY_SAMPLERS,
}


class UserError(Exception):
    """An error in what the user asked for: reported in one line."""


# ----------------------------------------------------------------------------- helpers


def _reporter(args):
    from jaxlp.progress import Reporter

    return Reporter(quiet=getattr(args, "quiet", False))


def _sampler_value(args, name):
    value = getattr(args, name)
    return SAMPLER_DEFAULTS.get(name) if value is None else value


def check_sampler_args(args, reporter=None) -> None:
    """Validate every sampler option through the sampler classes (the API's checks and
    messages), whichever sampler is chosen, before anything is loaded."""
    from jaxlp.sampling.base import Categorical

    if args.sampler in ENTROPY_SAMPLERS:  # the chosen sampler's class first: its name in the message
        t_low, tau0 = _entropy_settings(args)
        _entropy_classes()[args.sampler](t_low=t_low, tau0=tau0, t_high=_sampler_value(args, "t_high"),
                                         top_p=_sampler_value(args, "top_p"))
    Categorical(temperature=_sampler_value(args, "temperature"), top_k=_sampler_value(args, "top_k"),
                top_p=_sampler_value(args, "top_p"), min_p=_sampler_value(args, "min_p"))
    if reporter is not None:
        unused = [f"--{name.replace('_', '-')}" for name, readers in SAMPLER_OPTIONS.items()
                  if getattr(args, name) is not None and args.sampler not in readers]
        if unused:
            reporter.note(f"note: {', '.join(unused)} {'has' if len(unused) == 1 else 'have'} no effect with "
                          f"--sampler {args.sampler}")


def _entropy_settings(args) -> tuple[float, float]:
    from jaxlp import sampling

    t_low, tau0 = args.t_low, args.tau0
    if args.preset:
        preset = sampling.reset_preset(args.preset)
        t_low = preset.t_low if t_low is None else t_low
        tau0 = preset.tau0 if tau0 is None else tau0
    if t_low is None or tau0 is None:
        raise UserError(f"sampler {args.sampler!r} needs --t-low and --tau0 (or --preset; calibrate tau0 with "
                        "jaxlp calibrate-tau0)")
    return t_low, tau0


def _entropy_classes() -> dict:
    from jaxlp import sampling

    return {"reset": sampling.ReSETConfig, "fixed-threshold": sampling.FixedThreshold,
            "sliding-window": sampling.SlidingWindowEstimate, "within-step-mean": sampling.WithinStepMeanEstimate,
            "ema": sampling.EMAEstimate, "uniform-confident-low": sampling.UniformConfidentLow}


def make_sampler(args, tokenizer=None):
    from jaxlp.sampling.base import Categorical, Greedy

    name = args.sampler
    entropy_samplers = _entropy_classes()
    if name in entropy_samplers:
        t_low, tau0 = _entropy_settings(args)
        return entropy_samplers[name].from_tokenizer(tokenizer, t_low, tau0, t_high=_sampler_value(args, "t_high"),
                                                     top_p=_sampler_value(args, "top_p"))
    temperature = _sampler_value(args, "temperature")
    if name == "greedy":
        return Greedy()
    if name == "temperature":
        return Categorical(temperature=temperature)
    if name == "top-k":
        return Categorical(temperature=temperature, top_k=_sampler_value(args, "top_k"))
    if name == "top-p":
        return Categorical(temperature=temperature, top_p=_sampler_value(args, "top_p"))
    if name == "min-p":
        return Categorical(temperature=temperature, min_p=_sampler_value(args, "min_p"))
    raise UserError(f"unknown sampler {name!r}; choose from {', '.join(SAMPLERS)}")


def normalize_prompt(text: str, newline: bool = True) -> str:
    """The prompt rule: with ``newline``, exactly one trailing newline (added or kept)."""
    return text.rstrip("\r\n") + "\n" if newline else text


def read_prompts_file(path: str, newline: bool = True) -> list[str]:
    """Prompts separated by blank lines, each normalized by :func:`normalize_prompt`."""
    file = Path(path)
    if not file.exists():
        raise UserError(f"--prompts-file {path} does not exist")
    if file.is_dir():
        raise UserError(f"--prompts-file {path} is a directory, not a text file")
    try:
        text = file.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise UserError(f"--prompts-file {path} is not UTF-8 text") from None
    blocks = [b.strip("\r\n") for b in text.replace("\r\n", "\n").split("\n\n")]
    prompts = [normalize_prompt(b, newline) for b in blocks if b.strip()]
    if not prompts:
        raise UserError(f"--prompts-file {path} holds no prompt (prompts are separated by blank lines)")
    return prompts


def _check_output_file(out: str, overwrite: bool) -> Path:
    """An output file path that can be written: not a directory, parent a directory, not there
    unless ``overwrite``."""
    path = Path(out).expanduser().resolve()
    if path.is_dir():
        raise UserError(f"--out {out} is a directory; it names the file to write")
    parent = path.parent
    if parent.exists() and not parent.is_dir():
        raise UserError(f"--out {out}: {parent} is a file, not a directory")
    if not parent.exists():
        raise UserError(f"--out {out}: the directory {parent} does not exist")
    if path.exists() and not overwrite:
        raise UserError(f"--out {out} exists (pass --overwrite to replace it)")
    return path


def write_atomically(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` complete or not at all (a temporary sibling, then a rename)."""
    import tempfile

    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.tmp-", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def _load(args, reporter):
    """The model (weights checked for NaN / Inf unless --no-check) and its tokenizer."""
    import jax.numpy as jnp

    from jaxlp.models.tokenizer import load_tokenizer
    from jaxlp.pretrained import from_pretrained

    with reporter.status(f"loading {args.model}"):
        model = from_pretrained(args.model, dtype=jnp.dtype(args.dtype), check_finite=not args.no_check)
        tokenizer = load_tokenizer(args.model)
    return model, tokenizer


def _config(model_dir):
    """The model's config (quantized checkpoints: from their marker) without loading weights."""
    from jaxlp.models.loading import check_model_dir, read_config
    from jaxlp.quantization.saving import _read_marker, is_quantized_checkpoint

    path = check_model_dir(model_dir)
    if is_quantized_checkpoint(path):
        return _read_marker(path)[1]
    return read_config(path)


def _check_interrupt() -> None:
    from jaxlp.progress import Interrupts

    Interrupts.check()


def _fused(model):
    from jaxlp.models import fuse_projections

    try:
        return fuse_projections(model, inplace=True)
    except ValueError as e:
        raise UserError(f"cannot fuse the projections of this checkpoint: {e}") from None


# ----------------------------------------------------------------------------- commands


def cmd_generate(args) -> int:
    import numpy as np

    from jaxlp import kvcache
    from jaxlp.generation import check_generation_settings, generate, raise_nonfinite
    from jaxlp.models.tokenizer import load_tokenizer

    reporter = _reporter(args)
    if args.prompt is not None:
        if not args.prompt.strip():
            raise UserError("the prompt is empty")
        prompts = [normalize_prompt(args.prompt, args.prompt_newline)]
    else:
        prompts = read_prompts_file(args.prompts_file, args.prompt_newline)
    check_sampler_args(args, reporter)
    kvcache.get(args.kv_cache)
    out = _check_output_file(args.out, args.overwrite) if args.out else None
    config = _config(args.model)
    limit = check_generation_settings(config, max_new_tokens=args.max_new_tokens, seed=args.seed)
    tokenizer = load_tokenizer(args.model)
    ids = [tokenizer.encode(p).ids for p in prompts]
    longest = max(len(i) for i in ids)
    if longest + args.max_new_tokens > limit:
        raise UserError(f"prompt of {longest} tokens + max_new_tokens {args.max_new_tokens} exceeds the context "
                        f"length {limit}")
    sampler = make_sampler(args, tokenizer)
    model, tokenizer = _load(args, reporter)
    if args.fuse_projections:
        model = _fused(model)
    if args.nestedfp_mode != "fp16":
        from jaxlp.quantization import set_mode

        set_mode(model, args.nestedfp_mode)

    start = time.perf_counter()
    texts, counts, finished = [], [], []
    batches = [range(i, min(i + args.batch_size, len(ids))) for i in range(0, len(ids), args.batch_size)]
    with reporter.bar(f"compiling and generating up to {args.max_new_tokens} tokens", len(ids)) as advance:
        for n, rows in enumerate(batches):
            result = generate(model, [ids[i] for i in rows], max_new_tokens=args.max_new_tokens, sampler=sampler,
                              seed=args.seed + n, kv_cache=args.kv_cache, on_nonfinite="return")
            steps = np.full(len(ids), -1)
            steps[list(rows)] = result.nonfinite_step
            raise_nonfinite(steps)  # naming the prompt by its index among all of them
            for seq, done in zip(result.sequences(), result.finished):
                texts.append(tokenizer.decode(seq, skip_special_tokens=True))
                counts.append(len(seq))
                finished.append(bool(done))
            advance(len(rows), description=f"generating up to {args.max_new_tokens} tokens")
    seconds = time.perf_counter() - start
    _check_interrupt()  # an interrupt that was swallowed on the way: nothing is written
    if out is not None:
        lines = [json.dumps(dict(prompt=p, completion=t, tokens=c, stopped=f))
                 for p, t, c, f in zip(prompts, texts, counts, finished)]
        write_atomically(out, "\n".join(lines) + "\n")
    if len(texts) == 1:
        print(texts[0], flush=True)
    else:
        for i, text in enumerate(texts):
            print(f"--- prompt {i}", flush=True)
            print(text, flush=True)
    reporter.note(f"{sum(counts)} tokens for {len(texts)} prompt{'s' if len(texts) > 1 else ''} in {seconds:.2f} s "
                  f"(compilation included){f'; written to {out}' if out else ''}")
    return 0


def _check_bindable(host: str, port: int) -> None:
    """UserError if ``host:port`` cannot be bound (checked before the weights load)."""
    import socket

    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError as e:
        raise UserError(f"--host {host!r}: {e.strerror or e}") from None
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(address)
        except OSError as e:
            raise UserError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None


def cmd_serve(args) -> int:
    import jax.numpy as jnp

    from jaxlp import kvcache
    from jaxlp.errors import check_int
    from jaxlp.generation import prompt_bucket

    try:
        from jaxlp.serving import server
    except ImportError as e:
        raise UserError(f"jaxlp serve needs the serve extra (pip install 'jaxlp[serve]'): {e}") from None
    from jaxlp.serving.chat import ChatTemplate

    reporter = _reporter(args)
    kvcache.get(args.kv_cache)
    recipe = None
    if args.recipe is not None:
        from jaxlp.quantization import get_recipe
        from jaxlp.quantization.activations import STATIC

        recipe = get_recipe(args.recipe)
        if recipe.activation in STATIC:
            raise UserError(f"recipe {recipe.name!r} calibrates activation scales: quantize with jaxlp quantize "
                            "first, then serve the quantized checkpoint")
    config = _config(args.model)
    max_len = check_int(None, "--max-len", args.max_len, low=2, high=config.max_position_embeddings, optional=True,
                        note="the model's context length is the most") or config.max_position_embeddings
    check_int(None, "--port", args.port, low=0, high=65535)
    _check_bindable(args.host, args.port)
    budget = None
    if args.cache_gib is not None:
        if not args.cache_gib > 0:
            raise UserError(f"--cache-gib must be > 0, got {args.cache_gib}")
        budget = int(args.cache_gib * 2**30)
    chat_template = ChatTemplate.from_model_dir(args.model)
    model, tokenizer = _load(args, reporter)
    if recipe is not None:
        from jaxlp.quantization import quantize_model

        with reporter.status(f"quantizing to {recipe.name}"):
            model = quantize_model(model, recipe)
    engine_kwargs = dict(max_len=max_len, slots=args.slots, cache_budget_bytes=budget,
                         steps_per_call=args.steps_per_call, max_waiting=args.max_waiting)
    buckets = sorted({min(prompt_bucket(n), max_len - 1) for n in (2**k for k in range(4, max_len.bit_length() + 1))
                      if n < max_len})
    model_id = args.model_id or Path(args.model).resolve().name
    reporter.note(f"serving {model_id} ({args.kv_cache} cache, {max_len} positions per slot) on "
                  f"http://{args.host}:{args.port}/v1 ; compiling {len(buckets)} prefill buckets and the decode step")
    server.serve(model, tokenizer, model_id=model_id, kv_cache=args.kv_cache, host=args.host, port=args.port,
                 chat_template=chat_template, warmup_lengths=buckets, log_level="info" if args.debug else "warning",
                 **engine_kwargs)
    return 0


def _checkpoint_tensors(path: Path) -> tuple[int, int, dict[str, int]]:
    """(parameter count, bytes, bytes per dtype) read from the safetensors headers."""
    import math

    from safetensors import SafetensorError, safe_open

    from jaxlp.errors import CheckpointFormatError
    from jaxlp.models.loading import describe_safetensors_error, safetensors_files

    count, nbytes, per_dtype = 0, 0, {}
    sizes = {"F64": 8, "F32": 4, "I64": 8, "I32": 4, "F16": 2, "BF16": 2, "I16": 2, "U8": 1, "I8": 1, "BOOL": 1,
             "F8_E4M3": 1, "F8_E5M2": 1}
    for f in safetensors_files(path):
        try:
            with safe_open(str(f), framework="numpy") as h:
                for name in h.keys():
                    sl = h.get_slice(name)
                    n = math.prod(sl.get_shape())
                    b = n * sizes.get(sl.get_dtype(), 4)
                    count, nbytes = count + n, nbytes + b
                    per_dtype[sl.get_dtype()] = per_dtype.get(sl.get_dtype(), 0) + b
        except (SafetensorError, OSError, ValueError, RuntimeError) as e:
            raise CheckpointFormatError(describe_safetensors_error(f, e)) from None
    return count, nbytes, per_dtype


def _cache_formats(config) -> str:
    """The KV cache formats that take this model, with their bytes per token."""
    import jax

    from jaxlp import kvcache

    rows = []
    for name in kvcache.formats():
        try:
            fmt = kvcache.get(name)
            jax.eval_shape(lambda: fmt.init(config, 1, 256))
            per_token = kvcache.cache_bytes(fmt, config, 1, 4096) / 4096
        except Exception:  # noqa: BLE001  (a format that does not take this shape)
            continue
        rows.append(f"{name} ({per_token / 1024:.3g} KiB/token)")
    return ", ".join(rows) if rows else "none"


def _print_rows(rows) -> None:
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{width}}  {v}")


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
    total = quantized + other
    _print_rows([
        ("architecture", f"{c.model_type}, {c.num_layers} layers, hidden {c.hidden_size}, vocab {c.vocab_size}"),
        ("context length", f"{c.max_position_embeddings:,} tokens"),
        ("recipe", f"{report.recipe}: {len(report.quantized)} layers quantized, {len(report.kept)} kept"),
        ("parameters", f"{c.num_params:,}"),
        ("bytes", f"{total:,} ({quantized:,} in quantized layers, {other:,} high precision)"),
        ("bytes per parameter", f"{total / c.num_params:.3f}"),
        ("KV cache formats", _cache_formats(c)),
    ])
    return 0


def cmd_info(args) -> int:
    from jaxlp.models.loading import check_model_dir, read_config
    from jaxlp.quantization.saving import is_quantized_checkpoint

    path = check_model_dir(args.model)
    if is_quantized_checkpoint(path):
        return _info_quantized(path)
    c = read_config(path)
    count, nbytes, per_dtype = _checkpoint_tensors(path)
    _print_rows([
        ("architecture", c.model_type),
        ("layers", c.num_layers),
        ("hidden / intermediate", f"{c.hidden_size} / {c.intermediate_size}"),
        ("heads (query / kv) x head_dim", f"{c.num_heads} / {c.num_kv_heads} x {c.head_dim}"),
        ("vocabulary", c.vocab_size),
        ("context length", f"{c.max_position_embeddings:,} tokens"),
        ("sliding window", f"{c.sliding_window} on {c.layer_types.count('sliding_attention')} layers"
         if c.sliding_window else "none"),
        ("tied embeddings", c.tie_word_embeddings),
        ("recipe", "none (high precision; jaxlp quantize --recipe ...)"),
        ("parameters", f"{count:,} (config: {c.num_params:,})"),
        ("bytes on disk", f"{nbytes:,} ({', '.join(f'{k}: {v:,}' for k, v in sorted(per_dtype.items()))})"),
        ("bytes per parameter", f"{nbytes / max(count, 1):.3f}"),
        ("KV cache formats", _cache_formats(c)),
    ])
    return 0


def cmd_quantize(args) -> int:
    from jaxlp.data import token_windows
    from jaxlp.errors import check_int
    from jaxlp.quantization import get_recipe, quantize_model, save_quantized
    from jaxlp.quantization.activations import STATIC
    from jaxlp.quantization.saving import check_output_dir

    reporter = _reporter(args)
    recipe = get_recipe(args.recipe)
    out = check_output_dir(args.out, overwrite=args.overwrite, source=args.model)
    config = _config(args.model)
    calibrate = recipe.activation in STATIC
    if calibrate:
        check_int(None, "--calibration-length", args.calibration_length, low=1, high=config.max_position_embeddings,
                  note="the model's context length is the most")
        check_int(None, "--calibration-sequences", args.calibration_sequences, low=1)
    model, tokenizer = _load(args, reporter)
    calibration = None
    if calibrate:
        calibration = token_windows(tokenizer, args.calibration_sequences, args.calibration_length)
        reporter.note(f"calibrating on {calibration.shape[0]} x {calibration.shape[1]} tokens of offline text")
    if args.fuse_projections:
        model = _fused(model)
    progress = reporter.callback({"calibrating": "calibrating activation scales (compiling first)",
                                  "quantizing": f"quantizing to {recipe.name}"})
    if calibration is not None:
        progress("calibrating", 0, len(calibration))  # the bar shows while the calibration program compiles
    try:
        quantized = quantize_model(model, recipe, calibration=calibration, progress=progress)
    finally:
        progress.close()
    with reporter.status(f"saving to {out}"):
        _check_interrupt()
        save_quantized(quantized, out, tokenizer_from=args.model, overwrite=args.overwrite)
    report = quantized.quantization
    print(f"{recipe.name}: {len(report.quantized)} layers quantized, {len(report.kept)} kept high precision -> {out}",
          flush=True)
    for path, why in report.kept:
        print(f"  kept {path}: {why}", flush=True)
    return 0


def _is_testbed_reasoner(model_dir) -> bool:
    log = Path(model_dir) / "training_log.json"
    try:
        return isinstance(json.loads(log.read_text()).get("spec"), dict)
    except (OSError, ValueError, AttributeError):
        return False


def cmd_calibrate_tau0(args) -> int:
    import numpy as np

    from jaxlp.data import token_windows
    from jaxlp.errors import check_int
    from jaxlp.generation import check_generation_settings, generate, raise_nonfinite
    from jaxlp.sampling import calibrate_tau0
    from jaxlp.sampling.baselines import base_decoding

    reporter = _reporter(args)
    check_int(None, "--num-prompts", args.num_prompts, low=1)
    config = _config(args.model)
    check_generation_settings(config, max_new_tokens=args.max_new_tokens, seed=args.seed)
    source = args.source
    if args.prompts_file:
        source = "file"
        texts = read_prompts_file(args.prompts_file, args.prompt_newline)[: args.num_prompts]
    elif source == "auto":
        source = "testbed" if _is_testbed_reasoner(args.model) else "text"
    if source == "text":
        check_int(None, "--prompt-length", args.prompt_length, low=1,
                  high=max(1, config.max_position_embeddings - args.max_new_tokens),
                  note=f"prompt plus --max-new-tokens must fit the context length {config.max_position_embeddings}")
    model, tokenizer = _load(args, reporter)
    if source == "file":
        prompts = [tokenizer.encode(t).ids for t in texts]
        what = f"{len(prompts)} prompts of {args.prompts_file}"
    elif source == "testbed":
        from jaxlp.testbed import train_problems
        from jaxlp.testbed.analysis import checkpoint_spec

        stream = train_problems(args.seed + 1000, checkpoint_spec(args.model))
        prompts = [tokenizer.encode(next(stream).question).ids for _ in range(args.num_prompts)]
        what = f"{len(prompts)} training-split testbed problems"
    else:
        prompts = token_windows(tokenizer, args.num_prompts, args.prompt_length).tolist()
        what = f"{len(prompts)} windows of {args.prompt_length} tokens of offline text"
    longest = max(len(p) for p in prompts)
    if longest + args.max_new_tokens > config.max_position_embeddings:
        raise UserError(f"prompt of {longest} tokens + max_new_tokens {args.max_new_tokens} exceeds the context "
                        f"length {config.max_position_embeddings}")
    entropies = []
    with reporter.bar(f"compiling and generating {args.max_new_tokens} tokens", len(prompts)) as advance:
        for n, start in enumerate(range(0, len(prompts), args.batch_size)):
            batch = prompts[start : start + args.batch_size]
            result = generate(model, batch, max_new_tokens=args.max_new_tokens, sampler=base_decoding(),
                              seed=args.seed + n, return_stats=True, on_nonfinite="return")
            steps = np.full(len(prompts), -1)
            steps[start : start + len(batch)] = result.nonfinite_step
            raise_nonfinite(steps)
            entropies.append(result.entropy[np.isfinite(result.entropy)])
            advance(len(batch), description=f"generating {args.max_new_tokens} tokens")
    pooled = np.concatenate(entropies)
    tau0 = calibrate_tau0(pooled)
    print(f"tau0 = {tau0:.4f}  (80th percentile of {pooled.size} raw-logit token entropies, generated at T=0.6, "
          f"top-p 0.95, for {what})", flush=True)
    return 0


def cmd_demo(args) -> int:
    from jaxlp import demo

    demo.run(num_problems=args.problems, seed=args.seed, model_dir=args.model, reporter=_reporter(args),
             check_finite=not args.no_check)
    return 0


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
    g.add_argument("--nestedfp-mode", default="fp16", choices=("fp16", "fp8"),
                   help=_d("for NestedFP checkpoints: compute with the FP16 or the FP8 model"))
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
                   help="KV cache memory in GiB: the slot count is what the cache format fits (capped by --slots)")
    v.add_argument("--steps-per-call", type=_positive_int, default=4, metavar="N",
                   help=_d("decode steps per device call (streaming granularity)"))
    v.add_argument("--max-waiting", type=int, default=256, metavar="N",
                   help=_d("requests that may wait for a slot; beyond, 503"))
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
        _check_interrupt()  # one swallowed on the way (see jaxlp.progress.Interrupts)
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
