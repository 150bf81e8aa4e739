"""What the commands share: the one-line :class:`UserError`, sampler options, the prompt rule,
atomic output files and model loading."""

from __future__ import annotations

import os
from pathlib import Path

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


def reporter_for(args):
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


def check_output_file(out: str, overwrite: bool) -> Path:
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


def load_model(args, reporter):
    """The model (weights checked for NaN / Inf unless --no-check) and its tokenizer."""
    import jax.numpy as jnp

    from jaxlp.models.tokenizer import load_tokenizer
    from jaxlp.pretrained import from_pretrained

    mesh = tp_mesh(getattr(args, "tp", 1))
    with reporter.status(f"loading {args.model}"):
        model = from_pretrained(args.model, dtype=jnp.dtype(args.dtype), check_finite=not args.no_check, mesh=mesh)
        tokenizer = load_tokenizer(args.model)
    return model, tokenizer


def tp_mesh(tp: int):
    """The mesh of ``--tp N`` (None for 1): the first N local devices on an axis ``"tp"``."""
    if tp < 1:
        raise UserError(f"--tp must be >= 1, got {tp}")
    if tp == 1:
        return None
    import jax
    import numpy as np
    from jax.sharding import Mesh

    devices = jax.local_devices()
    if tp > len(devices):
        raise UserError(f"--tp {tp}: this machine has {len(devices)} {devices[0].platform.upper()} device(s)")
    return Mesh(np.array(devices[:tp]), ("tp",))


def model_config(model_dir):
    """The model's config (quantized checkpoints: from their marker) without loading weights."""
    from jaxlp.models.loading import check_model_dir, read_config
    from jaxlp.quantization.saving import _read_marker, is_quantized_checkpoint

    path = check_model_dir(model_dir)
    if is_quantized_checkpoint(path):
        return _read_marker(path)[1]
    return read_config(path)


def check_interrupt() -> None:
    from jaxlp.progress import Interrupts

    Interrupts.check()


def fused_model(model):
    from jaxlp.models import fuse_projections

    try:
        return fuse_projections(model, inplace=True)
    except ValueError as e:
        raise UserError(f"cannot fuse the projections of this checkpoint: {e}") from None
