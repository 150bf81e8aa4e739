"""What a reasoner evaluation runs: its settings, the configs of each table, the compiled
programs (jobs) and the layout of their generate calls.

A config is weights x sampler x KV cache. Table 1: every weight format at base decoding
(T 0.6, top-p 0.95), BF16 cache; Table 2: the samplers on the sampler weights, BF16 cache;
Table 5: the KV caches on the cache weights at base decoding.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Sequence

import jax

from jaxlp import kvcache, sampling
from jaxlp.sampling.base import Sampler

DEFAULT_MODEL = Path(__file__).resolve().parents[1] / "assets" / "reasoner"
WEIGHTS = {  # name -> (label, recipe or None)
    "bf16": ("BF16", None),
    "w8a16-fp8": ("FP8 W8A16", "w8a16-fp8"),
    "w8a8-fp8": ("FP8 W8A8", "w8a8-fp8"),
    "w4a16-nvfp4": ("NVFP4 W4A16", "w4a16-nvfp4"),
    "w4a4-nvfp4": ("NVFP4 W4A4", "w4a4-nvfp4"),
    "w4a16-mxfp4": ("MXFP4 W4A16", "w4a16-mxfp4"),
    "w4a4-mxfp4": ("MXFP4 W4A4", "w4a4-mxfp4"),
    "nestedfp16": ("NestedFP16", "nestedfp"),
    "nestedfp8": ("NestedFP8", "nestedfp"),
    "w4a8-fireq": ("FireQ W4A8", "w4a8-fireq"),
    "w4a4-dialect": ("DialectFP4 W4A4", "w4a4-dialect"),
    "w4a16-dialect": ("DialectFP4 W4A16", "w4a16-dialect"),
}
DEFAULT_FORMATS = ("bf16", "w8a8-fp8", "w4a16-nvfp4", "w4a4-nvfp4", "w4a4-mxfp4", "nestedfp16", "nestedfp8",
                   "w4a8-fireq", "w4a4-dialect")
ENTROPY_SAMPLERS = {  # name -> (label, class)
    "fixed_threshold": ("Fixed threshold", sampling.FixedThreshold),
    "sliding_window": ("Sliding window", sampling.SlidingWindowEstimate),
    "ema": ("EMA (alpha 0.1)", sampling.EMAEstimate),
    "within_step_mean": ("Within-step mean", sampling.WithinStepMeanEstimate),
    "uniform_confident_low": ("Uniform T_low (confident steps)", sampling.UniformConfidentLow),
    "reset": ("ReSET", sampling.ReSETConfig),
}
BASE_SAMPLER = f"top_p={sampling.BASE_TOP_P:g}"  # the truncation sweep's name of base decoding
DEFAULT_SAMPLERS = tuple(sampling.truncation_sweep()) + tuple(ENTROPY_SAMPLERS)
FIREQ_CALIBRATED = "fireq-int4-calibrated"  # FireQ INT4 with RPN + CRS calibrated per weight format
DEFAULT_CACHES = ("bf16", "kivi-k4v4", "kivi-k2v2", "kivi-k2v2*", "kivi-k2v4*", "kivi-k4v2*", "kitty", "kitty-pro",
                  "fireq-int4", FIREQ_CALIBRATED)
REFERENCE_WEIGHTS = "bf16"
QUANT_WEIGHTS = "w4a4-nvfp4"
QUICK = dict(problems=4, seeds=2, formats=("bf16", "w4a4-nvfp4"), samplers=(BASE_SAMPLER, "reset"),
             caches=("bf16", "kivi-k2v2"), cache_weights="bf16", calibration_rows=2)
TABLES = {"1": "1", "formats": "1", "2": "2", "samplers": "2", "5": "5", "kv": "5", "caches": "5"}


def sampler_params(name: str) -> dict:
    """The truncation parameters of a sweep sampler name, e.g. ``top_p=0.95,min_p=0.01``."""
    params = dict(T=sampling.BASE_TEMPERATURE, top_p=None, min_p=None)
    for part in name.split(","):
        key, value = part.split("=")
        params[key] = float(value)
    return params


def sampler_label(name: str) -> str:
    """The table label of a sampler name: the entropy sampler's, "Base", or its sweep's."""
    if name in ENTROPY_SAMPLERS:
        return ENTROPY_SAMPLERS[name][0]
    if name == BASE_SAMPLER:
        return "Base"
    return "Min-p sweep" if "min_p" in name else "Top-p sweep"


def make_sampler(name: str, tokenizer=None, *, tau0: float | None = None, t_low: float = 0.1,
                 t_high: float = 1.0, window: int = 32) -> Sampler:
    """A sampler by name: a key of ``truncation_sweep()`` (T 0.6) or of ``ENTROPY_SAMPLERS``."""
    sweep = sampling.truncation_sweep()
    if name in sweep:
        return sweep[name]
    if name not in ENTROPY_SAMPLERS:
        raise ValueError(f"unknown sampler {name!r}; known: {', '.join(DEFAULT_SAMPLERS)}")
    if tau0 is None:
        raise ValueError(f"sampler {name!r} needs tau0")
    return ENTROPY_SAMPLERS[name][1].from_tokenizer(tokenizer, t_low, tau0, t_high=t_high, window=window,
                                                    top_p=sampling.BASE_TOP_P)


# ----------------------------------------------------------------------------------------------
# Settings
# ----------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class EvalSettings:
    """A resolved reasoner evaluation (see :func:`resolve_eval_settings` for the defaults).

    ``out``: output prefix (PREFIX.json after every program, PREFIX.md and PREFIX.png at the
    end; None writes nothing). ``seed``: sampling seed of the first generate call of each
    program; ``calib_seed``: training-stream seed of all calibration data.
    """

    model: Path = DEFAULT_MODEL
    out: Path | None = None
    problems: int = 256
    seeds: int = 8
    eval_seed: int = 0
    seed: int = 0
    calib_seed: int = 1
    tables: tuple[str, ...] = ("1", "2", "5")
    formats: tuple[str, ...] = DEFAULT_FORMATS
    samplers: tuple[str, ...] = DEFAULT_SAMPLERS
    caches: tuple[str, ...] = DEFAULT_CACHES
    sampler_weights: tuple[str, ...] = (REFERENCE_WEIGHTS, QUANT_WEIGHTS)
    cache_weights: tuple[str, ...] = (REFERENCE_WEIGHTS, QUANT_WEIGHTS)
    t_low: float = 0.1
    t_high: float = 1.0
    window: int = 32
    tau0_percentile: float = sampling.TAU0_PERCENTILE
    calibration_rows: int = 8
    max_rows: int = 4096
    max_cache_groups: int = 3
    workers: int = 1
    time_limit: float | None = None
    bootstrap: int = 2000


def _names(value: str | Sequence[str]) -> tuple[str, ...]:
    """Names from a comma-separated string or a sequence: stripped, empty ones and repeats dropped."""
    items = value.split(",") if isinstance(value, str) else value
    return tuple(dict.fromkeys(x.strip() for x in items if x.strip()))


def resolve_eval_settings(*, model: str | Path = DEFAULT_MODEL, out: str | Path | None = None,
                          problems: int | None = None, seeds: int | None = None, eval_seed: int = 0,
                          seed: int = 0, calib_seed: int = 1, tables: str | Sequence[str] = "1,2,5",
                          formats=None, samplers=None, caches=None, sampler_weights=None, cache_weights=None,
                          t_low: float = 0.1, t_high: float = 1.0, window: int = 32,
                          tau0_percentile: float = sampling.TAU0_PERCENTILE, calibration_rows: int | None = None,
                          max_rows: int = 4096, max_cache_groups: int = 3, workers: int | None = None,
                          time_limit: float | None = None, bootstrap: int = 2000, quick: bool = False) -> EvalSettings:
    """Settings from options as the command line gives them (name lists comma-separated).

    Unset (or zero) counts and name lists take the full defaults (256 problems x 8 seeds, all
    formats, samplers and caches) or, with ``quick``, the CPU smoke run's (4 problems x 2
    seeds, few configs). Base decoding is always the first sampler and the BF16 cache the
    first cache (the references of the deltas). ``workers``: 1 on CPU, 6 otherwise.
    Raises ValueError naming an unknown table, weight format, sampler or cache.
    """
    try:
        tables = tuple(sorted({TABLES[t] for t in _names(tables)}))
    except KeyError as e:
        raise ValueError(f"unknown table {e.args[0]!r}; choose from 1, 2, 5") from None
    q = quick
    problems = problems or (QUICK["problems"] if q else 256)
    seeds = seeds or (QUICK["seeds"] if q else 8)
    calibration_rows = calibration_rows or (QUICK["calibration_rows"] if q else 8)
    formats = _names(formats) if formats else (QUICK["formats"] if q else DEFAULT_FORMATS)
    samplers = _names(samplers) if samplers else (QUICK["samplers"] if q else DEFAULT_SAMPLERS)
    caches = _names(caches) if caches else (QUICK["caches"] if q else DEFAULT_CACHES)
    sampler_weights = _names(sampler_weights or f"{REFERENCE_WEIGHTS},{QUANT_WEIGHTS}")
    cache_weights = _names(cache_weights or (QUICK["cache_weights"] if q else f"{REFERENCE_WEIGHTS},"
                                                                              f"{QUANT_WEIGHTS}"))
    for w in formats + sampler_weights + cache_weights:
        if w not in WEIGHTS:
            raise ValueError(f"unknown weight format {w!r}; known: {', '.join(WEIGHTS)}")
    for s in samplers:
        if s not in DEFAULT_SAMPLERS:
            raise ValueError(f"unknown sampler {s!r}; known: {', '.join(DEFAULT_SAMPLERS)}")
    for c in caches:
        if c != FIREQ_CALIBRATED and c not in kvcache.formats():
            raise ValueError(f"unknown KV cache {c!r}; known: {', '.join(kvcache.formats())}, {FIREQ_CALIBRATED}")
    # Base decoding first: the reference of the deltas, and the group whose entropies give tau0.
    samplers = (BASE_SAMPLER,) + tuple(s for s in samplers if s != BASE_SAMPLER)
    if "bf16" not in caches:
        caches = ("bf16",) + caches
    if min(problems, seeds, max_rows, calibration_rows, max_cache_groups) < 1:
        raise ValueError("--problems, --seeds, --max-rows, --calibration-rows and --max-cache-groups must be >= 1")
    if workers is None:
        workers = 1 if jax.default_backend() == "cpu" else 6
    if workers < 1:
        raise ValueError("--workers must be >= 1")
    return EvalSettings(Path(model), None if out is None else Path(out), problems, seeds, eval_seed, seed,
                        calib_seed, tables, formats, samplers, caches, sampler_weights, cache_weights, t_low, t_high,
                        window, tau0_percentile, calibration_rows, max_rows, max_cache_groups, workers, time_limit,
                        bootstrap)


# ----------------------------------------------------------------------------------------------
# Configs and programs
# ----------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Config:
    """One evaluated setting: weights x sampler x KV cache (a row of one or more tables)."""

    weights: str
    sampler: str
    cache: str

    @property
    def key(self) -> str:
        return f"{self.weights}/{self.sampler}/{self.cache}"


@dataclasses.dataclass
class Job:
    """One compiled program: configs that run as row groups of the same generate calls."""

    name: str
    weights: str
    configs: list[Config]
    calibrate_tau0: bool = False  # first generate on training problems (base group) for tau0


def table_rows(tables: Sequence[str], formats: Sequence[str], samplers: Sequence[str], caches: Sequence[str],
               sampler_weights: Sequence[str], cache_weights: Sequence[str]) -> dict[str, list[Config]]:
    """The configs of each selected table, in row order (Table 2 and 5: row-major over weights)."""
    rows: dict[str, list[Config]] = {}
    if "1" in tables:
        rows["1"] = [Config(w, BASE_SAMPLER, "bf16") for w in formats]
    if "2" in tables:
        rows["2"] = [Config(w, s, "bf16") for s in samplers for w in sampler_weights]
    if "5" in tables:
        rows["5"] = [Config(w, BASE_SAMPLER, c) for c in caches for w in cache_weights]
    return rows


def settings_rows(settings: EvalSettings) -> dict[str, list[Config]]:
    """:func:`table_rows` of the settings' tables, formats, samplers, caches and weights."""
    return table_rows(settings.tables, settings.formats, settings.samplers, settings.caches,
                      settings.sampler_weights, settings.cache_weights)


def plan_jobs(rows: dict[str, list[Config]], max_cache_groups: int = 3) -> list[Job]:
    """Every distinct config once, grouped into programs: per weights, the samplers of Table 2
    (which also serve Table 1's row of those weights and calibrate tau0) and the caches of
    Table 5 in programs of at most ``max_cache_groups`` caches (each cache adds its own
    attention to every layer, so smaller programs compile faster, and in parallel); single
    base-decoding programs for the other weights of Table 1. Row-group programs first (they
    run longest), quantized weights before BF16."""
    if max_cache_groups < 1:
        raise ValueError(f"max_cache_groups must be >= 1, got {max_cache_groups}")
    done: set[Config] = set()
    jobs: list[Job] = []

    def add(name, weights, configs, calibrate=False):
        configs = [c for c in dict.fromkeys(configs) if c not in done]
        if configs:
            done.update(configs)
            jobs.append(Job(name, weights, configs, calibrate))

    t2 = rows.get("2", [])
    for w in dict.fromkeys(c.weights for c in t2):
        configs = [c for c in t2 if c.weights == w]
        add(f"samplers/{w}", w, configs, any(c.sampler in ENTROPY_SAMPLERS for c in configs))
    t5 = rows.get("5", [])
    for w in dict.fromkeys(c.weights for c in t5):
        todo = [c for c in dict.fromkeys(t5) if c.weights == w and c not in done]
        chunks = -(-len(todo) // max_cache_groups)
        for j in range(chunks):  # chunks of near-equal size
            add(f"kv/{w}" + (f"/{j + 1}" if chunks > 1 else ""), w, todo[j::chunks])
    for c in rows.get("1", []):
        add(f"base/{c.weights}", c.weights, [c])
    return sorted(jobs, key=lambda j: (-len(j.configs), j.weights == REFERENCE_WEIGHTS))


# ----------------------------------------------------------------------------------------------
# Call layout: which (seed, problem) units each generate call holds
# ----------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class CallPlan:
    """``calls[c]``: the units ``(seed, problem)`` of call c, all of the same length ``rows_per_group``
    (``None``: a filler row whose output is dropped). Every group of a call holds these units."""

    rows_per_group: int
    calls: tuple[tuple[tuple[int, int] | None, ...], ...]


def plan_calls(num_problems: int, num_seeds: int, groups: int, max_rows: int,
               lengths: Sequence[int] | None = None) -> CallPlan:
    """Lay out ``num_seeds x num_problems`` units over calls of ``groups x rows_per_group`` rows.

    If one seed of all problems fits (``groups * num_problems <= max_rows``), call ``s`` holds
    seed ``s`` with problem ``i`` in row ``i`` of every group: every program then draws unit
    ``(s, i)`` from the same random stream (key ``seed + s``, row ``i``), so configs are
    compared on common random numbers. Otherwise the problems are dealt round-robin (longest
    prompt first, by ``lengths``, so that every call has the same prompt bucket) into equal
    slices, one slice of one seed per call, short slices padded with filler rows.
    """
    if num_problems < 1 or num_seeds < 1 or groups < 1 or max_rows < groups:
        raise ValueError(f"cannot plan {num_problems} problems x {num_seeds} seeds x {groups} groups "
                         f"in calls of at most {max_rows} rows")
    if groups * num_problems <= max_rows:
        return CallPlan(num_problems, tuple(tuple((s, i) for i in range(num_problems)) for s in range(num_seeds)))
    slices = -(-num_problems // (max_rows // groups))
    order = list(range(num_problems))
    if lengths is not None:
        order.sort(key=lambda i: -lengths[i])
    parts = [order[j::slices] for j in range(slices)]
    width = max(len(p) for p in parts)
    calls = tuple(tuple((s, i) for i in part) + (None,) * (width - len(part))
                  for s in range(num_seeds) for part in parts)
    return CallPlan(width, calls)


def describe_plan(settings: EvalSettings) -> list[str]:
    """One line per compiled program (configs, calls x rows, tau0 calibration), then the totals."""
    jobs = plan_jobs(settings_rows(settings), settings.max_cache_groups)
    lines = []
    for job in jobs:
        plan = plan_calls(settings.problems, settings.seeds, len(job.configs), settings.max_rows)
        lines.append(f"{job.name:<24} {len(job.configs):>2} configs, {len(plan.calls)} calls x "
                     f"{plan.rows_per_group * len(job.configs)} rows"
                     + (" + tau0 calibration" if job.calibrate_tau0 else ""))
    lines.append(f"{len(jobs)} compiled programs, {sum(len(j.configs) for j in jobs)} configs")
    return lines
